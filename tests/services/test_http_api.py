"""The local cluster (real processes on loopback) through its HTTP and gRPC endpoints."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from hybridcache.services.api.openai_compat import chat_to_native
from hybridcache.services.contract import (
    METRIC_CACHE_HITS,
    METRIC_CACHE_QUERIES,
    METRIC_COLD_QUEUE_DEPTH,
    METRIC_TTFT_SECONDS,
)
from hybridcache.services.directory import HashRing
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.security import internal_channel
from serving_helpers import MAX_MODEL_LEN, TIER_BYTES, http

DOCS = [
    "Document A: the Varnel Bridge spans the Osk river and was completed in 1872 by Ilse Marrow.\n",
    "Document B: Lowmere is a market town of fourteen thousand people with a cheese fair each October.\n",
    "Document C: Ilse Marrow was born in Tarn in 1831 and designed two lighthouses on the north coast.\n",
]
QUESTION = "Question: who built the Varnel Bridge?\nAnswer:"


def chat_body(docs, **kw):
    content = [{"type": "text", "text": d} for d in docs] + [{"type": "text", "text": QUESTION}]
    return dict(model="default", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_entries_live_on_their_consistent_hash_owner(cluster, engine):
    # First in this file: the tiers are still empty, so nothing is evicted before the check.
    tiers = [t.grpc for t in cluster.role("cache-tier")]
    ring = HashRing(tiers)

    def key(d):
        return engine.entry_key(engine.tokenizer.encode(d))

    # Six documents, three owned by each member. The ring hashes the members' addresses, whose
    # ports differ from run to run, so a fixed six could all land on one member (CI saw it once).
    candidates = [f"Placement document {i}: " + "one two three four five six " * 3 for i in range(64)]
    docs = []
    for t in tiers:
        docs += [d for d in candidates if ring.owner(key(d)) == t][:3]
    assert len(docs) == 6
    status, _ = http("POST", f"{cluster.url}/generate", {"segments": docs, "text": "q?",
                                                        "sampling_params": {"max_new_tokens": 1}})
    assert status == 200
    keys = [key(d) for d in docs]
    owners = {k: ring.owner(k) for k in keys}
    assert len(set(owners.values())) == 2  # the six keys land on both members
    deadline = time.monotonic() + 10
    while True:
        present = {t: list(rpc.CacheTierStub(internal_channel(t)).Stat(pb.StatRequest(keys=keys), timeout=10)
                           .present) for t in tiers}
        if all(present[owners[k]][n] for n, k in enumerate(keys)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # scatter workers write entries after streaming them
    for n, k in enumerate(keys):
        assert present[owners[k]][n]
        assert not any(present[t][n] for t in tiers if t != owners[k])


def test_openai_client_completion_stream_and_reuse(client, engine):
    first = client.chat.completions.create(**chat_body(DOCS))
    assert first.choices[0].message.content is not None
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0
    st = first.model_extra["hybridcache"]
    assert [s["source"] for s in st["segments"]] == ["scatter"] * 3
    # Cold segments of one request go to both scatter workers (LPT over their queues).
    assert st["built_tokens"] > 0

    body = chat_body(DOCS[::-1])
    second = client.chat.completions.create(**body)
    st2 = second.model_extra["hybridcache"]
    assert st2["reused_segments"] == 3 and all(s["hit"] for s in st2["segments"])
    assert second.usage.prompt_tokens_details.cached_tokens == st2["reused_tokens"] > 0
    expected = LLM(engine).generate(chat_to_native(body)).text
    assert second.choices[0].message.content == expected

    pieces, last = [], None
    for chunk in client.chat.completions.create(**chat_body(DOCS[1:]), stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        last = chunk
    assert last.choices[0].finish_reason in ("stop", "length")
    assert last.usage.completion_tokens >= 1 and "hybridcache" in last.model_extra
    assert "".join(pieces) == LLM(engine).generate(chat_to_native(chat_body(DOCS[1:]))).text

    comp = client.completions.create(model="default", prompt=QUESTION, max_tokens=4, temperature=0.0)
    plain = {"suffix": QUESTION, "sampling_params": {"max_new_tokens": 4}}
    assert comp.choices[0].text == LLM(engine).generate(plain).text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt=QUESTION, max_tokens=4, temperature=0.0, stream=True))
    assert streamed == comp.choices[0].text
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_cold_segments_spread_over_scatter_workers(cluster):
    docs = [f"Fresh document {i}: " + "lorem ipsum dolor sit amet " * (2 + 3 * i) for i in range(4)]
    status, res = http("POST", f"{cluster.url}/generate", {"segments": docs, "text": QUESTION,
                                                          "sampling_params": {"max_new_tokens": 2}})
    assert status == 200, res
    assert [s["source"] for s in res["hybridcache"]["segments"]] == ["scatter"] * 4
    status, text = http("GET", f"{cluster.url}/metrics")
    depth_workers = set(re.findall(rf'{METRIC_COLD_QUEUE_DEPTH}{{worker="([^"]+)"}}', text))
    assert depth_workers == {s.grpc for s in cluster.role("scatter")}
    streamed = sum(_scatter_streamed(s) for s in cluster.role("scatter"))
    assert streamed > 0
    assert all(_scatter_streamed(s) > 0 for s in cluster.role("scatter"))


def _scatter_streamed(svc) -> float:
    _, text = http("GET", f"http://{svc.http}/metrics")
    m = re.search(r'hybridcache_entry_build_seconds_count (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_sglang_native_generate_and_stream(cluster, engine):
    req = {"segments": DOCS, "text": QUESTION, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    status, res = http("POST", f"{cluster.url}/generate", req)
    assert status == 200, res
    assert res["text"] == LLM(engine).generate({"segments": DOCS, "suffix": QUESTION,
                                           "sampling_params": {"max_new_tokens": 6}}).text
    assert res["meta_info"]["prompt_tokens"] == res["usage"]["prompt_tokens"]
    # One trace across router and combine worker (OpenTelemetry context in gRPC metadata).
    assert re.fullmatch("[0-9a-f]{32}", res["hybridcache"]["trace_id"]) and res["hybridcache"]["trace_propagated"]
    status, text = http("POST", f"{cluster.url}/generate", dict(req, stream=True))
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == res["text"]
    # The separator splits one text into segments the same way.
    status, res2 = http("POST", f"{cluster.url}/generate", {"text": "<doc>".join(DOCS + [QUESTION]),
                        "separator": "<doc>", "sampling_params": {"max_new_tokens": 6}})
    assert status == 200 and res2["text"] == res["text"]
    assert all(s["hit"] for s in res2["hybridcache"]["segments"])


def test_ttft_is_the_wait_from_the_routers_receipt_with_the_engines_share_beside_it(cluster):
    """The response's ttft_ms counts from the router's receipt of the request to its first token
    (HTTP, tokenizing, planning, gRPC included), engine_ttft_ms is the combine worker's part of it,
    and the client, who also waits for the connection and the body's transfer, waits at least as long."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(cluster.url)
    body = {"segments": [d + " (timed)" for d in DOCS], "text": QUESTION, "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    t0 = time.perf_counter()
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    client_ttft, last = None, None
    for line in resp:
        if line.startswith(b"data: {"):
            ev = json.loads(line[6:])
            if client_ttft is None and ev.get("output_ids"):
                client_ttft = (time.perf_counter() - t0) * 1000
            last = ev
    conn.close()
    st = last["hybridcache"]
    assert 0 < st["engine_ttft_ms"] < st["ttft_ms"] <= client_ttft
    assert 0 <= st["router_ms"] < st["ttft_ms"]
    # the combine worker's share of the wait: its engine's and more, less than the router's whole
    assert st["engine_ttft_ms"] <= st["combine_ttft_ms"] <= st["combine_ms"]
    assert st["combine_ttft_ms"] < st["ttft_ms"]
    # the hops between router and combine worker (one host's clock): inside the wait, in order
    assert 0 <= st["router_to_combine_ms"] and 0 <= st["combine_to_router_ms"]
    assert st["router_ms"] + st["router_to_combine_ms"] + st["combine_ttft_ms"] + st["combine_to_router_ms"] \
        <= st["ttft_ms"] + 0.5
    assert "combine_received_unix" not in st and "combine_first_token_unix" not in st
    # what the request cost the combine worker's memory: its new entries are in the entry cache,
    # which evicted nothing to hold them (1 GiB on the CPU); no CUDA allocator there
    assert st["entry_cache_bytes"] > 0 and st["entry_evictions"] == 0
    assert "device_allocs" not in st and "alloc_retries" not in st
    # and the collector's pauses over the request (all threads wait them out)
    assert st["gc_collections"] >= 0 and st["gc_pause_ms"] >= 0
    assert st["gc_collections"] > 0 or st["gc_pause_ms"] == 0


def test_sglang_frontend_program(cluster):
    sgl = pytest.importorskip("sglang", reason="sglang frontend not installed (pip install --no-deps sglang)")

    @sgl.function
    def rag(s, question):
        s += "Document: the Varnel Bridge was built by Ilse Marrow.\n"
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=6, temperature=0.0)

    backend = sgl.RuntimeEndpoint(cluster.url)
    state = rag.run(question="who built the bridge?", backend=backend)
    prompt = "Document: the Varnel Bridge was built by Ilse Marrow.\nQuestion: who built the bridge?\nAnswer:"
    status, direct = http("POST", f"{cluster.url}/generate", {"text": prompt,
                          "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert status == 200
    assert state["answer"] == direct["text"]


@pytest.mark.parametrize("case", ["malformed", "wrong-type", "empty", "too-big", "unknown-model", "many-segments",
                                  "bad-sampling", "no-text"])
def test_bad_input_is_a_4xx_with_a_message(cluster, case):
    url = f"{cluster.url}/v1/chat/completions"
    raw, body, want = None, None, 400
    if case == "malformed":
        raw = b'{"messages": ['
    elif case == "wrong-type":
        body = {"messages": "hello"}
    elif case == "empty":
        raw = b""
    elif case == "too-big":
        raw, want = b'{"messages": [{"role": "user", "content": "' + b"x" * (5 << 20) + b'"}]}', 413
    elif case == "unknown-model":
        body, want = chat_body(DOCS) | {"model": "gpt-17"}, 404
    elif case == "many-segments":
        url, body = f"{cluster.url}/generate", {"segments": ["doc"] * 100, "text": "q"}
    elif case == "bad-sampling":
        body = chat_body(DOCS) | {"temperature": "hot"}
    else:
        url, body = f"{cluster.url}/generate", {"sampling_params": {"max_new_tokens": 2}}
    status, res = http("POST", url, body, raw=raw)
    assert status == want, res
    assert isinstance(res, dict) and res["error"]["message"]
    # Still serving.
    assert http("GET", f"{cluster.url}/health")[0] == 200


@pytest.mark.parametrize("prompt_tokens, new_tokens, limit", [
    (MAX_MODEL_LEN - 4, 8, "max model length of 3000"),  # --max-model-len counts max_new_tokens too
    (MAX_MODEL_LEN + 500, 1, "max model length of 3000"),  # under the model's 4096, over the flag
    (20000, 1, "context limit of 4096"),  # over the model's own limit
])
def test_prompt_over_the_length_limit_is_400(cluster, prompt_tokens, new_tokens, limit):
    body = {"input_ids": [7] * prompt_tokens, "sampling_params": {"max_new_tokens": new_tokens}}
    status, res = http("POST", f"{cluster.url}/generate", body)
    assert status == 400 and limit in res["error"]["message"], res
    assert res["error"]["type"] == "invalid_request_error"


def test_prompt_at_the_length_limit_is_served(cluster):
    body = {"input_ids": [7] * (MAX_MODEL_LEN - 1), "sampling_params": {"max_new_tokens": 1}}
    status, res = http("POST", f"{cluster.url}/generate", body, timeout=120)
    assert status == 200 and res["meta_info"]["prompt_tokens"] == MAX_MODEL_LEN - 1, res


def test_load_mixed_hits_no_errors_and_cache_within_budget(cluster):
    pool = [f"Load document {i}: " + "alpha beta gamma delta " * (3 + i % 4) for i in range(10)]

    def one(n):
        docs = [pool[(n + k) % len(pool)] for k in range(3)]
        return http("POST", f"{cluster.url}/generate", {"segments": docs, "text": f"question {n % 5}?",
                                                        "sampling_params": {"max_new_tokens": 3}}, timeout=120)

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(50)))
    assert [s for s, _ in results] == [200] * 50, [r for s, r in results if s != 200][:2]
    hits = sum(seg["hit"] for _, r in results for seg in r["hybridcache"]["segments"])
    assert 0 < hits < 150
    for tier in cluster.role("cache-tier"):
        stat = rpc.CacheTierStub(internal_channel(tier.grpc)).Stat(pb.StatRequest(), timeout=10)
        assert stat.capacity_bytes == TIER_BYTES
        assert 0 < stat.used_bytes <= stat.capacity_bytes
        assert stat.entries > 0 and stat.evictions > 0
    combine = cluster.role("combine")[0]
    _, text = http("GET", f"http://{combine.http}/metrics")
    assert 0 < float(re.search(r'hybridcache_cache_bytes{tier="worker"} (\S+)', text).group(1)) <= 64 << 20


def metric(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m is not None, f"{pattern!r} not in the scrape:\n" + "\n".join(
        line for line in text.splitlines() if line.startswith("hybridcache_"))
    return float(m.group(1))


def test_metrics_after_traffic(cluster, engine):
    # A tier hit the router sees: a segment whose entry the tier holds and the combine worker has
    # never folded in (for segments it has, the router asks no tier).
    from hybridcache.services.cache_tier.client import CacheTierClient

    ids = [17 + (i * 7) % 190 for i in range(48)]
    entry = engine.build_entry(ids).seal()
    assert all(CacheTierClient(t.grpc).put([entry]) == 1 for t in cluster.role("cache-tier"))
    status, res = http("POST", f"{cluster.url}/generate",
                       {"segments": [ids], "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and res["hybridcache"]["segments"][0]["hit"], res
    status, text = http("GET", f"{cluster.url}/metrics")
    assert status == 200
    count = metric(text, rf"{METRIC_TTFT_SECONDS}_count (\S+)")
    total = metric(text, rf"{METRIC_TTFT_SECONDS}_sum (\S+)")
    assert count >= 5 and 0 < total / count < 60
    # The router's directory probes: did the owning cache-tier member hold the entry?
    queries = metric(text, rf'{METRIC_CACHE_QUERIES}{{tier="tier"}} (\S+)')
    hits = metric(text, rf'{METRIC_CACHE_HITS}{{tier="tier"}} (\S+)')
    assert 0 < hits < queries
    inter = metric(text, r"hybridcache_inter_token_latency_seconds_count (\S+)")
    assert inter > 0
    assert metric(text, r'hybridcache_requests_total{door="http",status="200"} (\S+)') >= 50
    # The operator's autoscaler reads the queue depth from this scrape: drained after the traffic.
    from hybridcache.operator.autoscaler import read_router_metrics

    assert re.search(rf'{METRIC_COLD_QUEUE_DEPTH}{{worker="[^"]+"}} 0.0', text)
    assert read_router_metrics(f"{cluster.url}/metrics") == 0.0
    for tier in cluster.role("cache-tier"):
        _, ttext = http("GET", f"http://{tier.http}/metrics")
        used = metric(ttext, r'hybridcache_cache_bytes{tier="host"} (\S+)')
        assert 0 < used <= TIER_BYTES
    combine = cluster.role("combine")[0]
    _, ctext = http("GET", f"http://{combine.http}/metrics")
    assert metric(ctext, r'hybridcache_bytes_moved_total{path="shm"} (\S+)') > 0
    assert metric(ctext, rf'{METRIC_CACHE_HITS}{{tier="worker"}} (\S+)') > 0


def test_grpc_inference_streams_tokens(cluster, engine):
    router = cluster.role("router")[0]
    stub = rpc.InferenceStub(grpc.insecure_channel(router.grpc))
    req = {"segments": DOCS, "suffix": QUESTION, "sampling_params": {"max_new_tokens": 5}}
    chunks = list(stub.Generate(pb.GenerateRequest(request_json=json.dumps(req)), timeout=60))
    assert chunks[-1].done and json.loads(chunks[-1].stats_json)["prompt_tokens"] > 0
    assert "".join(c.text for c in chunks if not c.done) == LLM(engine).generate(req).text
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(request_json="{"), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "JSON" in err.value.details()


def test_workers_freeze_what_they_hold_once_warm(cluster):
    """A served worker and the cache tier freeze the objects they hold once ready (gc.freeze), so
    that Python's full collections on a request's path walk only what requests made; /health says
    how many were frozen."""
    for role in ("combine", "scatter", "cache-tier"):
        for svc in cluster.role(role):
            status, health = http("GET", f"http://{svc.http}/health")
            assert status == 200 and health["status"] == "ok", (role, health)
            assert health["gc_frozen_objects"] > 10_000, (role, health)
