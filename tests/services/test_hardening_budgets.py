"""Resident memory at the default budgets: after a short soak of real requests and 1.5 GiB of
entries written through the cache tier's default 1 GiB store, every service holds no more than
what it held when it became ready, plus its default cache budgets, plus test_memory's stated
overhead (docs/deploy.md). The audit measured the tier 1,154 MiB over its ready state against the
1,120 MiB stated, from freed entries the allocator kept (cache_tier/store.py return_freed_entries)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

from hybridcache.services import security
from hybridcache.services.cache_tier.client import CacheTierClient
from hybridcache.services.devices import CPU_CACHE_BYTES, CPU_KV_BYTES
from hybridcache.services.launcher import LocalCluster, free_port
from serving_helpers import http
from test_memory import FLOOD_MIB, MIB, OVERHEAD_MIB, big_entry, rss

SOAK_S = 15.0
FLOOD_ENTRIES = 384  # 1.5 GiB of 4 MiB entries through the 1 GiB store


def test_resident_memory_at_the_default_budgets(model_dir):
    allowed = {"combine": 2 * CPU_CACHE_BYTES + CPU_KV_BYTES, "scatter": 2 * CPU_CACHE_BYTES,
               "cache-tier": CPU_CACHE_BYTES, "router": 0}
    rng = random.Random(1)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    pool = [f"doc {i}: " + " ".join(rng.choice(words) for _ in range(80)) for i in range(100)]
    with LocalCluster(model_dir, port=free_port(), scatter_workers=1) as c:
        ready = {s.role: rss(s.proc.pid) for s in c.services}

        def one(n: int):
            return http("POST", f"{c.url}/generate", {"segments": rng.sample(pool, 3), "text": f"question {n}?",
                                                     "sampling_params": {"max_new_tokens": 4}}, timeout=120)

        n, deadline = 0, time.monotonic() + SOAK_S
        with ThreadPoolExecutor(3) as ex:
            while time.monotonic() < deadline:
                assert all(status == 200 for status, _ in ex.map(one, range(n, n + 3)))
                n += 3
        security.install(c.secret)  # this process writes to the tier as a member would
        try:
            tier = CacheTierClient(c.role("cache-tier")[0].grpc, timeout_s=60)
            for i in range(FLOOD_ENTRIES):
                assert tier.put([big_entry(i)]) == 1
                if i % 8 == 7:
                    assert set(tier.get([f"flood-{i}", f"flood-{i - 1}"], "shm")) == {f"flood-{i}", f"flood-{i - 1}"}
            tier.close()
        finally:
            security.install(None)
        time.sleep(1.0)
        after = {s.role: rss(s.proc.pid) for s in c.services}
    assert FLOOD_ENTRIES * FLOOD_MIB * MIB > 1.4 * CPU_CACHE_BYTES
    report = {role: (round(ready[role] / MIB), round(after[role] / MIB), round((after[role] - ready[role]) / MIB),
                     round(allowed[role] / MIB) + OVERHEAD_MIB) for role in after}
    print("resident MiB (ready, after, growth, allowed growth):", report)
    for role, used in after.items():
        assert used <= ready[role] + allowed[role] + OVERHEAD_MIB * MIB, (role, report)
