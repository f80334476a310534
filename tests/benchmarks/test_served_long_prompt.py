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
    assert mod.main([*common, "--merge", "--phases", "pic,prefix,full", "--docs", "4", "--doc-tokens", "40",
                     "--system-tokens", "4", "--question-tokens", "6", "--repeats", "2", "--budget", "64",
                     "--warmup-shape", "4+4x40+6"]) == 0
    res = json.loads(out.read_text())
    r = res["results"]
    assert set(r) == {"itl", "pic", "prefix", "full"}
    assert r["pic"]["warm"]["completed"] == 2 and r["prefix"]["warm"]["completed"] == 2
    assert r["full"]["cold"]["completed"] == 1
    # pic's warm requests built nothing; the prefix peer cached none of their prompt
    assert all(s.get("built_tokens", 0) == 0 for s in r["pic"]["warm"]["stats"])
    f = res["figures"]
    assert f["itl_p99_during_long_prefill_vs_steady"] == round(
        itl["during_itl_ms"]["p99"] / itl["steady_itl_ms"]["p50"], 3)
    assert f["warm_pic_ttft_speedup_vs_prefix_128k"] > 0 and f["cold_pic_ttft_vs_full_128k"] > 0
    assert set(res["runs"]) == {"itl", "pic", "prefix", "full"} and res["gpu"] == "none (CPU)"
