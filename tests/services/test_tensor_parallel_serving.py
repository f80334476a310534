"""`hybridcache up --tensor-parallel-size 2` on the CPU: combine and scatter workers each start a
follower rank (gloo); served requests, cold and then warm, complete through the scheduler's
batched decode over both ranks and equal TP = 1 in-process. The cold request's entries are built
by the scatter worker's two ranks and each rank's slice reaches the combine worker's matching
rank; with no room in the combine worker's own cache, the next request after another system
prompt takes them from the cache tier; neither is rebuilt by the combine worker."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from hybridcache.services.config import RuntimeConfig
from hybridcache.services.launcher import free_port
from hybridcache.services.runtime.engine import Engine
from hybridcache.services.runtime.llm import LLM
from serving_helpers import http, stop_up


def test_served_tp2_equals_tp1(model_dir):
    segments = ["first a retrieved passage about caches", " then a second passage on states"]
    body = {"segments": segments, "suffix": " so the answer is",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
    want = LLM(Engine.from_dir(model_dir, config=RuntimeConfig(mode="pic"))).generate(body).output_ids
    port = free_port()
    other = dict(body, system="another system prompt")
    want_other = LLM(Engine.from_dir(model_dir, config=RuntimeConfig(mode="pic"))).generate(other).output_ids
    # an entry cache too small for any entry: the combine worker keeps none of its own
    proc = subprocess.Popen([sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model_dir),
                             "--port", str(port), "--scatter-workers", "1", "--tensor-parallel-size", "2",
                             "--entry-cache-bytes", "1"],
                            stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"]
        # each worker runs as rank 0 with its follower rank as a child process
        for svc in ready["services"]:
            if svc["role"] in ("combine", "scatter"):
                with open(f"/proc/{svc['pid']}/task/{svc['pid']}/children") as f:
                    assert f.read().split(), f"{svc['role']} started no follower rank"
        got = []
        for _ in range(2):  # cold (the scatter worker's ranks build the entries), then warm
            status, res = http("POST", f"{ready['http']}/generate", body, timeout=120)
            assert status == 200, res
            got.append(res)
        assert [r["output_ids"] for r in got] == [want, want]
        cold, warm = (r["hybridcache"] for r in got)
        assert [s["source"] for s in cold["segments"]] == ["scatter", "scatter"], cold["segments"]
        assert cold["scatter_bytes"] > 0 and warm["reused_segments"] >= 1
        # after another system prompt: the bundles the scatter worker wrote to the tier (written
        # after its stream: asked again until they are there)
        for _ in range(20):
            status, res = http("POST", f"{ready['http']}/generate", other, timeout=120)
            assert status == 200, res
            assert res["output_ids"] == want_other
            sources = [s["source"] for s in res["hybridcache"]["segments"]]
            assert "built" not in sources, sources
            if sources == ["tier", "tier"]:
                break
            time.sleep(0.25)
        assert sources == ["tier", "tier"] and res["hybridcache"]["tier_bytes"] > 0
    finally:
        stop_up(proc)


def test_a_size_that_does_not_divide_the_heads_is_one_error_line(model_dir, tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"segments": ["a"], "sampling_params": {"max_new_tokens": 1}}))
    for cmd in (["generate", "--model", str(model_dir), "--request", str(req), "--tensor-parallel-size", "3"],
                ["eval", "--model", str(model_dir), "--limit", "1", "--tensor-parallel-size", "2"]):
        out = subprocess.run([sys.executable, "-m", "hybridcache.services.cli", *cmd], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "tensor-parallel" in out.stderr
