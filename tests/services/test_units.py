"""Pieces of the serving stack in-process: assignment, cost model, hashing, codec, stores, protocol."""

from __future__ import annotations

import random
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from hybridcache.services.api.openai_compat import chat_to_native, completion_to_native, sglang_to_native
from hybridcache.services.cache_tier.client import CacheTierClient
from hybridcache.services.cache_tier.server import CacheTierServicer
from hybridcache.services.cache_tier.store import TierStore
from hybridcache.services.directory import HashRing, InProcessDirectory
from hybridcache.services.launcher import free_port
from hybridcache.services.protocol import build, rpc
from hybridcache.services.router.assign import lpt_assign, makespan, round_robin_assign
from hybridcache.services.router.cost import CostModel
from hybridcache.services.runtime.sampling import RequestError
from hybridcache.services.transport import get_transport, transport_for_address
from hybridcache.services.transport.codec import EntryAssembler, entry_chunks, entry_to, read_entries


@pytest.fixture(scope="module")
def entries(engine):
    rng = random.Random(0)
    return [engine.build_entry([rng.randrange(256) for _ in range(n)]).seal() for n in (24, 40, 64)]


def test_lpt_beats_round_robin_on_skewed_lengths():
    costs = [8.0, 1.0, 1.0, 1.0, 7.0, 1.0, 1.0, 6.0]
    queued = [0.0, 0.0, 0.0]
    lpt, rr = lpt_assign(costs, queued), round_robin_assign(costs, queued)
    assert makespan(costs, queued, lpt) == 9.0
    assert makespan(costs, queued, rr) == 14.0
    # Existing queues count: a busy worker gets nothing while others are idle.
    assert 0 not in lpt_assign([1.0, 1.0], [10.0, 0.0, 0.0])
    # Spreads even equal segments over all workers.
    assert sorted(lpt_assign([1.0] * 4, [0.0, 0.0])) == [0, 0, 1, 1]
    with pytest.raises(ValueError):
        lpt_assign([1.0], [])


def test_lpt_never_worse_than_round_robin_random():
    rng = random.Random(1)
    for _ in range(200):
        costs = [rng.choice([1, 1, 2, 30]) * rng.random() for _ in range(rng.randrange(1, 12))]
        queued = [0.0] * rng.randrange(1, 5)
        assert makespan(costs, queued, lpt_assign(costs, queued)) <= \
            makespan(costs, queued, round_robin_assign(costs, queued)) * 4 / 3 + 1e-9


def test_fetch_or_recompute_on_both_sides_of_break_even():
    cm = CostModel(prefill_tokens_per_s=10_000.0, bandwidth={"grpc": 1e8}, latency_s={"grpc": 0.0})
    # 1000 tokens recompute in 0.1 s; 1e7 bytes move in 0.1 s: the break-even point.
    assert cm.choose(9_000_000, 1000, "grpc") == "fetch"
    assert cm.choose(11_000_000, 1000, "grpc") == "recompute"
    # A faster GPU moves the point: the same entry is now cheaper to recompute.
    cm.observe_prefill(1000, 0.001)
    assert cm.prefill_tokens_per_s > 10_000.0
    assert cm.choose(9_000_000, 1000, "grpc") == "recompute"
    cm.observe_transfer("grpc", 10**9, 0.01)
    assert cm.bandwidth["grpc"] > 1e8


def test_hash_ring_is_consistent():
    keys = [f"k{i}" for i in range(2000)]
    ring3 = HashRing(["a:1", "b:1", "c:1"])
    ring4 = HashRing(["a:1", "b:1", "c:1", "d:1"])
    owners3 = [ring3.owner(k) for k in keys]
    assert set(owners3) == {"a:1", "b:1", "c:1"}
    moved = sum(o3 != ring4.owner(k) for o3, k in zip(owners3, keys))
    assert 0.1 * len(keys) < moved < 0.45 * len(keys)
    assert all(ring4.owner(k) == "d:1" for o3, k in zip(owners3, keys) if o3 != ring4.owner(k))
    assert HashRing([]).owner("x") is None
    d = InProcessDirectory({"cache-tier": ["a:1"]})
    assert d.owner("x") == "a:1"


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_codec_round_trip_layer_by_layer(entries, transport):
    chunks = [c for i, e in enumerate(entries) for c in entry_chunks(e, i, get_transport(transport))]
    layers = [c.tensor.layer for c in chunks if c.WhichOneof("body") == "tensor"][:6]
    assert layers == sorted(layers)
    out = list(read_entries(chunks))
    assert [(i, err) for i, _, err in out] == [(0, ""), (1, ""), (2, "")]
    for (_, got, _), want in zip(out, entries):
        assert got.key == want.key and got.checksum == want.checksum and got.verify()
        assert (got.data.linear[0].S == want.data.linear[0].S).all()


def test_entry_to_moves_every_tensor(entries):
    e = entries[0]
    assert entry_to(e, "cpu") is e
    moved = entry_to(e, "meta")
    assert moved.checksum == e.checksum and moved.nbytes == e.nbytes
    assert {t.device.type for s in moved.data.linear.values() for t in (s.T, s.S, s.conv_tail)} == {"meta"}
    assert {t.device.type for a in moved.data.attn.values() for t in (a.k, a.v)} == {"meta"}


def test_corrupted_bytes_are_detected(entries):
    chunks = list(entry_chunks(entries[0], 0, get_transport("grpc")))
    t = next(c for c in chunks if c.WhichOneof("body") == "tensor" and len(c.tensor.data) > 8)
    data = bytearray(t.tensor.data)
    data[3] ^= 0xFF
    t.tensor.data = bytes(data)
    out = list(read_entries(chunks))
    assert out[0][1] is None and "checksum" in out[0][2]
    # A consistent forgery (tensor checksum fixed up) still fails the entry's seal.
    import zlib

    t.tensor.checksum = f"crc32:{zlib.crc32(t.tensor.data):08x}"
    asm = EntryAssembler()
    res = [r for c in chunks if (r := asm.feed(c)) is not None]
    assert res[0][1] is None and "seal" in res[0][2]


def test_stale_shm_blocks_are_swept(tmp_path, monkeypatch):
    import os

    from hybridcache.services.transport import shm

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    old, fresh, other = tmp_path / f"{shm.PREFIX}old", tmp_path / f"{shm.PREFIX}fresh", tmp_path / "unrelated"
    for p in (old, fresh, other):
        p.write_bytes(b"x")
    os.utime(old, (1, 1))
    os.utime(other, (1, 1))
    assert shm.sweep_stale(60) == 1
    assert not old.exists() and fresh.exists() and other.exists()


def test_transport_choice():
    assert transport_for_address("127.0.0.1:5000") == "shm"
    assert transport_for_address("10.0.0.7:5000") == "grpc"
    assert transport_for_address("localhost:5000") == "shm"
    with pytest.raises(ValueError):
        get_transport("carrier-pigeon")


def test_tier_store_budget_spill_and_corruption(entries, tmp_path):
    cap = entries[1].nbytes + entries[2].nbytes
    store = TierStore(cap, spill_dir=tmp_path / "spill")
    for e in entries:
        assert store.put(e)
        assert store.memory.used_bytes <= cap
    spilled = [e for e in entries if not store.memory.contains(e.key)]
    assert spilled and store.disk_entries == len(spilled)
    back = store.get(spilled[0].key)
    assert back is not None and back.checksum == spilled[0].checksum
    assert store.memory.used_bytes <= cap
    # A corrupted spill file is a miss.
    victim = next(e for e in entries if not store.memory.contains(e.key))
    path = tmp_path / "spill" / f"{victim.key}.entry"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.get(victim.key) is None and store.corrupt == 1
    # An entry corrupted in memory is a miss too.
    key = next(e.key for e in entries if store.memory.contains(e.key))
    held = store.memory.get(key)  # the object the tier holds (not re-verified by the raw memory store)
    held.data.linear[0].S.add_(1.0)
    try:
        assert store.get(key) is None and store.corrupt == 2
    finally:
        held.data.linear[0].S.sub_(1.0)


def test_cache_tier_over_grpc_corrupt_entry_is_a_miss(engine):
    store = TierStore(1 << 24)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rpc.add_CacheTierServicer_to_server(CacheTierServicer(store), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        client = CacheTierClient(f"127.0.0.1:{port}")
        a, b = engine.build_entry(list(range(30, 70))), engine.build_entry(list(range(80, 120)))
        assert client.put([a, b]) == 2
        for transport in ("grpc", "shm"):
            got = client.get([a.key, b.key, "nope"], transport)
            assert set(got) == {a.key, b.key}
        store.memory.get(b.key).data.attn[2].k.mul_(2.0)
        assert set(client.get([a.key, b.key])) == {a.key}
        stat = client.stat([a.key, b.key])
        assert list(stat.present) == [True, False] and stat.corrupt == 1
    finally:
        server.stop(0)
    # The tier down: a miss, not an error.
    assert CacheTierClient(f"127.0.0.1:{port}", timeout_s=1).get([a.key]) == {}


def test_request_mapping():
    native = chat_to_native({"messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "d1"}, {"type": "text", "text": "d2"},
                                     {"type": "text", "text": "q"}]}], "max_tokens": 3})
    assert native == {"system": "sys", "segments": ["d1", "d2"], "suffix": "q",
                      "sampling_params": {"max_new_tokens": 3}}
    assert chat_to_native({"messages": [{"role": "user", "content": "a||b||q"}], "separator": "||"})["segments"] == \
        ["a", "b"]
    assert completion_to_native({"prompt": "x", "segments": ["s"]})["segments"] == ["s"]
    assert sglang_to_native({"text": "a|b", "separator": "|", "sampling_params": {"n": 1, "regex": None}}) == \
        {"segments": ["a"], "suffix": "b", "sampling_params": {}}
    for bad in ({"messages": []}, {"messages": [{"role": "user", "content": 5}]}, {"messages": [], "n": 2},
                {"messages": [{"role": "user", "content": "q"}], "bogus": 1}):
        with pytest.raises(RequestError):
            chat_to_native(bad)
    with pytest.raises(RequestError):
        sglang_to_native({"text": "q", "sampling_params": {"regex": "a+"}})


def test_generated_protocol_code_is_current():
    here = Path(build.__file__).parent
    for name, text in build.generated_text().items():
        assert (here / name).read_text() == text, f"{name} is stale: python -m hybridcache.services.protocol.build"


def test_router_plan_fetches_or_recomputes_held_entries(engine, model_dir):
    from hybridcache.services.protocol import pb
    from hybridcache.services.router.router import Router

    store = TierStore(1 << 24)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rpc.add_CacheTierServicer_to_server(CacheTierServicer(store), server)
    tier = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(tier)
    server.start()
    try:
        directory = InProcessDirectory({"cache-tier": [tier], "scatter": ["127.0.0.1:1", "127.0.0.1:2"]})
        router = Router(model_dir, directory)
        router.adopt(pb.InfoReply(fingerprint=engine.fingerprint, seam_window=engine.config.seam_window, mode="pic"))
        held, cold = [5 + i % 200 for i in range(60)], [9 + i % 180 for i in range(50)]
        store.put(engine.build_entry(held))
        req = router.parse({"segments": [held, cold], "suffix": "q"})
        assert router.planner.entry_key(held) == engine.entry_key(held)
        # Recomputing 60 tokens at 2k tokens/s takes 30 ms; the ~50 KB entry moves in ~1 ms: fetch.
        plan, assigned, _ = router.plan(req)
        assert [(p.index, p.source) for p in sorted(plan, key=lambda p: p.index)] == [(0, "tier"), (1, "scatter")]
        assert plan[-1].cache_tier == tier and router.cold_queue_depth == 1
        router._release(plan, assigned)
        assert router.cold_queue_depth == 0
        # A device that prefills 1e9 tokens/s: still a fetch while a rebuilt entry would come back
        # over gRPC (slower than the tier's shared memory); the cold segment is built by the
        # combine worker itself, which is faster than moving its entry from a scatter worker...
        router.cost.prefill_tokens_per_s = 1e9
        plan, assigned, _ = router.plan(req)
        assert [(p.index, p.source) for p in sorted(plan, key=lambda p: p.index)] == [(0, "tier"), (1, "local")]
        assert assigned == {} and router.cold_queue_depth == 0
        router._release(plan, assigned)
        # ...and both rebuilt once the combine workers report the scatter path as CUDA IPC, still
        # on the combine worker at that speed
        router.cost.observe_scatter("cuda_ipc", 10**9, 0.02)
        plan, assigned, _ = router.plan(req)
        assert sorted(p.source for p in plan) == ["local", "local"]
        router._release(plan, assigned)
        # at 2k tokens/s a build takes longer than the move over CUDA IPC: both cold segments of a
        # request go to the scatter workers, LPT spreading them over both
        router.cost.prefill_tokens_per_s = 2000.0
        plan, assigned, _ = router.plan(router.parse({"segments": [cold, cold[::-1]], "suffix": "q"}))
        assert sorted(p.source for p in plan) == ["scatter", "scatter"]
        assert set(assigned) == {"127.0.0.1:1", "127.0.0.1:2"}
        router._release(plan, assigned)
    finally:
        server.stop(0)


def test_router_asks_the_tier_only_for_entries_the_combine_worker_does_not_hold(engine, model_dir):
    """After a combine worker finished a request, the router plans that request's segments from the
    tier for that worker without a Stat (the worker looks in its own cache first); another worker,
    or a segment it has not folded in, is still looked up."""
    from hybridcache.services.protocol import pb
    from hybridcache.services.router.router import Router

    stats = []

    class Counting(CacheTierServicer):
        def Stat(self, request, context):
            stats.append(list(request.keys))
            return super().Stat(request, context)

    server = grpc.server(futures.ThreadPoolExecutor(4))
    rpc.add_CacheTierServicer_to_server(Counting(TierStore(1 << 24)), server)
    tier = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(tier)
    server.start()
    try:
        router = Router(model_dir, InProcessDirectory({"cache-tier": [tier]}))
        router.adopt(pb.InfoReply(fingerprint=engine.fingerprint, seam_window=engine.config.seam_window, mode="pic"))
        a, b, c = ([7 + (i * k) % 150 for i in range(40)] for k in (1, 3, 5))
        req = router.parse({"segments": [a, b], "suffix": "q"})
        plan, _, _ = router.plan(req, "combine-1")
        assert len(stats) == 1 and sorted(p.source for p in plan) == ["local", "local"]  # the tier holds nothing
        router._remember("combine-1", plan)
        plan, _, _ = router.plan(router.parse({"segments": [b, a], "suffix": "q"}), "combine-1")
        assert len(stats) == 1
        assert sorted((p.index, p.key, p.source, p.address) for p in plan) == sorted(
            [(0, router.planner.entry_key(b), "tier", tier), (1, router.planner.entry_key(a), "tier", tier)])
        plan, _, _ = router.plan(router.parse({"segments": [a, c], "suffix": "q"}), "combine-1")
        assert stats[-1] == [router.planner.entry_key(c)] and len(stats) == 2
        router.plan(req, "combine-2")
        assert len(stats) == 3 and len(stats[-1]) == 2
    finally:
        server.stop(0)


class _FakeCombine(rpc.CombineServicer):
    """A combine worker that refuses every request (queue full) or answers two tokens."""

    def __init__(self, full: bool):
        self.full, self.calls = full, 0

    def Generate(self, request, context):
        from hybridcache.services.protocol import pb

        self.calls += 1
        if self.full:
            context.set_trailing_metadata((("retry-after", "3"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "4 requests running and 2 waiting")
        yield pb.TokenChunk(token_id=7, text="a")
        yield pb.TokenChunk(done=True, finish_reason="length", stats_json="{}")


def test_router_asks_the_next_combine_worker_when_one_is_full(engine, model_dir):
    from hybridcache.services.protocol import pb
    from hybridcache.services.router.router import Overloaded, Router

    workers, servers = [_FakeCombine(full=True), _FakeCombine(full=False)], []
    addresses = []
    for w in workers:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        rpc.add_CombineServicer_to_server(w, server)
        addresses.append(f"127.0.0.1:{free_port()}")
        server.add_insecure_port(addresses[-1])
        server.start()
        servers.append(server)
    try:
        router = Router(model_dir, InProcessDirectory({"combine": addresses}))
        router.adopt(pb.InfoReply(fingerprint=engine.fingerprint, seam_window=engine.config.seam_window, mode="pic"))
        req = router.parse({"suffix": "q"})
        # round robin starts at either worker: every request is served, by the one with room
        for _ in range(4):
            chunks = list(router.stream(req))
            assert [c.token_id for c in chunks if not c.done] == [7] and chunks[-1].finish_reason == "length"
        assert workers[1].calls == 4 and workers[0].calls >= 2
        workers[1].full = True
        with pytest.raises(Overloaded) as e:
            list(router.stream(req))
        assert e.value.retry_after_s == 3.0 and "waiting" in str(e.value)
    finally:
        for server in servers:
            server.stop(0)


def test_http_request_threads_are_reused_one_per_request_in_flight_and_end_when_idle():
    import threading
    import time

    from hybridcache.services.api.http import _Workers

    workers = _Workers()
    workers.IDLE_S = 0.3

    def wait_for(cond, timeout_s=5.0):
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.005)

    # one request after another: the same thread runs them all
    ran = []
    for _ in range(3):
        workers.submit(lambda: ran.append(threading.get_ident()))
        wait_for(lambda: workers._idle == 1)
    assert len(ran) == 3 and len(set(ran)) == 1
    # requests in flight together each get a thread (none waits for another to end)
    release, started = threading.Event(), []
    for _ in range(3):
        workers.submit(lambda: (started.append(threading.get_ident()), release.wait(5)))
    wait_for(lambda: len(started) == 3)
    assert len(set(started)) == 3
    release.set()
    wait_for(lambda: workers._idle == 3)
    # idle threads end; a later request starts one again
    alive = [t for t in threading.enumerate() if t.name == "http-request"]
    wait_for(lambda: workers._idle == 0 and not any(t.is_alive() for t in alive))
    done = threading.Event()
    workers.submit(done.set)
    assert done.wait(5)


def test_http_request_parsed_is_handed_to_the_event_loop_once_sent_or_with_its_first_item():
    """_Run.work: the handler gets the parsed request when the stream says it went to a combine
    worker (before its first chunk), or else with the stream's first item or error, once."""
    import asyncio
    import threading

    from hybridcache.services.api.http import _Run

    async def run_one(stream):
        run = _Run(asyncio.get_running_loop())
        threading.Thread(target=run.work, args=(lambda: "parsed", stream), daemon=True).start()
        parsed = await asyncio.wait_for(run.parsed, 5)
        items = []
        try:
            async for item in run.chunks():
                items.append(item)
        except RuntimeError as e:
            items.append(f"raised {e}")
        return parsed, items

    seen, gate = [], threading.Event()

    def sends(parsed, control, sent, direct):
        seen.append(parsed)
        sent()
        sent()  # once only
        assert gate.wait(5)  # the handler has the request before the first chunk
        yield "a"
        yield "b"

    async def first_case():
        run = _Run(asyncio.get_running_loop())
        threading.Thread(target=run.work, args=(lambda: "parsed", sends), daemon=True).start()
        parsed = await asyncio.wait_for(run.parsed, 5)  # the stream still waits for the gate
        gate.set()
        return parsed, [item async for item in run.chunks()]

    assert asyncio.run(first_case()) == ("parsed", ["a", "b"])
    assert seen == ["parsed"]

    def fails(parsed, control, sent, direct):
        raise RuntimeError("no combine worker")
        yield

    def never_says(parsed, control, sent, direct):
        yield "a"

    assert asyncio.run(run_one(fails)) == ("parsed", ["raised no combine worker"])
    assert asyncio.run(run_one(never_says)) == ("parsed", ["a"])


def test_a_process_keeps_its_last_spans_only():
    """The in-memory span exporter is bounded: a serving process does not keep every request's
    spans for as long as it runs."""
    from hybridcache.services.observability import tracing
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()  # the process's exporter, without setting the global provider
    provider.add_span_processor(SimpleSpanProcessor(tracing._memory))
    tracer = provider.get_tracer("test")
    for n in range(tracing.KEPT_SPANS + 40):
        with tracer.start_as_current_span(f"span-{n}"):
            pass
    spans = tracing.finished_spans()
    assert len(spans) == tracing.KEPT_SPANS
    assert spans[-1].name == f"span-{tracing.KEPT_SPANS + 39}"


def test_free_port_stays_out_of_the_ephemeral_range_and_skips_reserved_ports(monkeypatch):
    import socket

    from hybridcache.services import launcher

    low = launcher._ephemeral_low()
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    if low - launcher._PORT_FLOOR >= 1000:
        assert all(launcher._PORT_FLOOR <= p < low for p in ports), ports
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    # in a window of 1000 ports with all but one reserved (a port the caller chose, as up --port
    # is), that one is the port handed out
    monkeypatch.setattr(launcher, "_HANDED_OUT", set())
    monkeypatch.setattr(launcher, "_PORT_FLOOR", 21000)
    monkeypatch.setattr(launcher, "_ephemeral_low", lambda: 22000)
    left = next(p for p in range(21500, 22000) if launcher._bindable(p))
    for p in range(21000, 22000):
        if p != left:
            launcher.reserve_port(p)
    assert launcher.free_port() == left


def test_gc_pauses_are_timed_and_exported():
    import gc

    from hybridcache.services.observability import metrics

    pauses = metrics.watch_gc()
    assert metrics.watch_gc() is pauses and gc.callbacks.count(pauses) == 1  # installed once
    junk = [[i] for i in range(200_000)]  # something for a full collection to walk
    gc.disable()  # no automatic collection (this thread's or another's allocations) between the reads
    try:
        before = pauses.counters()
        count_before = metrics.GC_PAUSE.labels(generation="2")._sum.get()
        gc.collect()
        after = pauses.counters()
    finally:
        gc.enable()
    del junk
    assert after["gc_collections"] == before["gc_collections"] + 1
    assert after["gc_pause_ms"] > before["gc_pause_ms"]
    assert metrics.GC_PAUSE.labels(generation="2")._sum.get() > count_before
    assert b'hybridcache_gc_pause_seconds_bucket{generation="2"' in metrics.scrape()


def test_scheduler_steps_go_into_their_histogram_by_kind():
    from hybridcache.services.observability import metrics

    h = metrics.SCHEDULER_STEP.labels(kind="mixed")
    before = h._sum.get()
    metrics.scheduler_step("mixed", 0.0123)
    assert h._sum.get() == pytest.approx(before + 0.0123)
    text = metrics.scrape()
    assert b'hybridcache_scheduler_step_seconds_bucket{kind="mixed",le="0.0125"}' in text


def test_request_counters_carry_the_graph_cache_counts():
    from types import SimpleNamespace

    from hybridcache.services.combine.worker import request_counters
    from hybridcache.services.runtime.cache.memory import MemoryEntryStore
    from hybridcache.services.runtime.graphs import LayoutGraphs
    from hybridcache.services.runtime.runner import ModelRunner

    runner = ModelRunner(SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=64)))
    store = MemoryEntryStore(1 << 20)
    plain = request_counters("cpu", store, runner)
    assert set(plain) == {"entry_evictions", "gc_collections", "gc_pause_ms"}
    runner.layout_graphs = LayoutGraphs(runner.model)
    runner.layout_graphs.stats.update(captures=2, replays=5, eager=1)
    got = request_counters("cpu", store, runner)
    assert {k: got[k] for k in ("graph_captures", "graph_replays", "graph_eager", "graph_failures")} == {
        "graph_captures": 2, "graph_replays": 5, "graph_eager": 1, "graph_failures": 0}


def test_streamed_events_encode_what_json_would_and_fall_back_where_orjson_refuses():
    """Server-sent events are encoded by orjson; each parses back to its payload (ints, text with
    non-ASCII, numpy scalars, int keys as json.dumps writes them), and a payload orjson refuses (a
    lone surrogate in a str, an int past 64 bits) is encoded by json.dumps instead of failing."""
    import json

    import numpy as np
    from hybridcache.services.api.http import _events_bytes

    payloads = [{"text": "héllo ✓", "output_ids": list(range(1000)), "meta_info": {"n": np.int64(7)}},
                {"top": {3: -0.5}}, {"text": "a \ud800 b"}, {"big": 2**70}]
    data = _events_bytes(payloads)
    events = [e for e in data.split(b"\n\n") if e]
    assert len(events) == len(payloads) and all(e.startswith(b"data: ") for e in events)
    decoded = [json.loads(e[6:]) for e in events]
    assert decoded[0] == {"text": "héllo ✓", "output_ids": list(range(1000)), "meta_info": {"n": 7}}
    assert decoded[1] == {"top": {"3": -0.5}}
    assert decoded[2] == {"text": "a \ud800 b"} and decoded[3] == {"big": 2**70}
    assert _events_bytes(None) == b"" and _events_bytes({"a": 1}) == b'data: {"a":1}\n\n'


def test_mailbox_coalesces_wake_ups_keeps_each_thread_s_order_and_survives_a_failing_call():
    """_Mailbox: calls posted from threads run in the loop, each thread's in its order; posts made
    before the loop ran the first wake-up share it; one call's exception does not drop the rest; a
    post to a closed loop is dropped, not raised."""
    import asyncio
    import threading

    from hybridcache.services.api.http import _Mailbox

    loop = asyncio.new_event_loop()
    box = _Mailbox.of(loop)
    assert _Mailbox.of(loop) is box
    wakes = []
    real = loop.call_soon_threadsafe

    def counting(fn, *args):
        wakes.append(fn)
        return real(fn, *args)

    loop.call_soon_threadsafe = counting
    got = []

    def boom():
        raise RuntimeError("one call fails")

    def post(k):
        for i in range(50):
            box.post(got.append, (k, i))
        box.post(boom)

    threads = [threading.Thread(target=post, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loop.run_until_complete(asyncio.sleep(0.01))
    assert len(got) == 200
    for k in range(4):
        assert [i for kk, i in got if kk == k] == list(range(50))
    assert len(wakes) == 1  # the loop had not run: every post after the first shared its wake-up
    loop.close()
    box.post(got.append, ("late", 0))  # no error, nothing runs
    assert len(got) == 200
