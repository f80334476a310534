"""The router's end of a combine worker's Tokens stream (services/combine/tokens.py): one stream
per combine worker carries the chunks of every request this router sent it, a scheduler step's
in one message; a reader thread hands each chunk to its request's inbox.

A request is registered before its Generate call goes out (no chunk can come before its inbox
exists); the call's end is put in the inbox too, so that a worker that fails a request without a
last chunk, or a deadline, still ends it. When the stream itself ends (the worker went away), every
request registered on it fails; the next request subscribes again.
"""

from __future__ import annotations

import collections
import logging
import threading
import uuid

import grpc
from hybridcache.services.protocol import pb

log = logging.getLogger("hybridcache.router")

# how long a first request waits for a worker to register its subscription
SUBSCRIBE_TIMEOUT_S = 10.0


class Unreachable(Exception):
    """The worker refused or failed a new Tokens stream (its status code): it is down, not old."""

    def __init__(self, code: grpc.StatusCode):
        super().__init__(code.name)
        self.code = code


class StreamEnded:
    """An inbox item: the Tokens stream its request was on ended (the worker failed or went away)."""

    def __init__(self, code: grpc.StatusCode | None):
        self.code = code


class CallEnded:
    """An inbox item: the request's Generate call ended (its code, details and trailers say how)."""

    def __init__(self, call):
        self.code = call.code()
        self.details = call.details()
        self.trailers = dict(call.trailing_metadata() or ())


class Inbox:
    """One request's chunks and ends, read by the thread that relays the request. Once that thread
    has handed it a sink (go_direct), a token chunk that ends nothing (not done, closed nor an
    error) goes to the sink in the thread that puts it (the Tokens stream's reader) instead of
    waking the relaying thread; everything else still comes to get()."""

    __slots__ = ("subscriber", "_q", "_cv", "_sink")

    def __init__(self, subscriber: str):
        self.subscriber = subscriber
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._sink = None

    def put(self, item) -> None:
        with self._cv:
            sink = self._sink
            if sink is None or not _passes(item):
                self._q.append(item)
                self._cv.notify()
                return
        sink(item)

    def get(self):
        with self._cv:
            while not self._q:
                self._cv.wait()
            return self._q.popleft()

    def go_direct(self, sink) -> bool:
        """Send passing chunks to sink(chunk) from now on, when nothing is queued (True); False
        when something is (it must be read first, or it would come after later chunks)."""
        with self._cv:
            if self._q:
                return False
            self._sink = sink
            return True


def _passes(item) -> bool:
    """A token chunk that ends nothing: what an inbox may hand straight to its sink."""
    return isinstance(item, pb.TokenChunk) and not (item.done or item.closed or item.error)


class TokenMux:
    """The Tokens stream of one combine worker (subscribed on first use, again after it ends)."""

    def __init__(self, stub, address: str):
        self.stub = stub
        self.address = address
        self._lock = threading.Lock()
        self._subscriber: str | None = None
        self._call = None
        self._unsupported = False
        self._inboxes: dict[str, Inbox] = {}

    def subscribe(self) -> str | None:
        """The subscriber id of a live stream to this worker (opened now if there is none); None when
        the worker does not answer one (requests then stream one by one). Raises Unreachable when
        the worker failed the stream (a request to it would fail alike)."""
        with self._lock:
            if self._subscriber is not None or self._unsupported:
                return self._subscriber
            sub = uuid.uuid4().hex
            call = self.stub.Tokens(pb.TokensRequest(subscriber=sub))
            ready = threading.Event()
            threading.Thread(target=self._read, args=(sub, call, ready), name=f"tokens-{self.address}",
                             daemon=True).start()
            if not ready.wait(SUBSCRIBE_TIMEOUT_S) or not call.running():
                call.cancel()
                code = call.code() if call.done() else None
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    self._unsupported = True
                elif code is not None and code != grpc.StatusCode.CANCELLED:
                    raise Unreachable(code)
                return None
            self._subscriber, self._call = sub, call
            return sub

    def lost(self, subscriber: str) -> None:
        """The worker does not know `subscriber` (it restarted): subscribe again on next use."""
        with self._lock:
            if self._subscriber == subscriber:
                call, self._subscriber, self._call = self._call, None, None
                call.cancel()

    def register(self, request_id: str, subscriber: str) -> Inbox:
        inbox = Inbox(subscriber)
        self._inboxes[request_id] = inbox
        return inbox

    def unregister(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)

    def _read(self, sub: str, call, ready: threading.Event) -> None:
        code = None
        try:
            for batch in call:
                ready.set()
                inboxes = self._inboxes
                for chunk in batch.chunks:
                    inbox = inboxes.get(chunk.request_id)
                    if inbox is not None:
                        inbox.put(chunk)
        except grpc.RpcError as e:
            code = e.code()
        finally:
            ready.set()
            with self._lock:
                if self._subscriber == sub:
                    self._subscriber = self._call = None
            if code is not None and code != grpc.StatusCode.CANCELLED:
                log.warning("token stream of combine worker %s ended: %s", self.address, code.name)
            for inbox in list(self._inboxes.values()):
                if inbox.subscriber == sub:
                    inbox.put(StreamEnded(code))
