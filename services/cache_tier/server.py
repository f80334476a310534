"""Cache-tier service: Put/Get entry streams and Stat over gRPC; registers itself in the directory."""

from __future__ import annotations

import socket

from hybridcache.services.cache_tier.store import TierStore
from hybridcache.services.observability import metrics, tracing
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.transport import get_transport
from hybridcache.services.transport.codec import entry_chunks, read_entries


class CacheTierServicer(rpc.CacheTierServicer):
    def __init__(self, store: TierStore):
        self.store = store

    def _gauge(self):
        metrics.CACHE_BYTES.labels(tier="host").set(self.store.memory.used_bytes)
        metrics.CACHE_BYTES.labels(tier="disk").set(self.store._disk_used)

    def Put(self, request_iterator, context):
        with tracing.tracer().start_as_current_span("cache_tier.put", context=tracing.incoming_context(context)):
            stored = rejected = 0
            for _, entry, _err in read_entries(request_iterator):
                if entry is not None and self.store.put(entry):
                    stored += 1
                    metrics.BYTES_MOVED.labels(path="grpc").inc(entry.nbytes)
                else:
                    rejected += 1
            self._gauge()
            return pb.PutReply(stored=stored, rejected=rejected)

    def Get(self, request, context):
        with tracing.tracer().start_as_current_span("cache_tier.get", context=tracing.incoming_context(context)):
            name = request.transport or "grpc"
            transport = get_transport(name if name in ("grpc", "shm") else "grpc")
            for i, key in enumerate(request.keys):
                entry = self.store.get(key)
                metrics.cache_lookup("host", entry is not None)
                if entry is None:
                    yield pb.EntryChunk(segment_index=i, error="miss")
                    continue
                yield from entry_chunks(entry, i, transport)
            metrics.BYTES_MOVED.labels(path=transport.name).inc(transport.bytes_moved())
            self._gauge()

    def Stat(self, request, context):
        s = self.store
        present, nbytes = zip(*[s.contains(k) for k in request.keys]) if request.keys else ((), ())
        return pb.StatReply(present=present, nbytes=nbytes, used_bytes=s.memory.used_bytes,
                            capacity_bytes=s.memory.capacity_bytes, entries=len(s.memory), hits=s.hits,
                            misses=s.misses, corrupt=s.corrupt + s.memory.corrupt, evictions=s.memory.evictions,
                            disk_entries=s.disk_entries, host=socket.gethostname())
