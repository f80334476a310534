"""Many requests at once through the served stack (real processes on loopback, the shipped model):
continuous batching gives the answers of one-by-one runs, a short request is not held behind a
long one, a full queue answers 429 (HTTP) and RESOURCE_EXHAUSTED (gRPC), and a client that goes
away frees the engine within a step."""

from __future__ import annotations

import http.client as httplib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hybridcache.services.contract import (
    METRIC_SCHEDULER_FINISHED,
    METRIC_SCHEDULER_GENERATED_TOKENS,
    METRIC_SCHEDULER_REQUESTS,
)
from hybridcache.services.launcher import LocalCluster, free_port
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.runtime.modelzoo import default_model_dir
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import http

MAX_NUM_SEQS = 4
MAX_WAITING = 2
LONG = 6000  # tokens a long request asks for: far more than it gets before the tests end it
DOCS = [f"Document {i}: the {w} bridge was built in 18{i}5 by the engineer of {c}.\n"
        for i, (w, c) in enumerate([("red", "Tarn"), ("stone", "Osk"), ("iron", "Lowmere"), ("north", "Varn"),
                                    ("old", "Kell"), ("long", "Brae")])]


@pytest.fixture(scope="module")
def stack():
    with LocalCluster(default_model_dir(), port=free_port(), scatter_workers=0, max_num_seqs=MAX_NUM_SEQS,
                      max_waiting=MAX_WAITING) as c:
        yield c


def _body(i: int, max_new: int, stream: bool = False) -> dict:
    return {"segments": [DOCS[i % len(DOCS)], DOCS[(i + 2) % len(DOCS)]], "text": f"Question {i}: who built it?",
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0.0},
            "stream": stream}


def _native(i: int, max_new: int) -> dict:
    """The same request as the engine's native object (the gRPC API's)."""
    body = _body(i, max_new)
    return {"segments": body["segments"], "suffix": body["text"], "sampling_params": body["sampling_params"]}


class Stream:
    """A streaming /generate request read event by event, with the arrival time of each; close()
    drops the connection as a client that goes away does."""

    def __init__(self, url: str, body: dict, timeout: float = 60.0):
        host, port = url.removeprefix("http://").split(":")
        self.conn = httplib.HTTPConnection(host, int(port), timeout=timeout)
        self.conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        self.resp = None
        self.events: list[tuple[float, dict]] = []

    def open(self) -> httplib.HTTPResponse:
        if self.resp is None:
            self.resp = self.conn.getresponse()
        return self.resp

    def next_event(self) -> dict | None:
        resp = self.open()
        while True:
            line = resp.readline()
            if not line:
                return None
            line = line.decode().strip()
            if line == "data: [DONE]":
                return None
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                self.events.append((time.perf_counter(), ev))
                return ev

    def read_all(self) -> list[tuple[float, dict]]:
        while self.next_event() is not None:
            pass
        return self.events

    def close(self) -> None:
        self.conn.close()


def _scrape(stack) -> dict:
    """The combine worker's scheduler metrics: {(name, labels): value}."""
    status, text = http("GET", f"http://{stack.role('combine')[0].http}/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (METRIC_SCHEDULER_REQUESTS, METRIC_SCHEDULER_FINISHED, METRIC_SCHEDULER_GENERATED_TOKENS):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _finished(m: dict, reason: str) -> float:
    return m.get((METRIC_SCHEDULER_FINISHED, (("reason", reason),)), 0.0)


def _tokens(m: dict) -> float:
    return m.get((METRIC_SCHEDULER_GENERATED_TOKENS, ()), 0.0)


def _in_flight(m: dict, state: str) -> float:
    return m.get((METRIC_SCHEDULER_REQUESTS, (("state", state),)), 0.0)


def _wait_for(stack, pred, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _scrape(stack)
        if pred(m):
            return m
        assert time.monotonic() < deadline, f"scheduler metrics did not get there: {m}"
        time.sleep(0.05)


def test_concurrent_requests_equal_one_by_one_and_overlap(stack):
    n = MAX_NUM_SEQS
    # 96 tokens: a decode long enough that the requests' arrivals, tens of ms apart on a loaded
    # CI machine, fall inside it (at 24 tokens one request finished before the last one started)
    tokens = 96
    with ThreadPoolExecutor(n) as pool:
        streams = [Stream(stack.url, _body(i, tokens, stream=True)) for i in range(n)]
        together = list(pool.map(Stream.read_all, streams))
    for s in streams:
        s.close()
    alone = []
    for i in range(n):
        status, res = http("POST", f"{stack.url}/generate", _body(i, tokens))
        assert status == 200, res
        alone.append(res)
    for events, res in zip(together, alone):
        last = events[-1][1]
        assert last["meta_info"]["finish_reason"] == {"type": "length"}
        assert last["output_ids"] == res["output_ids"] and len(res["output_ids"]) == tokens
        assert last["text"] == res["text"]
    # served together, not one after another: every request had tokens before every other's last
    firsts = [events[0][0] for events in together]
    lasts = [events[-1][0] for events in together]
    assert max(firsts) < min(lasts), (firsts, lasts)


def test_short_request_is_not_held_behind_a_long_one_and_a_gone_client_frees_the_engine(stack):
    before = _scrape(stack)
    long = Stream(stack.url, _body(0, LONG, stream=True))
    try:
        assert long.next_event() is not None  # the long request decodes
        status, short = http("POST", f"{stack.url}/generate", _body(1, 4), timeout=30)
        assert status == 200 and len(short["output_ids"]) == 4
        # the short one finished while the long one went on: it got a token after the short answer
        t_short = time.perf_counter()
        ev = long.next_event()
        assert ev is not None and ev["meta_info"]["finish_reason"] is None and long.events[-1][0] > t_short
    finally:
        long.close()
    # the client went away: its request ends (abort) and stops generating, long before LONG tokens
    after = _wait_for(stack, lambda m: _finished(m, "abort") > _finished(before, "abort")
                      and _in_flight(m, "running") == 0)
    generated = _tokens(after) - _tokens(before) - 4
    assert 0 < generated < LONG // 4, generated
    time.sleep(0.5)
    assert _tokens(_scrape(stack)) == _tokens(after)  # nothing more is generated for it
    # and the next request is served at once
    status, res = http("POST", f"{stack.url}/generate", _body(2, 4), timeout=30)
    assert status == 200 and len(res["output_ids"]) == 4


def test_full_queue_answers_429_and_resource_exhausted_then_recovers(stack):
    before = _scrape(stack)
    n = MAX_NUM_SEQS + MAX_WAITING
    streams = [Stream(stack.url, _body(i, LONG, stream=True)) for i in range(n)]
    try:
        _wait_for(stack, lambda m: _in_flight(m, "running") == MAX_NUM_SEQS
                  and _in_flight(m, "waiting") == MAX_WAITING)
        for body in (_body(5, 4), _body(5, 4, stream=True)):
            status, err = http("POST", f"{stack.url}/generate", body, timeout=30)
            assert status == 429, err
            assert "waiting" in err["error"]["message"] and err["error"]["code"] == 429
        # the header, on the OpenAI endpoint too
        conn = httplib.HTTPConnection(*stack.url.removeprefix("http://").split(":"), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 429 and int(resp.getheader("Retry-After")) >= 1
        assert json.loads(resp.read())["error"]["type"] == "rate_limit_exceeded"
        conn.close()
        channel = grpc.insecure_channel(stack.role("router")[0].grpc)
        with pytest.raises(grpc.RpcError) as e:
            list(rpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(request_json=json.dumps(_native(5, 4))), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting" in e.value.details()
        channel.close()
    finally:
        for s in streams:
            s.close()
    # every one of them ends when its client goes away, the waiting ones before they ran
    _wait_for(stack, lambda m: _finished(m, "abort") - _finished(before, "abort") == n
              and _in_flight(m, "running") + _in_flight(m, "waiting") + _in_flight(m, "prefilling") == 0)
    status, res = http("POST", f"{stack.url}/generate", _body(3, 4), timeout=30)
    assert status == 200 and len(res["output_ids"]) == 4


def test_grpc_client_that_cancels_frees_the_engine(stack):
    before = _scrape(stack)
    channel = grpc.insecure_channel(stack.role("router")[0].grpc)
    call = rpc.InferenceStub(channel).Generate(pb.GenerateRequest(request_json=json.dumps(_native(4, LONG))),
                                               timeout=60)
    got = threading.Event()

    def read():
        try:
            for chunk in call:
                if chunk.token_id >= 0:
                    got.set()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert got.wait(30)
    call.cancel()
    after = _wait_for(stack, lambda m: _finished(m, "abort") > _finished(before, "abort")
                      and _in_flight(m, "running") == 0)
    assert 0 < _tokens(after) - _tokens(before) < LONG // 4
    reader.join(10)
    channel.close()
