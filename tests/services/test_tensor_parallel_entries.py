"""Entries of tensor-parallel workers on the CPU (two ranks as two processes, gloo): the ranks'
slices gathered into one bundle equal the TP = 1 entry head for head; a bundle from the cache tier
reaches a TP = 2 combine worker's ranks, each its own slice, and is folded in (not rebuilt) with
the TP = 1 answer; a changed rank-1 slice changes the answer (the follower uses what it was
handed); a TP = 1 entry offered to the TP = 2 worker is a miss, rebuilt, the answer unchanged."""

from __future__ import annotations

import functools
from concurrent import futures

import grpc
import pytest
import torch
from hybridcache.services.cache_tier.server import CacheTierServicer
from hybridcache.services.cache_tier.store import TierStore
from hybridcache.services.combine.worker import CombineServicer
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.launcher import free_port
from hybridcache.services.observability import metrics
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.runtime.cache import SegmentEntry
from hybridcache.services.runtime.engine import Engine
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.modelzoo import init_model_dir
from hybridcache.services.runtime.tensor_parallel import ranks
from hybridcache.services.runtime.tensor_parallel.entries import bundle, gather_entries, scatter_entries, unbundle

SIZE = 2
ARCH = "qwen3_5_text"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(init_model_dir(ARCH, "tiny", tmp_path_factory.mktemp("tp_entries") / ARCH, seed=2, std=0.08))


@pytest.fixture(scope="module")
def group(model):
    g = ranks.start(SIZE, functools.partial(ranks.build_runners, {"pic": (model, RuntimeConfig(mode="pic"))}))
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def eng(group, model):
    """Rank 0's engine over the group's runners."""
    return ranks.engine_of(group, model, "pic")


@pytest.fixture(scope="module")
def tp1(model):
    return Engine.from_dir(model, config=RuntimeConfig(mode="pic"))


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request(segments, system: int = 90):
    return {"system": _ids(system, 5), "segments": segments, "suffix": _ids(91, 6),
            "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}


def test_gathered_slices_are_the_tp1_entry_head_for_head(group, eng, tp1):
    seg = _ids(1, 37)
    [b] = gather_entries(group, eng.build_entries([seg]))
    ref = tp1.build_entry(seg)
    assert b.key == eng.entry_key(seg) != ref.key  # the key carries the split
    for i, s in ref.data.linear.items():
        got = b.data.linear[i]
        assert got.S.shape[0] == SIZE and got.S.shape[1] * SIZE == s.S.shape[1]
        # rank r holds heads [r H / N, (r + 1) H / N): side by side they are the whole layer's
        assert torch.allclose(got.S.reshape(s.S.shape), s.S, atol=1e-5)
        assert torch.allclose(got.T.reshape(s.T.shape), s.T, atol=1e-5)
        assert s.S.abs().max() > 1e-3
    for i, a in ref.data.attn.items():
        assert torch.allclose(b.data.attn[i].k.reshape(a.k.shape), a.k, atol=1e-5)
        assert torch.allclose(b.data.attn[i].v.reshape(a.v.shape), a.v, atol=1e-5)
    parts = unbundle(b, SIZE)
    assert [p.meta["tensor_parallel"] for p in parts] == ["0/2", "1/2"]
    assert torch.equal(bundle(parts).data.linear[0].S, b.data.linear[0].S)
    assert "holds no 2 rank slices" in unbundle(ref, SIZE)


def test_scattered_slices_are_folded_in_on_every_rank(group, eng, tp1):
    segs = [_ids(2, 41), _ids(3, 29)]
    bundles = gather_entries(group, [eng.build_entry(s) for s in segs])
    assert not any(eng.entries.contains(b.key) for b in bundles)
    for system, change in ((92, 0.0), (93, 1.0)):  # another system prompt each: no prefix hit
        want = tp1.prefill(tp1.parse_request(_request(segs, system)))
        tp1.finish_prefix(want)
        slices = [unbundle(b, SIZE) for b in bundles]
        for span in slices[1][1].data.linear.values():
            span.S.add_(change)  # rank 1's slice of the second segment: only that rank holds it
        mine = scatter_entries(group, slices)
        assert [e.meta["tensor_parallel"] for e in mine] == ["0/2", "0/2"]
        pre = eng.prefill(eng.parse_request(_request(segs, system)), pinned={e.key: e for e in mine})
        eng.finish_prefix(pre)
        assert [s.source for s in pre.stats.segments] == ["entry", "entry"] and pre.stats.built_tokens == 0
        close = torch.allclose(pre.logits, want.logits, atol=1e-5)
        assert close if change == 0.0 else not close


@pytest.fixture()
def tier():
    store = TierStore(1 << 24)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rpc.add_CacheTierServicer_to_server(CacheTierServicer(store), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    yield store, address
    server.stop(0)


def test_combine_worker_takes_a_bundle_from_the_tier_and_misses_a_tp1_entry(group, eng, tp1, tier):
    store, address = tier
    combine = CombineServicer(eng)
    try:
        segs = [_ids(4, 45), _ids(5, 33)]
        keys = [eng.entry_key(s) for s in segs]
        [held] = gather_entries(group, eng.build_entries([segs[0]]))
        store.put(held)
        # a TP = 1 entry of the second segment under the TP = 2 key (sealed, so only its layout tells)
        one = tp1.build_entry(segs[1])
        for span in one.data.linear.values():
            span.S.add_(1.0)  # would change the answer if it were folded in
        store.put(SegmentEntry(keys[1], one.segment_tokens, one.data, one.build_seconds))
        request = pb.CombineRequest(plan=[pb.SegmentPlan(index=i, key=k, source="tier", address=address)
                                          for i, k in enumerate(keys)])
        before = metrics.BYTES_MOVED.labels(path="tensor_parallel")._value.get()
        pinned, source, moved = combine._gather(request, segs)
        assert source == {0: "tier"} and set(pinned) == {keys[0]} and moved["tier_bytes"] == held.nbytes
        # rank 1's half went to rank 1
        assert metrics.BYTES_MOVED.labels(path="tensor_parallel")._value.get() - before == held.nbytes // SIZE
        assert pinned[keys[0]].meta["tensor_parallel"] == "0/2"
        want = LLM(tp1).generate(_request(segs)).output_ids
        handle = combine.scheduler.add_request(eng.parse_request(_request(segs)), pinned)
        assert handle.result().output_ids == want
        stats = handle.prefill.stats
        assert [s.source for s in stats.segments] == ["entry", "built"]
    finally:
        combine.close()


def test_a_failed_hand_over_is_a_miss_and_the_group_goes_on(group, eng, tp1, tier, monkeypatch):
    """Slices that cannot be sent (here: not serialisable) fail the hand-over on every rank alike,
    a follower's object that cannot be sent fails a gather on rank 0: the group still works, and
    the combine worker rebuilds the segments it could not hand out, with TP = 1's answer."""
    from hybridcache.services.runtime.tensor_parallel import entries

    with pytest.raises(Exception):  # noqa: B017 - pickle's own error: a lambda cannot be serialised
        group.scatter([lambda: 0, lambda: 1])
    # a follower's counterpart that cannot be sent (its runners hold weak references): rank 0 hears of it
    with pytest.raises(ranks.TPError, match="could not send"):
        group.gather(group.local)
    assert len(gather_entries(group, eng.build_entries([_ids(7, 20)]))) == 1
    store, address = tier
    combine = CombineServicer(eng)
    try:
        segs = [_ids(6, 39)]
        [held] = gather_entries(group, eng.build_entries(segs))
        store.put(held)
        real = entries.scatter_entries
        monkeypatch.setattr(entries, "scatter_entries",
                            lambda g, slices: real(g, [[*s[:-1], lambda: 0] for s in slices]))
        request = pb.CombineRequest(plan=[pb.SegmentPlan(index=0, key=held.key, source="tier", address=address)])
        pinned, source, _ = combine._gather(request, segs)
        assert pinned == {} and source == {}
        handle = combine.scheduler.add_request(eng.parse_request(_request(segs, 94)), pinned)
        assert handle.result().output_ids == LLM(tp1).generate(_request(segs, 94)).output_ids
        assert [s.source for s in handle.prefill.stats.segments] == ["built"]
    finally:
        combine.close()
