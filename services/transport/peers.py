"""The Endpoints of scatter workers, as each describes itself (Scatter.Describe), asked once per
address: the combine worker compares them with its own (a scatter worker on its GPU is not sent
work), the router derives from them the path a scatter-built entry takes to the combine worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.security import internal_channel
from hybridcache.services.transport import Endpoint

PEER_RETRY_S = 10.0  # a scatter worker that did not answer Describe is asked again after this


class ScatterEndpoints:
    """address -> Endpoint of the scatter worker there (`get`): asked once and kept; None for one
    that cannot describe itself (UNIMPLEMENTED, kept too), or, for PEER_RETRY_S, one that did not
    answer."""

    def __init__(self, timeout_s: float = 1.0):
        self.timeout_s = timeout_s
        self.known: dict[str, Endpoint | None] = {}
        self.retry_at: dict[str, float] = {}  # address that did not answer -> when to ask again

    def get(self, address: str, retry_now: bool = False) -> Endpoint | None:
        """The Endpoint of the scatter worker at `address`; `retry_now`: ask one that did not
        answer again now (the background watch), not after PEER_RETRY_S (a request's path)."""
        if address in self.known:
            return self.known[address]
        if not retry_now and time.monotonic() < self.retry_at.get(address, 0.0):
            return None
        channel = internal_channel(address)
        try:
            endpoint = Endpoint.from_pb(rpc.ScatterStub(channel).Describe(pb.InfoRequest(), timeout=self.timeout_s))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                self.retry_at[address] = time.monotonic() + PEER_RETRY_S
                return None
            endpoint = None
        finally:
            channel.close()
        self.known[address] = endpoint
        return endpoint

    def watch(self, members: Callable[[], list[str]], stop: threading.Event, every_s: float = 2.0,
              unknown_every_s: float = 0.1) -> threading.Thread:
        """Ask each address `members()` lists, now and every `every_s` until `stop` is set, on a
        daemon thread: the Endpoints are known before the first request that needs them (a
        Describe on a request's path costs it a channel's set-up, ~30 ms on an H200 host). A
        member that has not answered yet (a scatter worker listed before it serves: it warms up
        first) is asked again every `unknown_every_s`, here and not on a request's path."""

        def run():
            while True:
                pending = False
                try:
                    for address in members():
                        self.get(address, retry_now=True)
                        pending |= address not in self.known
                except Exception:  # noqa: BLE001 - a directory that cannot be read now is read again later
                    pass
                if stop.wait(unknown_every_s if pending else every_s):
                    return

        thread = threading.Thread(target=run, name="scatter-endpoints", daemon=True)
        thread.start()
        return thread
