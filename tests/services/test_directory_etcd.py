"""The etcd directory against a real etcd server on loopback: leases, outage, re-registration."""

from __future__ import annotations

import time

from hybridcache.services.directory import EtcdDirectory, InProcessDirectory, make_directory


def wait_for(pred, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_register_outage_and_reregistration(etcd):
    d = EtcdDirectory(etcd.endpoint, ttl_s=3, refresh_s=0.3, timeout_s=1)
    watcher = EtcdDirectory(etcd.endpoint, ttl_s=3, refresh_s=0.3, timeout_s=1)
    try:
        d.register("cache-tier", "127.0.0.1:1001")
        assert d.backend == "etcd"
        assert watcher.members("cache-tier") == ["127.0.0.1:1001"]
        assert watcher.owner("some-key") == "127.0.0.1:1001"

        etcd.stop()
        # The service keeps going on its last view, and can still register members locally.
        assert d.members("cache-tier") == ["127.0.0.1:1001"]
        assert d.backend.startswith("local")
        d.register("scatter", "127.0.0.1:2001")
        assert d.members("scatter") == ["127.0.0.1:2001"]

        etcd.start()
        assert wait_for(lambda: d.connected and watcher.members("scatter") == ["127.0.0.1:2001"])
        assert watcher.members("cache-tier") == ["127.0.0.1:1001"]
        assert d.reregistrations >= 1
    finally:
        d.close()
    # Closing revokes the lease: the members are gone at once.
    assert wait_for(lambda: watcher.members("cache-tier") == [], timeout=5)
    watcher.close()


def test_lease_expiry_removes_a_dead_member(etcd):
    d = EtcdDirectory(etcd.endpoint, ttl_s=2, refresh_s=0.3, timeout_s=1)
    watcher = EtcdDirectory(etcd.endpoint, ttl_s=2, refresh_s=0.3, timeout_s=1)
    d.register("scatter", "127.0.0.1:3001")
    assert watcher.members("scatter") == ["127.0.0.1:3001"]
    d._stop.set()  # stops renewing, as a killed process would
    assert wait_for(lambda: watcher.members("scatter") == [], timeout=10)
    watcher.close()


def test_without_etcd_the_directory_is_in_process():
    d = make_directory(None, {"combine": ["127.0.0.1:1"], "cache-tier": ["localhost:7"]})
    assert isinstance(d, InProcessDirectory) and d.members("combine") == ["127.0.0.1:1"]
    # A name stands for every address behind it (a headless Service: one member per pod).
    assert d.members("cache-tier") == ["127.0.0.1:7"]
    d.register("scatter", "127.0.0.1:2")
    d.deregister("combine", "127.0.0.1:1")
    assert d.members("scatter") == ["127.0.0.1:2"] and d.members("combine") == []
