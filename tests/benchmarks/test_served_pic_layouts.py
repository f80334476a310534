"""benchmarks/served_pic_layouts.py: the warm request's floor arithmetic, and the whole script on
CPU at a tiny size (it starts `hybridcache up` itself; its figures come from requests that ran)."""

import importlib.util
import json
import sys
from pathlib import Path


def _bench(name):
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_floor_counts_weights_entries_and_flops(tmp_path):
    """The 9B shape's 32 x 1k warm request: every weight (the embedding's live rows only), each
    entry's T, S, conv tail and K/V; FLOPs of the live tokens; the floor is the larger time."""
    from hybridcache.services.runtime.modelzoo import hf_config

    mod = _bench("served_pic_layouts")
    (tmp_path / "config.json").write_text(json.dumps(hf_config("qwen3_5_text", "qwen3.5-9b")))
    shape = mod.model_shape(tmp_path, "bfloat16")
    assert shape["linear_layers"] == 24 and shape["attention_layers"] == 8 and shape["kv_heads"] == 4
    f = mod.warm_floor(shape, 32, 1024, 336, 8, 4, 3e12, 800e12)
    per_entry = 24 * (32 * (128 * 128 * 2) * 4 + shape["conv_dim"] * 3 * 2) + 1016 * 8 * 2 * 4 * 256 * 2
    assert f["entry_bytes"] == 32 * per_entry
    assert f["bytes_read"] == shape["weights_read"] + 336 * shape["embedding_row"] + 32 * per_entry
    assert f["floor_ms"] == max(f["bytes_ms"], f["flops_ms"]) and 5 < f["bytes_ms"] < 10
    assert f["flops"] > 2 * shape["matmul_params"] * 336


def test_served_pic_layouts_on_cpu(qwen35_dir, tmp_path, capsys):
    mod = _bench("served_pic_layouts")
    out = tmp_path / "r.json"
    assert mod.main(["--model", str(qwen35_dir), "--device", "cpu", "--dtype", "float32", "--docs", "6",
                     "--doc-tokens", "20,60", "--docs-per-request", "3", "--floor-docs", "3", "--floor-doc-tokens",
                     "24", "--system-tokens", "4", "--question-tokens", "6", "--requests", "3",
                     "--copy-bandwidth", "1e10", "--peak-flops", "1e11", "--up-args", "--scatter-workers 0",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == res
    r = res["results"]
    assert r["cache_fill"]["completed"] == 2 and r["unseen"]["completed"] == 3
    assert r["repeated"]["completed"] == 4 and r["floor_request"]["completed"] == 4
    # every timed request folded its documents in from their entries: nothing built
    assert r["unseen"].get("built_tokens", 0) == 0 and r["repeated"].get("built_tokens", 0) == 0
    f = res["figures"]
    assert f["warm_pic_ttft_unseen_layouts_vs_repeated"] == round(
        r["unseen"]["ttft_ms"]["p50"] / r["repeated"]["ttft_ms"]["p50"], 3)
    assert f["warm_pic_ttft_fraction_of_floor_32x1k"] == round(
        res["floor_32x1k"]["floor_ms"] / r["floor_request"]["ttft_ms"]["p50"], 3) > 0
    assert res["gpu"] == "none (CPU)" and res["commit"] and res["date"] and res["copy_bandwidth_tb_per_s"] == 0.01


def test_a_phase_with_failed_requests_gives_no_figure():
    """A timed phase whose requests did not all complete gives no figure; a failed cache fill none."""
    mod = _bench("served_pic_layouts")

    def phase(p50, completed=3):
        return {"requests": 3, "completed": completed, "errors": [] if completed == 3 else ["HTTP 500"],
                "ttft_ms": {"p50": p50}, "graph_captures": 0}

    floor = {"floor_ms": 10.0}
    results = {"cache_fill": phase(900.0), "repeated": phase(100.0), "unseen": phase(110.0, completed=2),
               "floor_request": phase(50.0)}
    figures, failed = mod.figures_of(results, floor)
    assert failed == ["unseen"] and "warm_pic_ttft_unseen_layouts_vs_repeated" not in figures
    assert figures["warm_pic_ttft_fraction_of_floor_32x1k"] == 0.2
    results["unseen"] = phase(110.0)
    assert mod.figures_of(results, floor)[0]["warm_pic_ttft_unseen_layouts_vs_repeated"] == 1.1
    results["cache_fill"] = phase(900.0, completed=1)
    figures, failed = mod.figures_of(results, floor)
    assert failed == ["cache_fill"] and set(figures) == {"warm_pic_unseen_layouts_graph_captures"}
