"""The router: turns a request into a plan (per segment: own cache, cache tier or which scatter
worker), sends it to a combine worker and relays the token stream."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
from grpc.experimental import ChannelOptions
from hybridcache.services.cache_tier.client import CacheTierClient
from hybridcache.services.config import DTYPES, RuntimeConfig
from hybridcache.services.directory import Directory
from hybridcache.services.observability import metrics, tracing
from hybridcache.services.observability.stats import RequestRecord
from hybridcache.services.protocol import narrow_ids, pb, rpc, segment
from hybridcache.services.router.admission import Admission, Refused
from hybridcache.services.router.assign import lpt_assign, round_robin_assign
from hybridcache.services.router.cost import PATHS, CostModel, parse_bandwidths
from hybridcache.services.router.mux import CallEnded, Inbox, StreamEnded, TokenMux, Unreachable
from hybridcache.services.runtime.models.registry import config_from_dir
from hybridcache.services.runtime.plan import Planner
from hybridcache.services.runtime.sampling import GenerationDefaults, RequestError
from hybridcache.services.runtime.tokenizer import Tokenizer
from hybridcache.services.security import internal_channel, retry_unavailable
from hybridcache.services.transport import Endpoint, choose_transport, transport_for_address
from hybridcache.services.transport.peers import ScatterEndpoints

log = logging.getLogger("hybridcache.router")


class RequestTooLarge(RequestError):
    """A prompt over the served length limit (HTTP 400, as vLLM answers it)."""


class ServiceUnavailable(RuntimeError):
    """No combine worker answered (HTTP 503)."""


class Overloaded(RuntimeError):
    """The combine worker's waiting queue is full (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _Cancelled(Exception):
    """The request was cancelled while a combine worker was being asked."""


class StreamControl:
    """Ends a request's stream from another thread (its client went away): cancels the combine
    worker's RPC, whose scheduler then drops the request within one step."""

    def __init__(self):
        self._lock = threading.Lock()
        self._call = None
        self.cancelled = False

    def attach(self, call) -> None:
        with self._lock:
            self._call = call
            if self.cancelled:
                call.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            if self._call is not None:
                self._call.cancel()


@dataclass
class RouterConfig:
    assignment: str = "lpt"  # lpt | round_robin
    timeout_s: float = 300.0

    def __post_init__(self):
        if self.assignment not in ("lpt", "round_robin"):
            raise ValueError("assignment must be lpt or round_robin")


def served_max_model_len(cfg, max_model_len: int | None) -> int:
    """The model's max_position_embeddings, or --max-model-len when that says less (more is an error)."""
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    return max_model_len or cfg.max_position_embeddings


# keys remembered per combine worker as held in its own cache (newest last; the oldest forgotten)
HELD_KEYS_PER_COMBINE = 1 << 16


class Router:
    def __init__(self, model_dir: str | Path, directory: Directory, config: RouterConfig | None = None,
                 runtime: RuntimeConfig | None = None):
        self.config = config or RouterConfig()
        self.runtime = runtime or RuntimeConfig()  # seam window and mode until a combine worker tells its own
        self.directory = directory
        cfg = config_from_dir(model_dir)
        self.model_name = Path(model_dir).name
        self.max_model_len = served_max_model_len(cfg, self.runtime.max_model_len)
        # tokens, validation and entry keys need no weights: the engine's request plan
        self.planner = Planner(cfg, Tokenizer.from_dir(model_dir), self.runtime, fingerprint="",
                               generation=GenerationDefaults.from_dir(model_dir))
        self.cost = CostModel()
        # requests in flight per combine worker, refused at once past its seats, queue or wait bound
        self.admission = Admission(self.runtime.max_queue_wait_s, self.runtime.max_num_seqs, self.runtime.max_waiting)
        self.cost.bandwidth.update(parse_bandwidths(self.runtime.transport_bandwidth))
        self._queued: dict[str, float] = {}  # scatter worker -> outstanding estimated seconds
        self._depth: dict[str, int] = {}
        self._lock = threading.Lock()
        self._rr = itertools.count()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, rpc.CombineStub] = {}
        self._muxes: dict[str, TokenMux] = {}  # combine worker -> its Tokens stream
        self._tiers: dict[str, CacheTierClient] = {}
        self.info: pb.InfoReply | None = None
        # combine worker -> (its Endpoint, its --scatter-same-gpu), from its Info; the scatter
        # workers' Endpoints from their Describe: together the path of a scatter-built entry
        self._combine_endpoints: dict[str, tuple[Endpoint, bool]] = {}
        self._scatter_endpoints = ScatterEndpoints()
        # combine worker -> keys of the entries it folded into a request it finished: it keeps
        # them in its own cache, so a request sent to it again needs no tier lookup for them
        self._held: dict[str, OrderedDict[str, None]] = {}

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            # a combine worker that restarts is waited for a few seconds before the answer is 503;
            # a Generate stream is read by the thread that iterates it (no channel spin thread
            # started per call, no hand-over of each chunk from that thread to the reader)
            self._channels[address] = internal_channel(address, [retry_unavailable("hybridcache.v1.Combine"),
                                                                 (ChannelOptions.SingleThreadedUnaryStream, 1)])
        return self._channels[address]

    def _stub(self, address: str) -> rpc.CombineStub:
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = rpc.CombineStub(self._channel(address))
        return stub

    def _mux(self, address: str) -> TokenMux | None:
        """The combine worker's Tokens stream (--token-stream multiplexed), on a channel of its own
        whose calls report their end (a multiplexed request's Generate call is never read: its end
        comes to the request's inbox)."""
        if self.runtime.token_stream != "multiplexed":
            return None
        with self._lock:
            mux = self._muxes.get(address)
            if mux is None:
                channel = internal_channel(address, [retry_unavailable("hybridcache.v1.Combine")])
                mux = self._muxes[address] = TokenMux(rpc.CombineStub(channel), address)
        return mux

    def _subscribe_early(self, address: str) -> None:
        """The combine worker's Tokens stream opened now (a channel, its connection and one round
        trip), not by the first request sent to it. A failure here is the first request's to meet:
        it subscribes again and reports what it gets."""
        mux = self._mux(address)
        if mux is None:
            return
        try:
            mux.subscribe()
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.info("token stream of %s not opened at connect (%s); the first request opens it", address, e)

    def _tier(self, address: str) -> CacheTierClient:
        if address not in self._tiers:
            self._tiers[address] = CacheTierClient(address, timeout_s=2.0)
        return self._tiers[address]

    def connect(self, timeout_s: float = 60.0) -> pb.InfoReply:
        """Learn the served model's fingerprint and seam window from a combine worker, and open its
        token stream (--token-stream multiplexed) before a request needs it."""
        deadline = time.monotonic() + timeout_s
        while True:
            for address in self.directory.members("combine"):
                try:
                    info = self._stub(address).Info(pb.InfoRequest(), timeout=2.0)
                except grpc.RpcError:
                    continue
                adopted = self.adopt(info, address)
                self._subscribe_early(address)
                return adopted
            if time.monotonic() > deadline:
                raise ServiceUnavailable("no combine worker answered Info")
            time.sleep(0.2)

    def adopt(self, info: pb.InfoReply, address: str = "") -> pb.InfoReply:
        """Key entries as the served engine does (its fingerprint, seam window and mode); `address`:
        the combine worker's, whose Endpoint the reply names."""
        self.info = info
        if address and info.HasField("endpoint"):
            self._combine_endpoints[address] = (Endpoint.from_pb(info.endpoint), info.scatter_same_gpu)
        self.admission.configure(address, info.max_num_seqs, info.max_waiting)
        served = {"seam_window": info.seam_window, "mode": info.mode or "pic"}
        if info.dtype in DTYPES:
            served["dtype"] = info.dtype
        p = self.planner
        self.planner = Planner(p.cfg, p.tokenizer, replace(self.runtime, **served), info.fingerprint, p.generation)
        if info.prefill_tokens_per_second > 0:
            self.cost.prefill_tokens_per_s = info.prefill_tokens_per_second
        # what the combine worker measured at start-up, unless --transport-bandwidth says otherwise
        configured = parse_bandwidths(self.runtime.transport_bandwidth)
        for path, bps in info.transport_bandwidth.items():
            if path in self.cost.bandwidth and path not in configured and bps > 0:
                self.cost.bandwidth[path] = bps
        return info

    @property
    def cold_queue_depth(self) -> int:
        with self._lock:
            return sum(self._depth.values())

    def check_admission(self) -> None:
        """Overloaded when no combine worker would take a request now: asked before a request is
        parsed (its admission proper comes in stream(), before it is planned)."""
        try:
            self.admission.check(self.directory.members("combine"))
        except Refused as e:
            raise Overloaded(str(e), e.retry_after_s) from None

    def parse(self, obj: dict, json_ids: bool = False):
        """The request (Planner.parse; `json_ids`: obj's lists of ids are a JSON parser's)."""
        try:
            req = self.planner.parse(obj, json_ids)
        except RequestError as e:
            if "context limit" in str(e):
                raise RequestTooLarge(str(e)) from None
            raise
        n, new = req.prompt_len, req.sampling.max_new_tokens
        if n + new > self.max_model_len:
            raise RequestTooLarge(f"prompt of {n} tokens plus max_new_tokens {new} exceeds this server's "
                                  f"max model length of {self.max_model_len} tokens")
        return req

    def plan(self, req, combine: str = "") -> tuple[list[pb.SegmentPlan], dict[str, float], list[str]]:
        """Per cacheable segment: fetch from the tier (if held and sooner) or build on a scatter worker.

        Segments whose entries `combine` (the worker the request goes to first) folded into an
        earlier request are planned from the tier without asking it: that worker looks in its
        own cache first, then the tier, and builds what neither holds (the answer is the same;
        only a segment it has evicted since costs a build)."""
        if self.info is None:
            self.connect(timeout_s=5.0)
        segments = self.planner.reused_segments(req)
        keys = [s.key for s in segments]
        ring = self.directory.ring("cache-tier")  # the tier members, read once for every key
        tiers = ring.members
        owners = [ring.owner(key) for key in keys]
        with self._lock:
            held = self._held.get(combine, {})
            known = {n for n, key in enumerate(keys) if key in held}
        plan = [pb.SegmentPlan(index=segments[n].index, key=keys[n], source="tier" if owners[n] else "local",
                               address=owners[n]) for n in sorted(known)]
        rest = [n for n in range(len(keys)) if n not in known]
        more, assigned = self._plan_segments([segments[n] for n in rest], [keys[n] for n in rest],
                                             [owners[n] for n in rest], combine)
        return plan + more, assigned, tiers

    def _remember(self, combine: str, plan) -> None:
        """`combine` finished a request with these segments folded in: it holds their entries."""
        with self._lock:
            held = self._held.setdefault(combine, OrderedDict())
            for p in plan:
                held[p.key] = None
                held.move_to_end(p.key)
            while len(held) > HELD_KEYS_PER_COMBINE:
                held.popitem(last=False)

    def scatter_path(self, worker: str, combine: str) -> str:
        """The path an entry built on scatter worker `worker` takes to combine worker `combine`:
        choose_transport of the two Endpoints (the scatter worker's Describe, the combine worker's
        Info); "local" for a scatter worker on the combine worker's GPU (it builds that work itself,
        unless its --scatter-same-gpu is on); the path the combine workers last reported where an
        Endpoint is unknown."""
        known = self._combine_endpoints.get(combine)
        peer = self._scatter_endpoints.get(worker) if known is not None else None
        if known is None or peer is None:
            return self.cost.scatter_path
        endpoint, same_gpu_on = known
        if not same_gpu_on and peer.same_gpu(endpoint):
            return "local"
        return choose_transport(peer, endpoint)

    def _rebuild_path(self, workers: list[str], combine: str) -> str:
        """The slowest of the scatter workers' paths to `combine` (the one any of them may be given
        the work over): what a cold segment's build elsewhere is charged with."""
        paths = {self.scatter_path(w, combine) for w in workers}
        return min(paths, key=lambda p: self.cost.bandwidth.get(p, 0.0) if p in PATHS else float("inf"))

    def _plan_segments(self, segments, keys: list[str], owners: list[str], combine: str = ""):
        """(plan, assigned) of these segments: a tier Stat per owner, then fetch or rebuild."""
        cacheable = [(s.index, s.token_ids) for s in segments]
        by_owner: dict[str, list[int]] = {}
        for n, owner in enumerate(owners):
            if owner:
                by_owner.setdefault(owner, []).append(n)
        present: dict[int, tuple[str, int]] = {}
        for owner, ns in by_owner.items():
            reply = self._tier(owner).stat([keys[n] for n in ns])
            for m, n in enumerate(ns):
                hit = reply is not None and reply.present[m]
                metrics.cache_lookup("tier", hit)
                if hit:
                    present[n] = (owner, reply.nbytes[m] or segments[n].nbytes)
        plan, cold = [], []
        nbytes_of: dict[int, int] = {}
        workers = self.directory.members("scatter")
        # where a recomputed entry would be built: on a scatter worker (then moved to the combine
        # worker over the scatter path), or by the combine worker itself
        rebuild_path = self._rebuild_path(workers, combine) if workers else "local"
        for n, (idx, ids) in enumerate(cacheable):
            if n in present:
                owner, nbytes = present[n]
                path = transport_for_address(owner)
                if self.cost.choose(nbytes, len(ids), path, rebuild_path) == "fetch":
                    plan.append(pb.SegmentPlan(index=idx, key=keys[n], source="tier", address=owner))
                    continue
            cold.append((idx, keys[n], len(ids), owners[n] or ""))
            nbytes_of[idx] = segments[n].nbytes
        # a segment whose entry would take longer to move here than to build here is built by the
        # combine worker (CostModel.build_here, with the scatter path's measured bandwidth)
        if workers:
            here = [c for c in cold if self.cost.build_here(c[2], nbytes_of[c[0]], rebuild_path)]
            plan += [pb.SegmentPlan(index=idx, key=key, source="local") for idx, key, _, _ in here]
            cold = [c for c in cold if c not in here]
        assigned: dict[str, float] = {}
        if cold and workers:
            costs = [self.cost.recompute_seconds(t) for _, _, t, _ in cold]
            with self._lock:
                queued = [self._queued.get(w, 0.0) for w in workers]
                if self.config.assignment == "lpt":
                    choice = lpt_assign(costs, queued)
                else:
                    choice = round_robin_assign(costs, queued, next(self._rr))
                for (idx, key, _, owner), c, w in zip(cold, costs, choice):
                    plan.append(pb.SegmentPlan(index=idx, key=key, source="scatter", address=workers[w],
                                               cache_tier=owner))
                    assigned[workers[w]] = assigned.get(workers[w], 0.0) + c
                    self._queued[workers[w]] = self._queued.get(workers[w], 0.0) + c
                    self._depth[workers[w]] = self._depth.get(workers[w], 0) + 1
                    metrics.COLD_QUEUE_DEPTH.labels(worker=workers[w]).set(self._depth[workers[w]])
        else:
            # No scatter worker: the combine worker builds cold segments itself.
            plan += [pb.SegmentPlan(index=idx, key=key, source="local") for idx, key, _, _ in cold]
        return plan, assigned

    def _release(self, plan, assigned: dict[str, float]) -> None:
        with self._lock:
            for w, c in assigned.items():
                self._queued[w] = max(0.0, self._queued.get(w, 0.0) - c)
            for p in plan:
                if p.source == "scatter":
                    self._depth[p.address] = max(0, self._depth.get(p.address, 0) - 1)
                    metrics.COLD_QUEUE_DEPTH.labels(worker=p.address).set(self._depth[p.address])

    def stream(self, req, control: StreamControl | None = None, received: float | None = None,
               sent=None, direct=None) -> Iterator[pb.TokenChunk]:
        """Token chunks from a combine worker; the last one has done=True and the stats. After
        control.cancel() the stream ends (without a done chunk). `sent`: called (no arguments)
        once the request is on its way to a combine worker, before its first chunk comes back.
        `direct`: where the caller's chunks go (deliver(chunk), callable from any thread): once the
        first token went out, the chunks of a multiplexed request that end nothing may go there
        from the Tokens stream's reader instead of being yielded (_Direct), the rest still are.

        `received`: when the request reached the router (time.perf_counter(); default: now). The
        stats' ttft_ms is the wait from then to the first token leaving the router, what a
        client sees of it; engine_ttft_ms is the combine worker's share (its scheduler's arrival
        to that token), router_ms the router's own (parse and plan) before it asked the combine."""
        t0 = time.perf_counter() if received is None else received
        with tracing.tracer().start_as_current_span("router.request") as span:
            span.set_attribute("hybridcache.prompt_tokens", req.prompt_len)
            combines = self.directory.members("combine")
            if not combines:
                raise ServiceUnavailable("no combine worker is registered")
            start = next(self._rr)
            order = [combines[(start + k) % len(combines)] for k in range(len(combines))]
            # admitted (or refused) before anything is planned, fetched or built for it
            try:
                admitted = self.admission.admit(order)
            except Refused as e:
                raise Overloaded(str(e), e.retry_after_s) from None
            order = [admitted.address] + [c for c in order if c != admitted.address]
            try:
                plan, assigned, tiers = self.plan(req, order[0])
            except BaseException:
                self.admission.done(admitted, False)
                raise
            creq = pb.CombineRequest(
                request_id=uuid.uuid4().hex, system_ids=req.system_ids,
                segments=[_segment(req, i) for i in range(len(req.segment_ids))],
                suffix_ids=req.suffix_ids, sampling_json=json.dumps(_sampling_dict(req.sampling)), plan=plan,
                scatter_workers=self.directory.members("scatter"), cache_salt=req.cache_salt,
                cache_tier=self.directory.owner(plan[0].key) or "" if plan else (tiers[0] if tiers else ""))
            first = True
            t_asked = time.perf_counter()
            t_first_token = None
            answered = False
            record = RequestRecord(creq.request_id, req.prompt_len) if self.runtime.log_requests else None
            # the last token's time (relay.last_t), kept by this thread and by the direct path alike
            relay = _Direct(direct, control)
            try:
                combine, chunks = self._open(creq, order, control, sent, relay)
                for chunk in chunks:
                    if control is not None and control.cancelled:
                        return  # chunks already received when the client went away are not passed on
                    now = time.perf_counter()
                    if first:
                        self._release(plan, assigned)
                        first = False
                        if not chunk.error:
                            metrics.first_token(now - t0)
                    elif relay.last_t is not None and not chunk.done:
                        metrics.INTER_TOKEN.observe(now - relay.last_t)
                    relay.last_t = now
                    if t_first_token is None and not chunk.done and chunk.token_id >= 0:
                        t_first_token = now
                        relay.ready = direct is not None
                    if chunk.done and not chunk.error:
                        self._remember(combine, plan)
                        answered = True
                    if chunk.done and chunk.stats_json:
                        stats = json.loads(chunk.stats_json)
                        metrics.request_finished(stats, now - t0)
                        self._learn(stats)
                        stats["engine_ttft_ms"] = stats.get("ttft_ms", 0.0)
                        stats["ttft_ms"] = ((t_first_token or now) - t0) * 1000
                        stats["router_ms"] = (t_asked - t0) * 1000
                        _hops(stats, t_asked, t_first_token)
                        # The combine worker's span must sit in this request's trace (context in metadata).
                        stats["trace_propagated"] = stats.get("trace_id") == tracing.current_trace_id() != ""
                        chunk.stats_json = json.dumps(stats)
                        if record is not None:
                            record.finished(stats, chunk.finish_reason)
                    if chunk.error and record is not None:
                        record.status = chunk.status or 500
                    yield chunk
            except _Cancelled:
                return
            except grpc.RpcError as e:
                if control is not None and control.cancelled:
                    return
                if record is not None:
                    record.status = 503
                raise ServiceUnavailable(f"combine worker {combine} failed: {e.code().name}") from None
            except (Overloaded, ServiceUnavailable) as e:
                if record is not None:
                    record.status = 429 if isinstance(e, Overloaded) else 503
                raise
            finally:
                self.admission.done(admitted, answered)
                if first:
                    self._release(plan, assigned)
                if record is not None:
                    record.log(time.perf_counter() - t0)

    def _open(self, creq, order: list[str], control: StreamControl | None, sent=None, relay=None):
        """(combine worker, its chunks) from the first of `order` that takes the request: one whose
        waiting queue is full refuses at once (RESOURCE_EXHAUSTED) and the next is asked; when all
        refuse, Overloaded with the shortest back-off they gave. The chunks come on the worker's
        Tokens stream where it has one (TokenMux), else on the Generate call itself."""
        refusals = []
        for combine in order:
            mux = self._mux(combine)
            try:
                subscriber = mux.subscribe() if mux is not None else None
            except Unreachable as e:
                raise ServiceUnavailable(f"combine worker {combine} failed: {e.code.name}") from None
            if subscriber:
                opened = self._open_muxed(combine, mux, subscriber, creq, control, sent, relay)
                if isinstance(opened, tuple):
                    refusals.append(opened)
                    continue
                if opened is not None:
                    return combine, opened
            # no Tokens stream (or the worker no longer knows this one): the chunks on the call
            creq.subscriber = ""
            call = self._stub(combine).Generate(
                creq, timeout=self.config.timeout_s, metadata=tracing.outgoing_metadata())
            if control is not None:
                control.attach(call)
            if sent is not None:
                sent()
            try:
                head = next(call)
            except StopIteration:
                return combine, iter(())
            except grpc.RpcError as e:
                if control is not None and control.cancelled:
                    raise _Cancelled from None
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise ServiceUnavailable(f"combine worker {combine} failed: {e.code().name}") from None
                trailers = dict(e.trailing_metadata() or ())
                refusals.append((float(trailers.get("retry-after", 1)), e.details()))
                continue
            return combine, itertools.chain([head], call)
        retry_after, message = min(refusals)
        raise Overloaded(message, retry_after)

    def _open_muxed(self, combine: str, mux: TokenMux, subscriber: str, creq, control, sent, relay=None):
        """Send a request whose chunks come on `mux`: its chunks (an iterator), a refusal
        (retry-after, message), or None when the worker does not know the subscriber. The Generate
        call is never read: its end comes to the inbox (CallEnded) like the chunks (the first of
        them, or its end, says whether the worker took it)."""
        creq.subscriber = subscriber
        inbox = mux.register(creq.request_id, subscriber)
        try:
            call = mux.stub.Generate(creq, timeout=self.config.timeout_s, metadata=tracing.outgoing_metadata())
            call.add_done_callback(lambda c: inbox.put(CallEnded(c)))
            if control is not None:
                control.attach(call)
            if sent is not None:
                sent()
            first = inbox.get()
            if isinstance(first, CallEnded) and first.code != grpc.StatusCode.OK:
                if control is not None and control.cancelled:
                    raise _Cancelled
                if first.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    return float(first.trailers.get("retry-after", 1)), first.details
                if first.code == grpc.StatusCode.FAILED_PRECONDITION:
                    mux.lost(subscriber)
                    return None
                raise ServiceUnavailable(f"combine worker {combine} failed: {first.code.name}")
        except BaseException:
            mux.unregister(creq.request_id)
            raise
        return self._muxed(mux, creq.request_id, inbox, control, first, relay)

    def _muxed(self, mux: TokenMux, request_id: str, inbox: Inbox, control: StreamControl | None, item,
               relay=None):
        """A multiplexed request's chunks from its inbox (`item` the first), up to its done chunk.
        Its end without one is the Generate call's to explain: cancelled here (the stream just
        ends), or failed on the worker (ServiceUnavailable, as a broken per-request stream). With a
        `relay` ready (its first token out) and nothing queued, the inbox hands the chunks that end
        nothing to it; what ends the request still comes here."""
        closed = False
        direct = False
        try:
            while True:
                if isinstance(item, CallEnded):
                    if control is not None and control.cancelled:
                        raise _Cancelled
                    if item.code != grpc.StatusCode.OK:
                        raise ServiceUnavailable(f"combine worker {mux.address} failed: {item.code.name}")
                    if closed:
                        return
                    # else its last chunk is on its way on the Tokens stream
                elif isinstance(item, StreamEnded):
                    if control is not None and control.cancelled:
                        raise _Cancelled
                    name = item.code.name if item.code is not None else "stream ended"
                    raise ServiceUnavailable(f"combine worker {mux.address} failed: its token stream ended ({name})")
                elif item.closed:
                    closed = True  # the call's end says why
                else:
                    item.request_id = ""  # the worker's routing field: the chunk as a per-request stream has it
                    yield item
                    if item.done:
                        return
                if relay is not None and relay.ready and not direct:
                    direct = inbox.go_direct(relay)
                item = inbox.get()
        finally:
            mux.unregister(request_id)

    def _learn(self, stats: dict) -> None:
        """Update the cost model with what the combine worker measured."""
        self.cost.observe_prefill(stats.get("built_tokens", 0), stats.get("build_seconds", 0.0))
        self.cost.observe_transfer(stats.get("tier_path", "grpc"), stats.get("tier_bytes", 0),
                                   stats.get("tier_seconds", 0.0))
        self.cost.observe_scatter(stats.get("scatter_path", ""), stats.get("scatter_bytes", 0),
                                  stats.get("scatter_seconds", 0.0))


class _Direct:
    """Where a multiplexed request's chunks that end nothing go once its first token is out
    (Inbox.go_direct): straight from the Tokens stream's reader to `deliver`, with what the
    relaying thread would do for them (dropped once the client went away, the gap since the last
    counted in the inter-token histogram), without waking that thread for each: with one thread a
    request, every scheduler step woke as many threads as requests were decoding. Every stream has
    one for its last token's time; one without `deliver` is never made ready."""

    __slots__ = ("deliver", "control", "last_t", "ready")

    def __init__(self, deliver, control: StreamControl | None):
        self.deliver = deliver
        self.control = control
        self.last_t: float | None = None
        self.ready = False

    def __call__(self, chunk) -> None:
        if self.control is not None and self.control.cancelled:
            return
        now = time.perf_counter()
        if self.last_t is not None:
            metrics.INTER_TOKEN.observe(now - self.last_t)
        self.last_t = now
        chunk.request_id = ""  # the worker's routing field, as _muxed clears it
        try:
            self.deliver(chunk)
        except Exception:  # noqa: BLE001 - the reader goes on with the other requests' chunks
            log.exception("a token chunk could not be delivered")


def _hops(stats: dict, t_asked: float, t_first_token: float | None) -> None:
    """The hops of a request between this router and its combine worker, from the wall-clock
    stamps the worker put in its stats (removed here): router_to_combine_ms, from the router asking
    to the worker's handler starting on it; combine_to_router_ms, from its first token leaving the
    worker to reaching the router. Both read two hosts' wall clocks: exact on one host, off by
    their skew across hosts."""
    wall = time.time() - time.perf_counter()
    received = stats.pop("combine_received_unix", None)
    first = stats.pop("combine_first_token_unix", None)
    if isinstance(received, (int, float)):
        stats["router_to_combine_ms"] = (received - (t_asked + wall)) * 1000
    if isinstance(first, (int, float)) and t_first_token is not None:
        stats["combine_to_router_ms"] = (t_first_token + wall - first) * 1000


def _segment(req, i: int) -> pb.Segment:
    """The request's segment i as a Segment, its ids packed from those parsing packed when it did."""
    packed = req.packed.get(i)
    if packed is None:
        return segment(i, req.segment_ids[i], live=i in req.live)
    return pb.Segment(index=i, ids=narrow_ids(packed), live=i in req.live)


def _sampling_dict(s) -> dict:
    return {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "stop": list(s.stop), "stop_token_ids": list(s.stop_token_ids), "seed": s.seed, "ignore_eos": s.ignore_eos,
            "logprobs": s.logprobs, "min_new_tokens": s.min_new_tokens, "repetition_penalty": s.repetition_penalty,
            "frequency_penalty": s.frequency_penalty, "presence_penalty": s.presence_penalty,
            "prompt_logprobs_from": s.prompt_logprobs_from}
