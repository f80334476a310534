"""Scatter worker: prefills cold segments standalone into entries and streams each one back as
soon as its build completes, over the transport its Endpoint and the receiver's pick (CUDA IPC,
shared memory or inline gRPC, services/transport/); writes every entry to the cache tier.

The write to the cache tier (a copy of the entry to the host, its seal over the host bytes and the
gRPC Put) is queued once the call's stream is sent, and done by a thread of its own that defers to
the worker's requests: it writes an entry only while no Prefill call is streaming, no segment waits
to be built and no build runs, or once the entry has waited `tier_write_defer_s` (so that under a
steady load the entries still reach the tier and the queue holds a bounded time's worth of them).
Its device-to-host copies run on a stream of their own, after the entry's build (its `cuda_ready`
event), not on the stream the builds run on.

One builder thread runs the model. Segments of every Prefill call wait in one queue; each build
takes the oldest ones, across calls, up to `max_batch_tokens` of them (at least one segment), and
prefills them in one batched call (Engine.build_entries), the same segment asked by several
calls built once. Requests arriving together are thus built together, and a call whose segments
span several builds streams the first entries while the rest are computed. Entries leave the
builder unsealed: a host transport seals an entry as it encodes it, cuda_ipc seals its device
block's checksum instead, so an entry that stays on the GPU is never copied to the host for it.

A worker split over tensor-parallel ranks builds each entry on all of them (every rank its heads)
and rank 0 collects the ranks' slices into one bundle (tensor_parallel/entries.py), which is what
it streams and writes to the tier: the combine worker's rank r gets rank r's slice.

Over cuda_ipc the entries are written into this worker's arena (services/transport/ipc_pool.py:
one device buffer per GPU, `arena_bytes`, exported once per receiving process), so that a
combine worker maps it once and later requests open no IPC handle."""

from __future__ import annotations

import collections
import logging
import os
import queue
import random
import threading
import time
from dataclasses import dataclass, replace

import grpc
from hybridcache.services.cache_tier.client import CacheTierClient
from hybridcache.services.observability import metrics, tracing
from hybridcache.services.observability.stats import warmup_requests
from hybridcache.services.protocol import pb, rpc, segment, unpack_ids
from hybridcache.services.runtime.engine import Engine
from hybridcache.services.runtime.llm import LLM, warmup_scheduling
from hybridcache.services.runtime.plan import salted_key
from hybridcache.services.runtime.sequence import LinearSpan
from hybridcache.services.transport import Endpoint, checksum, choose_transport, get_transport, local_endpoint
from hybridcache.services.transport.codec import (
    ATTN_FIELDS,
    LINEAR_FIELDS,
    LayeredEntry,
    entry_chunks,
    entry_to,
    layer_blocks,
    layer_tensors,
)
from hybridcache.services.transport.ipc_pool import ArenaPool

log = logging.getLogger("hybridcache.scatter")

# Fault injection for the tests only: exit the process after streaming this many entries.
FAULT_EXIT_AFTER = int(os.environ.get("HYBRIDCACHE_FAULT_EXIT_AFTER_ENTRIES", "0"))


def _ready_event(engine: Engine):
    """A CUDA event recorded after the work queued so far (the batch just built) on a CUDA
    engine, None otherwise: a device transport packs the batch's entries once it has passed,
    without waiting for the next batch queued behind it."""
    import torch

    if engine.model.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


@dataclass(slots=True)
class _Job:
    """One segment of one Prefill call; its result goes to the call's queue."""

    segment: pb.Segment
    out: queue.Queue  # ("entry", segment index, entry or None, error), ("layers", ...), ("reset", index)
    ctx: object  # the call's trace context
    call: dict  # {"cancelled": bool}, shared by the call's jobs


DEFAULT_ARENA_BYTES = 512 << 20
TIER_WRITE_DEFER_S = 2.0  # the longest a built entry waits for an idle worker before it is written to the tier


class ScatterServicer(rpc.ScatterServicer):
    def __init__(self, engine: Engine, max_batch_tokens: int, arena_bytes: int = DEFAULT_ARENA_BYTES,
                 tier_write_defer_s: float = TIER_WRITE_DEFER_S, members=None):
        """members(role): the deployment's members of a role (its directory); a Prefill naming a cache
        tier that is none of them is refused (None: any address, for a worker used in-process)."""
        self.engine = engine
        self._members = members
        self.max_batch_tokens = max_batch_tokens
        self._pending: collections.deque[_Job] = collections.deque()
        self._cv = threading.Condition()
        self._tiers: dict[str, CacheTierClient] = {}
        self.streamed = 0
        self.builds: list[int] = []  # segments per batched build, in order
        self.endpoint = local_endpoint(engine.model.device)
        # the tensor-parallel group of a worker split over ranks (its engine is rank 0's, over the ranks' runners)
        self.group = engine.group if engine.config.tensor_parallel_size > 1 else None
        # cuda_ipc's arenas (0: none, a fresh buffer exported per layer batch)
        self.arenas = ArenaPool(arena_bytes, owner=self.endpoint.process) if arena_bytes > 0 else None
        self._streaming = 0  # Prefill calls whose streams are open
        self._building = False  # a build is running
        # (tier, entry, when queued): written by the tier writer once the worker is idle
        self.tier_write_defer_s = tier_write_defer_s
        self._tier_writes: queue.Queue = queue.Queue()
        self._tier_stream = None  # the tier writer's CUDA stream (made on its first device entry)
        self.tier_writes = 0  # entries handed to a cache tier
        self.tier_writes_deferred = 0  # of those, written while the worker was busy (their wait ran out)
        threading.Thread(target=self._loop, name="scatter-build", daemon=True).start()
        threading.Thread(target=self._tier_writer, name="scatter-tier-write", daemon=True).start()

    def warmup(self) -> dict:
        """The engine's warm-up (Engine.warmup) through a scheduler made for it alone (one request
        at a time, K/V for the longest; dropped after), then the cold builds of its shaped requests'
        segments through this worker's builder, in the batches it makes of them (max_batch_tokens),
        so that a first request of that shape finds every build shape done before."""
        with LLM(self.engine, warmup_scheduling(self.engine)) as llm:
            out = self.engine.warmup(run=warmup_requests(llm.scheduler.generate))
        checksum.warm(self.engine.model.device)  # the checksum kernels of the entries it sends
        shape = self.engine.warmup_shape()
        if shape is not None:
            _, n, length, _ = shape
            gen = random.Random(0)
            vocab = self.engine.cfg.vocab_size
            done: queue.Queue = queue.Queue()
            call = {"cancelled": False}
            with self._cv:
                self._pending.extend(
                    _Job(segment(i, [gen.randrange(vocab) for _ in range(length)]), done, None, call)
                    for i in range(n))
                self._cv.notify()
            for _ in range(n):
                done.get()
            out["builds"] = list(self.builds)
            self.builds.clear()  # what requests build is counted from here
        return out

    def transport_for(self, request) -> str:
        """The receiver's Endpoint decides with this worker's (choose_transport); without one, the
        receiver's choice by address, shm or grpc."""
        if request.HasField("receiver"):
            return choose_transport(self.endpoint, Endpoint.from_pb(request.receiver))
        return request.transport if request.transport in ("grpc", "shm") else "grpc"

    def Describe(self, request, context):
        """This worker's Endpoint: a combine worker on the same GPU builds what it would ask here itself."""
        return self.endpoint.to_msg()

    def _transport(self, name: str, request):
        if name != "cuda_ipc":
            return get_transport(name)
        return get_transport(name, pool=self.arenas, receiver=request.receiver.process)

    def _tier(self, address: str) -> CacheTierClient:
        if address not in self._tiers:
            self._tiers[address] = CacheTierClient(address)
        return self._tiers[address]

    def _take(self) -> list[_Job]:
        """The oldest pending jobs of calls still open, up to the token budget (at least one)."""
        with self._cv:
            while True:
                while self._pending and self._pending[0].call["cancelled"]:
                    self._pending.popleft()
                if self._pending:
                    break
                self._cv.wait()
            jobs, tokens, seen = [], 0, set()
            while self._pending:
                job = self._pending[0]
                ids = job.segment.ids  # packed: hashable as it is
                # a segment already in the batch (asked by another call) costs nothing more
                n = 0 if ids in seen else len(ids) // 4
                if job.call["cancelled"]:
                    self._pending.popleft()
                    continue
                if jobs and tokens + n > self.max_batch_tokens:
                    break
                jobs.append(self._pending.popleft())
                seen.add(ids)
                tokens += n
            return jobs

    def _loop(self) -> None:
        while True:
            jobs = self._take()
            self._building = True
            try:
                self._build(jobs)
            finally:
                self._building = False

    def busy(self) -> bool:
        """Is a Prefill call streaming, a segment waiting to be built, or a build running?"""
        return bool(self._streaming or self._pending or self._building)

    def _tier_writer(self) -> None:
        """Write the queued entries to their cache tiers, one at a time, each once the worker is
        idle (busy() polled) or it has waited tier_write_defer_s."""
        while True:
            tier, entry, queued = self._tier_writes.get()
            deadline = queued + self.tier_write_defer_s
            while self.busy() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.tier_writes_deferred += self.busy()
            try:
                self._tier(tier).put([self._on_host(entry)])
            except Exception:  # noqa: BLE001 - the tier is a cache: an entry not written is rebuilt
                log.warning("writing an entry to the cache tier %s failed", tier, exc_info=True)
            self.tier_writes += 1
            del entry

    def _on_host(self, entry):
        """The entry copied to the host (what the tier is sent and sealed over), on the tier
        writer's CUDA stream after the entry's build, so that it neither waits behind nor delays
        the builds queued on the default stream."""
        import torch

        dev = self.engine.model.device
        if dev.type != "cuda" or all(t.device.type == "cpu" for _, _, t in layer_tensors(entry.data)):
            return entry_to(entry, "cpu")
        if self._tier_stream is None:
            self._tier_stream = torch.cuda.Stream(dev)
        ready = entry.meta.get("cuda_ready")
        if ready is not None:
            self._tier_stream.wait_event(ready)
        else:
            self._tier_stream.wait_stream(torch.cuda.default_stream(dev))
        with torch.cuda.stream(self._tier_stream):
            return entry_to(entry, "cpu")  # .to("cpu") waits for its copy: done when it returns

    def _build(self, jobs: list[_Job]) -> None:
        # One batched standalone prefill; if it fails, segment by segment, so that a bad segment
        # costs only its own entry. Calls that take layers (cuda_ipc) get each layer of the batch
        # as soon as it is computed, ("layers", layer, [(segment index, span)], ready event).
        by_ids: dict[bytes, list[_Job]] = {}  # packed token ids -> the jobs asking for that segment
        for job in jobs:
            by_ids.setdefault(job.segment.ids, []).append(job)
        groups = list(by_ids.values())
        on_layer = None
        if any(job.call.get("layers") for job in jobs):
            def on_layer(indices, layer, spans):
                # one item per call with all of its segments of this layer: sent as ranges of
                # one device buffer (codec.layer_blocks)
                ready = _ready_event(self.engine)
                per_call: dict[int, tuple[queue.Queue, list]] = {}
                for k, span in zip(indices, spans):
                    for job in groups[k]:
                        if job.call.get("layers"):
                            per_call.setdefault(id(job.out), (job.out, []))[1].append((job.segment.index, span))
                for out, spans_of in per_call.values():
                    out.put(("layers", layer, spans_of, ready))
        try:
            with tracing.tracer().start_as_current_span("scatter.build_entries", context=jobs[0].ctx) as span:
                span.set_attribute("hybridcache.segments", len(by_ids))
                segments = [unpack_ids(ids) for ids in by_ids]
                entries = (self.engine.build_entries(segments, on_layer=on_layer) if on_layer is not None
                           else self.engine.build_entries(segments))
                entries = self._bundled(entries)
            ready = _ready_event(self.engine)
            self.builds.append(len(by_ids))
            for js, entry in zip(groups, entries):
                metrics.ENTRY_BUILD_SECONDS.observe(entry.build_seconds)
                if ready is not None:
                    entry.meta["cuda_ready"] = ready
                for job in js:
                    job.out.put(("entry", job.segment.index, entry, ""))
            return
        except Exception:  # noqa: BLE001 - retried per segment below, which reports the error
            for job in jobs:
                if job.call.get("layers"):
                    job.out.put(("reset", job.segment.index))  # its layers sent so far do not count
        for ids, js in by_ids.items():
            try:
                with tracing.tracer().start_as_current_span("scatter.build_entry", context=js[0].ctx):
                    entry = self._bundled([self.engine.build_entry(unpack_ids(ids))])[0]
                metrics.ENTRY_BUILD_SECONDS.observe(entry.build_seconds)
                result = (entry, "")
            except Exception as e:  # a bad segment must not take the stream down
                result = (None, f"{type(e).__name__}: {e}")
            for job in js:
                job.out.put(("entry", job.segment.index, *result))

    def _bundled(self, entries: list) -> list:
        """The entries as they leave this worker: on one rank as built, over tensor-parallel
        ranks every rank's slice of each in one bundle."""
        if self.group is None:
            return entries
        from hybridcache.services.runtime.tensor_parallel.entries import gather_entries

        return gather_entries(self.group, entries)

    def Prefill(self, request, context):
        """Stream the entries of the request's segments: over cuda_ipc each layer of a batch as
        soon as it is computed (codec.LayeredEntry: header, a device block per layer, then the
        seal once the entry is whole; the batch's segments of one layer are ranges of one
        exported buffer), over the host transports each entry once built."""
        with self._cv:
            self._streaming += 1
        try:
            yield from self._prefill(request, context)
        finally:
            with self._cv:
                self._streaming -= 1

    def _prefill(self, request, context):
        tiers = {seg.cache_tier or request.cache_tier for seg in request.segments} - {""}
        if self._members is not None and not tiers <= set(self._members("cache-tier")):
            # entries go only to the deployment's own tiers: an address from elsewhere is never dialled
            bad = sorted(tiers - set(self._members("cache-tier")))[0]
            log.warning("Prefill refused: cache tier %s is not a member of this deployment", bad)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"cache tier {bad} is not a member of this deployment")
        ctx = tracing.incoming_context(context)
        built: queue.Queue = queue.Queue()
        name = self.transport_for(request)
        call = {"cancelled": False, "layers": name == "cuda_ipc" and self.engine.streams_layers}
        # A call that ends early (the combine worker went away) leaves its unbuilt segments unbuilt.
        if not context.add_callback(lambda: call.update(cancelled=True)):
            call["cancelled"] = True
        with self._cv:
            self._pending.extend(_Job(seg, built, ctx, call) for seg in request.segments)
            self._cv.notify()
        transport = self._transport(name, request)
        entries: dict[str, list] = {}  # cache-tier member -> entries it owns
        owner = {seg.index: seg.cache_tier or request.cache_tier for seg in request.segments}
        tokens = {seg.index: unpack_ids(seg.ids) for seg in request.segments}
        salt = request.key_salt  # a salted request's entries go under its keys (built once for any salt)
        kinds = self.engine.cfg.layer_types
        n_tensors = sum(len(LINEAR_FIELDS) if k == "linear_attention" else len(ATTN_FIELDS) for k in kinds)
        layered: dict[int, LayeredEntry] = {}
        done = 0
        while done < len(request.segments):
            item = built.get()
            if item[0] == "layers":
                _, layer, spans_of, ready = item
                pairs = []
                for index, span in spans_of:
                    le = layered.get(index)
                    if le is None:
                        ids = tokens[index]
                        key = salted_key(self.engine.entry_key(ids), salt)
                        le = layered[index] = LayeredEntry(index, key, len(ids), self.engine.config.seam_window,
                                                           n_tensors, transport)
                        yield le.header()
                    fields = LINEAR_FIELDS if isinstance(span, LinearSpan) else ATTN_FIELDS
                    pairs.append((le, [(f, getattr(span, f)) for f in fields]))
                yield from layer_blocks(pairs, layer, transport, ready)
                continue
            if item[0] == "reset":
                layered.pop(item[1], None)
                continue
            _, index, entry, err = item
            done += 1
            if entry is not None and salt:
                entry = replace(entry, key=salted_key(entry.key, salt), checksum="")
            le = layered.pop(index, None)
            if entry is None:
                yield pb.EntryChunk(segment_index=index, error=err)
                continue
            if le is not None and len(le.parts) == len(kinds):
                yield le.seal(entry.build_seconds)
            else:  # not streamed, or not all of it: the whole entry (its header starts it over)
                yield from entry_chunks(entry, index, transport)
            if owner.get(index):
                entries.setdefault(owner[index], []).append(entry)
            self.streamed += 1
            if FAULT_EXIT_AFTER and self.streamed >= FAULT_EXIT_AFTER:
                time.sleep(0.05)
                os._exit(3)
        transport.close()
        metrics.BYTES_MOVED.labels(path=transport.name).inc(transport.bytes_moved())
        # Written after the stream, off the critical path of the request: queued for the tier
        # writer, which waits for the worker to be idle (the requests that came meanwhile streamed)
        now = time.monotonic()
        for tier, owned in entries.items():
            for entry in owned:
                self._tier_writes.put((tier, entry, now))
