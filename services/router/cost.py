"""Fetch or recompute: the router's cost model (docs/concepts.md, "Fetch or recompute").

Per warm segment the router compares the time to move its entry from the cache tier over the
path it would take with the time to build it again where it would be built: prefill on a scatter
worker, then the entry's move to the combine worker over the scatter path (CUDA IPC when the two
share a host and GPU visibility, else shared memory or gRPC, services/transport/), and picks the
sooner. Python gRPC on loopback moves an entry slower than a GPU recomputes its segment
(benchmarks/transport_loopback.py); CUDA IPC moves it far faster. The same comparison sends a
cold segment to a scatter worker only when its entry moves back faster than the combine worker
would build it (build_here); a scatter worker on the combine worker's own GPU is never used for
it (the combine worker checks the two Endpoints). The router knows the scatter path before any
entry has moved, from the combine worker's Endpoint (its Info) and the scatter workers' (their
Describe): Router.scatter_path. Bandwidths start from
`--transport-bandwidth`, else from what the combine worker measured of its end of each path at
start-up (Router.adopt), else from the defaults below; they and the prefill speed then follow
running averages of what the combine workers measure on every request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# Starting points until the services report measurements: entry Get over loopback as recorded in
# benchmarks/results/transport_loopback_cpu_*.json (2-core CPU machine, checksums included);
# cuda_ipc: device-to-device on one H200 (4.2 TB/s read+write) less the per-entry handle opening
# and checksums, set low so a first measurement can only raise it.
DEFAULT_BANDWIDTH = {"grpc": 0.08e9, "shm": 0.17e9, "cuda_ipc": 20e9, "local": 50e9}
DEFAULT_LATENCY_S = {"grpc": 2e-3, "shm": 1e-3, "cuda_ipc": 5e-4, "local": 0.0}
PATHS = ("grpc", "shm", "cuda_ipc")


def parse_bandwidths(text: str | None) -> dict[str, float]:
    """"cuda_ipc=80,grpc=0.5" (GB/s) -> {"cuda_ipc": 80e9, "grpc": 0.5e9}; ValueError on bad text."""
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        path, sep, value = part.partition("=")
        path = path.strip()
        try:
            gbps = float(value) if sep else float("nan")
        except ValueError:
            gbps = float("nan")
        if path not in PATHS or not gbps > 0:
            raise ValueError(f"--transport-bandwidth: expected PATH=GB/s with PATH one of {', '.join(PATHS)} "
                             f"and a positive number, got {part.strip()!r}")
        out[path] = gbps * 1e9
    return out


@dataclass
class CostModel:
    prefill_tokens_per_s: float = 2000.0
    bandwidth: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTH))
    latency_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LATENCY_S))
    smoothing: float = 0.3  # weight of a new measurement in the running average
    # how a built entry reaches the combine worker: "local" when the combine builds it itself; the
    # router sets it to the scatter path the combine workers last reported
    scatter_path: str = "grpc"
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fetch_seconds(self, nbytes: int, path: str) -> float:
        return self.latency_s.get(path, 0.0) + nbytes / self.bandwidth[path]

    def recompute_seconds(self, tokens: int, nbytes: int = 0, path: str | None = None) -> float:
        """Prefill time of `tokens`, plus moving the `nbytes` entry over `path` when given (built on
        a scatter worker)."""
        t = tokens / self.prefill_tokens_per_s
        return t + self.fetch_seconds(nbytes, path) if path and path != "local" else t

    def choose(self, nbytes: int, tokens: int, path: str, rebuild_path: str | None = None) -> str:
        """"fetch" (over `path`) or "recompute" (then moved over `rebuild_path`), whichever is
        sooner; fetch on a tie: it saves compute."""
        fetch = self.fetch_seconds(nbytes, path)
        return "fetch" if fetch <= self.recompute_seconds(tokens, nbytes, rebuild_path) else "recompute"

    def build_here(self, tokens: int, nbytes: int, path: str) -> bool:
        """Does moving a segment's built entry from a scatter worker over `path` take at least
        as long, at the path's bandwidth, as the combine worker building it itself? Then sending
        it out cannot help: the entries of all such segments arriving at the combine worker take
        at least as long as building them there. (Per-entry latency is left out: a stream's
        entries are in flight together.)"""
        return path in PATHS and nbytes / self.bandwidth[path] >= self.recompute_seconds(tokens)

    def observe_transfer(self, path: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0 or not path:
            return
        with self._lock:
            old = self.bandwidth.get(path, nbytes / seconds)
            self.bandwidth[path] = (1 - self.smoothing) * old + self.smoothing * nbytes / seconds

    def observe_scatter(self, path: str, nbytes: int, seconds: float) -> None:
        """A combine worker's measured move of scatter-built entries: the path the next plans assume."""
        if path in PATHS:
            self.scatter_path = path
            self.observe_transfer(path, nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            a = self.smoothing
            self.prefill_tokens_per_s = (1 - a) * self.prefill_tokens_per_s + a * tokens / seconds
