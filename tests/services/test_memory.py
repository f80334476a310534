"""Resident memory of every service after a short soak stays within its cache budgets plus what it
held when it became ready (the interpreter, torch, gRPC and the model's weights) plus a stated
fixed overhead (OVERHEAD_MIB, documented in docs/deploy.md), on CPU with real processes."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from hybridcache.services import security
from hybridcache.services.cache_tier.client import CacheTierClient
from hybridcache.services.launcher import LocalCluster, free_port
from hybridcache.services.runtime.cache import SegmentEntry
from hybridcache.services.runtime.sequence import AttnSpan, LinearSpan, SpanData
from serving_helpers import http

MIB = 1 << 20
BUDGET = 8 * MIB  # each cache's budget: several times smaller than what the soak writes
OVERHEAD_MIB = 96  # allocator slack, gRPC buffers and transient copies of the messages in flight
SOAK_S = 40.0  # at most; the soak ends once it has written SOAK_WRITES times the budgets
SOAK_WRITES = 3
ENTRY_BYTES = 150_000  # an 80-word (~500-token) segment's entry of the tiny model, roughly
FLOOD_ENTRIES, FLOOD_MIB = 64, 4  # written straight to the tier: 256 MiB through an 8 MiB store


def big_entry(n: int) -> SegmentEntry:
    """A synthetic entry of about FLOOD_MIB (the tier checks seals, not model layouts)."""
    g = torch.Generator().manual_seed(n)
    d = 256
    linear = {i: LinearSpan(torch.randn(1, 4, d, d, generator=g), torch.randn(1, 4, d, d, generator=g),
                            torch.randn(1, 64, 3, generator=g)) for i in range(2)}
    attn = {2: AttnSpan(torch.randn(1, 2, d, 32, generator=g), torch.randn(1, 2, d, 32, generator=g))}
    return SegmentEntry(key=f"flood-{n}", segment_tokens=d, data=SpanData(d, 0, linear, attn), build_seconds=1.0)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_resident_memory_after_a_soak_stays_within_budgets(model_dir):
    budgets = {"entry_cache_bytes": BUDGET, "prefix_cache_bytes": BUDGET, "tier_cache_bytes": BUDGET,
               "kv_cache_bytes": 2 * BUDGET}
    allowed = {"combine": budgets["entry_cache_bytes"] + budgets["prefix_cache_bytes"] + budgets["kv_cache_bytes"],
               "scatter": budgets["entry_cache_bytes"] + budgets["prefix_cache_bytes"],
               "cache-tier": budgets["tier_cache_bytes"], "router": 0}
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    pool = [f"doc {i}: " + " ".join(rng.choice(words) for _ in range(80)) for i in range(200)]
    written = 0
    with LocalCluster(model_dir, port=free_port(), scatter_workers=1, **budgets) as c:
        ready = {s.role: rss(s.proc.pid) for s in c.services}
        deadline = time.monotonic() + SOAK_S

        def one(n: int):
            docs = rng.sample(pool, 3) if n % 3 else pool[:3]  # new documents, and a hot set
            return http("POST", f"{c.url}/generate", {"segments": docs, "text": f"question {n}?",
                                                     "sampling_params": {"max_new_tokens": 4}}, timeout=120)

        n = 0
        with ThreadPoolExecutor(3) as ex:
            while time.monotonic() < deadline and written * ENTRY_BYTES < SOAK_WRITES * BUDGET:
                for status, res in ex.map(one, range(n, n + 3)):
                    assert status == 200, res
                    written += sum(s["source"] == "scatter" for s in res["hybridcache"]["segments"])
                n += 3
        time.sleep(1.0)  # the scatter worker's writes to the tier land
        security.install(c.secret)  # this process writes to the tier as a member would
        try:
            tier = CacheTierClient(c.role("cache-tier")[0].grpc, timeout_s=60)
            for i in range(FLOOD_ENTRIES):
                entry = big_entry(i)
                assert abs(entry.nbytes - FLOOD_MIB * MIB) < 0.1 * FLOOD_MIB * MIB
                assert tier.put([entry]) == 1
                if i % 8 == 7:
                    assert set(tier.get([f"flood-{i}", f"flood-{i - 1}"], "shm")) == {f"flood-{i}"}
            tier.close()
        finally:
            security.install(None)
        after = {s.role: rss(s.proc.pid) for s in c.services}
    # the soak wrote several times the tier's budget
    assert written * ENTRY_BYTES > 1.5 * BUDGET, written
    report = {role: (round(ready[role] / MIB), round(after[role] / MIB), round(allowed[role] / MIB)) for role in after}
    print("resident MiB (ready, after soak, budgets):", report)
    for role, used in after.items():
        limit = ready[role] + allowed[role] + OVERHEAD_MIB * MIB
        assert used <= limit, (role, report)
