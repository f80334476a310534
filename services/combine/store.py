"""The combine worker's entry store: its own cache (GPU/host memory, byte budget) plus the entries
gathered for the request running now, pinned so that eviction cannot take them mid-request."""

from __future__ import annotations

from hybridcache.services.runtime.cache import EntryStore, MemoryEntryStore, SegmentEntry
from hybridcache.services.runtime.cache.host_tier import TieredEntryStore


class PinningEntryStore(EntryStore):
    def __init__(self, capacity_bytes: int, host_bytes: int = 0):
        """host_bytes > 0: what the local cache evicts moves to a host tier (cache/host_tier.py)."""
        if host_bytes > 0:
            self.local = TieredEntryStore(capacity_bytes, host_bytes)
        else:
            self.local = MemoryEntryStore(capacity_bytes)
        self._pinned: dict[str, SegmentEntry] = {}

    def pin(self, entries: dict[str, SegmentEntry]) -> None:
        """Make `entries` visible to get() until unpin(); also offers them to the local cache."""
        self._pinned = dict(entries)
        for e in entries.values():
            self.local.put(e)

    def unpin(self) -> None:
        self._pinned = {}

    def get(self, key: str) -> SegmentEntry | None:
        e = self._pinned.get(key)
        return e if e is not None else self.local.get(key)

    def peek(self, key: str) -> SegmentEntry | None:
        """The locally cached entry without gathering (updates recency like get)."""
        return self.local.get(key)

    def put(self, entry: SegmentEntry) -> bool:
        return self.local.put(entry)

    def contains(self, key: str) -> bool:
        return key in self._pinned or self.local.contains(key)

    def delete(self, key: str) -> None:
        self._pinned.pop(key, None)
        self.local.delete(key)

    @property
    def used_bytes(self) -> int:
        return self.local.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.local.capacity_bytes
