"""Faults on a local cluster registered in a real etcd: a scatter worker dies mid-request, the cache
tier goes down, etcd stops and comes back (with its data lost). Tests run in file order."""

from __future__ import annotations

import time

import pyetcd
import pytest
from hybridcache.services.launcher import LocalCluster, free_port
from hybridcache.services.runtime.llm import LLM
from serving_helpers import Etcd, http

QUESTION = "Question: what is in the documents?\nAnswer:"


def docs(tag: str, n: int = 4) -> list[str]:
    return [f"{tag} document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(n)]


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    e = Etcd(tmp_path_factory.mktemp("etcd") / "data").start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def faulty(model_dir, etcd_server):
    # The first scatter worker exits after streaming one entry; the combine keeps ~1 entry itself.
    c = LocalCluster(model_dir, port=free_port(), scatter_workers=2, etcd=etcd_server.endpoint,
                     tier_cache_bytes=32 << 20, extra={"combine": ["--entry-cache-bytes", "60000"]})
    c.start(scatter_env=[{"HYBRIDCACHE_FAULT_EXIT_AFTER_ENTRIES": "1"}, {}])
    yield c
    c.stop()


def ask(cluster, segments):
    status, res = http("POST", f"{cluster.url}/generate", {"segments": segments, "text": QUESTION,
                                                          "sampling_params": {"max_new_tokens": 4}}, timeout=120)
    assert status == 200, res
    return res


def expected(engine, segments):
    request = {"segments": segments, "suffix": QUESTION, "sampling_params": {"max_new_tokens": 4}}
    return LLM(engine).generate(request).text


def test_scatter_worker_killed_mid_request(faulty, engine):
    segs = docs("alpha")
    res = ask(faulty, segs)
    assert res["text"] == expected(engine, segs)
    assert res["hybridcache"]["redispatched"] >= 1
    doomed = faulty.role("scatter")[0]
    assert doomed.proc.wait(timeout=10) == 3
    # Later requests go to the survivor (or are re-dispatched until the dead member's lease ends).
    segs = docs("beta")
    assert ask(faulty, segs)["text"] == expected(engine, segs)


def test_cache_tier_down_entries_recomputed(faulty, engine):
    segs = docs("gamma", 3)
    ask(faulty, segs)
    time.sleep(1.0)  # scatter writes entries to the tier after streaming them
    res = ask(faulty, segs[::-1])
    assert "tier" in [s["source"] for s in res["hybridcache"]["segments"]]
    faulty.role("cache-tier")[0].kill()
    order = [segs[1], segs[2], segs[0]]
    res = ask(faulty, order)
    assert res["text"] == expected(engine, order)
    assert "tier" not in [s["source"] for s in res["hybridcache"]["segments"]]
    assert res["hybridcache"]["built_tokens"] > 0


def test_etcd_stopped_then_back_with_lost_data(faulty, etcd_server, engine):
    etcd_server.stop()
    segs = docs("delta", 3)
    assert ask(faulty, segs)["text"] == expected(engine, segs)
    assert http("GET", f"{faulty.url}/health")[1]["directory"].startswith("local")
    etcd_server.data_dir = etcd_server.data_dir.parent / "data-after-loss"
    etcd_server.start()
    host, port = etcd_server.endpoint.split(":")
    client = pyetcd.client(host=host, port=int(port), timeout=2)
    deadline = time.monotonic() + 20
    roles = set()
    while time.monotonic() < deadline and not {"router", "combine", "scatter"} <= roles:
        roles = {m.key.decode().split("/")[3] for _, m in client.get_prefix("/hybridcache/members/")}
        time.sleep(0.2)
    assert {"router", "combine", "scatter"} <= roles
    client.close()
    assert http("GET", f"{faulty.url}/health")[1]["directory"] == "etcd"
    segs = docs("epsilon", 3)
    assert ask(faulty, segs)["text"] == expected(engine, segs)
