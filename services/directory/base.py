"""Where the services find each other: members per role, and which cache-tier member holds a key.

Members register under a lease (etcd) and disappear when they stop renewing it. Entry keys map
to cache-tier members by consistent hashing over the live members (HashRing), so every router,
scatter and combine worker agrees on the owner without a per-entry record.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from abc import ABC, abstractmethod


class Directory(ABC):
    @abstractmethod
    def register(self, role: str, address: str, ttl_s: float = 10.0) -> None:
        """Announce `address` as a live member of `role` until deregister() or close(); keeps it alive."""

    @abstractmethod
    def deregister(self, role: str, address: str) -> None:
        """Withdraw a member this process registered."""

    @abstractmethod
    def members(self, role: str) -> list[str]:
        """Live members of a role, sorted. Does not modify the directory."""

    def owner(self, key: str, role: str = "cache-tier") -> str | None:
        """The member of `role` that holds `key` (consistent hashing), or None when there is none."""
        return self.ring(role).owner(key)

    def ring(self, role: str = "cache-tier") -> HashRing:
        """The consistent-hash ring over the live members of `role`, read once: a caller placing
        many keys asks the directory (an etcd round trip) once. Rings are kept per member set, so
        their points are hashed only when the members change."""
        return _ring(tuple(self.members(role)))

    @property
    def backend(self) -> str:
        return type(self).__name__

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop keep-alives and withdraw this process's registrations."""


def _point(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes: adding or removing one of m members moves ~1/m of the keys."""

    def __init__(self, members, vnodes: int = 64):
        self.members = sorted(set(members))
        self._points = sorted((_point(f"{m}#{v}"), m) for m in set(members) for v in range(vnodes))
        self._keys = [p for p, _ in self._points]

    def owner(self, key: str) -> str | None:
        if not self._points:
            return None
        i = bisect.bisect(self._keys, _point(key)) % len(self._points)
        return self._points[i][1]


@functools.lru_cache(maxsize=32)
def _ring(members: tuple[str, ...]) -> HashRing:
    return HashRing(members)
