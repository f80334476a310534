"""In-process directory: local mode without etcd, and the fallback while etcd is unreachable.

Static members come from flags. A member given by name (e.g. a Kubernetes headless Service) is
resolved to every address behind it, so each pod of a role counts as one member.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time

from hybridcache.services.directory.base import Directory

RESOLVE_EVERY_S = 5.0


def resolve(address: str) -> list[str]:
    """HOST:PORT -> every IPv4 HOST resolves to (itself when it is an IP literal or unresolvable)."""
    host, _, port = address.rpartition(":")
    try:
        ipaddress.ip_address(host)
        return [address]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, ValueError):
        return [address]
    return sorted({f"{info[4][0]}:{port}" for info in infos}) or [address]


class InProcessDirectory(Directory):
    def __init__(self, static: dict[str, list[str]] | None = None):
        self._lock = threading.Lock()
        self._static = {role: list(addrs) for role, addrs in (static or {}).items() if addrs}
        self._resolved: dict[str, tuple[float, list[str]]] = {}  # role -> (when, addresses)
        self._members: dict[str, set[str]] = {}  # registered here, or mirrored from etcd

    def register(self, role: str, address: str, ttl_s: float = 10.0) -> None:
        with self._lock:
            self._members.setdefault(role, set()).add(address)

    def deregister(self, role: str, address: str) -> None:
        with self._lock:
            self._members.get(role, set()).discard(address)
            if address in self._static.get(role, []):
                self._static[role].remove(address)
                self._resolved.pop(role, None)

    def replace(self, role: str, addresses: list[str]) -> None:
        """Set a role's members (the etcd directory mirrors what it last saw here)."""
        with self._lock:
            self._members[role] = set(addresses)
            self._static.pop(role, None)
            self._resolved.pop(role, None)

    def _static_members(self, role: str) -> list[str]:
        now = time.monotonic()
        when, addrs = self._resolved.get(role, (-1e9, []))
        if now - when > RESOLVE_EVERY_S:
            addrs = sorted({a for s in self._static.get(role, []) for a in resolve(s)})
            self._resolved[role] = (now, addrs)
        return addrs

    def members(self, role: str) -> list[str]:
        with self._lock:
            return sorted(set(self._static_members(role)) | self._members.get(role, set()))
