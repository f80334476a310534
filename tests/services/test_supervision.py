"""`hybridcache up` supervises its children: kill -9 of each one under a running `up` (the others
keep serving: local builds, recompute, 503 while the combine worker is away; then it is back on its
ports), kill -9 of `up` itself (every child dies with it), SIGTERM drains the requests in flight."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from http.client import HTTPConnection

import pytest
from hybridcache.services.launcher import free_port
from hybridcache.services.runtime.llm import LLM
from serving_helpers import http
from test_up import alive

QUESTION = "Question: what is in the documents?\nAnswer:"
DOCS = [f"supervised document {i}: " + "the quick brown fox jumps over the lazy dog " * (2 + i) for i in range(3)]


class Up:
    """A `hybridcache up` process: its ready line, the restart lines it prints, its stderr file."""

    def __init__(self, model_dir, tmp_path, *flags):
        self.port = free_port()
        self.log_dir = tmp_path / "logs"
        self.stderr_path = tmp_path / "up.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model_dir), "--port",
                 str(self.port), "--scatter-workers", "1", "--log-dir", str(self.log_dir), *flags],
                stdout=subprocess.PIPE, stderr=err, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith('{"ready"'), self.stderr()
        self.ready = json.loads(line)
        self.pids = {s["role"]: s["pid"] for s in self.ready["services"]}
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(json.loads(x)) for x in self.proc.stdout],
                         daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def restarted(self, role: str, timeout: float = 90.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line.get("restarted") == role:
                self.pids[role] = line["pid"]
                return line
        raise AssertionError(f"{role} was not restarted:\n{self.stderr()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def up(model_dir, tmp_path):
    u = Up(model_dir, tmp_path, "--drain-grace-s", "30")
    yield u
    u.stop()


def ask(u, docs=DOCS, timeout=120):
    return http("POST", f"{u.url}/generate", {"segments": docs, "text": QUESTION,
                                             "sampling_params": {"max_new_tokens": 4}}, timeout=timeout)


def want(engine, docs=DOCS):
    return LLM(engine).generate({"segments": docs, "suffix": QUESTION, "sampling_params": {"max_new_tokens": 4}}).text


def test_kill_9_of_each_child_is_restarted_and_the_rest_keeps_serving(up, engine):
    assert ask(up)[0] == 200
    for n, role in enumerate(("scatter", "cache-tier", "combine", "router")):
        docs = [f"round {n} " + d for d in DOCS]
        old = up.pids[role]
        os.kill(old, signal.SIGKILL)
        time.sleep(0.3)
        if role in ("scatter", "cache-tier"):
            # served meanwhile: the combine worker builds the segments, the tier is a miss
            status, res = ask(up, docs)
            assert status == 200 and res["text"] == want(engine, docs), res
            assert "tier" not in [s["source"] for s in res["hybridcache"]["segments"]]
        elif role == "combine":
            status, res = ask(up, docs, timeout=30)
            assert status == 503 and res["error"]["message"], res
        else:
            with pytest.raises(OSError):
                http("GET", f"{up.url}/livez", timeout=5)
        line = up.restarted(role)
        assert line["pid"] != old and not alive(old)
        if role == "router":
            deadline = time.monotonic() + 30
            while http("GET", f"{up.url}/health", timeout=5)[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
        status, res = ask(up, docs)
        assert status == 200 and res["text"] == want(engine, docs), (role, res)
        log = (up.log_dir / f"{role}-0.log").read_text()
        assert log.count('{"ready"') == 2, role
        assert f"{role} (pid {old}) exited with -9" in up.stderr() and str(up.log_dir / f"{role}-0.log") in up.stderr()
    # the other children were never restarted
    assert up.lines.empty()


def test_children_die_with_up(up):
    children = list(up.pids.values())
    assert all(alive(p) for p in children)
    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in children)
    with pytest.raises(OSError):
        http("GET", f"{up.url}/livez", timeout=5)


def _stream(port: int, n_tokens: int, first: threading.Event, out: list):
    conn = HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"text": "Tell a long story.", "stream": True,
            "sampling_params": {"max_new_tokens": n_tokens, "ignore_eos": True}}
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:])
            first.set()
    out.append((resp.status, events))


def test_sigterm_drains_the_requests_in_flight(up):
    n, tokens = 4, 500  # long enough that none ends before the last one starts on a loaded machine
    firsts = [threading.Event() for _ in range(n)]
    results: list = []
    threads = [threading.Thread(target=_stream, args=(up.port, tokens, firsts[i], results)) for i in range(n)]
    for t in threads:
        t.start()
    assert all(f.wait(60) for f in firsts)
    assert not results, "a request ended before SIGTERM: make it longer"
    t0 = time.monotonic()
    up.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    # no new requests once draining: the router no longer listens
    with pytest.raises(OSError):
        http("GET", f"{up.url}/livez", timeout=5)
    for t in threads:
        t.join(timeout=90)
    assert up.proc.wait(timeout=60) == 0 and time.monotonic() - t0 < 30 + 15
    assert len(results) == n
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert "error" not in last and last["meta_info"]["completion_tokens"] == tokens, last
    assert not any(alive(p) for p in up.pids.values())
