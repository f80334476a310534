"""Memory planning of a worker (devices.plan_memory, vLLM's determine_available_memory in kind):
the caches get what its share leaves after what it holds and its warm-up's transient peak, split
K/V : entries : prefix pages as 2 : 3 : 1, given budgets first; a configuration that does not fit
is refused with one line saying what to change."""

import pytest
from hybridcache.services.devices import PLAN_MARGIN_MIN, MemoryPlanError, plan_memory

GiB = 1 << 30


def test_the_caches_get_what_the_share_leaves():
    plan = plan_memory(share=71 * GiB, held=25 * GiB, transient=6 * GiB, free=60 * GiB, kv_min=GiB)
    # room 71 - 25 - 6 = 40 GiB, less a margin of 5 % (2 GiB): 38 GiB for the caches
    assert plan.left == 38 * GiB
    assert (plan.kv, plan.entry, plan.prefix) == (int(38 * GiB / 3), int(38 * GiB / 2), int(38 * GiB / 6))
    assert plan.held + plan.transient + plan.kv + plan.entry + plan.prefix <= plan.share
    assert "38.0 GiB" in plan.how and plan.summary()["kv_gib"] == round(38 / 3, 2)


def test_what_is_free_caps_the_room():
    """Another process on the GPU holds memory: the caches never take more than is free."""
    plan = plan_memory(share=71 * GiB, held=25 * GiB, transient=2 * GiB, free=12 * GiB, kv_min=GiB)
    assert plan.left == 10 * GiB - PLAN_MARGIN_MIN and "cut to the 12.0 GiB free" in plan.how


def test_given_budgets_come_off_first():
    plan = plan_memory(share=40 * GiB, held=10 * GiB, transient=4 * GiB, free=40 * GiB, kv_min=GiB, kv=6 * GiB)
    assert plan.kv == 6 * GiB
    rest = plan.left - 6 * GiB
    assert plan.entry == int(rest * 3 / 4) and plan.prefix == int(rest / 4)
    plan = plan_memory(share=40 * GiB, held=10 * GiB, transient=4 * GiB, free=40 * GiB, kv_min=GiB,
                       kv=2 * GiB, entry=3 * GiB, prefix=GiB)
    assert (plan.kv, plan.entry, plan.prefix) == (2 * GiB, 3 * GiB, GiB)


def test_a_k_v_share_under_its_minimum_is_raised_to_it():
    """8 GiB left: the K/V's third (2.7 GiB) would refuse a request the worker must admit (kv_min
    4 GiB, e.g. its warm-up shape's 128k prompt): K/V gets 4 GiB, entries and prefix pages split the
    other 4 as 3 : 1. A given K/V budget is never raised (refused instead when under the minimum)."""
    plan = plan_memory(share=20 * GiB, held=10 * GiB, transient=GiB, free=20 * GiB, kv_min=4 * GiB)
    assert plan.left == 8 * GiB and plan.kv == 4 * GiB
    assert (plan.entry, plan.prefix) == (3 * GiB, GiB) and "K/V raised to its minimum" in plan.how
    assert plan_memory(share=20 * GiB, held=10 * GiB, transient=GiB, free=20 * GiB, kv_min=GiB).kv == int(8 * GiB / 3)
    with pytest.raises(MemoryPlanError, match="at least 4.00 GiB"):
        plan_memory(share=20 * GiB, held=10 * GiB, transient=GiB, free=20 * GiB, kv_min=4 * GiB, kv=3 * GiB)


def test_more_held_or_transient_memory_leaves_smaller_caches():
    base = dict(share=71 * GiB, free=71 * GiB, kv_min=GiB)
    plans = [plan_memory(held=h * GiB, transient=t * GiB, **base) for h, t in ((20, 2), (20, 8), (30, 8), (40, 12))]
    for a, b in zip(plans, plans[1:]):
        assert b.kv < a.kv and b.entry < a.entry and b.prefix < a.prefix


def test_a_configuration_that_does_not_fit_is_refused_in_one_line():
    with pytest.raises(MemoryPlanError) as e:
        plan_memory(share=71 * GiB, held=60 * GiB, transient=9 * GiB, free=71 * GiB, kv_min=GiB,
                    parts={"the model": 18 * GiB, "the linear states of 128 requests": 6 * GiB},
                    advice="lower --max-num-seqs or --max-num-batched-tokens, or raise --gpu-memory-utilization")
    msg = str(e.value)
    assert "\n" not in msg and "does not fit" in msg and "lower --max-num-seqs" in msg
    assert "the linear states of 128 requests 6.0" in msg and "9.0 warm-up activations" in msg
    # what is left holds less than the K/V minimum: refused too, naming it
    with pytest.raises(MemoryPlanError, match="at least 9.00 GiB"):
        plan_memory(share=20 * GiB, held=10 * GiB, transient=GiB, free=20 * GiB, kv_min=9 * GiB)
    # given budgets that do not fit what is left
    with pytest.raises(MemoryPlanError, match="of entry as given"):
        plan_memory(share=20 * GiB, held=10 * GiB, transient=GiB, free=20 * GiB, kv_min=GiB, entry=9 * GiB)


def test_the_provisional_budget_serves_the_warm_up_and_the_plan_is_applied(qwen35_dir):
    """A planned worker warms up over a provisional K/V budget (serve.warmup_kv_bytes) that every
    warm-up request fits, its shape's included; then the engine's stores and the scheduler's pool
    take the planned budgets and serve requests."""
    from dataclasses import replace

    from hybridcache.services.api.serve import warmup_kv_bytes
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.scheduler import Scheduler, scheduler_config

    config = EngineConfig(warmup_shape="16+3x96+16")
    eng = Engine.from_dir(qwen35_dir, config=config)
    provisional = warmup_kv_bytes(eng, config)
    sched = Scheduler(eng, scheduler_config(config, "cpu", provisional))
    try:
        assert sched.config.kv_cache_bytes == provisional
        out = eng.warmup(run=sched.generate)  # a request over the budget would raise KVBudgetError
        assert out["shape"] == (16, 3, 96, 16) and out["requests"] == 10
        pages = sched.pool.kv.num_pages
        eng.set_cache_budgets(3 << 20, 1 << 20)
        sched.resize_kv(4 * provisional)
        assert eng.entries.capacity_bytes == 3 << 20 and eng.config.prefix_cache_bytes == 1 << 20
        assert sched.config.kv_cache_bytes == 4 * provisional and sched.pool.kv.num_pages > pages
        res = sched.generate(eng.parse_request({"segments": [list(range(30, 90))], "suffix": [5, 6],
                                                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}))
        assert len(res.output_ids) == 4
        # the plan's K/V minimum admits every warm-up request, the shaped one (16 + 3 x 96 + 16) too
        shaped = eng.warmup_requests()[0][-1]
        assert shaped.prompt_len == 16 + 3 * 96 + 16
        assert sched.kv_minimum(eng.warmup_requests()[0]) >= sched.admission_kv_bytes(shaped) > 0
        assert sched.kv_minimum() == sched.config.max_num_seqs * sched.config.kv_chunk_tokens * sched.kv_per_token
        # never over a budget given
        assert warmup_kv_bytes(eng, replace(config, kv_cache_bytes=provisional // 2)) == provisional // 2
    finally:
        sched.stop()


class FakeMemory:
    """A warm-up's device memory: per request (peak reserved while it ran, reserved after it)."""

    def __init__(self, reads):
        self.reads, self.started = list(reads), 0

    def start(self):
        self.started += 1

    def end(self):
        return self.reads.pop(0)


def test_a_warm_up_request_s_transient_leaves_out_what_it_cached():
    """Three warm-up requests: the second fills throwaway caches with 10 GiB of entries (held after
    it: not an activation), the third holds the largest activation above what stays. The transient
    is the largest of peak - held over the requests, not the whole warm-up's peak over what is held
    once its caches are dropped; each request's result comes back, a failing one's peak counts."""
    from hybridcache.services.devices import RequestPeaks

    g = GiB
    memory = FakeMemory([(20 * g, 18 * g), (31 * g, 28 * g), (33 * g, 28 * g), (40 * g, 30 * g)])
    seen = []
    peaks = RequestPeaks(lambda r: seen.append(r) or r * 2, "cuda", memory=memory)
    assert [peaks(r) for r in (1, 2, 3)] == [2, 4, 6] and seen == [1, 2, 3] and memory.started == 3
    assert peaks.transient == 5 * g and peaks.peak == 33 * g  # 33 - 28, not 33 - 18 after the drop

    def fails(_):
        raise RuntimeError("out of memory")

    peaks.run = fails
    with pytest.raises(RuntimeError, match="out of memory"):
        peaks(4)
    assert peaks.transient == 10 * g and peaks.peak == 40 * g

    def unreadable():
        raise RuntimeError("CUDA error: an illegal memory access")

    memory.end = unreadable  # the request's own error comes out, not the failed read after it
    with pytest.raises(RuntimeError, match="out of memory"):
        peaks(5)
