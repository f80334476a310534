"""How fast and how contended the host of a run is, so that runs on different machines (or on one
virtual machine at different times) can be compared where a figure depends on host time: a warm
request's launches and Python, a cold build issued by the host, the served path outside the engine.

    watch = HostWatch()          # a probe now
    ...                          # the phase
    detail["host"] = watch.report()

A probe times a fixed pure-Python workload (`python_ms`, the best of three) and a tiny torch op on
the CPU (`torch_op_us`, the median of many; what a launch's host side costs is of this kind), and
reads the load average and the CPU time counters of /proc/stat. A report holds the probes at the
start and at the end and, from the counters between them, the share of the host's CPU time that
was busy and the share the hypervisor took for other guests (`steal_fraction`: a virtual machine
whose neighbours are busy runs the same Python slower while its own load looks light).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

# /proc/stat's first line: cpu user nice system idle iowait irq softirq steal ...
CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def parse_cpu_times(text: str) -> dict[str, int] | None:
    """The host-wide CPU time counters (jiffies) of /proc/stat's text; None where it has no "cpu" line."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:1 + len(CPU_FIELDS)]]
            return dict(zip(CPU_FIELDS, values + [0] * (len(CPU_FIELDS) - len(values))))
    return None


def cpu_times() -> dict[str, int] | None:
    """/proc/stat's counters now, or None off Linux."""
    try:
        return parse_cpu_times(Path("/proc/stat").read_text())
    except OSError:
        return None


def cpu_shares(start: dict[str, int] | None, end: dict[str, int] | None) -> dict[str, float]:
    """The shares of the host's CPU time between two counter readings: busy (neither idle nor
    waiting on I/O nor stolen) and stolen; {} without both readings or with no time between them."""
    if not start or not end:
        return {}
    delta = {k: end[k] - start[k] for k in CPU_FIELDS}
    total = sum(delta.values())
    if total <= 0:
        return {}
    busy = total - delta["idle"] - delta["iowait"] - delta["steal"]
    return {"busy_fraction": round(busy / total, 4), "steal_fraction": round(delta["steal"] / total, 4)}


def _python_workload() -> int:
    """A fixed mix of what the serving code's host side does: dict and list work, small objects."""
    acc, table = 0, {}
    for i in range(60_000):
        table[i & 1023] = (i, i * 3)
        acc += len(table) + table[i & 511][1]
    return acc


def probe() -> dict:
    """One probe of the host: python_ms, torch_op_us (None without torch), loadavg_1m, cpu counters."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        _python_workload()
        times.append((time.perf_counter() - t0) * 1000)
    out = {"python_ms": round(min(times), 3), "torch_op_us": None,
           "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
           "cpus": os.cpu_count(), "cpu": cpu_times()}
    try:
        import torch
    except ImportError:
        return out
    x = torch.ones(8)
    ops = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        x.add(1.0)
        ops.append(time.perf_counter_ns() - t0)
    out["torch_op_us"] = round(statistics.median(ops) / 1000, 3)
    return out


class HostWatch:
    """A probe when made; report() probes again and gives both with the CPU shares in between."""

    def __init__(self):
        self.start = probe()
        self.t0 = time.perf_counter()

    def report(self) -> dict:
        end = probe()
        shares = cpu_shares(self.start.get("cpu"), end.get("cpu"))
        start = {k: v for k, v in self.start.items() if k != "cpu"}
        end = {k: v for k, v in end.items() if k != "cpu"}
        return {"seconds": round(time.perf_counter() - self.t0, 1), "start": start, "end": end, **shares}
