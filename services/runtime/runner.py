"""How a planned request executes on one model: the ModelRunner.

The split of the runtime, top to bottom:

    plan.Planner       what a request is (parsed, tokenized, its entry and chain keys); torch-free
    engine.Engine      the caches (entries, part chains, prefix pages), the layout of a request, stats
    ModelRunner        execution: the forward of a layout, cold builds, decode steps, staging
    models/            checkpoint-compatible layers and the math (LayoutLM, the mixers)

A ModelRunner is built from a model and a RuntimeConfig and settles, once, what the config
chooses for execution: the op implementations (backends.OpDispatch: fast kernels or the
references, the SDPA backends allowed), the CUDA graphs of assemblies (graphs.py, per layout
shape) and of decode steps (paged.DecodeGraphs, per padded batch size). Then it runs

- `forward`: the live pass of a layout from a SequenceState (updated in place), from the CUDA
  graphs of its shape where they apply, else the model's eager forward; the same answer either way;
- `build_span` / `build_spans`: the standalone prefill of cold segments into span data, one at a
  time or batched by similar length (entry_batches, LayoutLM.build_span_data);
- `new_state_pool` / `decode`: the paged states of running requests and one batched decode step
  over them (paged.decode_step);
- `stage`: entries of the host tier onto the model's device, layer by layer.

What the results mean for a request (entry keys and policy, page recorders, statistics) is the
engine's business.
"""

from __future__ import annotations

import time

import torch
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime import backends, graphs
from hybridcache.services.runtime.cache.host_tier import stage
from hybridcache.services.runtime.paged import StatePool, decode_step, set_decode_graphs, warm_decode_graphs
from hybridcache.services.runtime.sequence import LiveRun, SequenceState, SpanData


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


class ModelRunner:
    """Execution of layouts, cold builds and decode steps on `model` as `config` says (module
    docstring). Building one makes its op choice the process's (backends.configure) and sets the
    model's CUDA-graph switches; the graphs themselves stay with the model, shared by the runners
    of one model."""

    def __init__(self, model, config: RuntimeConfig | None = None):
        self.model = model
        self.config = config = config or RuntimeConfig()
        self.dispatch = backends.OpDispatch.of(config)
        backends.configure(self.dispatch)
        graphs.set_cuda_graphs(model, config.cuda_graphs, config.cuda_graph_shapes)
        set_decode_graphs(model, config.decode_cuda_graphs)
        # the longest sequence a running request may reach (the decode pool's table width)
        self.max_len = config.max_model_len or model.cfg.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return getattr(self.model, "device", torch.device("cpu"))

    def empty_state(self) -> SequenceState:
        return self.model.empty_state()

    @torch.no_grad()
    def forward(self, state: SequenceState, layout: list, logits_for: str = "last", snapshot_after=(),
                capture_hidden=()):
        """The live pass of `layout` from `state` (updated in place): LayoutLM.forward_layout's
        arguments and results. An assembly (a layout with cached spans) of a shape seen before may
        run from that shape's CUDA graphs (graphs.LayoutGraphs), with the same results."""
        return graphs.forward(self.model, state, layout, logits_for, snapshot_after, capture_hidden)

    @torch.no_grad()
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

    def stage(self, entries: list) -> list[SpanData]:
        """The span data of host-tier entries on the model's device, copied together layer by
        layer (host_tier.stage): a forward waits for a layer's copies only when it gets to it."""
        return stage(entries, self.model.device)

    def new_state_pool(self, slots: int, kv_tokens: int = 0) -> StatePool:
        """A paged.StatePool of `slots` running requests: their linear states and room for
        `kv_tokens` tokens of attention K/V in pages."""
        return StatePool(self.empty_state(), slots, kv_tokens, self.max_len)

    def warm_decode(self, pool: StatePool, capture_sets) -> int:
        """Capture the decode CUDA graphs of every padded batch size of `pool` for each set of
        captured hidden layers (paged.warm_decode_graphs); the graphs captured (0 off CUDA)."""
        return warm_decode_graphs(self.model, pool, capture_sets)

    @torch.no_grad()
    def decode(self, pool: StatePool, slots: list[int], tokens: list[int], capture_hidden=(), feed=None):
        """One decode step of the requests held in `slots` of `pool`, token ids `tokens` (or, for
        the columns `feed` names, ids already on the device): their states advance in the pool
        (paged.decode_step; from the decode CUDA graph of the padded batch size where decode
        graphs apply). Returns (logits [B, vocab] fp32, {layer in capture_hidden: entering stream [B, h]})."""
        return decode_step(self.model, pool, slots, tokens, capture_hidden, feed)
