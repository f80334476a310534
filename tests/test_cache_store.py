"""Segment-entry store: byte budget, eviction by recency and compute per byte, checksums, keys."""

import torch
from hybridcache.services.runtime.cache import MemoryEntryStore, SegmentEntry, expected_entry_nbytes, segment_key
from hybridcache.services.runtime.engine import Engine, EngineConfig
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
        eng.generate({"segments": [seg], "suffix": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
        assert eng.entries.used_bytes <= int(2.5 * one)
    assert len(eng.entries) == 2 and eng.entries.evictions == 3
