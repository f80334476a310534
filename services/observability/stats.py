"""What a serving process prints as it runs, as vLLM prints it: a worker's progress through its
start-up (one line per stage), a combine worker's periodic stats line (--stats-interval-s) and the
router's request log (--log-requests, one line per request)."""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log_progress = logging.getLogger("hybridcache.progress")
log_stats = logging.getLogger("hybridcache.stats")
log_requests = logging.getLogger("hybridcache.requests")
# The lines of those three in a service's log (serve's format: "DATE TIME ROLE LEVEL MESSAGE"), which
# `hybridcache up` shows on its own output: group 1 is the message
FORWARDED = re.compile(r"^\S+ \S+ \S+ (?:INFO|WARNING) ((?:progress: |Avg prompt throughput: |request \S+: ).*)$")


def progress(message: str, *args) -> None:
    """One stage of a worker's start-up, in its log (and forwarded by `up`)."""
    log_progress.info("progress: " + message, *args)


@contextmanager
def stage(what: str, *args) -> Iterator[None]:
    """A start-up stage's two progress lines: `what` as it begins, and its time once done."""
    t0 = time.perf_counter()
    progress(what + " ...", *args)
    yield
    progress(what + ": done in %.1f s", *args, time.perf_counter() - t0)


def warmup_requests(run: Callable) -> Callable:
    """`run(request)`, a warm-up's way of serving one request, with a progress line per request."""
    count = itertools.count(1)

    def logged(req):
        n, t0 = next(count), time.perf_counter()
        out = run(req)
        progress("warm-up request %d (%d segments, %d prompt tokens): done in %.1f s", n, len(req.segment_ids),
                 req.prompt_len, time.perf_counter() - t0)
        return out

    return logged


@dataclass(slots=True)
class RequestRecord:
    """One request as the router's request log states it once it ends. status: the HTTP status
    code it was answered with (499: the client went away first)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft_ms: float | None = None
    status: int = 499
    finish_reason: str = ""

    def finished(self, stats: dict, finish_reason: str) -> None:
        self.status, self.finish_reason = 200, finish_reason
        self.prompt_tokens = int(stats.get("prompt_tokens", self.prompt_tokens))
        self.cached_tokens = int(stats.get("cached_tokens", 0))
        self.generated_tokens = int(stats.get("generated_tokens", 0))
        self.ttft_ms = stats.get("ttft_ms")

    def line(self, seconds: float) -> str:
        ttft = "-" if self.ttft_ms is None else f"{self.ttft_ms:.1f} ms"
        reason = f" ({self.finish_reason})" if self.finish_reason else ""
        return (f"request {self.request_id}: status {self.status}{reason}, prompt {self.prompt_tokens} tokens "
                f"(cached {self.cached_tokens}), generated {self.generated_tokens} tokens, TTFT {ttft}, "
                f"total {seconds * 1000:.1f} ms")

    def log(self, seconds: float) -> None:
        log_requests.info(self.line(seconds))


@dataclass(slots=True)
class _Counts:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefix_tokens: int = 0  # prompt tokens restored from the prefix page tree
    segment_tokens: int = 0  # tokens of segments that could come from an entry
    segment_hit_tokens: int = 0  # of those, the ones whose entry was cached before the request


class StatsLog:
    """A combine worker's counts since its last stats line, and the line. `gauges()` returns the
    scheduler's {"running", "waiting"} (requests) and {"kv_usage", "entry_usage"} (0..1) and
    {"entry_bytes"} now. Counting methods may be called from any thread."""

    def __init__(self, interval_s: float, gauges: Callable[[], dict]):
        self.interval_s = interval_s
        self.gauges = gauges
        self._lock = threading.Lock()
        self._counts = _Counts()
        self._since = time.monotonic()
        self._idle = True  # the last line said nothing happened (or none was printed yet)

    def generated(self, n: int = 1) -> None:
        with self._lock:
            self._counts.generated_tokens += n

    def request_done(self, stats: dict) -> None:
        """A request's stats (the combine worker's, segment sources resolved) as it ends."""
        segments = [s for s in stats.get("segments", ()) if s.get("source") not in ("live", "prefix")]
        with self._lock:
            c = self._counts
            c.requests += 1
            c.prompt_tokens += int(stats.get("prompt_tokens", 0))
            c.prefix_tokens += int(stats.get("prefix_reused_tokens", 0))
            c.segment_tokens += sum(int(s.get("tokens", 0)) for s in segments)
            c.segment_hit_tokens += sum(int(s.get("tokens", 0)) for s in segments if s.get("hit"))

    def line(self, now: float | None = None) -> str | None:
        """The line for the interval that ends now (its counts start again); None when nothing
        ran in it nor in the one before (an idle worker prints one line, then is quiet)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            c, self._counts = self._counts, _Counts()
            seconds, self._since = max(now - self._since, 1e-9), now
        g = self.gauges()
        idle = not (c.requests or c.generated_tokens or g.get("running") or g.get("waiting"))
        if idle and self._idle:
            return None
        self._idle = idle

        def pct(part: float, whole: float) -> str:
            return f"{100.0 * part / whole:.1f}%" if whole else "-"

        return (f"Avg prompt throughput: {c.prompt_tokens / seconds:.1f} tokens/s, "
                f"Avg generation throughput: {c.generated_tokens / seconds:.1f} tokens/s, "
                f"Running: {g.get('running', 0)} reqs, Waiting: {g.get('waiting', 0)} reqs, "
                f"K/V cache usage: {100.0 * g.get('kv_usage', 0.0):.1f}%, "
                f"Entry cache usage: {100.0 * g.get('entry_usage', 0.0):.1f}% "
                f"({g.get('entry_bytes', 0) / 2**20:.1f} MiB), "
                f"Prefix cache hit rate: {pct(c.prefix_tokens, c.prompt_tokens)}, "
                f"Entry cache hit rate: {pct(c.segment_hit_tokens, c.segment_tokens)}")

    def run(self, stop: threading.Event) -> threading.Thread:
        """Log the line every interval_s in a daemon thread until `stop` is set."""
        def loop():
            while not stop.wait(self.interval_s):
                try:
                    text = self.line()
                except Exception:  # noqa: BLE001 - a stats line is never worth the worker
                    log_stats.exception("stats line failed")
                    continue
                if text is not None:
                    log_stats.info(text)

        thread = threading.Thread(target=loop, name="stats-log", daemon=True)
        thread.start()
        return thread
