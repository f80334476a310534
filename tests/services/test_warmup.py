"""Engine warm-up before serving: it takes every request path (cold batch builds, an assembly with
several seams, reuse after another prefix, a prefix hit, decode), leaves no trace in the caches,
and a worker started with --warmup on answers /health 503 until it is done."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from hybridcache.services.launcher import free_port
from serving_helpers import http


def test_warmup_takes_every_path_and_leaves_caches_as_they_were(model_dir, monkeypatch):
    from hybridcache.services.runtime.engine import Engine
    from hybridcache.services.runtime.models import qwen3_hybrid

    engine = Engine.from_dir(model_dir)
    engine.generate({"segments": [list(range(3, 40)), list(range(50, 90))], "suffix": [7, 8, 9],
                     "sampling_params": {"max_new_tokens": 2}})
    before = (len(engine.entries), len(engine.prefixes), len(engine.pages), engine.entries.used_bytes)
    stores = (engine.entries, engine.prefixes, engine.pages)

    calls = {"batched_scan": 0, "build": 0, "decode": 0}
    orig_scan = qwen3_hybrid.GatedDeltaNet.batched_scan
    orig_build = Engine.build_entries
    orig_decode = Engine.decode_one_token

    def scan(self, *a, **k):
        calls["batched_scan"] += 1
        return orig_scan(self, *a, **k)

    def build(self, segments):
        calls["build"] += len(segments)
        return orig_build(self, segments)

    def decode(self, *a, **k):
        calls["decode"] += 1
        return orig_decode(self, *a, **k)

    monkeypatch.setattr(qwen3_hybrid.GatedDeltaNet, "batched_scan", scan)
    monkeypatch.setattr(Engine, "build_entries", build)
    monkeypatch.setattr(Engine, "decode_one_token", decode)
    report = engine.warmup()

    assert report["requests"] == 3 and report["seconds"] > 0
    assert calls["batched_scan"] > 0, "no assembly with several seams"
    assert calls["build"] >= 3, "the cold segments were not built in a batch"
    assert calls["decode"] >= 3 * 2, "decode steps missing"
    assert (engine.entries, engine.prefixes, engine.pages) == stores
    assert (len(engine.entries), len(engine.prefixes), len(engine.pages), engine.entries.used_bytes) == before


def test_health_is_503_until_ready_and_livez_always_answers():
    from hybridcache.services.observability.http import serve_health_and_metrics

    port = free_port()
    state = {"status": "warming up", "role": "scatter"}
    server = serve_health_and_metrics("127.0.0.1", port, lambda: dict(state))
    try:
        assert http("GET", f"http://127.0.0.1:{port}/health") == (503, state)
        assert http("GET", f"http://127.0.0.1:{port}/livez")[0] == 200
        state["status"] = "ok"
        assert http("GET", f"http://127.0.0.1:{port}/health") == (200, state)
    finally:
        server.shutdown()


def test_scatter_worker_warms_up_before_it_is_ready(model_dir, tmp_path):
    from hybridcache.services.security import DeploymentSecret

    grpc_port, http_port = free_port(), free_port()
    secret = DeploymentSecret.generate().write(tmp_path / "secret")
    cmd = [sys.executable, "-m", "hybridcache.services.cli", "serve", "scatter", "--model", str(model_dir),
           "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--warmup", "on", "--secret-file", str(secret)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith('{"ready"'):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    seen = set()
    try:
        deadline = time.monotonic() + 120
        while not ready.is_set() and time.monotonic() < deadline and proc.poll() is None:
            try:
                code, body = http("GET", f"http://127.0.0.1:{http_port}/health", timeout=2)
                seen.add((code, body.get("status") if isinstance(body, dict) else None))
            except OSError:
                pass
            time.sleep(0.02)
        assert ready.is_set(), "".join(lines[-20:])
        code, body = http("GET", f"http://127.0.0.1:{http_port}/health")
        assert code == 200 and body["status"] == "ok"
        assert body["warmup"]["requests"] == 3
        assert all(c == 503 for c, s in seen if s != "ok"), seen
        assert not any(c == 200 and s != "ok" for c, s in seen)
        assert any("warm-up done" in line for line in lines), "".join(lines[-20:])
        assert json.loads(next(x for x in lines if x.startswith('{"ready"')))["ready"] == "scatter"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
