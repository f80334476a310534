"""Fixtures of the serving tests: the tiny random model, a local cluster, a real etcd on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from hybridcache.services.launcher import LocalCluster, free_port


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from hybridcache.services.runtime.modelzoo import init_model_dir

    return init_model_dir("qwen3_5_text", "tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0, std=0.08)


@pytest.fixture(scope="session")
def engine(model_dir):
    from hybridcache.services.runtime.engine import Engine

    return Engine.from_dir(model_dir)


TIER_BYTES = 300_000


@pytest.fixture(scope="session")
def cluster(model_dir):
    # Two cache-tier members of ~5 tiny-model entries each, so that the load test makes them evict.
    with LocalCluster(model_dir, port=free_port(), scatter_workers=2, cache_tiers=2, cache_bytes=64 << 20,
                      extra={"cache-tier": ["--cache-bytes", str(TIER_BYTES)]}) as c:
        yield c


def http(method: str, url: str, body=None, raw: bytes | None = None, timeout: float = 60.0):
    """(status, parsed JSON or text) without raising on 4xx/5xx."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


class Etcd:
    """A real etcd server on 127.0.0.1 with its own data dir; start() and stop() may repeat."""

    def __init__(self, data_dir):
        self.data_dir = data_dir
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> Etcd:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", str(self.data_dir), "--listen-client-urls", c,
             "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
             "--initial-cluster", f"t={p}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{c}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("etcd did not become healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture
def etcd(tmp_path):
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed (requirements/apt.txt: etcd-server)")
    e = Etcd(tmp_path / "etcd").start()
    yield e
    e.stop()
