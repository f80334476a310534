"""Standard clients unmodified: the request bodies of guidellm, aiperf, `vllm bench serve` (openai and
openai-chat backends) and `sglang.bench_serving` (sglang and openai backends), as their source
builds them (tests/data/load_generator_requests.json), are served: 200, a well-formed stream, the
output length they fix honoured. gRPC Inference/Generate's stream gives the ids the HTTP API gives,
its last chunk carrying the proto's -1 ("no token")."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import grpc
import pytest
from hybridcache.services.protocol import pb, rpc

RECORDED = json.loads((Path(__file__).resolve().parents[1] / "data" / "load_generator_requests.json").read_text())


def sse(url: str, body: dict) -> list:
    """The events of a server-sent-event response (the JSON of each `data:` line, "[DONE]" as is)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("entry", RECORDED["requests"], ids=[e["client"].split(",")[0] + " " + e["path"]
                                                             for e in RECORDED["requests"]])
def test_load_generator_request_is_served(clients_cluster, entry):
    body, path = entry["body"], entry["path"]
    events = sse(clients_cluster.url + path, body)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    chunks = events[:-1]
    want = body.get("max_tokens") or body.get("max_completion_tokens") or body["sampling_params"]["max_new_tokens"]
    if path == "/generate":
        # SGLang streams the text so far in every chunk; the last has the counts
        meta = chunks[-1]["meta_info"]
        assert meta["completion_tokens"] == want and meta["finish_reason"]["type"] == "length"
        assert len(chunks[-1]["output_ids"]) == want
        return
    # the OpenAI stream: a usage object at the end (every load generator reads it), the output
    # length fixed by ignore_eos (and min_tokens)
    usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    assert usage["completion_tokens"] == want and usage["prompt_tokens"] > 0
    finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
    assert finishes == ["length"]
    if body.get("stream_options", {}).get("include_usage"):
        # as OpenAI sends it: the usage in a last chunk of its own, with no choices
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage


def test_grpc_stream_ids_equal_the_http_ids_and_end_with_the_no_token_sentinel(clients_cluster):
    native = {"segments": ["The Varnel Bridge spans the Osk river.\n"], "suffix": "Who built it?",
              "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
    stub = rpc.InferenceStub(grpc.insecure_channel(clients_cluster.role("router")[0].grpc))
    chunks = list(stub.Generate(pb.GenerateRequest(request_json=json.dumps(native)), timeout=60))
    done = chunks[-1]
    assert done.done and done.token_id == -1 and not any(c.done for c in chunks[:-1])
    grpc_ids = [c.token_id for c in chunks if c.token_id >= 0]
    assert len(grpc_ids) == 12  # a client keeping every id >= 0 gets the tokens generated, no more

    body = {"segments": native["segments"], "text": native["suffix"], "sampling_params": native["sampling_params"]}
    req = urllib.request.Request(f"{clients_cluster.url}/generate", method="POST",
                                 headers={"Content-Type": "application/json"}, data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        http_ids = json.loads(r.read())["output_ids"]
    assert grpc_ids == http_ids
