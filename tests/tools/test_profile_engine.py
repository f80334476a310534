"""tools/profile_engine.py on CPU at the tiny preset: the warm requests timed and profiled, with the
host's speed over the timed requests (benchmarks/host_probe.py) beside their times."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import profile_engine  # noqa: E402


def test_warm_requests_are_timed_beside_the_host_s_speed(capsys):
    assert profile_engine.main(["--preset", "tiny", "--segments", "3", "--segment-tokens", "40",
                                "--question-tokens", "8", "--requests", "2", "--top", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["ttft_ms"]) == 2 and all(t > 0 for t in res["ttft_ms"]) and res["device"] == "cpu"
    host = res["host"]
    assert host["start"]["python_ms"] > 0 and host["end"]["torch_op_us"] > 0
    assert 0 < host["busy_fraction"] <= 1 and res["by_host_time"]
