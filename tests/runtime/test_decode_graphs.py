"""Decode CUDA graphs' static-buffer path (runtime/paged.py DecodeGraphs) without CUDA: a graph
that reruns the step on replay stands in for a captured one. A step padded up to its batch size's
bucket, through the static inputs and the scratch slot, equals the unpadded eager step while
requests join and leave and cross page boundaries; batch sizes past the largest bucket run
eagerly; a pool that grows drops the graphs."""

import pytest
import torch
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.paged import DecodeGraphs, StatePool, decode_batch_sizes, decode_step, eager_step
from hybridcache.services.runtime.sequence import LiveRun


class RerunGraph:
    """capture keeps the step; replay runs it again and returns its outputs."""

    def __init__(self, mempool, device):
        self.fn = None

    def capture(self, fn, reset=None):
        self.fn = fn
        return None, {}

    def replay(self):
        return self.fn()


@pytest.fixture(scope="module")
def model(qwen35_dir):
    return load_model(qwen35_dir)


def assign_prefilled(model, pools, ids) -> tuple:
    """`ids` prefilled from an empty state once per pool, each state assigned a slot there: the slots."""
    slots = []
    for pool in pools:
        s = model.empty_state()
        model.forward_layout(s, [LiveRun(ids, 0)], logits_for="none")
        slots.append(pool.assign(s))
    return tuple(slots)


def test_batch_sizes():
    assert decode_batch_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert decode_batch_sizes(16) == (1, 2, 4, 8, 16)
    assert decode_batch_sizes(5) == (1, 2, 4, 5)
    assert decode_batch_sizes(1) == (1,)


def test_padded_static_step_equals_unpadded_eager(model):
    gen = torch.Generator().manual_seed(4)
    eager = StatePool(model.empty_state(), 6, 2048, 512)
    static = StatePool(model.empty_state(), 6, 2048, 512)
    graphs = DecodeGraphs(model, static, sizes=(1, 2, 4), graph_factory=RerunGraph)
    slots = {}  # request -> (eager slot, static slot)

    def join(r, n):
        slots[r] = assign_prefilled(model, (eager, static), torch.randint(0, 250, (n,), generator=gen))

    for r, n in enumerate((15, 16)):
        join(r, n)
    sizes_seen, ran_eager = set(), 0
    for step in range(24):
        if step == 2:
            join(2, 3)  # three requests: bucket 4, one padding row
        if step == 5:
            join(3, 33)  # four: no padding
        if step == 9:
            join(4, 7)  # five: past the largest bucket, eager
        if step == 13:
            for r in (0, 4):  # request 0 leaves (slot 0 free: rows no longer consecutive)
                a, b = slots.pop(r)
                eager.release(a)
                static.release(b)
        order = sorted(slots)
        toks = torch.randint(0, 250, (len(order),), generator=gen).tolist()
        want, _ = decode_step(model, eager, [slots[r][0] for r in order], toks)
        rows = [slots[r][1] for r in order]
        host, max_pages = static.step_inputs(rows, toks)
        out = graphs.run(host)
        if out is None:
            ran_eager += 1
            out = eager_step(model, static, rows, host, max_pages)
        else:
            sizes_seen.add(graphs.size_for(len(order)))
        assert out[0].shape == want.shape
        # a padded batch is a GEMM of another shape: equal up to fp32 rounding (the CPU's GEMM
        # blocking depends on the shape), and the same greedy tokens
        torch.testing.assert_close(out[0], want, rtol=0, atol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")
        assert out[0].argmax(-1).tolist() == want.argmax(-1).tolist(), step
    assert ran_eager == 4  # the steps of five requests
    assert sizes_seen == {2, 4} and graphs.stats["replays"] > 10
    # the K/V in the static pool's pages are the eager pool's
    for a, b in slots.values():
        for i in eager.kv.layers:
            # (24 steps of states that differ by rounding: relative 1e-4)
            torch.testing.assert_close(static.kv.read(b, i)[0], eager.kv.read(a, i)[0], rtol=1e-4, atol=1e-5)


def test_graphs_are_dropped_when_the_pool_grows(model):
    gen = torch.Generator().manual_seed(5)
    pool = StatePool(model.empty_state(), 2, 16, 64)  # room for few pages
    graphs = DecodeGraphs(model, pool, sizes=(1, 2), graph_factory=RerunGraph)
    s = model.empty_state()
    model.forward_layout(s, [LiveRun(torch.randint(0, 250, (30,), generator=gen), 0)], logits_for="none")
    slot = pool.assign(s)
    for _ in range(3):
        graphs.run(pool.step_inputs([slot], [1])[0])
    assert len(graphs.graphs) == 1
    generation = pool.generation
    big = model.empty_state()
    model.forward_layout(big, [LiveRun(torch.randint(0, 250, (60,), generator=gen), 0)], logits_for="none")
    other = pool.assign(big)  # past the pool's pages: it grows
    assert pool.generation > generation
    graphs.run(pool.step_inputs([slot, other], [1, 2])[0])
    assert graphs.generation == pool.generation and list(graphs.graphs) == [(2, ())]


class FailingGraph(RerunGraph):
    def capture(self, fn, reset=None):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_leaves_that_size_eager(model):
    gen = torch.Generator().manual_seed(6)
    pool = StatePool(model.empty_state(), 2, 256, 128)
    ref = StatePool(model.empty_state(), 2, 256, 128)
    slots = assign_prefilled(model, (pool, ref), torch.randint(0, 250, (9,), generator=gen))
    graphs = DecodeGraphs(model, pool, sizes=(1, 2), graph_factory=FailingGraph)
    host, max_pages = pool.step_inputs([slots[0]], [3])
    first = graphs.run(host)  # the step's eager answer stands
    assert first is not None and list(graphs.failed) == [(1, ())]
    want, _ = decode_step(model, ref, [slots[1]], [3])
    assert torch.equal(first[0], want)
    host, max_pages = pool.step_inputs([slots[0]], [4])
    assert graphs.run(host) is None  # the caller runs it eagerly
    got = eager_step(model, pool, [slots[0]], host, max_pages)[0]
    assert torch.equal(got, decode_step(model, ref, [slots[1]], [4])[0])


def test_capture_all_captures_every_size_before_requests(model):
    """A server's warm-up captures each padded batch size (and each hidden-layer set) from padding
    columns alone; the steps of real requests then replay those graphs, capture nothing more and
    give the eager answer."""
    gen = torch.Generator().manual_seed(7)
    pool = StatePool(model.empty_state(), 4, 1024, 256)
    ref = StatePool(model.empty_state(), 4, 1024, 256)
    graphs = DecodeGraphs(model, pool, sizes=(1, 2, 4), graph_factory=RerunGraph)
    anchors = (model.linear_groups()[0][0],)
    assert graphs.capture_all([(), anchors]) == 6
    assert set(graphs.graphs) == {(s, h) for s in (1, 2, 4) for h in ((), anchors)}
    assert graphs.capture_all([(), anchors]) == 0  # captured once
    pairs = []
    for n in (5, 17, 30):
        pairs.append(assign_prefilled(model, (pool, ref), torch.randint(0, 250, (n,), generator=gen)))
        toks = torch.randint(0, 250, (len(pairs),), generator=gen).tolist()
        for hidden in ((), anchors):
            host, _ = pool.step_inputs([a for a, _ in pairs], toks)
            got, got_hidden = graphs.run(host, hidden)
            want, _ = decode_step(model, ref, [b for _, b in pairs], toks, hidden)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
            assert set(got_hidden) == set(hidden)
    assert graphs.stats["captures"] == 6 and graphs.stats["replays"] == 6


def test_capture_all_after_the_pool_was_reallocated_captures_every_size_again(model):
    """Graphs of reallocated pool tensors are stale: a warm-up after the reallocation captures every
    size again (none skipped because a stale graph of its size was still listed), and held() counts
    only the current ones."""
    pool = StatePool(model.empty_state(), 4, 1024, 256)
    graphs = DecodeGraphs(model, pool, sizes=(1, 2, 4), graph_factory=RerunGraph)
    assert graphs.capture_all([()]) == 3 and graphs.held([()]) == 3
    pool.kv._grow(2 * pool.kv.num_pages)  # the K/V pages reallocated: every graph read the old ones
    assert graphs.held([()]) == 0
    assert graphs.capture_all([()]) == 3 and graphs.held([()]) == 3
    assert graphs.generation == pool.generation


def test_no_decode_graphs_are_captured_off_cuda(model):
    from hybridcache.services.runtime.runner import ModelRunner

    runner = ModelRunner(model)
    pool = runner.new_state_pool(2, 64)
    assert runner.warm_decode(pool, [()]) == 0 and runner.decode_graphs(pool) is None
