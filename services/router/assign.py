"""Assignment of cold segments to scatter workers.

LPT (longest processing time first): take segments in decreasing estimated cost and give each to
the worker that would finish it soonest given its current queue. Round-robin is kept as the
baseline it is compared against.
"""

from __future__ import annotations


def lpt_assign(costs: list[float], queued: list[float], speeds: list[float] | None = None) -> list[int]:
    """Worker index per segment. `queued` is each worker's outstanding work in time units (a
    worker of speed 1 does one cost unit per time unit); not modified. `speeds` (default all 1):
    each worker's cost units per time unit, e.g. measured build rates, so a slower worker gets less;
    each segment goes to the worker that would finish it soonest."""
    if not queued:
        raise ValueError("no scatter workers")
    speeds = _speeds(speeds, len(queued))
    load = list(queued)
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        w = min(range(len(load)), key=lambda w: (load[w] + costs[i] / speeds[w], w))
        out[i] = w
        load[w] += costs[i] / speeds[w]
    return out


def _speeds(speeds: list[float] | None, n: int) -> list[float]:
    if speeds is None:
        return [1.0] * n
    if len(speeds) != n or not all(s > 0 for s in speeds):
        raise ValueError(f"speeds must be {n} positive numbers, got {speeds!r}")
    return list(speeds)


def round_robin_assign(costs: list[float], queued: list[float], start: int = 0) -> list[int]:
    if not queued:
        raise ValueError("no scatter workers")
    return [(start + i) % len(queued) for i in range(len(costs))]


def makespan(
    costs: list[float], queued: list[float], assignment: list[int], speeds: list[float] | None = None
) -> float:
    speeds = _speeds(speeds, len(queued))
    load = list(queued)
    for c, w in zip(costs, assignment):
        load[w] += c / speeds[w]
    return max(load)
