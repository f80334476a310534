"""Assignment of cold segments to scatter workers.

LPT (longest processing time first): take segments in decreasing estimated cost and give each to
the worker that would finish it soonest given its current queue. Round-robin is kept as the
baseline it is compared against.
"""

from __future__ import annotations


def lpt_assign(costs: list[float], queued: list[float]) -> list[int]:
    """Worker index per segment. `queued` is each worker's outstanding work (same unit as costs);
    not modified."""
    if not queued:
        raise ValueError("no scatter workers")
    load = list(queued)
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        w = min(range(len(load)), key=lambda w: (load[w], w))
        out[i] = w
        load[w] += costs[i]
    return out


def round_robin_assign(costs: list[float], queued: list[float], start: int = 0) -> list[int]:
    if not queued:
        raise ValueError("no scatter workers")
    return [(start + i) % len(queued) for i in range(len(costs))]


def makespan(costs: list[float], queued: list[float], assignment: list[int]) -> float:
    load = list(queued)
    for c, w in zip(costs, assignment):
        load[w] += c
    return max(load)
