"""Segment-entry store: byte budget, eviction by recency and compute per byte, checksums, keys."""

import torch
from hybridcache.services.runtime.cache import MemoryEntryStore, SegmentEntry, expected_entry_nbytes, segment_key
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.sequence import LinearSpan, SpanData


def fake_entry(key, nbytes_floats, build_seconds):
    t = torch.zeros(nbytes_floats // 4)
    data = SpanData(1, 0, {0: LinearSpan(T=torch.zeros(0), S=t, conv_tail=torch.zeros(0))}, {})
    return SegmentEntry(key=key, segment_tokens=1, data=data, build_seconds=build_seconds)


def test_store_stays_within_budget_and_evicts_least_valuable():
    store = MemoryEntryStore(capacity_bytes=4000)
    store.put(fake_entry("cheap", 1000, 0.001))
    store.put(fake_entry("dear", 1000, 1.0))
    store.put(fake_entry("mid", 1000, 0.1))
    assert store.used_bytes == 3000
    store.put(fake_entry("new", 2000, 0.5))
    assert store.used_bytes <= 4000
    assert not store.contains("cheap") and store.contains("dear") and store.contains("new")
    assert not store.put(fake_entry("huge", 8000, 9.0))
    assert store.used_bytes <= 4000


def test_recency_ages_out_untouched_entries():
    store = MemoryEntryStore(capacity_bytes=3000)
    store.put(fake_entry("a", 1000, 0.5))
    for i in range(10):
        store.put(fake_entry(f"x{i}", 1000, 0.5))
        assert store.get(f"x{i}") is not None
    assert not store.contains("a")


def test_corrupt_entry_is_a_miss():
    store = MemoryEntryStore(capacity_bytes=10_000, verify_checksums=True)
    e = fake_entry("k", 400, 0.1).seal()
    store.put(e)
    assert store.get("k") is e
    e.data.linear[0].S[3] = 1.0  # corrupt in place
    assert store.get("k") is None
    assert store.corrupt == 1 and not store.contains("k")


def test_key_depends_on_model_format_window_and_tokens():
    base = segment_key("fp", 8, [1, 2, 3])
    assert base == segment_key("fp", 8, [1, 2, 3])
    assert (
        len({base, segment_key("fp2", 8, [1, 2, 3]), segment_key("fp", 4, [1, 2, 3]), segment_key("fp", 8, [1, 2, 4])})
        == 4
    )


def test_entry_size_known_before_build(qwen35_dir):
    eng = Engine.from_dir(qwen35_dir, config=EngineConfig())
    seg = list(range(10, 90))
    expected = expected_entry_nbytes(eng.cfg, len(seg) - eng.config.seam_window, eng.model.dtype)
    assert eng.build_entry(seg).nbytes == expected


def test_engine_cache_respects_budget(qwen35_dir):
    eng = Engine.from_dir(qwen35_dir, config=EngineConfig())
    one = expected_entry_nbytes(eng.cfg, 72, eng.model.dtype)
    eng = Engine.from_dir(qwen35_dir, config=EngineConfig(entry_cache_bytes=int(2.5 * one)))
    for i in range(5):
        seg = [(i * 7 + j) % 250 for j in range(80)]
        LLM(eng).generate({"segments": [seg], "suffix": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
        assert eng.entries.used_bytes <= int(2.5 * one)
    assert len(eng.entries) == 2 and eng.entries.evictions == 3


def _snapshot(kv, end, seed):
    from hybridcache.services.runtime.cache.prefix import PrefixSnapshot
    from hybridcache.services.runtime.sequence import AttnState, LinearState

    g = torch.Generator().manual_seed(seed)
    lin = {0: LinearState(torch.randn(1, 2, 4, 4, generator=g), torch.randn(1, 8, 3, generator=g))}
    attn = {1: AttnState(kv[0][:, :, :end], kv[1][:, :, :end])}  # views of the request's K/V, as prefill keeps
    return PrefixSnapshot(end, lin, attn)


def test_prefix_store_counts_shared_kv_once_and_whole():
    """Snapshots of one request share its K/V: the budget counts those storages once, in full
    (a short prefix's view keeps every token alive), and frees them with the last snapshot."""
    from hybridcache.services.runtime.cache.prefix import PrefixStore

    kv = (torch.zeros(1, 2, 1000, 8), torch.zeros(1, 2, 1000, 8))  # 64,000 bytes each
    lin_bytes = (2 * 4 * 4 + 8 * 3) * 4
    store = PrefixStore(10**6)
    assert store.put("a", _snapshot(kv, 100, 0))
    assert store.used_bytes == 2 * 64_000 + lin_bytes  # the whole K/V, not 100 tokens of it
    assert store.put("b", _snapshot(kv, 600, 1))
    assert store.used_bytes == 2 * 64_000 + 2 * lin_bytes  # shared K/V counted once
    # a budget that holds one request's K/V and one more small snapshot evicts by what is pinned
    small = PrefixStore(2 * 64_000 + 2 * lin_bytes)
    assert small.put("a", _snapshot(kv, 100, 0)) and small.put("b", _snapshot(kv, 600, 1))
    other = (torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8))
    assert small.put("c", _snapshot(other, 10, 2))
    assert len(small) == 1 and small.get("c") is not None  # both a and b had to go to free the K/V
    assert small.used_bytes == 2 * 640 + lin_bytes
    assert not PrefixStore(10_000).put("x", _snapshot(kv, 1, 3))  # pins more than the whole budget
