"""Tenancy: a request's cache salt (vLLM's `cache_salt`) keys its segment entries, part chains and
prefix pages, so it hits only what requests of the same salt stored; `--cache-isolation per-key`
salts every request with its API key, so one client's documents are a miss (and as slow as a miss)
to every other client, in the stats and on the clock; `/metrics` needs the key unless
`--metrics-open`."""

from __future__ import annotations

import random

import pytest
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.plan import salted_key
from hybridcache.services.runtime.sampling import RequestError
from hybridcache.services.runtime.scheduler import Scheduler, SchedulerConfig


def rag(seed: int, salt: str | None = None) -> dict:
    rng = random.Random(seed)
    docs = [[rng.randrange(5, 250) for _ in range(rng.randrange(90, 140))] for _ in range(3)]
    req = {"system": [rng.randrange(5, 250) for _ in range(80)], "segments": docs,
           "suffix": [rng.randrange(5, 250) for _ in range(9)],
           "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    if salt is not None:
        req["cache_salt"] = salt
    return req


def _stats(llm: LLM, req: dict):
    res = llm.generate(req)
    return res, res.stats


@pytest.mark.parametrize("mode", ["pic", "prefix"])
def test_a_salt_hits_only_its_own_entries_chains_and_pages(model_dir, mode):
    eng = LLM.from_dir(model_dir, config=EngineConfig(mode=mode))
    first, s = _stats(eng, rag(1, "tenant-a"))
    assert s.cached_tokens == 0
    # the same documents under another salt, and with none: misses, the same answer
    for other in ("tenant-b", None):
        res, s = _stats(eng, rag(1, other))
        assert s.cached_tokens == 0 and s.prefix_reused_tokens == 0, (other, s)
        assert not any(seg.hit for seg in s.segments), other
        assert res.output_ids == first.output_ids
    # an empty salt is no salt: it hits what the unsalted request stored
    _, s = _stats(eng, rag(1, ""))
    assert s.cached_tokens > 0
    # the same salt again: its pages and entries hit
    res, s = _stats(eng, rag(1, "tenant-a"))
    assert s.cached_tokens > 0 and res.output_ids == first.output_ids
    if mode == "pic":
        # documents reordered: only the entries can hit (the prefix differs after the system prompt)
        req = rag(1, "tenant-a")
        req["segments"] = req["segments"][::-1]
        _, s = _stats(eng, req)
        assert sum(seg.hit for seg in s.segments) >= 2
        req["cache_salt"] = "tenant-c"
        _, s = _stats(eng, req)
        assert not any(seg.hit for seg in s.segments) and s.cached_tokens == 0


def test_salted_keys_and_their_checks(model_dir):
    eng = Engine.from_dir(model_dir, config=EngineConfig(mode="pic"))
    plain, salted = eng.parse_request(rag(2)), eng.parse_request(rag(2, "t"))
    p = eng.planner
    assert salted.cache_salt == "t" and plain.cache_salt == ""
    assert p.segment_key(salted, 0) == salted_key(p.segment_key(plain, 0), "t") != p.segment_key(plain, 0)
    assert p.chain_keys(salted)[0] != p.chain_keys(plain)[0]
    assert salted_key("k", "") == "k" and salted_key("k", "a|b") != salted_key("k", "a")
    for bad in (5, ["t"], "x" * 257):
        with pytest.raises(RequestError, match="cache_salt"):
            eng.parse_request(dict(rag(2), cache_salt=bad))


def test_the_scheduler_builds_salted_entries_under_salted_keys(model_dir):
    """Cold segments built ahead by the scheduler (batched across requests) are stored under the
    key of the request that needed them: a salted request's entry answers no unsalted lookup."""
    eng = Engine.from_dir(model_dir, config=EngineConfig(mode="pic"))
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=4))
    try:
        a = sched.add_request(eng.parse_request(rag(3, "tenant-a"))).result()
        req = eng.parse_request(rag(3))
        for i in range(len(req.segment_ids)):
            assert not eng.entries.contains(eng.planner.segment_key(req, i))
        b = sched.add_request(req).result()
        c = sched.add_request(eng.parse_request(rag(3, "tenant-a"))).result()
    finally:
        sched.stop()
    assert a.output_ids == b.output_ids == c.output_ids
    assert b.stats.cached_tokens == 0 and c.stats.cached_tokens > 0


KEYS = ("sk-tenant-a-7c1e", "sk-tenant-b-94d2")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def per_key(model_dir, tmp_path_factory):
    from hybridcache.services.launcher import LocalCluster, free_port

    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# tenants\n{KEYS[0]}\n\n{KEYS[1]}\n")
    keys.chmod(0o600)
    with LocalCluster(model_dir, port=free_port(), scatter_workers=1, api_key_file=str(keys),
                      cache_isolation="per-key", metrics_open=True) as c:
        yield c


def _post(cluster, key: str, body: dict, path: str = "/generate"):
    import json
    import urllib.request

    req = urllib.request.Request(f"{cluster.url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _docs(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(60)) for i in range(3)]


def test_per_key_isolation_keeps_each_clients_documents_its_own(per_key):
    docs = _docs(5)
    body = {"system": "Answer from the documents.", "segments": docs, "text": "Which doc?",
            "sampling_params": {"max_new_tokens": 3}}
    a1 = _post(per_key, KEYS[0], body)["hybridcache"]
    assert a1["cached_tokens"] == 0 and not any(s["hit"] for s in a1["segments"])
    # the same client again, its documents reordered: its entries hit
    a2 = _post(per_key, KEYS[0], dict(body, segments=docs[::-1]))["hybridcache"]
    assert sum(s["hit"] for s in a2["segments"]) >= 2 and a2["cached_tokens"] > 0, a2["segments"]
    # another client sending the same documents learns nothing of them: every segment is built for
    # it (no hit flag, no cached token: no faster answer)
    b = _post(per_key, KEYS[1], body)["hybridcache"]
    assert b["cached_tokens"] == 0 and not any(s["hit"] for s in b["segments"]), b["segments"]
    assert b["built_tokens"] > 0
    # a client's own cache_salt is a key space within its own
    a3 = _post(per_key, KEYS[0], dict(body, cache_salt="project-x"))["hybridcache"]
    assert a3["cached_tokens"] == 0
    # the OpenAI endpoints too, and the gRPC door
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": d} for d in _docs(7)] + [
        {"type": "text", "text": "Which doc?"}]}], "max_tokens": 2}
    _post(per_key, KEYS[0], chat, "/v1/chat/completions")
    res = _post(per_key, KEYS[1], chat, "/v1/chat/completions")
    assert res["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_per_key_isolation_on_the_grpc_door(per_key):
    import json

    import grpc
    from hybridcache.services.protocol import pb, rpc

    stub = rpc.InferenceStub(grpc.insecure_channel(per_key.role("router")[0].grpc))
    native = {"segments": _docs(6), "suffix": "Which doc?", "sampling_params": {"max_new_tokens": 2}}

    def stats(key):
        chunks = list(stub.Generate(pb.GenerateRequest(request_json=json.dumps(native)), timeout=120,
                                    metadata=(("authorization", f"Bearer {key}"),)))
        return json.loads(chunks[-1].stats_json)

    assert stats(KEYS[0])["cached_tokens"] == 0
    assert stats(KEYS[0])["cached_tokens"] > 0
    assert stats(KEYS[1])["cached_tokens"] == 0


def test_metrics_open_serves_metrics_without_the_key(per_key):
    from serving_helpers import http

    status, text = http("GET", f"{per_key.url}/metrics")
    assert status == 200 and "hybridcache_" in text
    assert http("POST", f"{per_key.url}/generate", {"text": "hi"})[0] == 401
