"""CUDA graphs of the live pass over assembled layouts (LayoutLM.forward_layout).

A warm pic request is bound by the host, not the GPU: an assembly of many segments issues
thousands of kernel launches and torch ops from Python for little GPU work each
(tools/op_count.py counts them). Given a layout's *shape* — the pieces' kinds, lengths and positions, the
entries' dtypes, the state it starts from, what it records — its live pass is one fixed sequence
of kernels, so it can be captured once and replayed.

A ModelRunner (runner.py) holds the LayoutGraphs of its model where graphs apply and runs a
layout from its shape's graphs (LayoutGraphs.run), else eagerly (LayoutLM.forward_layout, which
knows nothing of graphs). LayoutGraphs keeps, for each shape seen `capture_after` times, one CUDA graph per layer (the
embedding with the first, the final norm and the head with the last) captured over *static*
buffers: the live token ids, every cached span's tensors, the entering state. A replay

1. copies the request's tensors into those buffers, layer by layer just before that layer's graph
   (entries staged from the host tier still arrive while earlier layers run: reading a layer of
   an ArrivingLayers waits for its copies on the stream, as the eager forward does);
2. replays the layer's graph;
3. clones what the request keeps out of the graphs' memory — the state, the logits, the recorded
   snapshots and hidden states — since the next replay overwrites it.

Capture, the first time a shape qualifies: the live pass runs eagerly on the static buffers (it
warms every kernel and cache and is this request's answer), then each layer is captured, then
the graphs are replayed once and must reproduce that answer, else they are dropped and the shape
runs eagerly from then on. Span T and S (most of an entry's bytes) are then bound without copies
where the graphs read them only through the fold's address tables: those table entries are found
among the host constants, and if a replay with the static T/S buffers poisoned (NaN) and the
tables pointing at the request's own T/S gives the same answer, later requests rewrite the tables
instead of copying, and the static T/S buffers are dropped (_Static.plan_patching).

Whatever goes wrong while binding or capturing (a shape mismatch, an op that cannot be captured)
falls back to the eager forward before the caller's state is touched: a graph never changes an
answer. Host-to-device copies of layout-derived index tensors inside the forward
(backends.to_device_async) become device tensors filled once after the capture
(backends.HostConstants), so no graph holds a memcpy node.

Off with RuntimeConfig.cuda_graphs (`--cuda-graphs off`); RuntimeConfig.cuda_graph_shapes
(`--cuda-graph-shapes`, default 4) bounds the shapes kept. Only models that declare
`cuda_graphs = True` (their live pass has no host synchronization) and only layouts with a cached
span (an assembly; decode and plain prefills change shape every call) are captured. The decode
step's graphs (paged.DecodeGraphs, one per padded batch size) are the runner's too; both kinds
are captured with CudaLayerGraph on the runner's capture stream.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.models.common import new_recording
from hybridcache.services.runtime.sequence import (
    AttnSpan,
    AttnState,
    CachedSpan,
    LinearSpan,
    LinearState,
    LiveRun,
    Recording,
    SequenceState,
    SpanData,
)

log = logging.getLogger(__name__)

# How many layout shapes keep their graphs by default (each holds buffers the size of its request's
# entries, 4.1 GB at the 32 x 1k shape of Qwen3.5-9B with fp32 entries, and its graphs' intermediates).
DEFAULT_MAX_SHAPES = 4


class GraphUnsupported(RuntimeError):
    """This layout cannot run from a graph (capture failed, or a request's tensors do not fit the
    graph's buffers); the caller runs the eager forward."""


def peek(mapping, layer):
    """A layer's span without waiting for its tensors to arrive (ArrivingLayers waits on indexing)."""
    spans = getattr(mapping, "_spans", None)
    return (spans if spans is not None else mapping)[layer]


def _span_key(data: SpanData) -> tuple:
    """What of a span's tensors fixes the graph's buffers, from its first layer of each kind
    (entries are uniform across layers; binding checks every tensor)."""
    key = [data.num_tokens, data.local_start]
    for group, fields in ((data.linear, ("T", "S", "conv_tail")), (data.attn, ("k", "v"))):
        layers = tuple(group)
        key.append(layers)
        if layers:
            span = peek(group, layers[0])
            key += [(getattr(span, f).dtype, tuple(getattr(span, f).shape)) for f in fields]
    return tuple(key)


def layout_key(state: SequenceState, layout, logits_for, snapshot_after, capture_hidden) -> tuple | None:
    """The shape of a live pass: equal keys launch the same kernels on same-shaped tensors.
    None when the layout is not one to capture (no cached span, or a run records an entry)."""
    pieces, spans = [], 0
    for p in layout:
        if isinstance(p, CachedSpan):
            spans += 1
            pieces.append(("span", p.start, p.use_transition, _span_key(p.data)))
        elif isinstance(p, LiveRun):
            if p.record is not None:
                return None
            pieces.append(("live", p.start, int(p.token_ids.numel())))
        else:
            return None
    if not spans or any(hasattr(a, "pages") for a in state.attn.values()):
        # (a state whose K/V lie in pages, a long prompt's chunked prefill, is not captured here)
        return None
    held = tuple(
        (i, s.ssm.dtype, tuple(s.ssm.shape), s.conv.dtype, tuple(s.conv.shape)) for i, s in state.linear.items()
    ) + tuple((i, a.k.dtype, tuple(a.k.shape), tuple(a.v.shape)) for i, a in state.attn.items())
    # the op choice fixes which kernels the pass launches
    dispatch = backends.current_dispatch()
    return (
        state.length,
        held,
        logits_for,
        tuple(sorted(snapshot_after)),
        tuple(sorted(capture_hidden)),
        dispatch,
        tuple(pieces),
    )


def copy_linear_states(states: list[dict]) -> list[dict]:
    """Fresh copies of layer -> LinearState maps (e.g. a planned pass's snapshots, views of a
    graph's outputs), copied as clone_out copies: one block per storage they view."""
    flat = [t for d in states for i in sorted(d) for t in (d[i].ssm, d[i].conv) if t is not None]
    out = iter(clone_out(flat))
    return [{i: LinearState(next(out), next(out) if d[i].conv is not None else None) for i in sorted(d)}
            for d in states]


def clone_out(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh copies of tensors that may live in a graph's memory, few launches: tensors that are
    views of one storage (the snapshots of a layer are views of one gather) are copied as one block
    spanning them and viewed again."""
    groups: dict[tuple, list[int]] = {}
    for j, t in enumerate(tensors):
        key = (t.untyped_storage().data_ptr(), t.dtype, t.device) if t.numel() else ("empty", j)
        groups.setdefault(key, []).append(j)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for js in groups.values():
        if len(js) == 1:
            out[js[0]] = tensors[js[0]].clone()
            continue
        ref = tensors[js[0]]
        lo = min(tensors[j].storage_offset() for j in js)
        hi = max(
            tensors[j].storage_offset() + sum((n - 1) * s for n, s in zip(tensors[j].shape, tensors[j].stride())) + 1
            for j in js
        )
        flat = ref.new_empty(0).set_(ref.untyped_storage(), lo, (hi - lo,), (1,)).clone()
        for j in js:
            t = tensors[j]
            out[j] = flat.as_strided(t.shape, t.stride(), t.storage_offset() - lo)
    return out


@dataclass
class _Static:
    """One captured shape: its static inputs, per-layer graphs and the tensors they write."""

    layout: list  # the layout with each CachedSpan's data replaced by static buffers
    spans: list[tuple[int, SpanData]]  # (layout index, static data)
    ids: torch.Tensor  # [n_live] int64
    positions: torch.Tensor  # [n_live] int64, fixed by the layout
    state: SequenceState  # the layers' entering states as static buffers (reset before runs)
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> its static entering state
    arena: backends.HostConstants
    graphs: list = field(default_factory=list)
    logits: torch.Tensor | None = None
    rec: Recording | None = None
    nbytes: int = 0
    # Patched binding (see plan_patching): layer -> [(slot, index, span position, "T" | "S")], the
    # entries of the host-constant address tables that point at span T/S buffers
    patch: dict[int, list[tuple[int, int, int, str]]] = field(default_factory=dict)
    patched: bool = False
    expect: dict[tuple[int, int, str], tuple] = field(default_factory=dict)  # (span, layer, field) -> (shape, dtype)

    def patch_sites(self) -> dict[tuple[int, int, str], list[tuple[int, int]]] | None:
        """Where the graphs' address tables (the fold's, compose_states_blocks) point at the spans'
        static T and S buffers; None unless every span T and S of every layer is found there."""
        addresses = {}
        for j, (_, data) in enumerate(self.spans):
            for lay, span in data.linear.items():
                addresses[span.T.data_ptr()] = (j, lay, "T")
                addresses[span.S.data_ptr()] = (j, lay, "S")
        sites = find_patch_sites(self.arena.values, addresses)
        return sites if set(sites) == set(addresses.values()) else None

    def plan_patching(self, sites) -> None:
        """From now on bind span T and S by rewriting the address tables at `sites` (patch_tables)
        instead of copying them into the static buffers."""
        self.patch = {}
        for (j, lay, name), where in sites.items():
            self.patch.setdefault(lay, []).extend((k, i, j, name) for k, i in where)
        self.expect = {
            (j, lay, name): (tuple(getattr(sp, name).shape), getattr(sp, name).dtype, getattr(sp, name).device)
            for j, (_, data) in enumerate(self.spans)
            for lay, sp in data.linear.items()
            for name in ("T", "S")
        }
        self.patched = True

    def cancel_patching(self) -> None:
        """Back to copied T and S (after a failed patching check): tables at the static buffers."""
        self.patch, self.expect, self.patched = {}, {}, False
        for slot, values in zip(self.arena.slots, self.arena.values):
            slot.copy_(values)

    def drop_static_transitions(self) -> None:
        """Free the static T and S buffers, which patched binding does not read (no copies of the
        3.2 GB of T and S of a 32 x 1k fp32 request); the caller has checked, with those buffers
        poisoned, that the graphs read T and S only through the tables."""
        for _, data in self.spans:
            for lay, span in list(data.linear.items()):
                self.nbytes -= sum(t.numel() * t.element_size() for t in (span.T, span.S))
                data.linear[lay] = LinearSpan(None, None, span.conv_tail)

    def patch_tables(self, layout) -> None:
        """Point the address tables' span entries at the request's span T and S, in one host-to-
        device copy per table, queued before any layer's graph: the addresses are read without
        waiting for arriving layers (peek); each graph still waits for its layer's arrival in bind.
        Raises GraphUnsupported before any copy if a tensor does not fit."""
        tables: dict[int, list[int]] = {}
        for layer, sites in self.patch.items():
            for k, i, j, name in sites:
                t = getattr(peek(layout[self.spans[j][0]].data.linear, layer), name)
                shape, dtype, device = self.expect[(j, layer, name)]
                if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
                    raise GraphUnsupported(
                        f"layer {layer}: span {name} {t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()}) "
                        f"does not fit the graph's {dtype} {shape}"
                    )
                if k not in tables:
                    tables[k] = self.arena.values[k].reshape(-1).tolist()
                tables[k][i] = t.data_ptr()
        for k, values in tables.items():
            host = torch.tensor(values, dtype=torch.int64)
            self.arena.slots[k].copy_(backends.pin(host).view(self.arena.slots[k].shape), non_blocking=True)

    def reset_state(self, layer: int | None = None) -> None:
        """Point the static state back at its input buffers (all layers, or one)."""
        for i, (a, b) in self.inputs.items():
            if layer is not None and i != layer:
                continue
            if i in self.state.linear:
                self.state.linear[i] = LinearState(a, b)
            else:
                self.state.attn[i] = AttnState(a, b)

    def bind(self, layer: int, state: SequenceState, layout, ids: torch.Tensor | None) -> None:
        """Copy layer `layer`'s request tensors into the static buffers (ids with the first layer;
        span T and S too unless patched: patch_tables first). Raises GraphUnsupported where a tensor
        does not match its buffer (nothing written yet to the caller's state)."""
        dst, src = [], []
        if ids is not None:
            self.ids.copy_(backends.pin(ids), non_blocking=True)
        if layer in self.inputs:
            real = state.linear[layer] if layer in state.linear else state.attn[layer]
            pair = (real.ssm, real.conv) if layer in state.linear else (real.k, real.v)
            dst += self.inputs[layer]
            src += pair
        for idx, data in self.spans:
            real = layout[idx].data
            if layer in data.linear:
                s, r = data.linear[layer], real.linear[layer]  # indexing waits for arriving layers
                if self.patched:
                    dst.append(s.conv_tail)
                    src.append(r.conv_tail)
                else:
                    dst += (s.T, s.S, s.conv_tail)
                    src += (r.T, r.S, r.conv_tail)
            elif layer in data.attn:
                s, r = data.attn[layer], real.attn[layer]
                dst += (s.k, s.v)
                src += (r.k, r.v)
        for d, s in zip(dst, src):
            if d.shape != s.shape or d.dtype != s.dtype or d.device != s.device:
                raise GraphUnsupported(
                    f"layer {layer}: a {s.dtype} {tuple(s.shape)} tensor on {s.device} does not fit its "
                    f"graph buffer {d.dtype} {tuple(d.shape)}"
                )
        # one multi-tensor copy per dtype: a list that mixes dtypes leaves torch's fused path, and
        # its tensor-by-tensor copies (thousands at a many-segment shape) cost GPU time and more of
        # the host's
        groups: dict[torch.dtype, tuple[list, list]] = {}
        for d, s in zip(dst, src):
            g = groups.setdefault(d.dtype, ([], []))
            g[0].append(d)
            g[1].append(s)
        for ds, ss in groups.values():
            torch._foreach_copy_(ds, ss)

    def collect(self, state: SequenceState, end: int) -> tuple[torch.Tensor | None, Recording]:
        """Clone what the request keeps out of the graphs' memory (the tensors the last run left in
        the static state and recording) into `state` and a new Recording."""
        order = sorted(self.inputs)
        held = [self.state.linear[i] if i in self.state.linear else self.state.attn[i] for i in order]
        flat = [t for s in held for t in ((s.ssm, s.conv) if isinstance(s, LinearState) else (s.k, s.v))]
        snaps = [(idx, lay, s) for idx, by_layer in self.rec.snapshots.items() for lay, s in by_layer.items()]
        flat += [t for _, _, s in snaps for t in (s.ssm, s.conv)]
        hidden = sorted(self.rec.hidden.items())
        flat += [h for _, h in hidden]
        if self.logits is not None:
            flat.append(self.logits)
        out = iter(clone_out(flat))
        for i in order:
            a, b = next(out), next(out)
            if i in state.linear:
                state.linear[i] = LinearState(a, b)
            else:
                state.attn[i] = AttnState(a, b)
        state.length = end
        rec = Recording()
        for idx, lay, _ in snaps:
            rec.snapshots.setdefault(idx, {})[lay] = LinearState(next(out), next(out))
        for i, _ in hidden:
            rec.hidden[i] = next(out)
        return (next(out) if self.logits is not None else None), rec


def find_patch_sites(tables: list[torch.Tensor], addresses: dict[int, tuple]) -> dict[tuple, list[tuple[int, int]]]:
    """For host int64 tables (the host constants of a captured pass) and device addresses -> keys:
    where each address appears, {key: [(table, index), ...]} (index tensors hold small numbers,
    never a device address)."""
    sites: dict[tuple, list[tuple[int, int]]] = {}
    for k, table in enumerate(tables):
        if table.dtype != torch.int64:
            continue
        for i, value in enumerate(table.reshape(-1).tolist()):
            key = addresses.get(value)
            if key is not None:
                sites.setdefault(key, []).append((k, i))
    return sites


def _static_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _build_static(model, state: SequenceState, layout, positions: torch.Tensor, n_live: int, arena) -> _Static:
    static_layout, spans, nbytes = [], [], 0
    for idx, p in enumerate(layout):
        if not isinstance(p, CachedSpan):
            static_layout.append(p)
            continue
        d = p.data
        lin = {
            i: LinearSpan(*(_static_copy(t) for t in (s.T, s.S, s.conv_tail)))
            for i, s in ((i, peek(d.linear, i)) for i in d.linear)
        }
        att = {i: AttnSpan(_static_copy(a.k), _static_copy(a.v)) for i, a in ((i, peek(d.attn, i)) for i in d.attn)}
        data = SpanData(d.num_tokens, d.local_start, lin, att)
        nbytes += sum(t.numel() * t.element_size() for s in lin.values() for t in (s.T, s.S, s.conv_tail))
        nbytes += sum(t.numel() * t.element_size() for a in att.values() for t in (a.k, a.v))
        static_layout.append(CachedSpan(data, p.start, p.use_transition))
        spans.append((idx, data))
    inputs = {i: (_static_copy(s.ssm), _static_copy(s.conv)) for i, s in state.linear.items()}
    inputs.update({i: (_static_copy(a.k), _static_copy(a.v)) for i, a in state.attn.items()})
    st = SequenceState(state.length, {i: None for i in state.linear}, {i: None for i in state.attn})
    ids = torch.empty(n_live, dtype=torch.long, device=model.device)
    static = _Static(static_layout, spans, ids, positions, st, inputs, arena, nbytes=nbytes)
    static.reset_state()
    return static


class CudaLayerGraph:
    """One layer's CUDA graph, captured on a side stream (`stream`: the runner's capture stream)
    into a memory pool shared by the shape's layers (they replay in capture order, never
    concurrently, so the pool's blocks may be shared)."""

    def __init__(self, pool, device, stream=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.device = device
        self.stream = stream

    def capture(self, fn, reset=None):
        """Capture fn() (the layer's pass) and return its outputs. `reset` (point the layer's state
        back at its input buffers) is for graphs that rerun Python on replay; a CUDA graph does not."""
        main = torch.cuda.current_stream(self.device)
        side = self.stream if self.stream is not None else torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            # thread_local: other threads' CUDA calls (a server's) neither break this capture nor
            # are refused while it runs
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                self.graph.capture_end()
        main.wait_stream(side)
        return out

    def replay(self):
        self.graph.replay()


class _NoFlaTensorCache:
    """fla memoizes index tensors by argument identity in small queues; a tensor made eagerly and
    read by a graph could be evicted and freed later. During capture the memo is off, so such
    tensors are made inside the graph (or the capture fails and the shape runs eagerly)."""

    def __enter__(self):
        import sys

        self.mod = sys.modules.get("fla.utils")
        if self.mod is not None:
            self.old = getattr(self.mod, "FLA_DISABLE_TENSOR_CACHE", False)
            self.mod.FLA_DISABLE_TENSOR_CACHE = True

    def __exit__(self, *exc):
        if self.mod is not None:
            self.mod.FLA_DISABLE_TENSOR_CACHE = self.old


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _max_abs_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


class _KeyedGraphs:
    """What LayoutGraphs and AssemblyGraphs keep alike: graphs per key, `max_graphs` of them, least
    recently used dropped first; a key captured the `capture_after`-th time it is seen (the first
    runs eagerly, compiling and autotuning its kernels); keys whose capture failed stay eager."""

    def __init__(self, model, max_graphs: int, capture_after: int, graph_factory=None):
        if max_graphs < 1 or capture_after < 1:
            raise ValueError("max_graphs and capture_after must be >= 1")
        self.model = model
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self._graph_factory = graph_factory or CudaLayerGraph
        self._graphs: OrderedDict[tuple, object] = OrderedDict()
        self._seen: dict[tuple, int] = {}
        self.failed: dict[tuple, str] = {}
        self._lock = threading.Lock()
        self.stats = {"captures": 0, "replays": 0, "eager": 0, "failures": 0}

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (and what is known of keys); needed after the weights change."""
        with self._lock:
            self._graphs.clear()
            self._seen.clear()
            self.failed.clear()

    def _due(self, key) -> bool:
        """Count a sighting of `key`, which has no graphs: is it its capture's turn (else it runs
        eagerly this time)?"""
        self._seen[key] = self._seen.get(key, 0) + 1
        if len(self._seen) > 4096:  # keys seen once each, e.g. decode-like traffic: forget them
            self._seen = {key: self._seen[key]}
        if self._seen[key] < self.capture_after:
            self.stats["eager"] += 1
            return False
        return True

    def _fail(self, key, error: Exception, what: str) -> None:
        self.failed[key] = f"{type(error).__name__}: {error}"
        self.stats["failures"] += 1
        log.warning("%s, runs eagerly: %s", what, self.failed[key])

    def _keep(self, key, static) -> None:
        self._graphs[key] = static
        self.stats["captures"] += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)


class LayoutGraphs(_KeyedGraphs):
    """Per-shape CUDA graphs of a model's live pass (module docstring). `max_graphs` shapes are
    kept, least recently used dropped first; a shape is captured the `capture_after`-th time it is
    seen (its first run compiles and autotunes kernels on the eager path). `graph_factory(pool,
    device)` makes a layer's graph (CudaLayerGraph)."""

    def __init__(self, model, max_graphs: int = 4, capture_after: int = 2, graph_factory=None):
        super().__init__(model, max_graphs, capture_after, graph_factory)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the static entry buffers of the shapes kept (their graphs' pools come on top)."""
        return sum(s.nbytes for s in self._graphs.values())

    @torch.no_grad()
    def run(self, state: SequenceState, layout, logits_for, snapshot_after, capture_hidden):
        """(logits, rec) of the live pass from this layout's graphs, updating `state` as the eager
        forward does; None when the caller should run the eager forward instead."""
        key = layout_key(state, layout, logits_for, snapshot_after, capture_hidden)
        if key is None or key in self.failed or _capturing():
            return None
        if not self._lock.acquire(blocking=False):  # a concurrent forward holds the buffers
            return None
        try:
            static = self._graphs.get(key)
            if static is None:
                if not self._due(key):
                    return None
                return self._capture(key, state, layout, logits_for, snapshot_after, capture_hidden)
            self._graphs.move_to_end(key)
            _, ids, _, end = new_recording(state, layout, snapshot_after)
            try:
                if static.patched:
                    static.patch_tables(layout)
                for i, graph in enumerate(static.graphs):
                    static.bind(i, state, layout, ids if i == 0 else None)
                    graph.replay()
            except GraphUnsupported as e:
                log.warning("a captured shape's graphs not used: %s", e)
                self.stats["eager"] += 1
                return None
            self.stats["replays"] += 1
            return static.collect(state, end)
        finally:
            self._lock.release()

    def _try_patching(self, static: _Static, state, layout, eager: SequenceState, eager_logits, end) -> None:
        """Switch the shape to patched binding of span T and S if the graphs read them only through
        address tables: with the static T and S buffers poisoned (NaN) and the tables pointing at
        this request's own T and S, a replay must give the eager answer; else copies stay."""
        sites = static.patch_sites()
        if sites is None:
            return
        _poison(static)
        static.plan_patching(sites)
        try:
            static.patch_tables(layout)
            for graph in static.graphs:
                graph.replay()
            check = SequenceState(state.length, dict(state.linear), dict(state.attn))
            logits, _ = static.collect(check, end)
            _check_same(eager, eager_logits, check, logits)
        except GraphUnsupported as e:
            log.warning("span T and S of a captured shape stay copied: %s", e)
            static.cancel_patching()  # the next bind copies T and S into the static buffers again
            return
        static.drop_static_transitions()

    def _capture(self, key, state, layout, logits_for, snapshot_after, capture_hidden):
        """Run this request eagerly on new static buffers, then capture and check the graphs. Returns
        the eager answer (state updated); None, before touching the state, if binding failed."""
        model = self.model
        _, ids, positions, end = new_recording(state, layout, snapshot_after)
        arena = backends.HostConstants()
        static = _build_static(model, state, layout, backends.to_device_async(positions, model.device), len(ids), arena)
        n_layers = len(model.layers)

        def live_pass(rec, only=None, x=None):
            """The forward's layer loop over the static buffers (layer `only` alone, from x)."""
            for i in range(n_layers) if only is None else (only,):
                if i == 0:
                    x = model.embed(static.ids)[None]  # [1, n_live, h]
                x = model.run_layer(i, x, static.layout, static.state, rec, static.positions, capture_hidden)
                if i == n_layers - 1:
                    static.logits = model.logits_of(x, logits_for)
            return x

        try:
            for i in range(n_layers):
                static.bind(i, state, layout, ids if i == 0 else None)
        except GraphUnsupported as e:
            self.failed[key] = str(e)
            self.stats["failures"] += 1
            return None
        # 1. this request, eagerly on the static buffers (every kernel and cache warm, host constants measured)
        backends.clear_kept()
        static.rec = new_recording(static.state, static.layout, snapshot_after)[0]
        with arena.measuring():
            live_pass(static.rec)
        result = SequenceState(state.length, dict(state.linear), dict(state.attn))
        answer = static.collect(result, end)
        try:
            # 2. capture, layer by layer
            static.reset_state()
            static.rec = new_recording(static.state, static.layout, snapshot_after)[0]
            static.logits = None
            backends.clear_kept()
            pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
            x = None
            with arena.serving(), _NoFlaTensorCache():
                for i in range(n_layers):
                    graph = self._graph_factory(pool, model.device)
                    x = graph.capture(
                        lambda i=i, x=x: live_pass(static.rec, i, x), reset=lambda i=i: static.reset_state(i)
                    )
                    static.graphs.append(graph)
            backends.clear_kept()
            # 3. one replay on the same inputs must give the eager answer
            for graph in static.graphs:
                graph.replay()
            graphed = SequenceState(state.length, dict(state.linear), dict(state.attn))
            logits, _ = static.collect(graphed, end)
            _check_same(result, answer[0], graphed, logits)
            self._try_patching(static, state, layout, result, answer[0], end)
        except Exception as e:  # noqa: BLE001 (whatever fails here, the shape runs eagerly)
            self._fail(key, e, "live pass of a layout shape not captured")
        else:
            self._keep(key, static)
        # the eager answer stands either way
        state.linear.update(result.linear)
        state.attn.update(result.attn)
        state.length = end
        return answer


def _poison(static: _Static) -> None:
    for _, data in static.spans:
        for span in data.linear.values():
            span.T.fill_(float("nan"))
            span.S.fill_(float("nan"))


def _check_same(eager: SequenceState, eager_logits, graphed: SequenceState, graphed_logits) -> None:
    """The replayed graphs' logits and states against the eager pass's: the same kernels on the same
    inputs, equal up to the order of floating-point reductions."""
    pairs = [("logits", eager_logits, graphed_logits)] if eager_logits is not None else []
    pairs += [(f"layer {i}'s state", s.ssm, graphed.linear[i].ssm) for i, s in eager.linear.items()]
    pairs += [(f"layer {i}'s keys", a.k, graphed.attn[i].k) for i, a in eager.attn.items()]
    for name, a, b in pairs:
        if a.shape != b.shape:
            raise GraphUnsupported(f"the replayed graphs' {name} has shape {tuple(b.shape)}, not {tuple(a.shape)}")
        gap = _max_abs_gap(a, b)
        scale = float(a.float().abs().max()) if a.numel() else 0.0
        if not gap <= 1e-3 * (scale + 1.0):
            raise GraphUnsupported(f"the replayed graphs' {name} differs from the eager pass's by {gap:.3g}")


class AssemblyGraphs(_KeyedGraphs):
    """CUDA graphs of planned assemblies (models/assembly.py), one set per plan key (a bucket of
    live structures), not per exact layout: a RAG request of any documents' lengths replays the
    graphs its bucket captured. Per key, one graph per layer (the embedding with the first, the
    head with the last) over a static plan (AssemblyBatch.static_copy: the index block, each
    layer's conv sources and fold tables, the K/V rows) and static linear-state inputs; the K/V
    are the request's pages, read through the table row in the static plan. A run

    1. copies the request's index block into the static plan (one copy) and its K/V rows;
    2. per layer: binds the layer's request data (AssemblyBatch.fill: conv sources, fold tables,
       the spans' K/V into the pages) and its entering linear state, then replays the layer;
    3. clones what the request keeps out of the graphs' memory (states, logits, kept states,
       captured hidden states).

    A key is captured the `capture_after`-th time it is seen (the first runs eagerly over the plan,
    compiling and autotuning its kernels), then replayed once and checked against that eager
    answer; a capture that fails or differs leaves the key eager. `max_graphs` keys are kept, least
    recently used dropped. The pool's tensors are part of the key (a pool reallocated by growth,
    paged.KVPages.generation, is another key)."""

    def __init__(self, model, max_graphs: int = 8, capture_after: int = 2, graph_factory=None):
        super().__init__(model, max_graphs, capture_after, graph_factory)

    @staticmethod
    def _key(state, plan) -> tuple:
        pages = next(iter(state.attn.values())).pages
        return (*plan.key, id(pages), pages.generation)

    @torch.no_grad()
    def run(self, state: SequenceState, plan):
        """(logits, rec) of the planned pass from its key's graphs, updating `state` as
        LayoutLM.forward_planned does; None when the caller should run that eager pass instead."""
        key = self._key(state, plan)
        if key in self.failed or _capturing():
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            static = self._graphs.get(key)
            if static is None:
                if not self._due(key):
                    return None
                return self._capture(key, state, plan)
            self._graphs.move_to_end(key)
            self.stats["replays"] += 1
            return self._replay(static, state, plan)
        finally:
            self._lock.release()

    def _bind(self, static: dict, state, plan, layer: int) -> None:
        """Layer `layer`'s request data and entering state (state.linear, the request's) into the
        static buffers; what the static state holds is left alone (after a capture, the tensors
        the layer's graph writes)."""
        static["plan"].fill(self.model, layer, state, plan)
        if layer in state.linear:
            s = state.linear[layer]
            torch._foreach_copy_(list(static["inputs"][layer]), [s.ssm, s.conv])

    def _reset(self, static: dict, layer: int | None = None) -> None:
        """Point the static state's layer (every layer by default) at its input buffers: before a
        pass over the static buffers, and before a graph double reruns a layer on replay."""
        for i, pair in static["inputs"].items():
            if layer is None or i == layer:
                static["state"].linear[i] = LinearState(*pair)

    def _replay(self, static: dict, state, plan):
        sp = static["plan"]
        sp.load(plan)
        try:
            sp.bind_rows(state, plan)
            static["replays"] = static.get("replays", 0) + 1
            for i, graph in enumerate(static["graphs"]):
                self._bind(static, state, plan, i)
                graph.replay()
            return self._collect(static, state, plan, lend=True)
        finally:
            sp.forget_request()

    def _collect(self, static: dict, state, plan, lend: bool = False):
        """Clone what the request keeps out of the graphs' memory into `state` and a Recording.
        lend: the kept states (part-chain snapshots, read after the first token) are left where
        the graphs wrote them, the Recording `borrowed` until this key's graphs run again (its
        keeper copies them: Engine._keep_chains), instead of copied before the first token."""
        from hybridcache.services.runtime.models.assembly import PLANNED_SNAPSHOTS, finish_recording

        st, rec = static["state"], static["rec"]
        order = sorted(st.linear)
        flat = [t for i in order for t in (st.linear[i].ssm, st.linear[i].conv)]
        snaps = sorted(k for k in rec.scratch if isinstance(k, tuple) and k[0] == PLANNED_SNAPSHOTS)
        lent = {k: rec.scratch[k] for k in snaps} if lend else {}
        flat += [t for k in snaps if k not in lent for t in rec.scratch[k]]
        hidden = sorted(rec.hidden)
        flat += [rec.hidden[i] for i in hidden]
        logits = static["logits"]
        if logits is not None:
            flat.append(logits)
        out = iter(clone_out(flat))
        for i in order:
            state.linear[i] = LinearState(next(out), next(out))
        mine = Recording()
        for k in snaps:
            mine.scratch[k] = lent[k] if k in lent else (next(out), next(out))
        if lent:
            mine.borrowed = functools.partial(_not_replayed_since, static, static["replays"])
        for i in hidden:
            mine.hidden[i] = next(out)
        logits = next(out) if logits is not None else None
        for idx in plan.snapshots:
            mine.snapshots[idx] = {}
        finish_recording(plan, mine)
        state.length = plan.end
        return logits, mine

    def _capture(self, key, state, plan):
        """This request eagerly on new static buffers (its answer, every kernel warm), then each
        layer captured, then one replay that must give that answer; the eager answer stands
        either way. None (before touching the state) when binding fails."""
        from hybridcache.services.runtime.models.common import new_planned_recording

        model = self.model
        sp = plan.static_copy()
        inputs = {i: (_static_copy(s.ssm), _static_copy(s.conv)) for i, s in state.linear.items()}
        st = SequenceState(state.length, {}, dict(state.attn))
        static = {"plan": sp, "inputs": inputs, "state": st, "graphs": [], "logits": None, "rec": None}
        n_layers = len(model.layers)

        def live_pass(rec, i, x):
            if i == 0:
                x = model.embed(sp.ids)[None]
            x = model.run_layer(i, x, sp, st, rec, sp.positions, plan.host["capture"])
            if i == n_layers - 1:
                static["logits"] = sp.logits(model, x)
            return x

        try:
            sp.load(plan)
            sp.bind_rows(state, plan)
            # 1. this request, eagerly on the static buffers
            backends.clear_kept()
            static["rec"] = new_planned_recording(plan)
            self._reset(static)
            x = None
            for i in range(n_layers):
                self._bind(static, state, plan, i)
                x = live_pass(static["rec"], i, x)
            answer_state = SequenceState(state.length, dict(state.linear), dict(state.attn))
            answer = self._collect(static, answer_state, plan)
        except Exception as e:  # noqa: BLE001 - binding or the pass failed: the caller runs eagerly
            self._fail(key, e, "planned assembly not run on static buffers")
            return None
        try:
            # 2. capture, layer by layer (each layer's request data bound before it, outside the graph)
            static["rec"] = new_planned_recording(plan)
            static["logits"] = None
            backends.clear_kept()
            pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
            self._reset(static)
            x = None
            with _NoFlaTensorCache():
                for i in range(n_layers):
                    self._bind(static, state, plan, i)
                    graph = self._graph_factory(pool, model.device)
                    x = graph.capture(lambda i=i, x=x: live_pass(static["rec"], i, x),
                                      reset=lambda i=i: self._reset(static, i))
                    static["graphs"].append(graph)
            backends.clear_kept()
            # 3. one replay on the same request must give the eager answer
            check = SequenceState(state.length, dict(state.linear), dict(state.attn))
            logits, _ = self._replay(static, check, plan)
            _check_same(answer_state, answer[0], check, logits)
        except Exception as e:  # noqa: BLE001 (whatever fails here, the key runs eagerly)
            self._fail(key, e, "planned assembly of a bucket not captured")
        else:
            self._keep(key, static)
        sp.forget_request()
        state.linear.update(answer_state.linear)
        state.length = answer_state.length
        return answer



def _not_replayed_since(static: dict, replays: int) -> bool:
    return static.get("replays", 0) == replays


class ReplayGraphs(_KeyedGraphs):
    """A suffix_replay restore's replays (cache/policies.restore_pages: each linear group run over
    the page anchors of its last k tokens from a zero state) from CUDA graphs, one per (group,
    anchors, dtype). The replay has the same shape at every restore, so after a key's first eager
    run (kernels compiled) its capture serves every later restore: the eager replay issues tens of
    launches a layer from Python for 64 tokens of GPU work.

    A graph reads a static anchor buffer and zero states it clears itself, and leaves each layer's
    state in its own memory; a restore copies the anchors in, replays, and clones the states out.
    The capture's eager run on the static buffers is that restore's answer, and the first replay
    must reproduce it (else the key stays eager), as with LayoutGraphs."""

    def __init__(self, model, max_graphs: int = 64, capture_after: int = 2, graph_factory=None):
        super().__init__(model, max_graphs, capture_after, graph_factory)
        self._pool = None

    def run(self, group: tuple[int, ...], hidden: torch.Tensor, state: SequenceState) -> None:
        """model.replay_linear_group(group, hidden, state) for a state whose group layers are zero
        (what suffix_replay restores from), from the key's graph where there is one."""
        key = (tuple(group), hidden.shape[0], hidden.dtype)
        with self._lock:
            static = self._graphs.get(key)
            if static is None:
                if key not in self.failed and self._due(key):
                    self._capture(key, group, hidden, state)  # its eager run answers this restore
                else:
                    self.model.replay_linear_group(group, hidden, state)
                return
            self._graphs.move_to_end(key)
            static["hidden"].copy_(hidden)
            out = static["graph"].replay() or static["out"]
            self.stats["replays"] += 1
        for i in group:
            ssm, conv = out[i]
            state.linear[i] = LinearState(ssm.clone(), conv.clone())

    def _pass(self, group, static) -> dict:
        """The group's replay over the static buffers: its states cleared, then run; the outputs."""
        for s in static["init"].values():
            s.ssm.zero_()
            s.conv.zero_()
        st = SequenceState(0, {i: LinearState(s.ssm, s.conv) for i, s in static["init"].items()}, {})
        self.model.replay_linear_group(group, static["hidden"], st)
        return {i: (st.linear[i].ssm, st.linear[i].conv) for i in group}

    def _capture(self, key, group, hidden, state) -> None:
        """This restore eagerly on new static buffers (its answer, every kernel warm), the capture,
        one replay that must give that answer. The answer goes into `state` either way; a failed
        capture leaves the key eager from then on."""
        model = self.model
        zero = model.empty_state().linear
        static = {"hidden": hidden.detach().clone(), "init": {i: zero[i] for i in group}, "graph": None, "out": None}
        arena = backends.HostConstants()
        backends.clear_kept()
        with arena.measuring():
            answer = {i: (s.clone(), c.clone()) for i, (s, c) in self._pass(group, static).items()}
        for i in group:
            state.linear[i] = LinearState(*answer[i])
        try:
            backends.clear_kept()
            if self._pool is None and model.device.type == "cuda":
                self._pool = torch.cuda.graph_pool_handle()
            graph = self._graph_factory(self._pool, model.device)
            with arena.serving(), _NoFlaTensorCache():
                out = graph.capture(lambda: self._pass(group, static))
            backends.clear_kept()
            out = graph.replay() or out
            for i in group:
                for name, a, b in (("state", answer[i][0], out[i][0]), ("conv tail", answer[i][1], out[i][1])):
                    gap = _max_abs_gap(a, b) if a.shape == b.shape else float("inf")
                    if not gap <= 1e-3 * (float(a.float().abs().max()) + 1.0):
                        raise GraphUnsupported(f"the replayed graph's layer {i} {name} differs from the eager "
                                               f"pass's by {gap:.3g}")
        except Exception as e:  # noqa: BLE001 (whatever fails here, the key runs eagerly)
            self._fail(key, e, f"replay of linear group {group[0]}-{group[-1]} over {key[1]} anchors not captured")
            return
        static["graph"], static["out"], static["arena"] = graph, out, arena
        self._keep(key, static)
