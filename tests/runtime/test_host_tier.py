"""The host-memory entry tier: evictions move down instead of being dropped, host hits are staged
back layer by layer, and a request answers the same from either tier."""

import pytest
import torch
from hybridcache.services.runtime.cache import MemoryEntryStore
from hybridcache.services.runtime.cache.host_tier import TieredEntryStore, is_host, stage, to_host
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM


@pytest.fixture(scope="module")
def engine(qwen35_dir):
    return Engine.from_dir(qwen35_dir)


def _entry(engine, seed, n=40):
    ids = torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return engine.build_entry(ids)


def _tensors(data):
    out = []
    for i in sorted(data.linear):
        s = data.linear[i]
        out += [s.T, s.S, s.conv_tail]
    for i in sorted(data.attn):
        a = data.attn[i]
        out += [a.k, a.v]
    return out


def test_memory_store_reports_evictions(engine):
    a, b = _entry(engine, 0), _entry(engine, 1)
    seen = []
    store = MemoryEntryStore(a.nbytes + b.nbytes // 2, on_evict=seen.append)
    store.put(a)
    store.put(b)
    assert [e.key for e in seen] == [a.key] and not store.contains(a.key)
    store.delete(b.key)
    assert len(seen) == 1  # delete is not an eviction


def test_tiered_store_demotes_and_answers_from_host(engine):
    a, b = _entry(engine, 0), _entry(engine, 1)
    store = TieredEntryStore(a.nbytes + b.nbytes // 2, 10 * a.nbytes)
    store.put(a)
    store.put(b)
    assert store.demotions == 1
    got = store.get(a.key)
    assert got is not None and is_host(got) and not is_host(store.get(b.key))
    assert got.nbytes == a.nbytes and got.key == a.key
    for x, y in zip(_tensors(got.data), _tensors(a.data)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    store.put(a)  # back on the device: one copy only
    assert not is_host(store.get(a.key)) and not store.host.contains(a.key)


def test_stage_gives_the_same_tensors_layer_by_layer(engine):
    entries = [to_host(_entry(engine, s, n)) for s, n in ((2, 40), (3, 57), (4, 33))]
    staged = stage(entries, "cpu")
    assert len(staged) == 3
    for e, data in zip(entries, staged):
        assert data.num_tokens == e.data.num_tokens and data.local_start == e.data.local_start
        assert sorted(data.linear) == sorted(e.data.linear) and sorted(data.attn) == sorted(e.data.attn)
        for x, y in zip(_tensors(data), _tensors(e.data)):
            assert torch.equal(x, y) and x.dtype == y.dtype and x.is_contiguous()
            assert x.data_ptr() != y.data_ptr()  # copies, not the host buffer itself


def _request(segments, system):
    return {"system": system, "segments": segments, "suffix": [11, 12, 13, 14],
            "sampling_params": {"max_new_tokens": 4}}


def test_requests_answer_the_same_from_the_host_tier(qwen35_dir):
    gen = torch.Generator().manual_seed(5)
    segs = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (40, 63, 35)]
    plain = Engine.from_dir(qwen35_dir)
    tiered = Engine.from_dir(qwen35_dir, config=EngineConfig(host_cache_bytes=1 << 30))
    for e in (plain, tiered):
        LLM(e).generate(_request(segs, [5, 6, 7]))
    tiered.entries.demote_all()
    assert len(tiered.entries.device) == 0 and len(tiered.entries.host) == 3
    reordered = [segs[2], segs[0], segs[1]]
    want = LLM(plain).generate(_request(reordered, [8, 9]))
    got = LLM(tiered).generate(_request(reordered, [8, 9]))
    assert got.output_ids == want.output_ids
    assert [s.source for s in got.stats.segments] == ["host"] * 3
    assert [s.source for s in want.stats.segments] == ["entry"] * 3
    # the logits themselves, for an order neither engine has seen
    tiered.entries.demote_all()
    pre = [e.prefill(e.parse_request(_request([segs[1], segs[2], segs[0]], [4]))) for e in (plain, tiered)]
    for e, p in zip((plain, tiered), pre):
        e.finish_prefix(p)
    assert torch.equal(pre[0].logits, pre[1].logits)


def test_small_device_budget_moves_entries_down_as_it_fills(qwen35_dir, engine):
    one = _entry(engine, 0).nbytes
    cfg = EngineConfig(entry_cache_bytes=int(one * 1.5), host_cache_bytes=1 << 30)
    tiered = Engine.from_dir(qwen35_dir, config=cfg)
    gen = torch.Generator().manual_seed(6)
    segs = [torch.randint(3, 200, (40,), generator=gen).tolist() for _ in range(3)]
    LLM(tiered).generate(_request(segs, [5]))
    assert len(tiered.entries.device) == 1 and len(tiered.entries.host) == 2
    res = LLM(tiered).generate(_request(segs[::-1], [6]))
    assert sorted(s.source for s in res.stats.segments) == ["entry", "host", "host"]


def test_negative_host_budget_is_refused():
    with pytest.raises(ValueError, match="host_cache_bytes"):
        EngineConfig(host_cache_bytes=-1)


@pytest.mark.gpu
def test_stage_on_cuda_matches_resident_entries(qwen35_dir):
    """Copies on the side stream, waited for by layer: the logits of a request from the host tier
    equal those from device-resident entries."""
    dev = Engine.from_dir(qwen35_dir, device="cuda")
    tiered = Engine.from_dir(qwen35_dir, device="cuda", config=EngineConfig(host_cache_bytes=1 << 30))
    gen = torch.Generator().manual_seed(7)
    segs = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (70, 41, 130, 33)]
    for e in (dev, tiered):
        LLM(e).generate(_request(segs, [5, 6, 7]))
    tiered.entries.demote_all()
    host_entry = tiered.entries.get(tiered.entries.host.keys()[0])
    assert host_entry.data.linear[0].S.device.type == "cpu" and host_entry.data.linear[0].S.is_pinned()
    want = LLM(dev).generate(_request(segs[::-1], [8]))
    got = LLM(tiered).generate(_request(segs[::-1], [8]))
    assert got.output_ids == want.output_ids
    assert [s.source for s in got.stats.segments] == ["host"] * 4


def test_warmup_of_a_tiered_engine_stages_from_the_host(qwen35_dir, monkeypatch):
    from hybridcache.services.runtime import runner as runner_mod

    tiered = Engine.from_dir(qwen35_dir, config=EngineConfig(host_cache_bytes=1 << 30))
    store = tiered.entries
    staged = []
    real = runner_mod.stage

    def spy(entries, device):
        staged.append(len(entries))
        return real(entries, device)

    monkeypatch.setattr(runner_mod, "stage", spy)
    LLM(tiered).warmup()
    assert staged and max(staged) >= 3
    assert tiered.entries is store and len(store) == 0


@pytest.mark.parametrize("arch", ["kimi_linear", "nemotron_h", "olmo_hybrid"])
def test_other_families_answer_the_same_from_the_host_tier(arch, tmp_path):
    """Matrix (KDA), scalar (SSD) and gated-delta T, MLA latents: every span kind survives packing."""
    from hybridcache.services.runtime.modelzoo import init_model_dir

    d = init_model_dir(arch, "tiny", tmp_path / arch, seed=1, std=0.08)
    gen = torch.Generator().manual_seed(8)
    segs = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (21, 17)]
    plain = Engine.from_dir(d)
    tiered = Engine.from_dir(d, config=EngineConfig(host_cache_bytes=1 << 30))
    for e in (plain, tiered):
        LLM(e).generate(_request(segs, [5, 6]))
    tiered.entries.demote_all()
    pre = [e.prefill(e.parse_request(_request(segs[::-1], [7]))) for e in (plain, tiered)]
    for e, p in zip((plain, tiered), pre):
        e.finish_prefix(p)
    assert [s.source for s in pre[1].stats.segments] == ["host", "host"]
    assert torch.equal(pre[0].logits, pre[1].logits)


def test_a_requests_memory_counters_count_the_device_stores_evictions(engine):
    """The combine worker's per-request counters (memory_counters): the entries the device store
    evicted, whether it drops them or moves them to host memory; no CUDA counters off CUDA."""
    from hybridcache.services.combine.worker import memory_counters

    a, b, c = _entry(engine, 0), _entry(engine, 1), _entry(engine, 2)
    room = a.nbytes + b.nbytes // 2
    for store in (MemoryEntryStore(room), TieredEntryStore(room, 10 * a.nbytes)):
        before = memory_counters("cpu", store)
        assert before == {"entry_evictions": 0}
        for e in (a, b, c):
            store.put(e)
        assert memory_counters("cpu", store)["entry_evictions"] - before["entry_evictions"] == 2
