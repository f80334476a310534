"""Fixtures of the serving tests: the tiny random model, a local cluster, a real etcd on loopback."""

from __future__ import annotations

import shutil

import pytest
from hybridcache.services.launcher import LocalCluster, free_port
from serving_helpers import MAX_MODEL_LEN, TIER_BYTES, Etcd


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from hybridcache.services.runtime.modelzoo import init_model_dir

    return init_model_dir("qwen3_5_text", "tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0, std=0.08)


@pytest.fixture(scope="session")
def engine(model_dir):
    from hybridcache.services.runtime.engine import Engine

    return Engine.from_dir(model_dir)


@pytest.fixture(scope="session")
def cluster(model_dir):
    # Two cache-tier members of ~5 tiny-model entries each, so that the load test makes them evict.
    # The router's length limit below the tiny model's 4096 positions: test_http_api checks both.
    from hybridcache.services import security

    with LocalCluster(model_dir, port=free_port(), scatter_workers=2, cache_tiers=2, entry_cache_bytes=64 << 20,
                      tier_cache_bytes=TIER_BYTES, max_model_len=MAX_MODEL_LEN) as c:
        # the tests call the services' internal gRPC as a member of the deployment would
        security.install(c.secret)
        try:
            yield c
        finally:
            security.install(None)


@pytest.fixture(scope="session")
def clients_cluster(model_dir):
    """Local services of the standard-client tests (tests/services/test_clients_*.py): a router, a
    combine worker and one cache tier, apart from `cluster`, whose placement checks want empty tiers."""
    with LocalCluster(model_dir, port=free_port(), scatter_workers=0, entry_cache_bytes=64 << 20,
                      max_model_len=MAX_MODEL_LEN) as c:
        yield c


@pytest.fixture
def etcd(tmp_path):
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed (requirements/apt.txt: etcd-server)")
    e = Etcd(tmp_path / "etcd").start()
    yield e
    e.stop()
