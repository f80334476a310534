"""benchmarks/served_long_prompt.py on CPU at a tiny size: the itl phase (streams decoding while a
long prompt prefills in chunks), then the pic, prefix and full phases merged into the same result
file; each figure is computed from the requests that ran."""

import json

from test_served_pic_layouts import _bench


def test_served_long_prompt_on_cpu(qwen35_dir, tmp_path):
    mod = _bench("served_long_prompt")
    out = tmp_path / "r.json"
    common = ["--model", str(qwen35_dir), "--device", "cpu", "--dtype", "float32", "--out", str(out)]
    assert mod.main([*common, "--phases", "itl", "--streams", "3", "--stream-prompt-tokens", "8", "--stream-tokens",
                     "3000", "--steady-s", "0.5", "--long-tokens", "600", "--itl-budget", "32",
                     "--itl-warmup-shape", "none"]) == 0
    itl = json.loads(out.read_text())["results"]["itl"]
    assert itl["streams_decoding"] == 3 and not itl["errors"] and "ttft_ms" in itl["long"]
    assert itl["steady_gaps"] > 0 and itl["during_gaps"] > 0
    # the combine worker's steps over the long prompt's prefill: chunks beside the streams' decode
    steps = itl["during_combine"]["scheduler_step"]
    assert steps["mixed"]["count"] >= 600 // 32 // 2
    assert sum(steps["mixed"]["by_le_ms"].values()) == steps["mixed"]["count"]
    # and the router's: the gaps between the streams' tokens it relayed meanwhile
    assert itl["during_router"].get("inter_token_latency"), itl["during_router"]
    assert itl["during_router"]["inter_token_latency"]["all"]["count"] >= steps["mixed"]["count"]
    assert mod.main([*common, "--merge", "--phases", "pic,prefix,full", "--docs", "4", "--doc-tokens", "40",
                     "--system-tokens", "4", "--question-tokens", "6", "--repeats", "2", "--budget", "64",
                     "--warmup-shape", "4+4x40+6"]) == 0
    res = json.loads(out.read_text())
    r = res["results"]
    assert set(r) == {"itl", "pic", "prefix", "full"}
    assert r["pic"]["warm"]["completed"] == 2 and r["prefix"]["warm"]["completed"] == 2
    assert r["full"]["cold"]["completed"] == 1
    assert "combine_memory" not in r["pic"]  # a CPU worker plans no device memory: none is recorded
    # pic's warm requests built nothing; the prefix peer cached none of their prompt
    assert all(s.get("built_tokens", 0) == 0 for s in r["pic"]["warm"]["stats"])
    f = res["figures"]
    assert f["itl_p99_during_long_prefill_vs_steady"] == round(
        itl["during_itl_ms"]["p99"] / itl["steady_itl_ms"]["p50"], 3)
    assert f["warm_pic_ttft_speedup_vs_prefix_128k"] > 0 and f["cold_pic_ttft_vs_full_128k"] > 0
    assert set(res["runs"]) == {"itl", "pic", "prefix", "full"} and res["gpu"] == "none (CPU)"
    # each phase's run says how fast the host ran meanwhile (host_probe.py), the merged ones kept
    for run in res["runs"].values():
        assert run["host"]["start"]["python_ms"] > 0 and run["host"]["end"]["python_ms"] > 0


def test_a_failed_request_gives_no_figure():
    """A long prompt refused at once (HTTP 400) leaves the streams' gaps looking steady: the itl
    figure is withheld and the failure listed; likewise a pic, prefix or full phase whose requests
    did not all complete."""
    mod = _bench("served_long_prompt")
    itl = {"long": {"error": "HTTP 400: exceeds the model's context limit"}, "errors": [],
           "steady_itl_ms": {"p50": 10.0}, "during_itl_ms": {"p99": 12.0}}
    timed = {"requests": 2, "completed": 2, "errors": [], "ttft_ms_p50": 50.0}
    results = {"itl": itl, "pic": {"cold": timed, "warm": dict(timed, ttft_ms_p50=5.0)},
               "prefix": {"cold": timed, "warm": dict(timed, completed=1, errors=["HTTP 500"])},
               "full": {"cold": timed}}
    assert [phase for phase, _ in mod.failures(results)] == ["itl", "prefix"]
    figures = mod.figures_of(results)
    assert "itl_p99_during_long_prefill_vs_steady" not in figures
    assert "warm_pic_ttft_speedup_vs_prefix_128k" not in figures
    assert figures == {"cold_pic_ttft_vs_full_128k": 1.0}
    itl["long"] = {"ttft_ms": 900.0}
    results["prefix"]["warm"] = timed
    assert mod.failures(results) == []
    # a phase whose stack did not start (its worker refused its configuration) is a failure too
    results["pic"] = {"stack_error": "served_load: `hybridcache up` did not become ready"}
    assert mod.failures(results) == [("pic", "its stack did not start: served_load: `hybridcache up` did not "
                                             "become ready")]
    assert "warm_pic_ttft_speedup_vs_prefix_128k" not in mod.figures_of(results)
    results["pic"] = {"cold": timed, "warm": dict(timed, ttft_ms_p50=5.0)}
    assert mod.figures_of(results)["itl_p99_during_long_prefill_vs_steady"] == 1.2


def test_the_combine_workers_memory_plan_is_kept(monkeypatch):
    """Each long phase keeps its combine worker's memory plan from /health (the budgets say whether
    64 documents' entries fit), and nothing where the worker has none or does not answer."""
    import types

    mod = _bench("served_long_prompt")
    import served_decode

    calls = []

    def health(address, path, timeout):
        calls.append((address, path))
        return 200, {"memory": {"entry_gib": 9.5}}

    monkeypatch.setattr(served_decode, "get_json", health)
    stack = types.SimpleNamespace(services=[{"role": "router", "http": "h:1"}, {"role": "combine", "http": "h:2"}])
    assert mod.combine_memory(stack, 5.0) == {"entry_gib": 9.5} and calls == [("h:2", "/health")]
    monkeypatch.setattr(served_decode, "get_json", lambda *a: (0, {}))
    assert mod.combine_memory(stack, 5.0) == {}
    assert mod.combine_memory(types.SimpleNamespace(services=[]), 5.0) == {}
