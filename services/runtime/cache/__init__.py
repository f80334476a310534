"""Segment entries (public pool), the page tree of prefixes and part-chain snapshots (private pool)."""

from hybridcache.services.runtime.cache.base import EntryStore
from hybridcache.services.runtime.cache.entry import (
    CACHE_FORMAT,
    ENTRY_STATE_DTYPES,
    EntryLayout,
    SegmentEntry,
    cast_entry_states,
    entry_checksum,
    entry_nbytes,
    expected_entry_nbytes,
    segment_key,
)
from hybridcache.services.runtime.cache.memory import MemoryEntryStore
from hybridcache.services.runtime.cache.policies import (
    POLICIES,
    PageRecorder,
    PrefixPolicy,
    linear_state_bytes_per_token,
    restore_state,
)
from hybridcache.services.runtime.cache.prefix import PrefixSnapshot, PrefixStore, chain_key
from hybridcache.services.runtime.cache.radix import PageNode, PagePayload, PageTree

__all__ = [
    "CACHE_FORMAT",
    "ENTRY_STATE_DTYPES",
    "EntryLayout",
    "EntryStore",
    "MemoryEntryStore",
    "POLICIES",
    "PageNode",
    "PagePayload",
    "PageRecorder",
    "PageTree",
    "PrefixPolicy",
    "PrefixSnapshot",
    "PrefixStore",
    "SegmentEntry",
    "cast_entry_states",
    "chain_key",
    "entry_checksum",
    "entry_nbytes",
    "expected_entry_nbytes",
    "linear_state_bytes_per_token",
    "restore_state",
    "segment_key",
]
