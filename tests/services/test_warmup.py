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
    from hybridcache.services.runtime.llm import LLM
    from hybridcache.services.runtime.models import qwen3_hybrid

    engine = Engine.from_dir(model_dir)
    llm = LLM(engine)
    llm.generate({"segments": [list(range(3, 40)), list(range(50, 90))], "suffix": [7, 8, 9],
                  "sampling_params": {"max_new_tokens": 2}})
    before = (len(engine.entries), len(engine.prefixes), len(engine.pages), engine.entries.used_bytes)
    stores = (engine.entries, engine.prefixes, engine.pages)

    calls = {"batched_scan": 0, "build": 0, "decode": 0}
    orig_scan = qwen3_hybrid.GatedDeltaNet.batched_scan
    orig_build = Engine.build_entries
    orig_decode = Engine.decode_batch

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
    monkeypatch.setattr(Engine, "decode_batch", decode)
    report = llm.warmup()

    # the four small requests, and six of the default shape cut to the tiny model's 4096 positions
    assert report["shape"] == (16, 3, 1024, 64)
    assert report["requests"] == 10 and report["seconds"] > 0
    assert calls["batched_scan"] > 0, "no assembly with several seams"
    assert calls["build"] >= 3, "the cold segments were not built in a batch"
    assert calls["decode"] >= 10 * 2, "decode steps missing"  # the scheduler's: every request's 2nd and 3rd token
    assert (engine.entries, engine.prefixes, engine.pages) == stores
    assert (len(engine.entries), len(engine.prefixes), len(engine.pages), engine.entries.used_bytes) == before


def test_after_warmup_no_request_of_the_shape_captures_graphs(model_dir, monkeypatch):
    """The live-pass shapes of the warm-up's request shape are all captured during the warm-up:
    requests of that shape after it (a first cold one, warm ones after other system prompts, cold
    ones after the same, now cached, system prompt: served_gpu.py's sequence) only replay. Graphs
    run on CUDA only; here the bucket cache (graphs.AssemblyGraphs' counting by plan key, capture
    on the second sighting) is followed on the CPU with the engine's real plans (the runner runs
    each planned pass eagerly)."""
    import random

    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.scheduler import Scheduler, scheduler_config

    events: list[tuple[str, str]] = []
    seen: dict[tuple, int] = {}
    captured: set[tuple] = set()
    phase = ["warmup"]

    class Shapes:
        def run(self, state, plan):
            key = plan.key
            if key is not None:
                if key in captured:
                    events.append((phase[0], "replay"))
                else:
                    seen[key] = seen.get(key, 0) + 1
                    if seen[key] >= 2:
                        captured.add(key)
                    events.append((phase[0], "capture" if key in captured else "eager"))
            return None  # the eager forward runs

    system, n, length, question = 16, 4, 64, 16
    engine = Engine.from_dir(model_dir, config=EngineConfig(warmup_shape=f"{system}+{n}x{length}+{question}"))
    engine.runner.assembly_graphs = Shapes()  # the runner's graph cache, counting buckets (the eager pass runs)
    scheduler = Scheduler(engine, scheduler_config(engine.config, "cpu"))
    try:
        engine.warmup(run=scheduler.generate)
        assert ("warmup", "capture") in events
        rng = random.Random(1)

        def ids(k):
            return [rng.randrange(engine.cfg.vocab_size) for _ in range(k)]

        sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        cold = {"system": ids(system), "segments": [ids(length) for _ in range(n)], "suffix": ids(question),
                "sampling_params": sp}
        sequence = [cold, dict(cold, system=ids(system), segments=cold["segments"][::-1])]
        sequence += [dict(cold, segments=[ids(length) for _ in range(n)]) for _ in range(3)]
        for k, body in enumerate(sequence):
            phase[0] = f"request {k}"
            scheduler.generate(body)
    finally:
        scheduler.stop()
    served = [e for e in events if e[0] != "warmup"]
    assert len(served) >= len(sequence) and all(kind == "replay" for _, kind in served), served


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
        assert body["warmup"]["requests"] == 10 and body["warmup"]["shape"] == [16, 3, 1024, 64]
        # the shape's 3 segments through the worker's builder, in its batches of --max-num-batched-tokens
        assert body["warmup"]["builds"] == [3]
        assert all(c == 503 for c, s in seen if s != "ok"), seen
        assert not any(c == 200 and s != "ok" for c, s in seen)
        assert any("warm-up done" in line for line in lines), "".join(lines[-20:])
        assert json.loads(next(x for x in lines if x.startswith('{"ready"')))["ready"] == "scatter"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _shape_recorder(engine, monkeypatch):
    """Counts of the assembly buckets (the planned assembly's key, models/assembly.py) and build
    batches ((segments, longest)) the engine's model runs: what a CUDA worker compiles, autotunes
    or captures per shape."""
    from collections import Counter

    from hybridcache.services.runtime.models.assembly import plan_assembly

    seen = {"layout": Counter(), "build": Counter()}
    model = engine.model
    forward, build = model.forward_layout, model.build_span_data

    def forward_layout(state, layout, logits_for="last", snapshot_after=(), capture_hidden=()):
        plan = plan_assembly(model, state, layout, snapshot_after, capture_hidden, logits_for,
                             engine.runner.run_tokens)
        key = plan.key if plan is not None else None
        if key is not None:
            seen["layout"][key] += 1
        return forward(state, layout, logits_for, snapshot_after, capture_hidden)

    def build_span_data(segments, seam, on_layer=None):
        seen["build"][(len(segments), max(map(len, segments)))] += 1
        return build(segments, seam, on_layer)

    monkeypatch.setattr(model, "forward_layout", forward_layout)
    monkeypatch.setattr(model, "build_span_data", build_span_data)
    return seen


def test_shaped_warmup_leaves_nothing_new_for_the_first_request_of_its_shape(model_dir, monkeypatch):
    """Through a combine worker's path (its scheduler): after the warm-up, the first request of the
    warm-up shape (new documents, all cold) and a warm one build only batch shapes the warm-up
    built and assemble only layout shapes it assembled at least twice (so that a CUDA worker
    captured their graphs there). Without the shaped requests the same requests meet new shapes."""
    import random

    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.scheduler import Scheduler

    rng = random.Random(5)
    sp = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    docs = [[rng.randrange(5, 250) for _ in range(40)] for _ in range(3)]
    system, question = [rng.randrange(5, 250) for _ in range(5)], [rng.randrange(5, 250) for _ in range(8)]
    first = {"system": system, "segments": docs, "suffix": question, "sampling_params": sp}
    warm = dict(first, system=system[::-1], segments=docs[::-1])
    news = {}
    for shape in ("5+3x40+8", "none"):
        engine = Engine.from_dir(model_dir, config=EngineConfig(warmup_shape=shape, max_num_batched_tokens=80))
        seen = _shape_recorder(engine, monkeypatch)
        sched = Scheduler(engine)
        try:
            report = engine.warmup(run=sched.generate)
            assert report["shape"] == ((5, 3, 40, 8) if shape != "none" else None)
            before = {k: dict(v) for k, v in seen.items()}
            for body in (first, warm):
                sched.generate(body)
        finally:
            sched.stop()
        after = seen
        assert set(after["build"]) and set(after["layout"])
        new_builds = [k for k in after["build"] if k not in before["build"]]
        new_layouts = [k for k, n in after["layout"].items()
                       if n > before["layout"].get(k, 0) and before["layout"].get(k, 0) < 2]
        news[shape] = (new_builds, new_layouts)
    assert news["5+3x40+8"] == ([], [])
    builds, layouts = news["none"]
    assert builds and layouts


def test_warmup_shape_is_cut_to_the_served_length(model_dir):
    from hybridcache.services.runtime.engine import Engine, EngineConfig

    def shape(text, **kw):
        return Engine.from_dir(model_dir, config=EngineConfig(warmup_shape=text, **kw)).warmup_shape()

    assert shape("16+32x1024+64", max_model_len=3000) == (16, 2, 1024, 64)  # (3000 - 16 - 64 - 3) // 1024
    assert shape("16+32x1024+64", max_model_len=3000, max_segments=1) == (16, 1, 1024, 64)
    assert shape("8x2000+64", max_model_len=1000) is None
    assert shape("none") is None
