"""In-process entry store with a byte budget; eviction weighs recency against compute saved per byte."""

from __future__ import annotations

import threading
from collections.abc import Callable

from hybridcache.services.runtime.cache.base import EntryStore
from hybridcache.services.runtime.cache.entry import SegmentEntry


class MemoryEntryStore(EntryStore):
    """GreedyDual-Size: priority = clock + build_seconds / bytes, refreshed on every hit.

    The clock rises to the priority of each evicted entry, so an entry not touched for a while
    falls behind newer ones (recency), while entries that are expensive to rebuild per byte
    stay longer (compute saved per byte).
    """

    def __init__(
        self,
        capacity_bytes: int,
        verify_checksums: bool = False,
        on_evict: Callable[[SegmentEntry], None] | None = None,
    ):
        """on_evict(entry) is called for each entry evicted to make room (after the store's lock
        is released), e.g. to move it to a lower tier; not for delete() or a refreshed key."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self._capacity = capacity_bytes
        self._verify = verify_checksums
        self._entries: dict[str, SegmentEntry] = {}
        self._priority: dict[str, float] = {}
        self._clock = 0.0
        self._used = 0
        self._lock = threading.Lock()
        self.evictions = 0
        self.corrupt = 0
        self._on_evict = on_evict

    def _value(self, e: SegmentEntry) -> float:
        return max(e.build_seconds, 1e-9) / max(e.nbytes, 1)

    def get(self, key: str) -> SegmentEntry | None:
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return None
            if self._verify and not e.verify():
                self.corrupt += 1
                self._remove(key)
                return None
            self._priority[key] = self._clock + self._value(e)
            return e

    def put(self, entry: SegmentEntry) -> bool:
        evicted = []
        with self._lock:
            if entry.nbytes > self._capacity:
                return False
            if entry.key in self._entries:
                self._remove(entry.key)
            while self._used + entry.nbytes > self._capacity:
                victim = min(self._priority, key=self._priority.__getitem__)
                self._clock = self._priority[victim]
                evicted.append(self._remove(victim))
                self.evictions += 1
            self._entries[entry.key] = entry
            self._priority[entry.key] = self._clock + self._value(entry)
            self._used += entry.nbytes
        if self._on_evict is not None:
            for e in evicted:
                self._on_evict(e)
        return True

    def _remove(self, key: str) -> SegmentEntry:
        e = self._entries.pop(key)
        self._priority.pop(key, None)
        self._used -= e.nbytes
        return e

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> None:
        with self._lock:
            if key in self._entries:
                self._remove(key)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        """The keys held now (a snapshot), in insertion order."""
        with self._lock:
            return list(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity
