"""Directory in etcd (v3 API through etcd-sdk-python, `pyetcd`).

Members live under /hybridcache/members/<role>/<address>, attached to a lease this process
renews. When etcd is unreachable the directory keeps serving from its last view (an in-process
directory) and keeps trying; once etcd answers again it takes a fresh lease and re-registers.
"""

from __future__ import annotations

import logging
import threading

from hybridcache.services.directory.base import Directory
from hybridcache.services.directory.memory import InProcessDirectory

log = logging.getLogger("hybridcache.directory")
PREFIX = "/hybridcache/members/"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be HOST:PORT, got {endpoint!r}")
    return host, int(port)


class EtcdDirectory(Directory):
    def __init__(self, endpoint: str, ttl_s: float = 5.0, refresh_s: float = 1.0, timeout_s: float = 2.0,
                 static: dict[str, list[str]] | None = None):
        import pyetcd

        host, port = parse_endpoint(endpoint)
        # pyetcd marks a node that failed once as unusable: a lost connection gets a new client.
        self._new_client = lambda: pyetcd.client(host=host, port=port, timeout=timeout_s)
        self._client = self._new_client()
        self._ttl = max(2, int(ttl_s))
        self._refresh = refresh_s
        self._local = InProcessDirectory(static)  # the view used while etcd is unreachable
        self._own: set[tuple[str, str]] = set()
        self._lease = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.connected = False
        self.reregistrations = 0
        self._sync()
        self._thread = threading.Thread(target=self._loop, name="etcd-keepalive", daemon=True)
        self._thread.start()

    @property
    def backend(self) -> str:
        return "etcd" if self.connected else "local (etcd unreachable)"

    def register(self, role: str, address: str, ttl_s: float = 10.0) -> None:
        with self._lock:
            self._own.add((role, address))
        self._local.register(role, address)
        if self._lease is None:
            self._sync()
            return
        try:
            self._client.put(f"{PREFIX}{role}/{address}", address, lease=self._lease)
        except Exception as e:
            self._lost(e)

    def deregister(self, role: str, address: str) -> None:
        with self._lock:
            self._own.discard((role, address))
        self._local.deregister(role, address)
        try:
            self._client.delete(f"{PREFIX}{role}/{address}")
        except Exception:
            pass

    def members(self, role: str) -> list[str]:
        if self.connected:
            try:
                found = sorted(m.key.decode().rsplit("/", 1)[1] for _, m in self._client.get_prefix(f"{PREFIX}{role}/"))
                self._local.replace(role, found)
                return found
            except Exception as e:
                self._lost(e)
        return self._local.members(role)

    def _lost(self, err) -> None:
        if self.connected:
            log.warning("etcd unreachable (%s): serving from the local directory", type(err).__name__)
        self.connected = False
        self._lease = None

    def _sync(self) -> None:
        """Renew the lease, or (after a loss) take a new one and re-register everything we own."""
        try:
            if self._lease is not None:
                reply = self._lease.refresh()
                if reply and getattr(reply[0], "TTL", 1) <= 0:
                    raise RuntimeError("lease expired")
                self.connected = True
                return
            if not self.connected:
                old, self._client = self._client, self._new_client()
                old.close()
            lease = self._client.lease(self._ttl)
            with self._lock:
                own = sorted(self._own)
            for role, address in own:
                self._client.put(f"{PREFIX}{role}/{address}", address, lease=lease)
            if not self.connected and own:
                self.reregistrations += 1
            self._lease, self.connected = lease, True
        except Exception as e:
            self._lost(e)

    def _loop(self) -> None:
        while not self._stop.wait(self._refresh):
            self._sync()

    def close(self) -> None:
        self._stop.set()
        try:
            if self._lease is not None:
                self._lease.revoke()
            self._client.close()
        except Exception:
            pass


def make_directory(etcd: str | None, static: dict[str, list[str]] | None = None) -> Directory:
    """etcd when an endpoint is given, else the in-process directory seeded with `static` members."""
    if etcd:
        return EtcdDirectory(etcd, static=static)
    return InProcessDirectory(static)
