"""benchmarks/qps.py on CPU: bad arguments exit 2, the queue simulation behaves, and a tiny run
produces every figure."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _qps():
    spec = importlib.util.spec_from_file_location("qps", ROOT / "benchmarks" / "qps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sustainable_rate_falls_with_service_time_and_rises_with_the_slo():
    q = _qps()
    fast, slow = q.qps_at_slo([0.1] * 8), q.qps_at_slo([0.2] * 8)
    assert slow < fast < 10.0  # a server busy 0.1 s a request cannot take 10 requests/s
    assert q.qps_at_slo([0.1] * 8, slo_s=2.0) > fast


def test_bad_arguments_exit_2_and_a_tiny_run_gives_every_figure(tmp_path):
    cmd = [sys.executable, "-P", str(ROOT / "benchmarks" / "qps.py"), "--preset", "tiny"]
    bad = subprocess.run([*cmd, "--segment-tokens", "4"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "qps: error" in bad.stderr
    out = tmp_path / "qps.json"
    run = subprocess.run([*cmd, "--quick", "--segment-tokens", "48", "--trace-requests", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(out.read_text())["figures"]
    assert {"qps_at_slo_pic", "qps_at_slo_prefix", "qps_at_slo_full", "qps_at_slo_pic_vs_prefix",
            "grpc_transfer_GBps"} <= set(figures)
    # a rate is 0 when even an idle server misses the SLO (the slow CPU modes may)
    assert all(v >= 0 for v in figures.values()) and figures["grpc_transfer_GBps"] > 0
