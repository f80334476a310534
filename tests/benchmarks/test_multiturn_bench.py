"""benchmarks/multiturn.py: its trace (seeded, branching, Poisson arrivals), the SGLang
request-end bound, the shape's bytes per token against an engine's, and a tiny served run on CPU
that starts `hybridcache up` per policy (SGLang's peer, with its request-end states, among them)."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest


def _bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "multiturn.py"
    spec = importlib.util.spec_from_file_location("multiturn_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["multiturn_bench"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _args(**kw):
    base = dict(seed=0, vocab=200, systems=2, system_tokens=70, conversations=12, rate=2.0, turns=(4, 16),
                user_tokens=(5, 9), branch_prob=0.3, think_s=0.5)
    return SimpleNamespace(**dict(base, **kw))


def test_trace_is_seeded_branches_and_arrives_in_order():
    mt = _bench()
    trace = mt.make_trace(_args())
    assert trace == mt.make_trace(_args()) and trace != mt.make_trace(_args(seed=1))
    starts = [c.start_s for c in trace.conversations]
    assert starts == sorted(starts) and starts[0] > 0
    branched = 0
    for conv in trace.conversations:
        assert 4 <= len(conv.turns) <= 16 and 0 <= conv.system < 2
        assert conv.turns[0].parent is None and conv.turns[1].parent == 0
        for i, turn in enumerate(conv.turns[1:], 1):
            assert 0 <= turn.parent < i and 5 <= len(turn.user) <= 9
            branched += turn.parent != i - 1
    assert branched > 0
    assert trace.requests == sum(len(c.turns) for c in trace.conversations)


def test_sglang_bound_counts_request_ends_and_grid_states():
    mt = _bench()
    a = mt.Sent(0, 0, [1, 2, 3, 4], sent=0.0, first=0.1, done=1.0, status=200, output_ids=[5, 6])
    # continues a's tokens whose state is kept (prompt and answer but its last token): 5 of them
    b = mt.Sent(0, 1, [1, 2, 3, 4, 5, 6, 7, 8], sent=2.0, first=2.1, done=3.0, status=200, output_ids=[9])
    # shares 3 tokens with a: only a grid multiple of that (interval 2) counts
    c = mt.Sent(1, 0, [1, 2, 3, 9, 9], sent=4.0, first=4.1, done=5.0, status=200, output_ids=[9])
    # sent before a finished: nothing of a is kept yet
    d = mt.Sent(2, 0, [1, 2, 0, 0, 0, 0, 0], sent=0.5, first=0.6, done=0.7, status=200, output_ids=[1])
    got = mt.sglang_request_end_hits([a, b, c, d], interval=2)
    assert got["hit_tokens"] == 0 + 5 + 2 + 0
    assert got["prompt_tokens"] == 4 + 8 + 5 + 7


def test_bytes_per_token_from_the_shape_match_an_engine(qwen35_dir):
    """The trace's per-policy bytes (the capacity it reports at a budget) are what the engine's
    page tree keeps: a 256-token prompt under each policy (sglang_peer's request ends at its grid's
    second state, which it keeps once); past its grid, sglang_peer keeps one dense state more, where
    the request ended."""
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.llm import LLM

    mt = _bench()
    args = SimpleNamespace(checkpoint_every=4, anchors_per_page=4, replay_anchors=64, anchor_dtype="float8_e4m3fn",
                           sglang_interval=128)
    policies = {p: mt.prefix_policy(p, args) for p in mt.POLICIES}
    per_token = mt.bytes_per_token(qwen35_dir, "float32", policies)
    assert policies["sglang_peer"].request_end_checkpoints and not policies["sglang_grid"].request_end_checkpoints

    def kept(pol, n):
        eng = Engine.from_dir(qwen35_dir, config=EngineConfig(
            mode="prefix", prefix_policy=pol.name, checkpoint_every=pol.checkpoint_every,
            anchors_per_page=pol.anchors_per_page, replay_anchors=pol.replay_anchors,
            anchor_dtype=pol.anchor_dtype, checkpoint_request_ends=pol.request_end_checkpoints,
            prefix_cache_bytes=1 << 30))
        with LLM(eng) as llm:
            llm.generate({"suffix": [7 + i % 50 for i in range(n)],
                          "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}})
        return eng.pages.used_bytes, eng.pages.linear_bytes

    for name, pol in policies.items():
        used, linear = kept(pol, 257)
        assert used / 256 == per_token[name]["total"], name
        assert linear / 256 == per_token[name]["linear"], name
    used, linear = kept(policies["sglang_peer"], 321)  # 5 pages: grid states at 128 and 256, the end at 320
    assert linear == 256 * per_token["sglang_peer"]["linear"] + per_token["dense_state"]
    assert used == 320 * per_token["attention_kv"] + linear


def test_tiny_served_run(qwen35_dir, tmp_path, capsys):
    mt = _bench()
    out = tmp_path / "mt.json"
    res = mt.main(["--model", str(qwen35_dir), "--policies", "suffix_replay,sglang_peer,sglang_grid",
                   "--conversations", "2",
                   "--turns", "3,3", "--systems", "1", "--system-tokens", "70", "--user-tokens", "4,8",
                   "--output-tokens", "3", "--think-s", "0", "--rate", "20", "--vocab", "200",
                   "--prefix-cache-bytes", str(64 << 20), "--out", str(out)])
    assert json.loads(out.read_text()) == res == json.loads(capsys.readouterr().out)
    sr, peer, grid = (res["results"][p] for p in ("suffix_replay", "sglang_peer", "sglang_grid"))
    assert sr["completed"] == peer["completed"] == grid["completed"] == 6 and not sr["errors"]
    # every follow-up turn (and the second conversation, after the shared system prompt) resumes
    # at a page of the tree under suffix_replay; under SGLang's peer every follow-up resumes where
    # the turn before it ended (its last page boundary: 64 in these prompts); its 8,192-token grid
    # alone never fits these prompts
    assert sr["requests_with_a_hit"] >= 4 and sr["prefix_hit_tokens"] >= 4 * 64
    assert peer["requests_with_a_hit"] >= 4 and peer["prefix_hit_tokens"] >= 4 * 64
    assert grid["prefix_hit_tokens"] == 0
    f = res["figures"]
    assert f["multiturn_ttft_p50_suffix_replay_vs_sglang_grid_checkpoint"] == round(
        sr["ttft_ms"]["p50"] / peer["ttft_ms"]["p50"], 3) == f["multiturn_ttft_p50_suffix_replay_vs_sglang_peer"]
    assert f["multiturn_ttft_p50_suffix_replay_vs_sglang_bare_grid"] == round(
        sr["ttft_ms"]["p50"] / grid["ttft_ms"]["p50"], 3)
    assert f["multiturn_hit_fraction_suffix_replay"] == sr["prefix_hit_fraction"] > 0
    assert res["prefix_cache_bytes"] == 64 << 20 and res["trace"]["requests"] == 6
    assert res["policies"]["sglang_grid"][:4] == ["--prefix-policy", "checkpoint", "--checkpoint-every", "128"]
    assert res["policies"]["sglang_peer"][:4] == res["policies"]["sglang_grid"][:4]
    assert res["policies"]["sglang_peer"][-2:] == ["--checkpoint-request-ends", "on"]
    assert res["policies"]["sglang_grid"][-2:] == ["--checkpoint-request-ends", "off"]
    assert res["machine"] == "cpu" and res["command"].startswith("python benchmarks/multiturn.py")


def test_bad_flags_exit_2():
    mt = _bench()
    for bad in (["--policies", "fast"], ["--sglang-interval", "100"], ["--turns", "5,2"]):
        with pytest.raises(SystemExit) as e:
            mt.main(bad)
        assert e.value.code == 2


def test_a_policy_with_failed_requests_gives_no_figure():
    """A policy whose server did not start or whose requests did not all complete is left out of the
    figures: its TTFT would be of the requests that happened to succeed."""
    mt = _bench()

    def run(p50, failed=0):
        return {"ttft_ms": {"p50": p50}, "prefix_hit_fraction": 0.5, "failed": failed}

    results = {"suffix_replay": run(100.0), "sglang_peer": run(50.0, failed=3), "checkpoint": run(200.0),
               "exact_replay": {"error": "did not start"}}
    f = mt.figures_of(results, None)
    assert f["multiturn_ttft_p50_suffix_replay_vs_checkpoint"] == 0.5
    assert not any("sglang" in k or "exact_replay" in k for k in f), f
    results["sglang_peer"]["failed"] = 0
    assert mt.figures_of(results, None)["multiturn_ttft_p50_suffix_replay_vs_sglang_grid_checkpoint"] == 2.0
