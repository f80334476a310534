"""A combine worker's Tokens stream (services/combine/tokens.py, services/router/mux.py): the
router's requests' chunks on one stream per worker, a scheduler step's in one message.

Checked on a real CombineServicer and Router over loopback gRPC (the tiny model): the answers,
log-probabilities and stats equal the per-request stream's; many requests' tokens travel in far
fewer messages than tokens; a cancelled request ends and leaves the scheduler; a worker that lost
the subscription answers FAILED_PRECONDITION and the router streams that request on its call; a
worker whose stream breaks fails its requests with 503, never a hang."""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent import futures

import grpc
import pytest
from hybridcache.services.combine.worker import CombineServicer
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.directory.memory import InProcessDirectory
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.router.router import Router, ServiceUnavailable, StreamControl
from hybridcache.services.runtime.engine import Engine
from hybridcache.services.runtime.scheduler import SchedulerConfig


def _serve(servicer, threads: int):
    """(started server, its address) of a combine servicer on loopback."""
    server = grpc.server(futures.ThreadPoolExecutor(threads))
    rpc.add_CombineServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return server, address


@pytest.fixture(scope="module")
def worker(model_dir):
    engine = Engine.from_dir(model_dir)
    servicer = CombineServicer(engine, scheduling=SchedulerConfig(max_num_seqs=16, max_waiting=16))
    server, address = _serve(servicer, 48)
    try:
        yield servicer, address
    finally:
        server.stop(0)
        servicer.close()


def _router(model_dir, address: str, token_stream: str) -> Router:
    router = Router(model_dir, InProcessDirectory({"combine": [address]}),
                    runtime=RuntimeConfig(token_stream=token_stream))
    router.connect(timeout_s=10)
    return router


def _body(i: int, n: int = 12, **sampling) -> dict:
    return {"segments": [f"Document {i}: a passage about caches and states.", "A second passage."],
            "suffix": f" Question {i}:", "sampling_params": {"max_new_tokens": n, "temperature": 0.0,
                                                               "ignore_eos": True, **sampling}}


def _run(router: Router, body: dict, control: StreamControl | None = None) -> list:
    return list(router.stream(router.parse(body), control))


def _answer(chunks: list) -> tuple:
    tokens = [c.token_id for c in chunks if c.token_id >= 0 and not c.done]
    text = "".join(c.text for c in chunks if not c.done)
    logprobs = [(c.logprob, list(c.top_ids)) for c in chunks if c.has_logprob]
    done = chunks[-1]
    return tokens, text, logprobs, done.done, done.finish_reason, done.error


def test_multiplexed_answers_equal_the_per_request_streams(worker, model_dir):
    _, address = worker
    bodies = [_body(i) for i in range(5)] + [_body(9, logprobs=3)]
    answers = {}
    for mode in ("per-request", "multiplexed"):
        router = _router(model_dir, address, mode)
        with futures.ThreadPoolExecutor(len(bodies)) as pool:
            runs = list(pool.map(lambda b, r=router: _run(r, b), bodies))
        answers[mode] = [_answer(chunks) for chunks in runs]
        for chunks in runs:
            stats = json.loads(chunks[-1].stats_json)
            assert stats["generated_tokens"] == 12 and stats["combine_ttft_ms"] > 0
            assert not any(c.request_id or c.closed for c in chunks)
        if mode == "multiplexed":
            assert router._muxes[address]._subscriber is not None
    # the same tokens, text and ends; the log-probabilities within float rounding (a request's batch
    # mates differ from run to run)
    strip = [[a[:2] + a[3:] for a in answers[m]] for m in ("multiplexed", "per-request")]
    assert strip[0] == strip[1]
    for got, want in zip(answers["multiplexed"], answers["per-request"]):
        assert [ids for _, ids in got[2]] == [ids for _, ids in want[2]]
        assert [lp for lp, _ in got[2]] == pytest.approx([lp for lp, _ in want[2]], abs=1e-3)
    assert all(a[0] and a[3] and a[4] == "length" and not a[5] for a in answers["multiplexed"])
    assert len(answers["multiplexed"][-1][2]) == 12  # the logprobs request's, one per token


def test_direct_delivery_keeps_the_answer_and_spares_the_relaying_thread(worker, model_dir, monkeypatch):
    """Router.stream with `direct` (the HTTP door's path): once the first token is out, a
    multiplexed request's chunks that end nothing go from the Tokens stream's reader to `direct`;
    the answer, merged in arrival order, equals the yielded-only one, the done chunk with its stats
    is still yielded last, and the relaying thread reads a few items from its inbox, not one a
    token."""
    from hybridcache.services.router import mux as mux_module

    _, address = worker
    router = _router(model_dir, address, "multiplexed")
    want = _answer(_run(router, _body(3, 24)))
    gets = []
    real_get = mux_module.Inbox.get

    def counting_get(self):
        item = real_get(self)
        gets.append(item)
        return item

    monkeypatch.setattr(mux_module.Inbox, "get", counting_get)
    arrived, lock = [], threading.Lock()

    def direct(chunk):
        with lock:
            arrived.append(("direct", chunk))

    for chunk in router.stream(router.parse(_body(3, 24)), None, None, None, direct):
        with lock:
            arrived.append(("yielded", chunk))
    chunks = [c for _, c in arrived]
    assert _answer(chunks)[:2] + _answer(chunks)[3:] == want[:2] + want[3:]
    assert arrived[-1][0] == "yielded" and arrived[-1][1].done and json.loads(arrived[-1][1].stats_json)
    ways = [w for w, _ in arrived]
    assert ways.count("direct") >= 12 and ways[0] == "yielded"
    assert not any(c.request_id for c in chunks)
    assert len(gets) <= 6, [type(g).__name__ for g in gets]


def test_the_token_stream_is_open_before_the_first_request(worker, model_dir):
    """connect() (the router's start) subscribes to the combine worker's Tokens stream: the first
    request finds it open and takes it, opening no other."""
    servicer, address = worker
    router = _router(model_dir, address, "multiplexed")
    mux = router._muxes[address]
    sub = mux._subscriber
    assert sub is not None and mux._call.running()
    _answer(_run(router, _body(5, 4)))
    assert mux._subscriber == sub


def test_many_requests_tokens_travel_in_few_messages(worker):
    """Eight requests decoding together: their 8 x 24 tokens come in about one message a step."""
    servicer, address = worker
    channel = grpc.insecure_channel(address)
    stub = rpc.CombineStub(channel)
    sub = uuid.uuid4().hex
    stream = stub.Tokens(pb.TokensRequest(subscriber=sub))
    assert len(next(stream).chunks) == 0  # registered
    n, new = 8, 24
    engine = servicer.engine
    calls = []
    for i in range(n):
        req = engine.parse_request(_body(i, new))
        calls.append(stub.Generate(pb.CombineRequest(
            request_id=f"r{i}", suffix_ids=req.prompt_ids, subscriber=sub,
            sampling_json=json.dumps({"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True})), timeout=60))
    per_request: dict[str, list] = {f"r{i}": [] for i in range(n)}
    messages = 0
    try:
        while not all(c and c[-1].done for c in per_request.values()):
            batch = next(stream)
            messages += 1
            for c in batch.chunks:
                per_request[c.request_id].append(c)
    finally:
        stream.cancel()
    assert all(list(c) == [] for c in calls)  # a multiplexed Generate answers nothing itself
    for chunks in per_request.values():
        # its tokens, maybe a text-only chunk (an incomplete character's bytes flushed at the end), done
        assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert len([c for c in chunks if c.token_id >= 0]) == new
        assert json.loads(chunks[-1].stats_json)["generated_tokens"] == new
    # one token a message would be n * new = 192 messages; a step's tokens in one: about `new`
    assert messages <= n * new / 3, messages
    channel.close()


def test_a_cancelled_request_ends_and_leaves_the_scheduler(worker, model_dir):
    servicer, address = worker
    router = _router(model_dir, address, "multiplexed")
    control = StreamControl()
    got = []
    for chunk in router.stream(router.parse(_body(1, 4000)), control):
        got.append(chunk)
        if len(got) == 3:
            control.cancel()
    assert len(got) == 3 and not any(c.done for c in got)
    deadline = time.monotonic() + 10
    while sum(servicer.scheduler.load().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(servicer.scheduler.load().values()) == 0
    assert not router._muxes[address]._inboxes  # its inbox is gone


def test_a_worker_that_lost_the_subscription_streams_on_the_call(worker, model_dir):
    servicer, address = worker
    router = _router(model_dir, address, "multiplexed")
    want = _answer(_run(router, _body(3)))
    first = router._muxes[address]._subscriber
    with servicer.subscriptions._lock:  # as a worker that restarted: it knows no subscriber
        servicer.subscriptions._subs.clear()
    assert _answer(_run(router, _body(3))) == want  # FAILED_PRECONDITION, then on the call
    assert _answer(_run(router, _body(3))) == want  # a new subscription
    assert router._muxes[address]._subscriber not in (None, first)


def test_a_broken_stream_fails_its_requests_with_503(model_dir):
    engine = Engine.from_dir(model_dir)
    servicer = CombineServicer(engine, scheduling=SchedulerConfig(max_num_seqs=4, max_waiting=4))
    server, address = _serve(servicer, 16)
    try:
        router = _router(model_dir, address, "multiplexed")
        errors, got = [], []

        def run():
            try:
                for chunk in router.stream(router.parse(_body(2, 4000))):
                    got.append(chunk)
            except ServiceUnavailable as e:
                errors.append(str(e))

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        server.stop(0)  # the worker goes away mid-request
        t.join(30)
        assert not t.is_alive() and len(errors) == 1 and f"combine worker {address} failed" in errors[0]
        with pytest.raises(ServiceUnavailable):  # and the next request is answered, not held
            _run(router, _body(2))
    finally:
        server.stop(0)
        servicer.close()


class _OldCombine(rpc.CombineServicer):
    """A combine worker from before Tokens streams: Generate streams on the call, Tokens is
    UNIMPLEMENTED (the generated base class's answer)."""

    def __init__(self, engine):
        self.engine, self.subscribers = engine, []

    def Info(self, request, context):
        e = self.engine
        return pb.InfoReply(fingerprint=e.fingerprint, seam_window=e.config.seam_window, mode=e.config.mode)

    def Generate(self, request, context):
        self.subscribers.append(request.subscriber)
        yield pb.TokenChunk(token_id=7, text="x")
        yield pb.TokenChunk(token_id=-1, done=True, finish_reason="length", stats_json="{}")


def test_a_worker_without_token_streams_gets_requests_one_by_one(model_dir, engine):
    old = _OldCombine(engine)
    server, address = _serve(old, 8)
    try:
        router = _router(model_dir, address, "multiplexed")
        for _ in range(2):
            chunks = _run(router, _body(4))
            assert [c.token_id for c in chunks] == [7, -1] and chunks[-1].done
        assert old.subscribers == ["", ""]  # asked once, then never named a subscriber
        assert router._muxes[address]._unsupported
    finally:
        server.stop(0)
