"""The scatter worker's write-through of built entries to the cache tier: queued once a call's
stream is sent, written by its tier writer only while the worker is idle (no call streaming, no
segment waiting, no build), or once an entry has waited tier_write_defer_s; each entry goes to
the tier as host tensors, sealed there."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hybridcache.services.protocol import pb, segment
from hybridcache.services.scatter.worker import ScatterServicer
from hybridcache.services.transport.codec import layer_tensors


class _Context:
    def invocation_metadata(self):
        return ()

    def add_callback(self, fn):
        return True


class _Tier:
    """A cache tier client that records what it is given and whether the worker was busy then."""

    def __init__(self, servicer):
        self.servicer, self.puts, self.lock = servicer, [], threading.Lock()

    def put(self, entries, transport="grpc"):
        with self.lock:
            for e in entries:
                on_host = all(t.device.type == "cpu" for _, _, t in layer_tensors(e.data))
                self.puts.append((e.key, self.servicer.busy(), on_host))
        return len(entries)


@pytest.fixture
def scatter(engine, monkeypatch):
    def make(**kw):
        s = ScatterServicer(engine, max_batch_tokens=10_000, arena_bytes=0, **kw)
        s.transport_for = lambda request: "grpc"
        tier = _Tier(s)
        monkeypatch.setattr(s, "_tier", lambda address: tier)
        return s, tier
    return make


def _request(seed, n=3):
    rng = random.Random(seed)
    return pb.PrefillRequest(segments=[segment(i, [rng.randrange(5, 250) for _ in range(20 + 7 * i)])
                                       for i in range(n)], cache_tier="tier-a", transport="grpc")


def _keys(chunks):
    return [c.header.key for c in chunks if c.HasField("header")]


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_entries_are_written_to_the_tier_only_after_the_stream_was_sent(scatter):
    servicer, tier = scatter()
    chunks = []
    for chunk in servicer.Prefill(_request(1), _Context()):
        chunks.append(chunk)
        time.sleep(0.02)  # a writer started before the end of the stream would have written by now
        assert tier.puts == []
    assert _wait_for(lambda: len(tier.puts) == 3)
    assert [k for k, _, _ in tier.puts] == _keys(chunks)
    assert all(not busy and on_host for _, busy, on_host in tier.puts) and servicer.tier_writes_deferred == 0


def test_a_requests_write_through_waits_while_another_call_streams(scatter):
    servicer, tier = scatter()
    second = servicer.Prefill(_request(2), _Context())
    head = next(second)  # the second call is streaming (its first entry sent, the rest not yet)
    first = list(servicer.Prefill(_request(3), _Context()))
    time.sleep(0.3)
    assert tier.puts == [] and servicer.busy()  # the first call's entries wait for the second call
    rest = list(second)
    assert _wait_for(lambda: len(tier.puts) == 6)
    assert [k for k, _, _ in tier.puts] == _keys(first) + _keys([head, *rest])
    assert all(not busy for _, busy, _ in tier.puts)


def test_an_entry_is_written_once_its_wait_runs_out_even_when_the_worker_stays_busy(scatter):
    servicer, tier = scatter(tier_write_defer_s=0.2)
    second = servicer.Prefill(_request(4), _Context())
    next(second)
    t0 = time.monotonic()
    first = list(servicer.Prefill(_request(5), _Context()))
    assert _wait_for(lambda: len(tier.puts) == 3, timeout=5.0)
    assert time.monotonic() - t0 >= 0.2
    assert [k for k, _, _ in tier.puts] == _keys(first) and all(busy for _, busy, _ in tier.puts)
    assert servicer.tier_writes_deferred == 3
    second.close()  # the call ends (its client went away): the worker is idle again
    assert _wait_for(lambda: not servicer.busy())
