"""Segment entries (public pool) and prefix snapshots (private pool), with byte budgets."""

from hybridcache.services.runtime.cache.base import EntryStore
from hybridcache.services.runtime.cache.entry import (
    CACHE_FORMAT,
    SegmentEntry,
    entry_checksum,
    entry_nbytes,
    expected_entry_nbytes,
    segment_key,
)
from hybridcache.services.runtime.cache.memory import MemoryEntryStore
from hybridcache.services.runtime.cache.prefix import PrefixSnapshot, PrefixStore, chain_key

__all__ = [
    "CACHE_FORMAT",
    "EntryStore",
    "MemoryEntryStore",
    "PrefixSnapshot",
    "PrefixStore",
    "SegmentEntry",
    "chain_key",
    "entry_checksum",
    "entry_nbytes",
    "expected_entry_nbytes",
    "segment_key",
]
