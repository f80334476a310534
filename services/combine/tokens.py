"""A combine worker's Tokens streams: every request of one subscriber (a router) on one stream.

Streamed request by request, a token costs a gRPC message, a wake-up of the request's handler
thread and its turn at the interpreter lock on this worker, and as much again on the router: at
128 streams that is more host time than a decode step of the GPU. A router instead subscribes once
(Combine.Tokens) and names its subscriber id in each CombineRequest; the scheduler's thread hands
each step's events of those requests to the subscriber's outbox (RequestHandle's listener, an
append), and the subscriber's stream sends everything ready in one TokenBatch: one message and
one wake-up a step, whatever the number of requests.

A request's own Generate call stays open while it runs: its admission (RESOURCE_EXHAUSTED), its
cancellation (the call's end) and its last chunk (stats or error, put on the outbox by its handler
after the scheduler has emitted every token) keep the per-request path's meaning.
"""

from __future__ import annotations

import collections
import threading
import time

from hybridcache.services.protocol import pb

# how often an idle stream checks that its subscriber is still there
POLL_S = 1.0


def add_logprob(chunk: pb.TokenChunk, handle, n: int) -> None:
    """Chunk of a request's n-th output token: its log-probability and top alternatives, when the
    request asks for them (handle.logprobs has the n-th)."""
    if n < len(handle.logprobs):
        lp, top = handle.logprobs[n]
        chunk.has_logprob, chunk.logprob = True, lp
        chunk.top_ids.extend(i for i, _ in top)
        chunk.top_logprobs.extend(v for _, v in top)


class Muxed:
    """One request's state on a subscriber's stream (the chunks' request id, how many tokens went)
    and the listener its RequestHandle hands the scheduler's events to."""

    __slots__ = ("request_id", "handle", "sent", "t_first", "listener")

    def __init__(self, request_id: str, listener):
        self.request_id = request_id
        self.handle = None  # set once the scheduler took the request
        self.sent = 0  # tokens sent (indexes handle.logprobs)
        self.t_first: float | None = None  # when its first token's batch left this worker
        self.listener = listener


class Subscriber:
    """The outbox of one Tokens stream: the scheduler's thread appends, the stream's thread drains."""

    def __init__(self, on_tokens=None):
        self._on_tokens = on_tokens  # on_tokens(n): n tokens sent (the worker's generation counter)
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._requests: dict[str, Muxed] = {}
        self.closed = False

    def attach(self, request_id: str) -> Muxed:
        """A request of this subscriber (its listener for the scheduler: Muxed.listener)."""

        def listener(handle, events) -> None:
            if events is not None:
                self._put((m, handle, events))

        m = Muxed(request_id, listener)
        with self._cv:
            self._requests[request_id] = m
        return m

    def detach(self, request_id: str) -> None:
        """A request attached but never admitted."""
        with self._cv:
            self._requests.pop(request_id, None)

    def put_chunk(self, m: Muxed, chunk: pb.TokenChunk) -> None:
        """A request's last chunk (done, an error, or closed), after all its tokens."""
        chunk.request_id = m.request_id
        self._put((m, None, chunk))

    def _put(self, item) -> None:
        with self._cv:
            self._items.append(item)
            if len(self._items) == 1:
                self._cv.notify()

    def close(self) -> list[Muxed]:
        """The stream ended: its requests still running (the caller cancels them)."""
        with self._cv:
            self.closed = True
            left = [m for m in self._requests.values() if m.handle is not None and not m.handle.done.is_set()]
            self._requests.clear()
            self._cv.notify_all()
        return left

    def batches(self, active):
        """TokenBatch messages while active() holds: the first empty (registered), then one for
        everything ready at once."""
        yield pb.TokenBatch()
        while True:
            with self._cv:
                while not self._items and not self.closed:
                    if not self._cv.wait(POLL_S) and not active():
                        return
                if self.closed:
                    return
                items, self._items = self._items, collections.deque()
            batch = pb.TokenBatch()
            now, tokens = time.perf_counter(), 0
            for m, handle, what in items:
                if handle is None:  # a last chunk
                    batch.chunks.append(what)
                    with self._cv:
                        self._requests.pop(m.request_id, None)
                    continue
                for tok, delta in what:
                    chunk = batch.chunks.add(request_id=m.request_id, token_id=tok, text=delta)
                    if tok >= 0:
                        add_logprob(chunk, handle, m.sent)
                        m.sent += 1
                        tokens += 1
                        if m.t_first is None:
                            m.t_first = now
            if tokens and self._on_tokens is not None:
                self._on_tokens(tokens)
            yield batch


class Subscriptions:
    """The worker's subscribers by id."""

    def __init__(self, on_tokens=None):
        self._on_tokens = on_tokens
        self._lock = threading.Lock()
        self._subs: dict[str, Subscriber] = {}

    def get(self, subscriber: str) -> Subscriber | None:
        with self._lock:
            return self._subs.get(subscriber)

    def stream(self, subscriber: str, context):
        """Combine.Tokens: this subscriber's batches until its caller goes away; then its requests
        still running are cancelled (their Generate calls end with the caller's channel as well)."""
        sub = Subscriber(self._on_tokens)
        with self._lock:
            old = self._subs.get(subscriber)
            self._subs[subscriber] = sub
        if old is not None:
            for m in old.close():
                m.handle.cancel()
        try:
            yield from sub.batches(context.is_active)
        finally:
            with self._lock:
                if self._subs.get(subscriber) is sub:
                    del self._subs[subscriber]
            for m in sub.close():
                m.handle.cancel()
