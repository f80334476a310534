"""benchmarks/served_gpu.py's CPU-runnable parts: argument handling, and a tiny run on the CPU
through the in-process engine and a served stack with a scatter worker (real processes)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "served_gpu.py"


def _mod():
    spec = importlib.util.spec_from_file_location("served_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("bad, message", [
    (["--phases", "inproc,warp"], "unknown ['warp']"),
    (["--phases", ","], "empty list"),
    (["--segments", "0"], "--segments must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--layers", "-1"], "--layers -1: a count >= 0 or fit"),
    (["--layers", "fit"], "--layers fit needs --device cuda"),
    (["--preset", "qwen3.5-80b"], "--preset qwen3.5-80b: no such preset"),
    (["--arch", "qwen3_5_text", "--preset", "qwen3.5-35b-a3b"], "no such preset of --arch qwen3_5_text"),
])
def test_bad_arguments_exit_2_with_the_reason(bad, message):
    r = subprocess.run([sys.executable, "-P", str(SCRIPT), "--device", "cpu", *bad], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_figures_are_ratios_of_what_the_phases_measured():
    m = _mod()
    res = {"inproc": {"cold_pic_ms": 30.0, "warm_pic_ms": [10.0, 12.0, 11.0], "full_ms": [20.0]},
           "pic": {"cold": {"ttft_ms": 24.0, "stats": {}}, "warm": [{"ttft_ms": 11.0}, {"ttft_ms": 13.0}]},
           "scatter": {"cold": {"ttft_ms": 26.0, "stats": {"scatter_bytes": 4e9, "scatter_seconds": 0.05,
                                                            "scatter_path": "cuda_ipc"}},
                       "cold2": {"ttft_ms": 25.0, "stats": {"scatter_bytes": 2e9, "scatter_seconds": 0.05}}}}
    f = m.figures(res)
    assert f["served_warm_ttft_vs_in_process"] == round(12.0 / 11.0, 3)
    assert f["cold_pic_ttft_vs_full_32x1k"] == 1.2 and f["cold_pic_ttft_vs_full_32x1k_with_scatter"] == 1.3
    assert f["cold_pic_ttft_with_scatter_vs_without"] == round(26 / 24, 3)
    assert f["scatter_to_combine_gb_per_s"] == 60.0 and f["scatter_to_combine_transport"] == "cuda_ipc"
    assert f["scatter_to_combine_gb_per_s_host"] == 60.0  # stats without copy seconds: the host's time alone
    # cold pic: the median of the pic stack's cold requests against full's; the first request alone beside it
    res["pic"]["cold2"] = {"ttft_ms": 18.0, "stats": {}}
    res["pic"]["cold_more"] = [{"ttft_ms": 19.0, "stats": {}}]
    f = m.figures(res)
    assert f["cold_pic_ttft_vs_full_32x1k"] == round(19.0 / 20.0, 3)
    assert f["cold_pic_first_request_ttft_vs_full_32x1k"] == 1.2
    assert "served_cold_build_ms" not in f  # cold stats without the scheduler's split: no figure
    # the scheduler's split of the cold requests' wait: the served median beside R in-process
    for r, (steps, build, assembly) in zip([res["pic"]["cold"], res["pic"]["cold2"], res["pic"]["cold_more"][0]],
                                           [(5, 300.0, 40.0), (4, 200.0, 30.0), (6, 250.0, 35.0)]):
        r["stats"].update(prefill_steps=steps, build_ms=build, assembly_ms=assembly)
    res["inproc"]["cold_pic_stats"] = {"prefill_steps": 5, "build_ms": 180.0, "assembly_ms": 20.0}
    f = m.figures(res)
    assert (f["served_cold_prefill_steps"], f["served_cold_build_ms"], f["served_cold_assembly_ms"]) == (5, 250.0, 35.0)
    assert (f["inproc_cold_prefill_steps"], f["inproc_cold_build_ms"], f["inproc_cold_assembly_ms"]) == (5, 180.0, 20.0)


def test_the_link_rate_is_bytes_over_the_copy_seconds_and_the_host_rate_over_the_receive_seconds():
    m = _mod()
    stats = [{"scatter_bytes": 4e9, "scatter_seconds": 0.25, "scatter_copy_seconds": 0.04, "scatter_path": "cuda_ipc",
              "scatter_ipc_opens": 1},
             {"scatter_bytes": 4e9, "scatter_seconds": 0.2, "scatter_copy_seconds": 0.05, "scatter_ipc_opens": 0}]
    f = m.figures({"scatter_ipc": {"cold": {"ttft_ms": 30.0, "stats": stats[0]},
                                   "cold2": {"ttft_ms": 28.0, "stats": stats[1]}}})
    assert f["scatter_to_combine_gb_per_s"] == 90.0  # median of 100 and 80 GB/s
    assert f["scatter_to_combine_gb_per_s_host"] == 18.0  # median of 16 and 20 GB/s
    assert f["scatter_to_combine_ipc_opens"] == [1, 0]
    assert "served_pic_ttft_speedup_vs_prefix_32x1k" not in f  # no prefix phase: no figure, not a made-up one
    assert "served_warm_router_ms" not in f  # warm results without the stats that split them


def test_overhead_figures_split_the_warm_requests_stats():
    m = _mod()
    warm = [{"ttft_ms": 40.0, "stats": {"router_ms": 9.0, "combine_ms": 30.0, "engine_ttft_ms": 25.0,
                                        "combine_ttft_ms": 27.0, "ttft_ms": 39.0, "router_to_combine_ms": 1.5,
                                        "combine_to_router_ms": 0.5}},
            {"ttft_ms": 50.0, "stats": {"router_ms": 11.0, "combine_ms": 34.0, "engine_ttft_ms": 27.0,
                                        "combine_ttft_ms": 28.0, "ttft_ms": 47.0, "router_to_combine_ms": 2.5,
                                        "combine_to_router_ms": 0.7}},
            {"ttft_ms": 45.0, "stats": {"router_ms": 10.0, "combine_ms": 33.0, "engine_ttft_ms": 30.0,
                                        "combine_ttft_ms": 33.0, "ttft_ms": 43.0, "router_to_combine_ms": 2.0}}]
    f = m.figures({"pic": {"cold": {"ttft_ms": 60.0, "stats": {}}, "warm": warm}})
    assert f["served_warm_router_ms"] == 10.0
    assert f["served_warm_combine_outside_engine_ms"] == 5.0
    assert f["served_warm_combine_ttft_minus_engine_ms"] == 2.0
    assert f["served_warm_client_minus_engine_ms"] == 15.0
    # the hops: medians of what each request reported (one of them no combine_to_router_ms)
    assert f["served_warm_router_to_combine_ms"] == 2.0 and f["served_warm_combine_to_router_ms"] == 0.6
    assert f["served_warm_router_to_client_ms"] == 2.0  # 1, 3, 2
    for w in warm:
        del w["stats"]["combine_ttft_ms"]  # results of a combine worker that did not report it
    f = m.figures({"pic": {"cold": {"ttft_ms": 60.0, "stats": {}}, "warm": warm}})
    assert "served_warm_combine_ttft_minus_engine_ms" not in f and f["served_warm_combine_outside_engine_ms"] == 5.0


def test_tiny_cpu_run(tmp_path):
    out = tmp_path / "served.json"
    r = subprocess.run([sys.executable, "-P", str(SCRIPT), "--device", "cpu", "--preset", "tiny", "--dtype", "float32",
                        "--layers", "0", "--segments", "3", "--segment-tokens", "40", "--question-tokens", "8",
                        "--repeats", "1", "--phases", "inproc,scatter", "--model", str(tmp_path / "model"),
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == {} and res["shape"]["segments"] == 3
    # each phase says how fast its host ran meanwhile (host_probe.py): results of different runs compare
    for phase in ("inproc", "scatter"):
        host = res["detail"][phase]["host"]
        assert host["start"]["python_ms"] > 0 and host["end"]["torch_op_us"] > 0 and host["seconds"] > 0
        assert 0 < host["busy_fraction"] <= 1
    f = res["figures"]
    # processes of one CPU host: the scatter worker sends entries through /dev/shm
    assert f["scatter_to_combine_transport"] == "shm" and f["scatter_to_combine_gb_per_s"] > 0
    assert f["cold_pic_ttft_vs_full_32x1k_with_scatter"] > 0 and f["inproc_full_ttft_ms"] > 0
    cold = res["detail"]["scatter"]["cold"]
    # the response's ttft_ms is the router's view of the client's wait; the engine's share is inside it
    assert 0 < cold["stats"]["engine_ttft_ms"] < cold["stats"]["ttft_ms"] <= cold["ttft_ms"]
    assert cold["stats"]["built_tokens"] == 3 * 40 and cold["stats"]["scatter_bytes"] > 0
    # the combine worker froze what it held once warm (its /health), and says what requests cost its memory
    assert res["detail"]["scatter"]["combine_gc_frozen_objects"] > 10_000
    assert cold["stats"]["entry_evictions"] == 0 and cold["stats"]["entry_cache_bytes"] > 0
    # the scheduler's split of a cold request's wait, in-process and served (the combine worker
    # built the segments here: its scatter worker shares its CPU)
    inproc = res["detail"]["inproc"]["cold_pic_stats"]
    assert inproc["prefill_steps"] >= 1 and 0 < inproc["build_ms"] < res["detail"]["inproc"]["cold_pic_ms"]
    assert f["inproc_cold_build_ms"] == inproc["build_ms"] and cold["stats"]["prefill_steps"] >= 1
    assert 0 < cold["stats"]["assembly_ms"] < cold["stats"]["engine_ttft_ms"]
    # and what each cold request paid besides the engine's work, per stack (no graphs or CUDA
    # allocator on the CPU: collector pauses only)
    pauses = f["cold_gc_pause_ms_all_with_scatter"]
    assert len(pauses) >= 2 and all(p >= 0 for p in pauses) and "cold_graph_captures_all_with_scatter" not in f


def test_the_preset_names_its_model_type_and_moe_models_report_the_moe_figures():
    m = _mod()
    assert m.preset_arch("qwen3.5-9b") == "qwen3_5_text" and m.preset_arch("tiny") == "qwen3_5_text"
    assert m.preset_arch("qwen3.5-35b-a3b") == "qwen3_5_moe_text" and m.preset_arch("nope") is None
    assert m.is_moe("qwen3_5_moe_text", "qwen3.5-35b-a3b") and not m.is_moe("qwen3_5_text", "qwen3.5-9b")
    res = {"inproc": {"cold_pic_ms": 30.0, "warm_pic_ms": [10.0], "full_ms": [20.0]},
           "pic": {"cold": {"ttft_ms": 24.0, "stats": {}}, "warm": [{"ttft_ms": 2.0}]},
           "prefix": {"cold": {"ttft_ms": 24.0, "stats": {}}, "warm": [{"ttft_ms": 40.0}]}}
    dense, moe = m.figures(res), m.figures(res, moe=True)
    assert "moe_cold_pic_ttft_vs_full_32x1k" not in dense
    assert moe["moe_cold_pic_ttft_vs_full_32x1k"] == dense["cold_pic_ttft_vs_full_32x1k"] == 1.2
    assert moe["moe_served_pic_ttft_speedup_vs_prefix_32x1k"] == dense["served_pic_ttft_speedup_vs_prefix_32x1k"] == 20
    # the partial result written after each phase: inproc alone has neither figure yet
    assert not any(k.startswith("moe_") for k in m.figures({"inproc": res["inproc"]}, moe=True))


def test_layers_that_fit_keep_the_layer_mix_and_the_budget():
    """--layers fit: whole full-attention intervals of layers whose weights (and the embedding and
    head) fit the bytes given, at least one interval, at most the preset's layers."""
    import torch
    from hybridcache.services.runtime.models.registry import build_model, config_from_dict
    from hybridcache.services.runtime.modelzoo import hf_config

    m = _mod()
    arch, preset = "qwen3_5_moe_text", "qwen3.5-35b-a3b"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            full = build_model(config_from_dict(hf_config(arch, preset)))
    finally:
        torch.set_default_dtype(torch.float32)
    total = sum(p.numel() * p.element_size() for p in full.parameters())
    assert m.layers_that_fit(arch, preset, "bfloat16", total) == 40
    assert m.layers_that_fit(arch, preset, "bfloat16", total - 1) == 36
    assert m.layers_that_fit(arch, preset, "bfloat16", 1) == 4
    n = m.layers_that_fit(arch, preset, "bfloat16", 0.6 * total)
    assert n % 4 == 0 and 20 <= n <= 24
