"""Scatter worker: prefills cold segments standalone into entries and streams each one back,
layer by layer, while the next is being computed; writes every entry to the cache tier."""

from __future__ import annotations

import os
import queue
import threading
import time

from hybridcache.services.cache_tier.client import CacheTierClient
from hybridcache.services.observability import metrics, tracing
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.runtime.engine import Engine
from hybridcache.services.transport import get_transport
from hybridcache.services.transport.codec import entry_chunks

# Fault injection for the tests only: exit the process after streaming this many entries.
FAULT_EXIT_AFTER = int(os.environ.get("HYBRIDCACHE_FAULT_EXIT_AFTER_ENTRIES", "0"))


class ScatterServicer(rpc.ScatterServicer):
    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()  # one prefill at a time on the device
        self._tiers: dict[str, CacheTierClient] = {}
        self.streamed = 0

    def _tier(self, address: str) -> CacheTierClient:
        if address not in self._tiers:
            self._tiers[address] = CacheTierClient(address)
        return self._tiers[address]

    def _build(self, segments, out: queue.Queue, ctx) -> None:
        # All segments of the call in one batched standalone prefill (Engine.build_entries); if
        # the batch fails, one by one, so a bad segment costs only its own entry.
        try:
            with tracing.tracer().start_as_current_span("scatter.build_entries", context=ctx), self._lock:
                entries = self.engine.build_entries([list(seg.token_ids) for seg in segments])
            for seg, entry in zip(segments, entries):
                metrics.ENTRY_BUILD_SECONDS.observe(entry.build_seconds)
                out.put((seg.index, entry.seal(), ""))
            out.put(None)
            return
        except Exception:  # noqa: BLE001 - retried per segment below, which reports the error
            pass
        for seg in segments:
            try:
                with tracing.tracer().start_as_current_span("scatter.build_entry", context=ctx), self._lock:
                    entry = self.engine.build_entry(list(seg.token_ids)).seal()
                metrics.ENTRY_BUILD_SECONDS.observe(entry.build_seconds)
                out.put((seg.index, entry, ""))
            except Exception as e:  # a bad segment must not take the stream down
                out.put((seg.index, None, f"{type(e).__name__}: {e}"))
        out.put(None)

    def Prefill(self, request, context):
        ctx = tracing.incoming_context(context)
        built: queue.Queue = queue.Queue(maxsize=2)
        threading.Thread(target=self._build, args=(request.segments, built, ctx), daemon=True).start()
        transport = get_transport(request.transport if request.transport in ("grpc", "shm") else "grpc")
        entries: dict[str, list] = {}  # cache-tier member -> entries it owns
        owner = {seg.index: seg.cache_tier or request.cache_tier for seg in request.segments}
        while (item := built.get()) is not None:
            index, entry, err = item
            if entry is None:
                yield pb.EntryChunk(segment_index=index, error=err)
                continue
            yield from entry_chunks(entry, index, transport)
            if owner.get(index):
                entries.setdefault(owner[index], []).append(entry)
            self.streamed += 1
            if FAULT_EXIT_AFTER and self.streamed >= FAULT_EXIT_AFTER:
                time.sleep(0.05)
                os._exit(3)
        metrics.BYTES_MOVED.labels(path=transport.name).inc(transport.bytes_moved())
        # Written after the stream, off the critical path of the request.
        for tier, owned in entries.items():
            threading.Thread(target=self._tier(tier).put, args=(owned,), daemon=True).start()
