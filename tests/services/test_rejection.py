"""Cheap rejection and client errors on a real router: every bad input of the issue is a 4xx JSON
error (HTTP) or the right gRPC status with its message, refused before it costs much; slow clients
(slowloris headers, a stalled body) are cut off within the configured timeouts."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hybridcache.services.launcher import LocalCluster, free_port
from hybridcache.services.protocol import pb, rpc
from serving_helpers import http

LIMIT = 64 << 10  # --max-request-bytes of this cluster
TIMEOUT_S = 1  # --http-header-timeout-s and --http-body-timeout-s
MAX_LEN = 1000


@pytest.fixture(scope="module")
def strict(model_dir):
    with LocalCluster(model_dir, port=free_port(), scatter_workers=0, max_request_bytes=LIMIT,
                      http_header_timeout_s=TIMEOUT_S, http_body_timeout_s=TIMEOUT_S, max_model_len=MAX_LEN) as c:
        yield c


GOOD = {"text": "Hello there", "sampling_params": {"max_new_tokens": 2}}


def deep(n: int) -> bytes:
    return b'{"text": "q", "sampling_params": ' + b"[" * n + b"]" * n + b"}"


HTTP_CASES = {
    "json-nested-30000-deep": ("/generate", deep(30_000), 400, "nested"),
    "lone-surrogate": ("/generate", b'{"text": "abc \\ud800 def"}', 400, "surrogate"),
    "stop-token-ids-int": ("/generate", {"text": "q", "sampling_params": {"stop_token_ids": 5}}, 400, "stop_token_ids"),
    "seed-2^64": ("/generate", {"text": "q", "sampling_params": {"seed": 1 << 64}}, 400, "seed"),
    "seed-negative": ("/v1/completions", {"prompt": "q", "seed": -1}, 400, "seed"),
    "chat-segments": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "segments": "abc"},
                      400, "segments"),
    "generate-n-true": ("/generate", {"text": "q", "sampling_params": {"n": True}}, 400, "n must be an integer"),
    "chat-n-true": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "n": True}, 400, "n"),
    "frequency-penalty": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                                                   "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    "logit-bias": ("/v1/completions", {"prompt": "q", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    "best-of-true": ("/v1/completions", {"prompt": "q", "best_of": True}, 400, "best_of"),
    "image-data": ("/generate", {"text": "q", "image_data": "aGk="}, 400, "image_data"),
    "not-an-object": ("/generate", b"[1, 2]", 400, "object"),
    "sampling-not-an-object": ("/generate", {"text": "q", "sampling_params": [1]}, 400, "sampling_params"),
    "text-over-the-char-bound": ("/generate", {"text": "x" * 60_000}, 400, "characters"),
    "body-over-the-limit": ("/generate", b'{"text": "' + b"x" * LIMIT + b'"}', 413, "exceeds"),
    "invalid-utf8": ("/generate", b'{"text": "\xff\xfe"}', 400, "JSON"),
}


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_bad_http_input_is_a_4xx_json_error(strict, case):
    path, body, want, words = HTTP_CASES[case]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.monotonic()
    status, res = http("POST", f"{strict.url}{path}", raw=raw, timeout=30)
    assert status == want, res
    assert isinstance(res, dict) and words in res["error"]["message"], res
    assert time.monotonic() - t0 < 10


def test_fields_at_their_off_value_are_accepted(strict):
    body = {"prompt": "Hi", "max_tokens": 2, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
            "best_of": 1, "echo": False, "logprobs": None, "user": "u-1"}
    status, res = http("POST", f"{strict.url}/v1/completions", body, timeout=60)
    assert status == 200, res
    status, res = http("POST", f"{strict.url}/generate", dict(GOOD, return_logprob=False, rid="r1", image_data=None),
                       timeout=60)
    assert status == 200, res


def test_unserved_routes_and_methods_are_json(strict):
    for method, path, want in (("POST", "/flush_cache", 404), ("GET", "/flush_cache", 404),
                               ("GET", "/nope", 404), ("GET", "/generate", 405)):
        status, res = http(method, f"{strict.url}{path}", raw=b"{}" if method == "POST" else None)
        assert status == want and isinstance(res, dict) and res["error"]["code"] == want, (path, res)


def test_oversized_body_is_refused_before_it_is_sent(strict):
    """A Content-Length over the limit is answered 413 at once, without reading the body."""
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n{")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:100]


def test_slowloris_connections_are_closed_and_good_requests_served(strict):
    n = 50
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", strict.port), timeout=10)
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0 = time.monotonic()
    # trickle a header line now and then, never the blank line that ends the head
    closed = set()
    while len(closed) < n and time.monotonic() - t0 < 10 * TIMEOUT_S:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                s.sendall(b"X-Slow: 1\r\n")
                s.settimeout(0.01)
                if s.recv(1024) == b"":
                    closed.add(i)
            except TimeoutError:
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.2)
    elapsed = time.monotonic() - t0
    for s in socks:
        s.close()
    assert len(closed) == n and elapsed < TIMEOUT_S + 4, (len(closed), elapsed)
    status, res = http("POST", f"{strict.url}/generate", GOOD, timeout=60)
    assert status == 200, res


def test_idle_connections_to_the_workers_http_ports_are_closed(strict):
    for svc in (strict.role("combine")[0], strict.role("cache-tier")[0]):
        host, port = svc.http.split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\n")
            t0 = time.monotonic()
            assert s.recv(1024) == b"" and time.monotonic() - t0 < TIMEOUT_S + 3


def test_a_stalled_body_is_408(strict):
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"text\": ")
        t0 = time.monotonic()
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < TIMEOUT_S + 3, head[:100]


def test_large_bodies_at_once_do_not_hold_up_a_good_request(strict):
    """Bodies at the limit, parsed and refused (their text is over the character bound) while a
    good request is served."""
    big = json.dumps({"text": "y" * (LIMIT - 100)}).encode()
    with ThreadPoolExecutor(8) as pool:
        flood = [pool.submit(http, "POST", f"{strict.url}/generate", None, big, 30) for _ in range(16)]
        status, res = http("POST", f"{strict.url}/generate", GOOD, timeout=60)
        assert status == 200, res
        assert all(f.result()[0] == 400 for f in flood)


GRPC_CASES = {
    "malformed": ("{", grpc.StatusCode.INVALID_ARGUMENT, "JSON"),
    "nested": (deep(30_000).decode(), grpc.StatusCode.INVALID_ARGUMENT, "nested"),
    "not-an-object": ("[1]", grpc.StatusCode.INVALID_ARGUMENT, "object"),
    "stop-token-ids-int": (json.dumps({"suffix": "q", "sampling_params": {"stop_token_ids": 5}}),
                           grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
    "seed-2^64": (json.dumps({"suffix": "q", "sampling_params": {"seed": 1 << 64}}),
                  grpc.StatusCode.INVALID_ARGUMENT, "seed"),
    "surrogate": ('{"suffix": "a \\ud800"}', grpc.StatusCode.INVALID_ARGUMENT, "surrogate"),
    "unknown-field": (json.dumps({"suffix": "q", "n": 2}), grpc.StatusCode.INVALID_ARGUMENT, "unknown"),
    "too-long": (json.dumps({"suffix": [5] * MAX_LEN}), grpc.StatusCode.INVALID_ARGUMENT, "max model length"),
    "over-the-message-limit": (json.dumps({"suffix": "z" * LIMIT}), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
}


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_bad_grpc_input_ends_with_its_status(strict, case):
    text, code, words = GRPC_CASES[case]
    stub = rpc.InferenceStub(grpc.insecure_channel(strict.role("router")[0].grpc))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(request_json=text), timeout=30))
    assert err.value.code() == code, err.value.details()
    assert words in (err.value.details() or "")
    good = list(stub.Generate(pb.GenerateRequest(request_json=json.dumps({"suffix": "Hi", "sampling_params": {
        "max_new_tokens": 2}})), timeout=60))
    assert good[-1].done and not good[-1].error


def test_large_bodies_do_not_slow_a_good_request_on_the_default_limits(cluster):
    """The issue's case on the default 4 MiB limit: bodies of 3.9 MiB of text, parsed off the event
    loop and refused before tokenizing (over the character bound), while a good request is timed."""
    good = {"text": "Hello there", "sampling_params": {"max_new_tokens": 2}}
    http("POST", f"{cluster.url}/generate", good, timeout=60)
    t0 = time.monotonic()
    assert http("POST", f"{cluster.url}/generate", good, timeout=60)[0] == 200
    alone = time.monotonic() - t0
    big = json.dumps({"text": "w" * int(3.9 * (1 << 20))}).encode()
    stop = time.monotonic() + 8
    statuses = []

    def flood():
        while time.monotonic() < stop:
            statuses.append(http("POST", f"{cluster.url}/generate", None, big, 60)[0])

    with ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(flood) for _ in range(4)]
        time.sleep(1.0)
        t0 = time.monotonic()
        status, res = http("POST", f"{cluster.url}/generate", good, timeout=60)
        loaded = time.monotonic() - t0
        for f in floods:
            f.result()
    assert status == 200, res
    assert statuses and set(statuses) == {400}
    assert loaded < max(3.0, 5 * alone), (alone, loaded)
