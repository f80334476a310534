"""The interface every segment-entry store implements (in-process memory, cache tier, disk)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from hybridcache.services.runtime.cache.entry import SegmentEntry


class EntryStore(ABC):
    """A key -> SegmentEntry map with a byte capacity.

    Stores never hand out a corrupt entry: an entry whose checksum does not verify is dropped
    and reported as a miss.
    """

    @abstractmethod
    def get(self, key: str) -> SegmentEntry | None:
        """The entry or None. Updates the entry's recency; does not modify the entry."""

    @abstractmethod
    def put(self, entry: SegmentEntry) -> bool:
        """Insert (or refresh) an entry, evicting others to stay within capacity.

        Returns False when the entry alone exceeds the capacity (then nothing is evicted).
        """

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether get(key) would hit now. Does not update recency."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an entry if present."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...
