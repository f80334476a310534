"""benchmarks/host_probe.py: the host's CPU counters read and split, and its probes."""

import importlib.util
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_probe.py"


@pytest.fixture(scope="module")
def hp():
    spec = importlib.util.spec_from_file_location("host_probe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


STAT = """cpu  {u} 0 {s} {i} {w} 0 0 {st} 0 0
cpu0 1 2 3 4 5 6 7 8 0 0
intr 12345
"""


def test_cpu_counters_are_read_from_the_host_wide_line(hp):
    got = hp.parse_cpu_times(STAT.format(u=100, s=50, i=800, w=10, st=40))
    assert got == {"user": 100, "nice": 0, "system": 50, "idle": 800, "iowait": 10, "irq": 0, "softirq": 0,
                   "steal": 40}
    assert hp.parse_cpu_times("intr 1\n") is None
    # an old kernel's line without the steal column counts none stolen
    assert hp.parse_cpu_times("cpu 1 2 3 4 5\n")["steal"] == 0


def test_shares_are_of_the_time_between_two_readings(hp):
    a = hp.parse_cpu_times(STAT.format(u=100, s=50, i=800, w=10, st=40))
    b = hp.parse_cpu_times(STAT.format(u=400, s=150, i=1300, w=10, st=140))
    # 1,000 jiffies between: 400 busy (user + system), 500 idle, 100 stolen
    assert hp.cpu_shares(a, b) == {"busy_fraction": 0.4, "steal_fraction": 0.1}
    assert hp.cpu_shares(a, a) == {} and hp.cpu_shares(None, b) == {}


def test_a_probe_times_the_host_and_a_report_keeps_its_start(hp):
    p = hp.probe()
    assert p["python_ms"] > 0 and p["torch_op_us"] > 0 and p["cpus"] >= 1
    watch = hp.HostWatch()
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline:  # this process keeps a CPU busy
        pass
    first, second = watch.report(), watch.report()
    for r in (first, second):
        assert r["start"]["python_ms"] > 0 and r["end"]["python_ms"] > 0 and "cpu" not in r["start"]
    if hp.cpu_times() is not None:  # Linux: the spin shows as busy time
        assert first["busy_fraction"] > 0 and 0 <= first["steal_fraction"] < 1
        assert "busy_fraction" in second  # the start's counters were not used up by the first report
