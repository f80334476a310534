"""benchmarks/tensor_parallel.py on the CPU at tiny sizes: both TP sizes run and report, so a
broken script shows in CI and not first on lent GPUs."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tensor_parallel.py"


def test_tp1_and_tp2_figures_on_cpu():
    out = subprocess.run([sys.executable, "-P", str(SCRIPT), "--device", "cpu", "--preset", "tiny",
                          "--prefill-tokens", "64", "--prompt-tokens", "8", "--streams", "2", "--decode-steps", "2",
                          "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    for size in ("1", "2"):
        assert res["tp"][size]["prefill_s"] > 0 and res["tp"][size]["decode_tokens_per_s"] > 0
    assert res["tp2_prefill_speedup"] > 0 and res["tp2_decode_speedup"] > 0


def test_bad_sizes_exit_2():
    out = subprocess.run([sys.executable, "-P", str(SCRIPT), "--device", "cpu", "--preset", "tiny", "--tp", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--tp must be" in out.stderr
