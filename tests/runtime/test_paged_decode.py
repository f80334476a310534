"""Paged K/V of running requests (runtime/paged.py): a decode step's aten ops do not grow with the
batch size or the context lengths; decode from a pool whose requests cross page boundaries, join
and leave equals each request's own forward; K/V read back from the pages equal the forward's;
released slots refuse reads; a pool that runs out of pages grows."""

import pytest
import torch
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.paged import PAGE_SIZE, StatePool, decode_step
from hybridcache.services.runtime.sequence import LiveRun
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model(qwen35_dir):
    return load_model(qwen35_dir)


def _prefilled(model, n, gen):
    s = model.empty_state()
    model.forward_layout(s, [LiveRun(torch.randint(0, 250, (n,), generator=gen), 0)], logits_for="none")
    return s


def _step_ops(model, lengths):
    """The aten ops of one decode step of requests at these lengths."""
    gen = torch.Generator().manual_seed(0)
    pool = StatePool(model.empty_state(), 8, 4096, 1024)
    slots = [pool.assign(_prefilled(model, n, gen)) for n in lengths]
    toks = torch.randint(0, 250, (len(lengths),), generator=gen).tolist()
    with OpCounter() as counter:
        decode_step(model, pool, slots, toks)
    return counter.ops


def test_step_ops_do_not_grow_with_batch_or_context(model):
    _step_ops(model, [20])  # what fills once per model (a norm's kept scale) fills here
    one = _step_ops(model, [20])
    eight = _step_ops(model, [3, 20, 21, 40, 7, 9, 50, 100])  # no request starts a page this step
    long = _step_ops(model, [300])
    assert len(one) > 50  # the step's ops are counted
    assert sorted(one) == sorted(eight) == sorted(long)
    # and with a new page for some requests of the batch: a fixed number of ops more
    starts = _step_ops(model, [16, 20, 32, 5])
    starts_one = _step_ops(model, [48])
    assert sorted(starts) == sorted(starts_one) and len(starts) > len(one)


def test_pool_decode_equals_sequential_across_pages_joins_and_leaves(model):
    """Requests join and leave a persistent pool while their K/V cross page boundaries; every step's
    logits and the K/V read back from the pages equal each request's own decode."""
    gen = torch.Generator().manual_seed(1)
    pool = StatePool(model.empty_state(), 4, 64, 1024)  # few pages: the pool grows on the way
    ref, live = {}, {}  # request -> sequential state; request -> (state in the pool, slot)
    lengths = {0: PAGE_SIZE - 1, 1: PAGE_SIZE, 2: 1, 3: 2 * PAGE_SIZE + 3, 4: 5}
    generation = pool.generation

    def join(r):
        ids = torch.randint(0, 250, (lengths[r],), generator=gen)
        ref[r] = model.empty_state()
        model.forward_layout(ref[r], [LiveRun(ids, 0)], logits_for="none")
        s = model.empty_state()
        model.forward_layout(s, [LiveRun(ids, 0)], logits_for="none")
        live[r] = (s, pool.assign(s))

    for r in (0, 1, 2):
        join(r)
    for step in range(30):
        if step == 5:
            join(3)
        if step == 12:  # request 1 leaves, request 4 takes its slot
            s, slot = live.pop(1)
            pool.release(slot)
            join(4)
        order = sorted(live)
        toks = torch.randint(0, 250, (len(order),), generator=gen).tolist()
        want = torch.stack([model.forward_layout(ref[r], [LiveRun(torch.tensor([t]), ref[r].length)])[0]
                            for r, t in zip(order, toks)])
        got, _ = decode_step(model, pool, [live[r][1] for r in order], toks)
        for r in order:
            live[r][0].length += 1
        assert (got - want).abs().max().item() <= 5e-5, step  # fp32, sums in another order
    assert pool.generation > generation  # the pool grew
    # after 30 steps whose sums ran in another order: equal up to fp32 rounding (the logits bound)
    for r, (s, _) in live.items():
        for i in ref[r].attn:
            torch.testing.assert_close(s.attn[i].k, ref[r].attn[i].k, rtol=1e-4, atol=5e-5)
            torch.testing.assert_close(s.attn[i].v, ref[r].attn[i].v, rtol=1e-4, atol=5e-5)
        for i in ref[r].linear:
            torch.testing.assert_close(s.linear[i].ssm, ref[r].linear[i].ssm, rtol=1e-4, atol=5e-5)


def test_release_copies_out_or_refuses_reads(model):
    gen = torch.Generator().manual_seed(2)
    pool = StatePool(model.empty_state(), 2, 256, 1024)
    a, b = _prefilled(model, 20, gen), _prefilled(model, 9, gen)
    want = {i: x.k.clone() for i, x in a.attn.items()}
    sa, sb = pool.assign(a), pool.assign(b)
    free = len(pool.kv.free)
    pool.release(sa, keep=a)
    assert len(pool.kv.free) == free + 2  # 20 tokens: two pages back
    for i, k in want.items():
        assert type(a.attn[i]).__name__ == "AttnState" and torch.equal(a.attn[i].k, k)
    pool.release(sb)
    layer = next(iter(b.attn))
    with pytest.raises(RuntimeError, match="released"):
        b.attn[layer].k  # noqa: B018
    assert sorted(pool.free) == [0, 1]
