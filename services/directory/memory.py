"""In-process directory: local mode without etcd, and the fallback while etcd is unreachable."""

from __future__ import annotations

import threading
import time

from hybridcache.services.directory.base import Directory


class InProcessDirectory(Directory):
    def __init__(self, static: dict[str, list[str]] | None = None):
        self._lock = threading.Lock()
        # role -> address -> expiry (inf for static members and our own registrations)
        self._members: dict[str, dict[str, float]] = {}
        for role, addrs in (static or {}).items():
            for a in addrs:
                self._members.setdefault(role, {})[a] = float("inf")

    def register(self, role: str, address: str, ttl_s: float = 10.0) -> None:
        with self._lock:
            self._members.setdefault(role, {})[address] = float("inf")

    def deregister(self, role: str, address: str) -> None:
        with self._lock:
            self._members.get(role, {}).pop(address, None)

    def replace(self, role: str, addresses: list[str]) -> None:
        """Set a role's members (the etcd directory mirrors what it last saw here)."""
        with self._lock:
            self._members[role] = {a: float("inf") for a in addresses}

    def members(self, role: str) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return sorted(a for a, exp in self._members.get(role, {}).items() if exp > now)
