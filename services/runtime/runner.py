"""How a planned request executes on one model: the ModelRunner.

The split of the runtime, top to bottom:

    plan.Planner       what a request is (parsed, tokenized, its entry and chain keys); torch-free
    scheduler          when requests run: admission, prefill budgets, one batched decode step a time
    engine.Engine      the caches (entries, part chains, prefix pages), the layout of a request, stats
    ModelRunner        execution: the forward of a layout, cold builds, decode steps, staging
    models/            checkpoint-compatible layers and the math (LayoutLM, the mixers)

A ModelRunner is built from a model and a RuntimeConfig and owns how that model executes:

- the op implementations (`dispatch`, a backends.OpDispatch: fast kernels or the references, the
  SDPA backends allowed), entered for the duration of each of its calls (backends.dispatching, a
  context variable: another runner, or code outside any, keeps its own choice);
- on CUDA, the linear layers' weight layout and one-row kernel (`gemv_plan`: backends.plan_gemv
  times, per weight shape, cuBLAS on the row-major and on the column-major weight and
  kernels/ops/gemv's Triton GEMV as a decode step runs them; the weights whose shape is faster
  column-major are stored so, checked by the model's logits on a probe; the layers go through
  backends.linear);
- the CUDA graphs of assemblies (`layout_graphs`, a graphs.LayoutGraphs per model, per layout
  shape), of decode steps (a paged.DecodeGraphs per pool it made, per padded batch size) and of
  suffix_replay restores (`replay_graphs`, a graphs.ReplayGraphs: per linear group and anchor
  count, with `--cuda-graphs`), their capture stream, and whether they apply (`graphs_apply`: a
  CUDA model whose forward has no host synchronization (LayoutLM.cuda_graphs), the fast kernels,
  the config's switches; `eager()` turns them off for a block). The model holds none of it: models are layers and math.

Then it runs

- `forward`: the live pass of a layout from a SequenceState (updated in place), from the CUDA
  graphs of its shape where they apply, else the model's eager forward; the same answer either way;
- `build_span` / `build_spans` / `prompt_spans`: the standalone prefill of cold segments into span
  data, one at a time or batched by similar length (entry_batches, LayoutLM.build_span_data), and
  of whole prompts from empty states;
- `new_state_pool` / `decode` / `warm_decode`: the paged states of running requests and one
  batched decode step over them (paged.decode_step), replayed from its decode graphs;
- `restore_state`: a page-tree hit's state rebuilt from its pages (cache/policies.restore_state,
  which replays anchors through the model; suffix_replay's fixed-length replays from their graphs);
- `stage`: entries of the host tier onto the model's device, layer by layer;
- every change of a tensor the engine's caches hold: `as_entries` (an entry's state dtype and
  policy), `snapshot` / `restore_snapshot` (the part-chain store's states), `record` /
  `page_payloads` / `checkpoint_payload` / `drop_recorded` / `forget_recorded` (a request's page
  recorder and the payloads of its pages),
  `to_host` (the host tier's demotion), `assign` / `release` (a request's slot in a pool).

What the results mean for a request (entry keys and policy, which pages, statistics) is the
engine's business. Under tensor parallelism every rank holds a runner over its shard and rank 0's
is a tensor_parallel.ranks.RankedRunner: each of its calls runs on every rank, so the engine on
rank 0 keeps the bookkeeping and each rank holds its slices of the tensors it names. That is why
the engine never changes such a tensor itself.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref

import torch
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.cache.entry import SegmentEntry, cast_entry_states
from hybridcache.services.runtime.cache.host_tier import stage, to_host
from hybridcache.services.runtime.cache.policies import PageRecorder, restore_pages
from hybridcache.services.runtime.cache.prefix import PrefixSnapshot
from hybridcache.services.runtime.cache.radix import PagePayload
from hybridcache.services.runtime.cache.single_state import single_state_view
from hybridcache.services.runtime.graphs import AssemblyGraphs, CudaLayerGraph, LayoutGraphs, ReplayGraphs
from hybridcache.services.runtime.models.assembly import plan_assembly
from hybridcache.services.runtime.paged import DecodeGraphs, StatePool, decode_step, extend_pages
from hybridcache.services.runtime.sequence import (
    AttnState,
    CachedSpan,
    LinearState,
    LiveRun,
    SequenceState,
    SpanData,
)

log = logging.getLogger("hybridcache.runner")

def entry_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """How build_spans groups cold segments into batched prefills: indices in increasing length,
    cut into as few batches as fit `max_tokens` padded tokens each (count x longest; a segment
    longer than that goes alone), and among those cuts the one whose largest batch is smallest.
    18 equal segments that fit 16 to a batch are two batches of 9, not 16 and 2: a batch of 2 uses
    the GPU poorly, and the worker that builds it finishes last. Segment parallelism mirrors this
    order to stream a batch's entries layer by layer."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])

    def cut(limit: int) -> list[list[int]]:
        batches: list[list[int]] = []
        batch: list[int] = []
        for i in order:
            if batch and (len(batch) + 1) * lengths[i] > limit:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
        return batches

    fewest = cut(max_tokens)
    if len(fewest) < 2:
        return fewest
    # the smallest limit that still needs no more batches: the cut is then as even as it gets
    lo, hi = 1, max_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if len(cut(mid)) <= len(fewest):
            hi = mid
        else:
            lo = mid + 1
    return cut(lo)


class PartedForward:
    """A forward run part by part (ModelRunner.forward_parts / run_part): its generator. Under
    tensor parallelism each rank holds its own and the runner's calls step each rank's."""

    def __init__(self, gen):
        self.gen = gen

    def close(self) -> None:
        # (a method of its own makes the tensor-parallel group hand rank 0's caller a handle to
        # each rank's object, ranks.RankObject, rather than rank 0's generator)
        self.gen.close()


def _executes(method):
    """A runner method that runs the model: under the runner's op choice, without autograd."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with backends.dispatching(self.dispatch), torch.no_grad():
            return method(self, *args, **kwargs)

    return run


class ModelRunner:
    """Execution of layouts, cold builds and decode steps on `model` as `config` says (module
    docstring): the op choice, the CUDA graphs and the device state are this object's."""

    def __init__(self, model, config: RuntimeConfig | None = None, dispatch: backends.OpDispatch | None = None):
        """`dispatch`: the op choice when not the config's (a benchmark or test forcing the MoE path)."""
        self.model = model
        self.config = config = config or RuntimeConfig()
        self.dispatch = dispatch or backends.OpDispatch.of(config)
        # the longest sequence a running request may reach (the decode pool's table width)
        self.max_len = config.max_model_len or model.cfg.max_position_embeddings
        # What tensor parallelism (a shard of the model, tp_size > 1; tensor_parallel/ranks.py runs
        # this runner's calls on every rank) turns off, here alone:
        # - CUDA graphs: a rank's capture or replay would have to meet the other ranks' in their
        #   all-reduces, and a capture that fails on one rank alone would leave the ranks on
        #   different paths (one waiting in a collective the other never reaches);
        # - overlapped decode steps (`overlaps`, the scheduler's): a step's picks stay on rank 0's
        #   device as the next step's inputs, which the other ranks cannot read.
        # Batched prefills of plain prompts and batched cold builds run on every rank alike.
        single = getattr(model, "tp_size", 1) == 1
        # CUDA graphs apply to a CUDA model whose forward has no host synchronization, run with the
        # fast kernels
        self.graphs_apply = (single and getattr(model, "cuda_graphs", False) and self.device.type == "cuda"
                             and self.dispatch.kernels != "reference")
        self.overlaps = single
        # one-row linear layers on CUDA: the Triton GEMV for the weight shapes where it measures
        # faster than cuBLAS on this device (backends.plan_gemv; {} where nothing was planned)
        self.gemv_plan: dict[str, dict] = {}
        self.column_major_layers = 0
        self.linear_plan_seconds = 0.0
        if (single and self.device.type == "cuda" and torch.cuda.is_available()
                and self.dispatch.kernels != "reference"):
            self._plan_linears()
        self.layout_graphs: LayoutGraphs | None = None
        self.assembly_graphs: AssemblyGraphs | None = None
        self.replay_graphs: ReplayGraphs | None = None  # suffix_replay restores (restore_state)
        if self.graphs_apply and config.cuda_graphs:
            self.replay_graphs = ReplayGraphs(model, graph_factory=self.graph_factory)
            self.layout_graphs = LayoutGraphs(model, max_graphs=config.cuda_graph_shapes,
                                              graph_factory=self.graph_factory)
            if getattr(model, "planned_assemblies", False):
                self.assembly_graphs = AssemblyGraphs(model, max_graphs=config.cuda_graph_shapes,
                                                      graph_factory=self.graph_factory)
        # planned assemblies cut live runs into sub-runs of the seam window's length (8 at least)
        self.run_tokens = max(8, config.seam_window)
        self.decode_graphs_on = self.graphs_apply and config.decode_cuda_graphs
        self._decode_graphs: weakref.WeakKeyDictionary[StatePool, DecodeGraphs] = weakref.WeakKeyDictionary()
        self._eager = False
        self._capture_stream = None

    @property
    def device(self) -> torch.device:
        return getattr(self.model, "device", torch.device("cpu"))

    # a relayout whose probe logits move more than this (relative RMS) is undone: bf16 GEMMs of
    # another order move them ~1e-3, a weight read in the wrong layout ~1
    LAYOUT_PROBE_TOLERANCE = 0.05

    @_executes
    def _plan_linears(self) -> None:
        """The one-row linear layers' plan on this device (backends.plan_gemv: cuBLAS on either
        weight layout or the Triton GEMV, per weight shape), the model's nn.Linear layers routed
        through backends.linear, and the weights whose plan says so stored column-major
        (backends.column_major_linears). The model's logits on a short probe prompt, and on one
        token, are compared before and after; a relayout that changes them is undone (logged)."""
        model = self.model
        t0 = time.perf_counter()
        self.gemv_plan = backends.plan_gemv(backends.gemv_weights(model))
        before = self._probe()
        backends.use_gemv_plan(model)
        changed = backends.column_major_linears(model)
        if changed:
            try:
                after = self._probe()
                gap = max(float((a - b).norm() / b.norm().clamp_min(1e-6)) for a, b in zip(after, before))
            except Exception as e:  # noqa: BLE001 (a consumer that cannot read the new layout)
                gap, after = float("inf"), e
            if not gap <= self.LAYOUT_PROBE_TOLERANCE:
                backends.to_row_major(model, changed)
                log.warning("column-major weights of %d linear layers undone: the probe's logits moved %s",
                            len(changed), after if isinstance(after, Exception) else f"{gap:.3g}")
                changed = []
        self.column_major_layers = len(changed)
        self.linear_plan_seconds = round(time.perf_counter() - t0, 3)

    def _probe(self) -> list[torch.Tensor]:
        """fp32 logits of a fixed 7-token prompt and of its first token alone, from empty states."""
        ids = torch.arange(7, device=self.device) * 7919 % self.model.cfg.vocab_size
        return [self.model.forward_layout(self.model.empty_state(), [LiveRun(t, 0)], "all")[0].float()
                for t in (ids, ids[:1])]

    def graph_factory(self, mempool, device):
        """A CUDA graph (graphs.CudaLayerGraph) captured on this runner's side stream."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(device)
        return CudaLayerGraph(mempool, device, self._capture_stream)

    @contextlib.contextmanager
    def eager(self):
        """Inside the block every forward and decode step runs eagerly; the graphs held are kept
        (a reference run beside graphed ones, in tests and benchmarks)."""
        prev, self._eager = self._eager, True
        try:
            yield
        finally:
            self._eager = prev

    @property
    def graph_stats(self) -> dict[str, int]:
        """The assembly graphs' counts (LayoutGraphs.stats and AssemblyGraphs.stats summed: shapes or
        buckets captured, replayed, run eagerly, failed); empty where they do not apply."""
        out: dict[str, int] = {}
        for graphs in (self.layout_graphs, self.assembly_graphs):
            if graphs is not None:
                for k, v in graphs.stats.items():
                    out[k] = out.get(k, 0) + v
        return out

    def empty_state(self) -> SequenceState:
        return self.model.empty_state()

    @_executes
    def forward(self, state: SequenceState, layout: list, logits_for: str = "last", snapshot_after=(),
                capture_hidden=()):
        """The live pass of `layout` from `state` (updated in place): LayoutLM.forward_layout's
        arguments and results. An assembly (a layout with cached spans) whose K/V lie in its
        request's pages runs planned (models/assembly.py) from its bucket's CUDA graphs
        (graphs.AssemblyGraphs: any layout of a bucket seen before), else eagerly over its plan;
        one with contiguous K/V of a shape seen before may run from that shape's graphs
        (graphs.LayoutGraphs). The same results either way."""
        if self.assembly_graphs is not None and not self._eager:
            plan = plan_assembly(self.model, state, layout, snapshot_after, capture_hidden, logits_for,
                                 self.run_tokens)
            if plan is not None:
                out = self.assembly_graphs.run(state, plan)
                return out if out is not None else self.model.forward_planned(state, plan)
        if self.layout_graphs is not None and not self._eager:
            out = self.layout_graphs.run(state, layout, logits_for, snapshot_after, capture_hidden)
            if out is not None:
                return out
        return self.model.forward_layout(state, layout, logits_for, snapshot_after, capture_hidden)

    def forward_parts(self, state: SequenceState, layout: list, logits_for: str = "last", snapshot_after=(),
                      capture_hidden=(), parts: int = 1) -> PartedForward:
        """forward to be run in up to `parts` calls of run_part, a run of consecutive layers each
        (LayoutLM.forward_layout_parts); nothing runs yet. The state is part-way between the
        calls. A layout with a cached span (one the assembly or layout graphs may run) runs whole
        in the first call."""
        if parts > 1 and not any(isinstance(p, CachedSpan) for p in layout):
            gen = self.model.forward_layout_parts(state, layout, logits_for, snapshot_after, capture_hidden, parts)
        else:
            gen = self._whole(state, layout, logits_for, snapshot_after, capture_hidden)
        return PartedForward(gen)

    def _whole(self, *args):
        return self.forward(*args)
        yield  # a generator that returns at its first next()

    @_executes
    def run_part(self, fwd: PartedForward):
        """The next part of a forward_parts forward: None while layers are left, else forward's
        (logits, rec)."""
        try:
            next(fwd.gen)
        except StopIteration as e:
            return e.value
        return None

    def close_parts(self, fwd: PartedForward) -> None:
        """Drop a forward_parts forward part-way (its state is left part-way: not to be used)."""
        fwd.close()

    @_executes
    def build_span(self, segment_ids: list[int]) -> tuple[SpanData, float]:
        """Prefill the segment on its own (positions from 0): its body after the seam window as
        span data, and the seconds that took."""
        w = self.config.seam_window
        ids = torch.tensor(segment_ids, dtype=torch.long)
        t0 = time.perf_counter()
        layout = [LiveRun(ids[w:], w, record="entry")]
        if w:
            layout.insert(0, LiveRun(ids[:w], 0))
        _, rec = self.forward(self.empty_state(), layout, logits_for="none")
        return rec.entries[len(layout) - 1], time.perf_counter() - t0

    @_executes
    def build_spans(self, segments: list[list[int]], on_layer=None) -> list[tuple[SpanData, float]]:
        """(span data, build seconds) of each segment, equal to build_span of each: prefilled
        together (LayoutLM.build_span_data) in batches of similar lengths of at most
        `entry_batch_tokens` padded tokens (entry_batches); a batch's time is shared out by length.
        `on_layer(indices, layer, datas)`, if given, is called as each layer of a batch is computed:
        the batch's segment indices and their span data, whose layer `layer` is final."""
        if len(segments) < 2 and on_layer is None:
            return [self.build_span(s) for s in segments]
        build = self.model.build_span_data
        w = self.config.seam_window
        out: dict[int, tuple[SpanData, float]] = {}
        for batch in entry_batches([len(s) for s in segments], self.config.entry_batch_tokens):
            t0 = time.perf_counter()
            if on_layer is not None:
                def layer_done(layer, datas, batch=batch):
                    on_layer(batch, layer, datas)

                datas = build([segments[i] for i in batch], w, on_layer=layer_done)
            else:
                datas = build([segments[i] for i in batch], w)
            seconds = time.perf_counter() - t0
            total = sum(len(segments[i]) for i in batch)
            for i, data in zip(batch, datas):
                out[i] = (data, seconds * len(segments[i]) / total)
        return [out[i] for i in range(len(segments))]

    @_executes
    def prompt_spans(self, prompts: list[list[int]], capture_hidden=()) -> list[tuple[SpanData, dict]]:
        """Whole prompts prefilled together from empty states (LayoutLM.prompt_spans), in batches
        of similar lengths of at most `entry_batch_tokens` padded tokens (entry_batches): each
        prompt's SpanData and {layer in capture_hidden: the stream entering it [n, h]}."""
        out: dict[int, tuple[SpanData, dict]] = {}
        for batch in entry_batches([len(p) for p in prompts], self.config.entry_batch_tokens):
            datas, captured = self.model.prompt_spans([prompts[i] for i in batch], tuple(capture_hidden))
            for j, i in enumerate(batch):
                n = len(prompts[i])
                out[i] = (datas[j], {layer: c[j, :n].clone() for layer, c in captured.items()})
        return [out[i] for i in range(len(prompts))]

    @_executes
    def prompt_states(self, prompts: list[list[int]], capture_hidden=()) -> list[tuple[SequenceState, dict]]:
        """Whole prompts prefilled together from empty states (prompt_spans), each as the state
        after it (its span data folded into an empty state: linear S(prompt|0) and the conv tail,
        attention K/V at positions from 0) and {layer in capture_hidden: the stream entering it}."""
        out = []
        for prompt, (data, captured) in zip(prompts, self.prompt_spans(prompts, capture_hidden)):
            state = self.model.empty_state()
            for i, span in data.linear.items():
                state.linear[i] = LinearState(span.S.float(), span.conv_tail.to(state.linear[i].conv.dtype))
            for i, span in data.attn.items():
                state.attn[i] = AttnState(span.k, span.v)
            state.length = len(prompt)
            out.append((state, captured))
        return out

    def as_entries(self, datas: list[SpanData]) -> list[SpanData]:
        """Span data as segment entries keep it (in place; returned): T and S in the entry state
        dtype (RuntimeConfig.entry_state_dtype), T dropped under the single-state entry policy."""
        for data in datas:
            if self.config.entry_state_dtype != "float32":
                cast_entry_states(data, self.config.state_dtype)
            if self.config.entry_policy == "single_state":
                single_state_view(data)
        return datas

    def to_host(self, entry: SegmentEntry) -> SegmentEntry:
        """The entry moved to host memory (host_tier.to_host: the host tier's demotion)."""
        return to_host(entry)

    def snapshot(self, state: SequenceState, linear: dict, end: int) -> PrefixSnapshot:
        """The state after its first `end` tokens as the part-chain store keeps it: `linear` (the
        forward's snapshot there) and views of the first `end` positions of the K/V."""
        attn = {i: type(a)(a.k[:, :, :end], a.v[:, :, :end]) for i, a in state.attn.items()}
        return PrefixSnapshot(end, linear, attn)

    def snapshots(self, state: SequenceState, chain: list[tuple[dict, int]]) -> list[PrefixSnapshot]:
        """snapshot of each (linear states, end) of `chain` over one state: where its K/V lie in
        pages they are read out once, up to the largest end, and every snapshot views that copy."""
        if any(not isinstance(a, AttnState) for a in state.attn.values()):
            end = max(e for _, e in chain)
            state = SequenceState(end, state.linear, {i: AttnState(*a.span(0, end)) for i, a in state.attn.items()})
        return [self.snapshot(state, linear, end) for linear, end in chain]

    def kv_bytes(self, state: SequenceState, tokens: int) -> int:
        """Bytes of `tokens` tokens of the state's attention K/V (what a snapshot of them copies out
        of pages)."""
        per_token = 0
        for a in state.attn.values():
            pages = getattr(a, "pages", None)
            if pages is not None:  # a row of a page: [Hkv, d]
                pair = (pages.k[a.layer][0, 0], pages.v[a.layer][0, 0])
            else:  # one position: [Hkv, d]
                pair = (a.k[0, :, 0], a.v[0, :, 0]) if a.k.shape[2] else ()
            per_token += sum(t.numel() * t.element_size() for t in pair)
        return per_token * tokens

    def restore_snapshot(self, snap: PrefixSnapshot) -> SequenceState:
        """A fresh SequenceState of a part-chain snapshot (PrefixSnapshot.restore)."""
        return snap.restore()

    def record(self, recorder: PageRecorder, hidden: dict, n: int, checkpoints=()) -> None:
        """A prefill's share of a request's page recorder: the first `n` rows of the hidden streams
        it captured, and the linear states at positions where the page tree keeps them
        (`checkpoints`: (position, the states there: a forward's snapshot or a SequenceState,
        whether to copy them))."""
        if n:
            recorder.add_hidden(hidden, n)
        for pos, linear, copy in checkpoints:
            recorder.add_checkpoint(pos, linear.linear if isinstance(linear, SequenceState) else linear, copy)

    def page_payloads(self, recorder: PageRecorder, state: SequenceState, starts: list[int]) -> list:
        """The payloads of the pages at `starts` (PageRecorder.page_payloads: each layer's K/V of
        the pages read at once), up to the first one the recorder cannot make (None, the last in
        the list)."""
        return recorder.page_payloads(state, starts)

    def checkpoint_payload(self, recorder: PageRecorder, payload: PagePayload, pos: int) -> PagePayload:
        """A page's payload with the recorder's state after `pos` tokens as its checkpoint
        (PageRecorder.checkpoint_payload)."""
        return recorder.checkpoint_payload(payload, pos)

    def drop_recorded(self, recorder: PageRecorder, pos: int) -> None:
        """Forget what the recorder kept for pages ending by `pos` (PageRecorder.drop_before)."""
        recorder.drop_before(pos)

    def forget_recorded(self, recorder: PageRecorder) -> None:
        """Drop the linear states the recorder holds (PageRecorder.forget_states)."""
        recorder.forget_states()

    def stage(self, entries: list) -> list[SpanData]:
        """The span data of host-tier entries on the model's device, copied together layer by
        layer (host_tier.stage): a forward waits for a layer's copies only when it gets to it."""
        return stage(entries, self.model.device)

    def new_state_pool(self, slots: int, kv_tokens: int = 0) -> StatePool:
        """A paged.StatePool of `slots` running requests: their linear states and room for
        `kv_tokens` tokens of attention K/V in pages. It changes through this runner's calls
        (assign, release, decode)."""
        return StatePool(self.empty_state(), slots, kv_tokens, self.max_len)

    def assign(self, pool: StatePool, state: SequenceState) -> int:
        """Move a prefilled state into a free slot of `pool` (StatePool.assign); its slot."""
        return pool.assign(state)

    def release(self, pool: StatePool, slot: int, keep: SequenceState | None = None) -> None:
        """Free a slot of `pool` (StatePool.release: `keep` gets its K/V copied out first)."""
        pool.release(slot, keep)

    def adopt(self, pool: StatePool, slot: int, state: SequenceState) -> None:
        """Make `slot` of `pool` hold a state prefilled in its pages (StatePool.adopt)."""
        pool.adopt(slot, state)

    def extend_pages(self, state: SequenceState, n: int) -> None:
        """Before a forward of n new tokens of a state whose K/V lie in pages: their pages and rows
        (paged.extend_pages; a state with contiguous K/V is left alone)."""
        extend_pages(state, n)

    def decode_graphs(self, pool: StatePool) -> DecodeGraphs | None:
        """The decode CUDA graphs over `pool` (made on first use), or None where they do not apply."""
        if not self.decode_graphs_on or self._eager:
            return None
        graphs = self._decode_graphs.get(pool)
        if graphs is None:
            graphs = self._decode_graphs[pool] = DecodeGraphs(self.model, pool, graph_factory=self.graph_factory)
        return graphs

    @_executes
    def warm_decode(self, pool: StatePool, capture_sets) -> int:
        """Capture the decode CUDA graphs of every padded batch size of `pool` for each set of
        captured hidden layers (DecodeGraphs.capture_all); the graphs captured (0 where they do
        not apply)."""
        graphs = self.decode_graphs(pool)
        return graphs.capture_all(capture_sets) if graphs is not None else 0

    def decode_graphs_held(self, pool: StatePool, capture_sets) -> int:
        """The decode graphs `pool` has now, of every batch size and capture set (0 where they do
        not apply): all of them after warm_decode unless a capture failed."""
        graphs = self.decode_graphs(pool)
        return graphs.held(capture_sets) if graphs is not None else 0

    @_executes
    def decode(self, pool: StatePool, slots: list[int], tokens: list, capture_hidden=(), feed=None, states=(),
               recorders=(), keep=()):
        """One decode step of the requests held in `slots` of `pool`, token ids `tokens` (None, for
        the columns `feed` names: ids already on the device): their states advance in the pool
        (paged.decode_step; from the decode CUDA graph of the padded batch size where decode
        graphs apply). `states`, the SequenceStates held in those slots, advance their length;
        `recorders`, their page recorders (None where a request records no pages), take the step
        (PageRecorder.add_step; `keep`, per request, whether its recorder may keep a state this step:
        default yes). Returns (logits [B, vocab] fp32, {layer in capture_hidden:
        entering stream [B, h]})."""
        ids = [0 if t is None else t for t in tokens]
        logits, hidden = decode_step(self.model, pool, slots, ids, capture_hidden, feed, self.decode_graphs(pool))
        for b, state in enumerate(states):
            state.length += 1
            rec = recorders[b] if recorders else None
            if rec is not None:
                rec.add_step(tokens[b], {i: hidden[i][b : b + 1] for i in rec.capture_layers}, state,
                             keep[b] if keep else True)
        return logits, hidden

    @_executes
    def restore_state(self, policy, pages: list[PagePayload]) -> SequenceState:
        """The state after a page-tree prefix from its pages' payloads, the root's child first
        (cache/policies.restore_pages: the policy's checkpoints, or its anchors replayed through
        the model's linear groups)."""
        replay = self.replay_graphs.run if self.replay_graphs is not None and not self._eager else None
        return restore_pages(self.model, policy, pages, replay)
