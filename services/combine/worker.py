"""Combine worker: gathers a request's entries (own cache -> cache tier -> scatter workers -> local
rebuild), hands it to the engine's Scheduler (continuous batching: its assembly interleaves with the
decode steps of the requests already running, all decoded as one batch) and streams its tokens
back. A full waiting queue answers RESOURCE_EXHAUSTED; an RPC that ends early (the client went
away) cancels its request, which the scheduler drops within one step.

What comes from elsewhere is checked before the engine sees it: a plan's entry keys are recomputed
from the segments' tokens (a key that differs is ignored), and an entry from the tier or a scatter
worker, whose seal the codec verified, must also have the model's entry layout (EntryLayout: the
shapes and dtypes this engine builds) for its segment's length; anything else is a miss, rebuilt.

A worker split over tensor-parallel ranks receives entries as bundles of every rank's slice
(tensor_parallel/entries.py) on rank 0, under keys of its tensor-parallel size: each slice must
have the layout of the entries this worker's ranks build, and slice r goes to rank r (one
point-to-point hand-over per request, TPGroup.scatter), where the engine folds it in. A bundle of
another split is a miss: its key differs, and its tensors do not cut into this worker's slices."""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
from hybridcache.services.cache_tier.client import CacheTierClient
from hybridcache.services.combine.tokens import Subscriptions, add_logprob
from hybridcache.services.observability import metrics, tracing
from hybridcache.services.observability.stats import StatsLog, stage, warmup_requests
from hybridcache.services.protocol import pb, rpc, segment, segment_array
from hybridcache.services.runtime.cache import EntryLayout, SegmentEntry
from hybridcache.services.runtime.cache.host_tier import is_host
from hybridcache.services.runtime.engine import Engine
from hybridcache.services.runtime.sampling import RequestError, warm_kernels
from hybridcache.services.runtime.scheduler import QueueFull, RequestHandle, Scheduler, SchedulerConfig
from hybridcache.services.security import internal_channel
from hybridcache.services.transport import Endpoint, checksum, local_endpoint, measure_bandwidths, transport_for_address
from hybridcache.services.transport.codec import EntryAssembler, entry_to
from hybridcache.services.transport.peers import ScatterEndpoints

log = logging.getLogger("hybridcache.combine")


def memory_counters(device, store) -> dict[str, int]:
    """This process's running counts of what costs a request time outside its kernels: CUDA
    allocations the caching allocator made on `device` (cudaMalloc: it had no cached block to
    give), its retries after a failed one (each frees the cached blocks, synchronising the
    device), and the entries the device entry cache `store` evicted (a tiered store moves them to
    host memory). A request's stats carry the difference over the request (other requests in
    flight count in it too)."""
    import torch

    out = {}
    dev = torch.device(device)
    if dev.type == "cuda":
        st = torch.cuda.memory_stats_as_nested_dict(dev)  # both counts are top-level: no flattening
        out["device_allocs"] = int(st.get("num_device_alloc", 0))
        out["alloc_retries"] = int(st.get("num_alloc_retries", 0))
    evictions = getattr(getattr(store, "device", store), "evictions", None)
    if isinstance(evictions, int):
        out["entry_evictions"] = evictions
    return out


def request_counters(device, store, runner) -> dict[str, float]:
    """memory_counters, the interpreter's collections (metrics.GC_PAUSES) and the counts of the
    runner's CUDA graphs of live passes (ModelRunner.graph_stats: shapes captured, replayed, run
    eagerly; a capture runs on the request that sees a shape for the capture_after-th time):
    running totals whose difference over a request its stats carry."""
    out: dict[str, float] = {**memory_counters(device, store), **metrics.GC_PAUSES.counters()}
    out.update({f"graph_{k}": v for k, v in runner.graph_stats.items()})
    if getattr(runner, "replay_graphs", None) is not None:  # suffix_replay restores' graphs
        out.update({f"replay_graph_{k}": v for k, v in runner.replay_graphs.stats.items()})
    return out


def prefill_on_scatter(address: str, segments: list[tuple[int, list[int], str]], cache_tier: str,
                       metadata=(), timeout_s: float = 120.0, receiver: Endpoint | None = None,
                       device="cpu", key_salt: str = "") -> tuple[dict[int, SegmentEntry], EntryAssembler]:
    """Ask one scatter worker for entries; returns those received whole (a dead worker yields
    what arrived before it died) and the assembler (bytes, transfer seconds and path). With
    `receiver` (this worker's Endpoint) the scatter worker picks the transport; entries of the
    device transports land on `device`. `key_salt`: the request's cache salt (its entries' keys)."""
    channel = internal_channel(address)
    got: dict[int, SegmentEntry] = {}
    asm = EntryAssembler(device)
    req = pb.PrefillRequest(segments=[segment(i, ids, cache_tier=t) for i, ids, t in segments],
                            cache_tier=cache_tier, transport=transport_for_address(address), key_salt=key_salt)
    if receiver is not None:
        receiver.to_pb(req.receiver)
    try:
        for chunk in rpc.ScatterStub(channel).Prefill(req, timeout=timeout_s, metadata=metadata):
            out = asm.feed(chunk)
            if out is not None and out[1] is not None:
                got[out[0]] = out[1]
    except grpc.RpcError as e:
        log.warning("scatter worker %s failed mid-request (%s); %d of %d entries arrived",
                    address, e.code(), len(got), len(segments))
    finally:
        asm.close()  # the sender's arena slots still held are released
        channel.close()
    metrics.BYTES_MOVED.labels(path=asm.transport or req.transport).inc(asm.bytes_received)
    return got, asm


class CombineServicer(rpc.CombineServicer):
    def __init__(self, engine: Engine, cache_tier: str = "", dtype: str = "float32",
                 scheduling: SchedulerConfig | None = None, members=None):
        """members(role): the deployment's members of a role (its directory): the only addresses this
        worker dials or names to a scatter worker (None: any, for a worker used in-process)."""
        self.engine = engine
        self._members = members
        # the worker's own entry cache: GPU memory on a CUDA worker, its process memory otherwise
        self.own_tier = "gpu" if engine.model.device.type == "cuda" else "worker"
        self.cache_tier = cache_tier
        self.dtype = dtype
        # What received entries must look like: the layout of one this engine builds of a short
        # probe segment (here, before the scheduler's thread owns the model).
        probe = [0] * (engine.config.seam_window + max(1, engine.cfg.linear_conv_kernel_dim - 1) + 1)
        self.layout = EntryLayout.of(engine.build_entry(probe))
        self.tp_size = engine.config.tensor_parallel_size
        # Every request runs through this scheduler; its thread alone runs the model.
        self.scheduler = Scheduler(engine, scheduling, on_finish=_count_finished,
                                   on_preempt=lambda _handle: metrics.SCHEDULER_PREEMPTIONS.inc(),
                                   on_step=metrics.scheduler_step)
        # the scheduler's load and memory as gauges (read at each scrape) and in the stats line
        self.stats = StatsLog(engine.config.stats_interval_s, self.gauges)
        self.subscriptions = Subscriptions(on_tokens=self.stats.generated)  # routers' Tokens streams
        metrics.watch_scheduler(engine.config.served_model_name or Path(getattr(engine.model, "path", "")).name,
                                self.scheduler.load, self.scheduler.kv_usage, self._entry_usage)
        self._tiers: dict[str, CacheTierClient] = {}
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="combine-fetch")
        self.prefill_tps = 0.0
        self.device = engine.model.device
        self.endpoint = local_endpoint(self.device)
        self._scatter_endpoints = ScatterEndpoints()  # scatter worker -> its Endpoint (Describe)
        self.scatter_same_gpu = engine.config.scatter_same_gpu
        self._no_device_path: set[str] = set()  # scatter workers whose CUDA IPC blocks could not be opened here
        self.transport_bandwidth = measure_bandwidths(self.device)

    def _entry_usage(self) -> float:
        entries = self.engine.entries
        return entries.used_bytes / max(entries.capacity_bytes, 1)

    def gauges(self) -> dict:
        """What the stats line states of the worker now (StatsLog)."""
        load = self.scheduler.load()
        return {"running": load["running"] + load["prefilling"], "waiting": load["waiting"],
                "kv_usage": self.scheduler.kv_usage(), "entry_usage": self._entry_usage(),
                "entry_bytes": self.engine.entries.used_bytes}

    def _accept(self, entry: SegmentEntry, segment: list[int]) -> SegmentEntry | list[SegmentEntry] | None:
        """A received entry (seal verified) if it has the model's layout for this segment, None
        otherwise; on tensor-parallel ranks the list of its rank slices, each of that layout."""
        slices = [entry]
        problem = None
        if self.tp_size > 1:
            from hybridcache.services.runtime.tensor_parallel.entries import unbundle

            slices = unbundle(entry, self.tp_size)
            if isinstance(slices, str):
                problem, slices = slices, []
        for part in slices:
            problem = problem or self.layout.check(part, len(segment))
        if problem is not None:
            metrics.ENTRIES_REJECTED.labels(reason="layout").inc()
            log.warning("entry %s refused: %s", entry.key[:12], problem)
            return None
        return slices if self.tp_size > 1 else entry

    def _hand_out(self, received: dict[str, list[SegmentEntry]]) -> dict[str, SegmentEntry]:
        """key -> rank 0's slice of each received entry, every rank given its own (its device)."""
        if not received:
            return {}
        from hybridcache.services.runtime.tensor_parallel.entries import scatter_entries
        from hybridcache.services.transport.codec import entry_to

        keys = list(received)
        slices = [[entry_to(received[k][0], self.device), *received[k][1:]] for k in keys]
        try:
            return dict(zip(keys, scatter_entries(self.engine.group, slices)))
        except Exception:  # noqa: BLE001 - every rank failed alike (else the group is broken): rebuilt
            log.warning("handing %d received entries to the ranks failed; they are rebuilt", len(keys),
                        exc_info=True)
            return {}

    def warmup(self) -> dict:
        """The engine's warm-up (Engine.warmup) with every request served by this worker's
        scheduler, the path its requests take (its per-step batches of cold builds, batched decode),
        then the decode CUDA graph of every batch size the scheduler may step (captured here, not
        while a batch of that size waits)."""
        import torch
        from hybridcache.services.devices import RequestPeaks

        cuda = self.engine.model.device.type == "cuda"
        run = warmup_requests(self.scheduler.generate)
        # on CUDA each request's transient peak above what it leaves held (its throwaway caches'
        # contents included in the latter): plan_memory's `transient`
        measured = RequestPeaks(run, self.engine.model.device) if cuda else None
        out = self.engine.warmup(run=measured or run)
        checksum.warm(self.engine.model.device)  # received device blocks' checksum kernels
        out["sampling_shapes"] = warm_kernels(self.engine.model.device, self.engine.cfg.vocab_size,
                                              self.scheduler.config.max_num_seqs)
        runner = self.engine.runner
        if getattr(runner, "gemv_plan", None):
            # the linear layers' plan on this GPU (ModelRunner._plan_linears): per weight shape
            out["linear_plan"] = {"column_major_layers": runner.column_major_layers,
                                  "seconds": runner.linear_plan_seconds, "shapes": runner.gemv_plan}
        if cuda:
            out["activation_peak_bytes"] = max(0, measured.transient)
            out["requests_peak_reserved_bytes"] = measured.peak
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            held = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        with stage("decode graphs of batch sizes up to %d", self.scheduler.config.max_num_seqs):
            out.update(self._capture_decode_graphs())
        out["decode_graphs_seconds"] = round(time.perf_counter() - t0, 3)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            out["decode_graphs_bytes"] = torch.cuda.memory_reserved() - held
        return out

    def _capture_decode_graphs(self) -> dict:
        """The scheduler's decode graphs held after capturing the missing ones now (those captured
        now besides), and how many its batch sizes and capture sets call for where decode graphs
        apply (fewer held: some size runs eagerly)."""
        from hybridcache.services.runtime.paged import decode_batch_sizes

        sets = self.engine.decode_capture_sets()
        captured = self.scheduler.warm_decode_graphs()
        expected = 0
        if self.engine.runner.decode_graphs_on:
            expected = len(decode_batch_sizes(self.scheduler.config.max_num_seqs)) * len(sets)
        held = self.engine.runner.decode_graphs_held(self.scheduler.pool, sets)
        return {"decode_graphs": held, "decode_graphs_captured_now": captured, "decode_graphs_expected": expected}

    def plan_memory(self, given, warmup: dict) -> dict:
        """Size this worker's caches from what its warm-up measured (devices.plan_memory, vLLM's
        determine_available_memory in kind): its share of the GPU (`given`: the worker's
        RuntimeConfig, budgets None where unset) less what it holds now (the weights, the running
        requests' linear states, CUDA graphs) and its warm-up's activation peak. The entry and
        prefix stores are made anew with their budgets, the scheduler's pool with its K/V budget
        (it was provisional, just enough for the warm-up), and the decode graphs (and the assembly
        graphs of the warm-up's shaped requests) are captured again over it. Raises
        devices.MemoryPlanError (one line) when the configuration does not fit. Returns the plan's
        summary for /health."""
        import torch
        from hybridcache.services.devices import plan_memory

        model, sched = self.engine.model, self.scheduler
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        held = torch.cuda.memory_reserved()
        pool = sched.pool
        kv_now = pool.kv.nbytes if pool.kv is not None else 0
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        n = sched.config.max_num_seqs
        parts = {"weights": weights, f"linear states of {n} requests": pool.nbytes - kv_now,
                 "decode graphs": warmup.get("decode_graphs_bytes", 0)}
        # K/V enough for max_num_seqs requests to start and for the --warmup-shape request this
        # worker is warmed for
        kv_min = sched.kv_minimum(self.engine.warmup_requests()[0])
        plan = plan_memory(
            int(given.gpu_memory_utilization * total), held - kv_now, warmup.get("activation_peak_bytes", 0),
            free + kv_now, kv_min=kv_min,
            entry=given.entry_cache_bytes, prefix=given.prefix_cache_bytes, kv=given.kv_cache_bytes, parts=parts,
            advice="lower --max-num-seqs, --max-num-batched-tokens or --warmup-shape, or raise "
                   "--gpu-memory-utilization")
        log.info("memory plan: %s", plan.how)
        self.engine.set_cache_budgets(plan.entry, plan.prefix)
        sched.resize_kv(plan.kv)
        if getattr(self.engine.runner, "assembly_graphs", None) is not None:
            with stage("assembly graphs of the warm-up's buckets over the planned pool"):
                self.engine.warmup(run=warmup_requests(sched.generate), shaped_only=True)
        t0 = time.perf_counter()
        with stage("decode graphs of batch sizes up to %d over the planned pool", n):
            out = dict(plan.summary(), how=plan.how, **self._capture_decode_graphs())
        out["decode_graphs_seconds"] = round(time.perf_counter() - t0, 3)
        return out

    def receiver_for(self, address: str) -> Endpoint:
        """This worker's Endpoint as sent to the scatter worker at `address`: without the GPUs it
        can open once a device block from there failed to open (a container that cannot use CUDA
        IPC after all), so that worker sends through host memory from then on."""
        if address in self._no_device_path:
            return replace(self.endpoint, gpus=())
        return self.endpoint

    def _member_set(self, role: str) -> set[str] | None:
        return None if self._members is None else set(self._members(role))

    def scatter_endpoint(self, address: str) -> Endpoint | None:
        """The Endpoint of the scatter worker at `address` (ScatterEndpoints: its Describe, asked
        once; None for one that cannot describe itself, or, for PEER_RETRY_S, one that did not answer)."""
        return self._scatter_endpoints.get(address)

    def _on_my_gpu(self, address: str) -> bool:
        """Does the scatter worker at `address` hold its entries on this worker's GPU (and is
        --scatter-same-gpu off)?"""
        if self.scatter_same_gpu or not self.endpoint.device:
            return False
        peer = self.scatter_endpoint(address)
        return peer is not None and peer.same_gpu(self.endpoint)

    def close(self) -> None:
        self.scheduler.stop()

    def Tokens(self, request, context):
        if not request.subscriber:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Tokens stream needs a subscriber id")
        yield from self.subscriptions.stream(request.subscriber, context)

    def Info(self, request, context):
        e = self.engine
        return pb.InfoReply(fingerprint=e.fingerprint, seam_window=e.config.seam_window, model_type=e.cfg.model_type,
                            mode=e.config.mode, dtype=self.dtype, prefill_tokens_per_second=self.prefill_tps,
                            transport_bandwidth=self.transport_bandwidth, endpoint=self.endpoint.to_msg(),
                            scatter_same_gpu=self.scatter_same_gpu, max_num_seqs=self.scheduler.config.max_num_seqs,
                            max_waiting=self.scheduler.config.max_waiting)

    def _tier(self, address: str) -> CacheTierClient:
        if address not in self._tiers:
            self._tiers[address] = CacheTierClient(address)
        return self._tiers[address]

    def _gather(self, request, segments: list[list[int]], expected: dict[int, str] | None = None
                ) -> tuple[dict[str, SegmentEntry], dict[int, str], dict]:
        """Every planned entry (own cache -> tier -> scatter); returns key -> entry, index -> source.
        `expected`: segment index -> its entry key, as this engine's planner computes it (the
        request's own keys; None: computed here from `segments`)."""
        if expected is None:
            expected = {i: self.engine.entry_key(ids) for i, ids in enumerate(segments)}
        store = self.engine.entries
        pinned: dict[str, SegmentEntry] = {}
        source: dict[int, str] = {}
        need_tier: dict[str, list[pb.SegmentPlan]] = {}
        cold: dict[str, list[int]] = {}
        # scatter_seconds: the host time spent receiving (EntryAssembler.transfer_seconds);
        # scatter_copy_seconds: the time of the device copies themselves (its copy_seconds)
        moved = {"tier_bytes": 0, "tier_seconds": 0.0, "tier_path": "", "scatter_bytes": 0,
                 "scatter_seconds": 0.0, "scatter_copy_seconds": 0.0, "scatter_path": "", "scatter_blocks": 0,
                 "scatter_ipc_opens": 0, "build_seconds": 0.0, "redispatched": 0}
        # Only the keys of this engine's own planner count: a plan naming another key for a segment
        # (or no segment) is ignored, and the engine builds that segment itself.
        plan = [p for p in request.plan if p.key == expected.get(p.index)]
        # Only members of the deployment are dialled: a plan naming another address builds there here.
        tiers, scatters = self._member_set("cache-tier"), self._member_set("scatter")
        plan = [p if _dials_member(p, tiers, scatters) else pb.SegmentPlan(index=p.index, key=p.key, source="local")
                for p in plan]
        keys = {p.index: p.key for p in plan}
        owners = {p.index: p.cache_tier if tiers is None or p.cache_tier in tiers else "" for p in plan}
        request_tier = request.cache_tier if tiers is None or request.cache_tier in tiers else ""
        received: dict = {}  # key -> entry accepted from the tier or a scatter worker (rank slices on TP)
        hits = 0
        for p in plan:
            entry = store.get(p.key)
            if entry is not None:
                hits += 1
                pinned[p.key] = entry
                source[p.index] = "local"
            elif p.source == "tier":
                need_tier.setdefault(p.address, []).append(p)
            elif p.source == "scatter":
                cold.setdefault(p.address, []).append(p.index)
        metrics.cache_lookups(self.own_tier, len(plan), hits)
        for address, plans in need_tier.items():
            t0 = time.perf_counter()
            moved["tier_path"] = transport_for_address(address)
            found = self._tier(address).get([p.key for p in plans], moved["tier_path"])
            moved["tier_seconds"] += time.perf_counter() - t0
            for p in plans:
                accepted = self._accept(found[p.key], segments[p.index]) if p.key in found else None
                if accepted is not None:
                    received[p.key] = accepted
                    source[p.index] = "tier"
                    moved["tier_bytes"] += found[p.key].nbytes
                # A tier miss (evicted, corrupt, tier down): recompute it.
                else:
                    cold.setdefault("", []).append(p.index)
        # A scatter worker on this worker's own GPU builds nothing faster than this worker does,
        # and its entries would still have to move: what was planned there is built here.
        redispatch = [w for w in request.scatter_workers if scatters is None or w in scatters]
        same_gpu = {a for a in set(cold) | set(redispatch) if a and self._on_my_gpu(a)}
        workers = [w for w in redispatch if w not in same_gpu]
        moved["built_here_same_gpu"] = sum(len(cold[a]) for a in same_gpu if a in cold)
        # The pool threads do not inherit this thread's trace context: hand it over explicitly.
        trace_md = tracing.outgoing_metadata()
        failed: set[str] = set()
        pending = {a: idx for a, idx in cold.items() if a not in same_gpu}
        while pending:
            jobs = {}
            for address, idx in pending.items():
                if address and address not in failed:
                    jobs[address] = self._pool.submit(prefill_on_scatter, address,
                                                      [(i, segments[i], owners.get(i, "")) for i in idx],
                                                      request_tier, trace_md,
                                                      receiver=self.receiver_for(address), device=self.device,
                                                      key_salt=request.cache_salt)
            retry: list[int] = []
            for address, idx in pending.items():
                got, asm = jobs[address].result() if address in jobs else ({}, None)
                if asm is not None:
                    moved["scatter_bytes"] += asm.bytes_received
                    moved["scatter_seconds"] += asm.transfer_seconds
                    moved["scatter_copy_seconds"] += asm.copy_seconds
                    moved["scatter_path"] = asm.transport or moved["scatter_path"]
                    moved["scatter_blocks"] += asm.device_blocks
                    moved["scatter_ipc_opens"] += asm.ipc_opens
                    if asm.device_errors and address not in self._no_device_path:
                        self._no_device_path.add(address)
                        log.warning("CUDA IPC from scatter worker %s failed (%s); it sends through host memory "
                                    "from now on", address, asm.last_device_error)
                for i in idx:
                    accepted = (self._accept(got[i], segments[i]) if i in got and got[i].key == keys.get(i)
                                else None)
                    if accepted is not None:
                        received[got[i].key] = accepted
                        source[i] = "scatter"
                        moved["build_seconds"] += got[i].build_seconds
                    else:
                        retry.append(i)
                if address in jobs and len(got) < len(idx):
                    failed.add(address)
            pending = {}
            alive = [w for w in workers if w not in failed]
            if retry and alive:
                moved["redispatched"] += len(retry)
                for n, i in enumerate(retry):
                    pending.setdefault(alive[n % len(alive)], []).append(i)
            elif retry:
                # No scatter worker left: the engine builds them itself (source "built").
                break
        taken = self._hand_out(received) if self.tp_size > 1 else received
        pinned.update(taken)
        for i, key in keys.items():
            if source.get(i) in ("tier", "scatter") and key not in taken:
                del source[i]  # not handed out after all: the engine builds it
        return pinned, source, moved

    def Generate(self, request, context):
        """A request's chunks on this call, or, when it names a subscriber, on that subscriber's
        Tokens stream (services/combine/tokens.py): the call then answers nothing, holds the
        request's admission (RESOURCE_EXHAUSTED) and cancellation, and ends once its last chunk
        (done, an error, or `closed`) is on the stream."""
        with tracing.tracer().start_as_current_span("combine.generate", context=tracing.incoming_context(context)):
            sub = self.subscriptions.get(request.subscriber) if request.subscriber else None
            if request.subscriber and sub is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"no Tokens stream of subscriber {request.subscriber} on this worker")
            muxed = sub.attach(request.request_id) if sub is not None else None
            try:
                if muxed is None:
                    yield from self._generate(request, context)
                    return
                # its tokens went to the stream: what comes here is its last chunk, if any
                last = list(self._generate(request, context, muxed))
                sub.put_chunk(muxed, last[-1] if last else pb.TokenChunk(token_id=-1, closed=True))
            except QueueFull as e:
                context.set_trailing_metadata((("retry-after", str(math.ceil(e.retry_after_s))),))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            finally:
                if muxed is not None and muxed.handle is None:
                    sub.detach(request.request_id)

    def _generate(self, request, context, muxed=None):
        t0 = time.perf_counter()
        device = next(self.engine.model.parameters()).device
        counted = request_counters(device, self.engine.entries, self.engine.runner)
        try:
            sampling = json.loads(request.sampling_json) if request.sampling_json else {}
            # int32 arrays over the packed bytes: the planner checks their range in numpy
            packed = [segment_array(s) for s in sorted(request.segments, key=lambda s: s.index)]
            req = self.engine.parse_request({"system": list(request.system_ids), "segments": packed,
                                             "suffix": list(request.suffix_ids), "sampling_params": sampling,
                                             "live_segments": [s.index for s in request.segments if s.live],
                                             "cache_salt": request.cache_salt})
            self.scheduler.check_fits(req)
        except (RequestError, ValueError) as e:
            yield pb.TokenChunk(token_id=-1, done=True, error=str(e), status=400)
            return
        segments = req.segment_ids
        # the plan's keys are checked against the keys recomputed here from the tokens
        planner = self.engine.planner
        expected = {p.index: planner.segment_key(req, p.index) for p in request.plan if 0 <= p.index < len(segments)}
        sched = self.scheduler
        # Refused before its entries are gathered, when the queue is already full.
        if not sched.has_room():
            raise QueueFull(sched.queue_full_message(), sched.retry_after_s())
        pinned, source, moved = self._gather(request, segments, expected)
        # Entries that came from elsewhere go to the model's device and into this worker's cache;
        # those found in its cache's device tier are there already.
        held = {expected[i] for i, src in source.items() if src == "local"}
        for key, entry in pinned.items():
            if key not in held or is_host(entry):
                pinned[key] = entry_to(entry, device)
                self.engine.entries.put(pinned[key])
        handle: RequestHandle = sched.add_request(req, pinned, listener=muxed.listener if muxed else None)
        if muxed is not None:
            muxed.handle = handle
        # The RPC ends early when the client cancels or goes away: the request ends too, within a
        # step (at once when the RPC ended while its entries were gathered: no callback then).
        if not context.add_callback(handle.cancel):
            handle.cancel()
        if muxed is not None:  # its tokens go on its subscriber's stream (Generate)
            handle.done.wait()
            last = self._last_chunk(request, handle, source, moved, counted, device, t0, muxed.t_first)
            if last is not None:
                yield last
            return
        t_first = None  # when its first token left this worker's handler
        try:
            n = 0
            for tok, delta in handle:
                chunk = pb.TokenChunk(token_id=tok, text=delta)
                if tok >= 0:
                    add_logprob(chunk, handle, n)
                    n += 1
                    self.stats.generated()
                    if t_first is None:
                        t_first = time.perf_counter()
                yield chunk
        except Exception:  # noqa: BLE001 - handle.error, answered by _last_chunk
            pass
        last = self._last_chunk(request, handle, source, moved, counted, device, t0, t_first)
        if last is not None:
            yield last

    def _last_chunk(self, request, handle: RequestHandle, source: dict, moved: dict, counted: dict, device,
                    t0: float, t_first: float | None) -> pb.TokenChunk | None:
        """A finished request's last chunk: its error (400: what its parameters caused; 500: the
        engine failed, with an id to report), None when it was cancelled, else done with its stats."""
        if isinstance(handle.error, RequestError):  # the scheduler finished it alone
            return pb.TokenChunk(token_id=-1, done=True, error=str(handle.error), status=400)
        if handle.error is not None:
            log.error("request %s failed", request.request_id, exc_info=handle.error)
            kind = type(handle.error).__name__
            return pb.TokenChunk(token_id=-1, done=True, status=500, error=f"internal error ({kind}) in request "
                                 f"{request.request_id}; the combine worker's log has its traceback")
        if handle.finish_reason == "abort":
            return None
        stats = handle.prefill.stats.to_dict()
        built = 0
        for i, seg in enumerate(stats["segments"]):
            src = source.get(i)
            if seg["source"] == "entry" and src == "scatter":
                # a scatter worker built it for this request: reused, not cached
                stats["cached_tokens"] -= max(0, seg["tokens"] - stats["seam_window"])
            if seg["source"] == "built" or (seg["source"] == "entry" and src == "scatter"):
                seg["source"], seg["hit"] = ("scatter" if src == "scatter" else "built"), False
                built += seg["tokens"]
            elif seg["source"] == "entry":
                seg["source"] = "tier" if src == "tier" else self.own_tier
        stats["built_tokens"] = built
        stats["reused_segments"] = sum(s["hit"] for s in stats["segments"])
        stats.update(moved)
        stats["combine_ms"] = (time.perf_counter() - t0) * 1000
        # its wait in the scheduler's queue for a seat (what --max-queue-wait-s bounds at the router)
        if handle.admitted_at is not None:
            stats["queue_ms"] = (handle.admitted_at - handle.arrived) * 1000
        # this worker's share of the first token's wait (combine_ms goes on to the end of the
        # request): from the request reaching it to that token leaving its handler
        if t_first is not None:
            stats["combine_ttft_ms"] = (t_first - t0) * 1000
        # the request's arrival and first token on this host's wall clock, for the router to time
        # the hops between them (it removes these two)
        wall = time.time() - time.perf_counter()
        stats["combine_received_unix"] = t0 + wall
        if t_first is not None:
            stats["combine_first_token_unix"] = t_first + wall
        now = request_counters(device, self.engine.entries, self.engine.runner)
        stats.update({k: v - counted.get(k, 0) for k, v in now.items()})
        stats["gc_pause_ms"] = round(stats["gc_pause_ms"], 3)
        stats["entry_cache_bytes"] = self.engine.entries.used_bytes
        stats["trace_id"] = tracing.current_trace_id()
        metrics.CACHE_BYTES.labels(tier=self.own_tier).set(stats["entry_cache_bytes"])
        self.stats.request_done(stats)
        done = pb.TokenChunk(token_id=-1, done=True, finish_reason=handle.finish_reason, stats_json=json.dumps(stats))
        for lp, top in handle.prompt_logprobs or ():
            done.prompt_logprobs.append(lp)
            done.prompt_top_ids.extend(i for i, _ in top)
            done.prompt_top_logprobs.extend(v for _, v in top)
        return done


def _dials_member(p: pb.SegmentPlan, tiers: set[str] | None, scatters: set[str] | None) -> bool:
    """Whether a plan entry's address (a tier to fetch from, a scatter worker to build on) is a
    member of the deployment (None: any address is)."""
    if p.source == "tier":
        ok = tiers is None or p.address in tiers
    elif p.source == "scatter":
        ok = scatters is None or p.address in scatters
    else:
        return True
    if not ok:
        log.warning("plan names %s %s, not a member of this deployment: the segment is built here",
                    p.source, p.address)
    return ok


def _count_finished(handle: RequestHandle) -> None:
    metrics.SCHEDULER_FINISHED.labels(reason=handle.finish_reason or "abort").inc()
    metrics.SCHEDULER_GENERATED_TOKENS.inc(len(handle.output_ids))
