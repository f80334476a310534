"""Client side of the cache tier: stat, get and put entries on the member that owns each key."""

from __future__ import annotations

import logging

import grpc
from hybridcache.services.observability import metrics, tracing
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.runtime.cache import SegmentEntry
from hybridcache.services.security import internal_channel
from hybridcache.services.transport import get_transport
from hybridcache.services.transport.codec import EntryAssembler, entry_chunks

log = logging.getLogger("hybridcache.cache_tier")


class CacheTierClient:
    """One tier member. Every call fails soft: an unreachable tier is a miss, never an error."""

    def __init__(self, address: str, timeout_s: float = 10.0):
        self.address = address
        self.timeout = timeout_s
        self._channel = internal_channel(address)
        self._stub = rpc.CacheTierStub(self._channel)

    def stat(self, keys: list[str]) -> pb.StatReply | None:
        try:
            return self._stub.Stat(pb.StatRequest(keys=keys), timeout=self.timeout,
                                   metadata=tracing.outgoing_metadata())
        except grpc.RpcError as e:
            log.warning("cache tier %s stat failed: %s", self.address, e.code())
            return None

    def get(self, keys: list[str], transport: str = "grpc") -> dict[str, SegmentEntry]:
        """The entries found (seals verified); misses, corrupt or forged entries and errors are absent."""
        found: dict[str, SegmentEntry] = {}
        if not keys:
            return found
        asm = EntryAssembler()
        try:
            for chunk in self._stub.Get(pb.GetRequest(keys=keys, transport=transport), timeout=self.timeout,
                                        metadata=tracing.outgoing_metadata()):
                out = asm.feed(chunk)
                if out is not None and out[1] is not None and out[1].key == keys[out[0]]:
                    found[out[1].key] = out[1]
        except grpc.RpcError as e:
            log.warning("cache tier %s get failed: %s", self.address, e.code())
        metrics.BYTES_MOVED.labels(path=transport).inc(asm.bytes_received)
        return found

    def put(self, entries: list[SegmentEntry], transport: str = "grpc") -> int:
        """Entries stored by the tier (0 when it is unreachable)."""
        if not entries:
            return 0
        t = get_transport(transport)

        def chunks():
            for i, e in enumerate(entries):
                yield from entry_chunks(e, i, t)

        try:
            reply = self._stub.Put(chunks(), timeout=self.timeout, metadata=tracing.outgoing_metadata())
            return reply.stored
        except grpc.RpcError as e:
            log.warning("cache tier %s put failed: %s", self.address, e.code())
            return 0

    def close(self) -> None:
        self._channel.close()
