"""benchmarks/moe_bench.py on the CPU with the tiny Qwen3.5-MoE preset (fp32, transformers' model as
the peer without fla): every section runs and reports its figures, so the script cannot rot
between GPU runs; bad arguments exit 2 with one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_bench.py"


def test_tiny_run_reports_every_figure(tmp_path):
    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, "-P", str(SCRIPT), "--device", "cpu", "--preset", "tiny", "--quick",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert json.loads(r.stdout) == res and res["errors"] == {} and "partial" not in res
    assert res["shape"]["layers_run"] == res["shape"]["layers_requested"] == 4
    assert res["commit"] and res["date"] and res["gpu"] == "none (CPU)"
    f = res["figures"]
    assert f["moe_auto_path"] == "grouped_mm" and f["copy_gb_per_s"] > 0
    for n in (1, 32):
        assert f[f"moe_block_ms_loop_{n}"] > 0 and f[f"moe_block_ms_grouped_mm_{n}"] > 0
        assert f[f"moe_block_rel_err_grouped_mm_{n}"] <= 1e-5 and f[f"moe_block_fastest_{n}"] in ("loop", "grouped_mm")
        assert f[f"moe_auto_path_{n}"] == "grouped_mm" and f[f"moe_block_floor_us_{n}"] > 0
    assert f["moe_prefill_ms_ours_48"] > 0 and f["moe_prefill_ms_peer_48"] > 0
    speedup = f["moe_prefill_ms_peer_48"] / f["moe_prefill_ms_ours_48"]
    assert f["moe_prefill_speedup_vs_peer_48"] == pytest.approx(speedup, rel=2e-3, abs=6e-4)  # 3 decimals
    assert f["peer_kernels"]["experts"] == "grouped_mm"
    # tiny: 4 MoE layers of 4 experts, h = 64, I = 48, fp32: one expert is 3 * 64 * 48 * 4 bytes
    for b in (1, 4):
        parts = f[f"moe_decode_bytes_{b}"]
        active = f[f"moe_decode_active_experts_per_layer_{b}"]
        assert parts["weights_experts"] == pytest.approx(4 * active * 36864, rel=1e-3)
        assert parts["kv"] > 0 and parts["linear_states"] > 0 and parts["weights_dense"] > 0
        floor_ms = sum(parts.values()) / (f["copy_gb_per_s"] * 1e9) * 1e3
        assert f[f"moe_decode_floor_ms_{b}"] == pytest.approx(floor_ms, rel=1e-2, abs=2e-3)
        assert 0 < f[f"moe_decode_fraction_of_floor_{b}"] < 1
        assert f[f"moe_decode_path_{b}"] == "grouped_mm"
    assert f["moe_decode_active_experts_per_layer_1"] == 2  # top-2 of one token


@pytest.mark.parametrize("bad, message", [
    (["--sections", "block,warp"], "--sections"),
    (["--preset", "qwen3.5-9b"], "--preset"),
    (["--layers", "-1"], "--layers must be >= 0"),
])
def test_bad_arguments_exit_2_with_the_reason(bad, message):
    r = subprocess.run([sys.executable, "-P", str(SCRIPT), "--device", "cpu", *bad], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
