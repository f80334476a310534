"""Segment parallelism over one torch.distributed group (DESIGN §5).

Rank 0 is the combine worker and a scatter worker; ranks 1..m-1 are scatter workers. Cold
segments are assigned by LPT (or round robin, for comparison) over the workers' queues, rank 0's
starting with the combine's share of the work; each worker prefills its segments in batches
(`entry_batches`) and sends each batch's tensors to rank 0 layer by layer as the batched forward
computes them (NCCL point-to-point between GPUs of one host, gloo between CPU processes). Rank 0
builds its own share, then posts the receives, in the senders' order, into buffers whose shapes
it knows from the config and the segment lengths, and folds entries in as they arrive: the
forward waits for a layer's tensors only when it reaches that layer (`ArrivingLayers`), so
assembly overlaps the other workers' builds and transfers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from hybridcache.services.router.assign import lpt_assign, round_robin_assign
from hybridcache.services.runtime.engine import Engine, Request, entry_batches
from hybridcache.services.runtime.sequence import AttnSpan, CachedSpan, LinearSpan, LiveRun, SpanData


class ArrivingLayers(Mapping):
    """layer -> LinearSpan / AttnSpan whose tensors are receive buffers; indexing waits for them."""

    def __init__(self, spans: dict, works: dict):
        self._spans = spans
        self._works = works  # layer -> [Work]

    def __getitem__(self, layer):
        for w in self._works.pop(layer, ()):
            w.wait()
        return self._spans[layer]

    def __iter__(self):
        return iter(self._spans)

    def __len__(self):
        return len(self._spans)


def entry_tensor_specs(engine: Engine, body_tokens: int):
    """(layer, name, shape, dtype) of every tensor of an entry with `body_tokens` body tokens, in
    the order they are sent: layer by layer, T, S, conv_tail or k, v."""
    cfg, dt = engine.cfg, engine.model.dtype
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_dim = 2 * cfg.linear_num_key_heads * dk + hv * dv
    out = []
    for layer, kind in enumerate(cfg.layer_types):
        if kind == "linear_attention":
            out += [
                (layer, "T", (1, hv, dk, dk), torch.float32),
                (layer, "S", (1, hv, dk, dv), torch.float32),
                (layer, "conv_tail", (1, conv_dim, cfg.linear_conv_kernel_dim - 1), dt),
            ]
        else:
            shape = (1, cfg.num_key_value_heads, body_tokens, cfg.head_dim)
            out += [(layer, "k", shape, dt), (layer, "v", shape, dt)]
    return out


def _layer_tensors(data: SpanData, layer: int):
    """One layer's tensors of an entry in send order; T and S as fp32 (the receiver's buffers are)."""
    if layer in data.linear:
        s = data.linear[layer]
        return [s.T.float(), s.S.float(), s.conv_tail]
    a = data.attn[layer]
    return [a.k, a.v]


def _entry_tensors(data: SpanData):
    """The tensors of an entry in send order: layer by layer."""
    for layer in sorted(set(data.linear) | set(data.attn)):
        yield from _layer_tensors(data, layer)


def send_entry(data: SpanData, dst: int) -> list:
    """Post async sends of every tensor of an entry to rank `dst`, layer by layer; returns the works."""
    return [dist.isend(t.contiguous(), dst=dst) for t in _entry_tensors(data)]


class _EntryReceiver:
    """Receive buffers of one entry; receives are posted layer by layer (`post_layer`) in the
    order the sender sends, and the SpanData's layers wait for theirs on first use."""

    def __init__(self, engine: Engine, body_tokens: int, local_start: int, src: int):
        self.src = src
        self.specs: dict[int, list] = {}
        for layer, name, shape, dtype in entry_tensor_specs(engine, body_tokens):
            self.specs.setdefault(layer, []).append((name, shape, dtype))
        device = engine.model.device
        self.buf = {
            (layer, name): torch.empty(shape, dtype=dtype, device=device)
            for layer, specs in self.specs.items()
            for name, shape, dtype in specs
        }
        self.lw: dict[int, list] = {}
        self.aw: dict[int, list] = {}
        linear, attn = {}, {}
        for layer, kind in enumerate(engine.cfg.layer_types):
            b = self.buf
            if kind == "linear_attention":
                linear[layer] = LinearSpan(b[(layer, "T")], b[(layer, "S")], b[(layer, "conv_tail")])
            else:
                attn[layer] = AttnSpan(b[(layer, "k")], b[(layer, "v")])
        self.data = SpanData(
            body_tokens, local_start, ArrivingLayers(linear, self.lw), ArrivingLayers(attn, self.aw)
        )

    def post_layer(self, layer: int) -> None:
        for name, _, _ in self.specs[layer]:
            work = dist.irecv(self.buf[(layer, name)], src=self.src)
            (self.lw if name in ("T", "S", "conv_tail") else self.aw).setdefault(layer, []).append(work)

    def post_all(self) -> None:
        for layer in sorted(self.specs):
            self.post_layer(layer)


def streams_layers(engine: Engine) -> bool:
    """Whether the model builds a batch of entries layer by layer with a callback
    (HybridLM.build_span_data(on_layer=...)): then a scatter worker sends each layer of a batch as
    soon as it is computed, and the combine's forward can fold layer i while layer i + 1 is built."""
    return getattr(engine.model, "build_span_data", None) is not None


def build_and_send(engine: Engine, segments: list[list[int]], dst: int) -> list:
    """Build the entries of `segments` and send them to `dst`. Streaming models: in entry_batches
    order, each batch's layer i sent for every segment of the batch as soon as it is computed;
    others: entry by entry after each build. Returns the send works. `post_receives` mirrors it."""
    w = engine.config.seam_window
    if not streams_layers(engine):
        return [wk for e in engine.build_entries(segments) for wk in send_entry(e.data, dst)]
    works = []

    def on_layer(layer, datas):
        for data in datas:
            works.extend(dist.isend(t.contiguous(), dst=dst) for t in _layer_tensors(data, layer))

    for batch in entry_batches([len(s) for s in segments], engine.config.entry_batch_tokens):
        engine.model.build_span_data([segments[i] for i in batch], w, on_layer=on_layer)
    return works


def post_receives(engine: Engine, segments: list[list[int]], src: int) -> list[SpanData]:
    """Post the receives for what build_and_send(engine, segments, ...) sends from `src`, in the
    same order; returns the entries' SpanData (in `segments` order), whose layers wait on first use."""
    w = engine.config.seam_window
    rxs = [_EntryReceiver(engine, len(s) - w, w, src) for s in segments]
    if not streams_layers(engine):
        for rx in rxs:
            rx.post_all()
        return [rx.data for rx in rxs]
    layers = range(engine.cfg.num_hidden_layers)
    for batch in entry_batches([len(s) for s in segments], engine.config.entry_batch_tokens):
        for layer in layers:
            for i in batch:
                rxs[i].post_layer(layer)
    return [rx.data for rx in rxs]


@dataclass
class ColdResult:
    ttft_s: float
    first_token: int
    assignment: list[int]
    scatter_s: dict[int, float] = field(default_factory=dict)  # build time per rank (rank 0 only knows its own)
    combine_s: float = 0.0
    wait_s: float = 0.0  # rank 0 time between its own builds ending and the forward's end, minus compute


def assign(costs: list[float], workers: int, policy: str, rank0_queue: float = 0.0) -> list[int]:
    queued = [rank0_queue] + [0.0] * (workers - 1)
    if policy == "lpt":
        return lpt_assign(costs, queued)
    if policy == "round_robin":
        return round_robin_assign(costs, queued)
    raise ValueError(f"unknown assignment policy {policy!r}")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def run_cold_request(
    engine: Engine, req: Request, workers: int, policy: str = "lpt", combine_share: float = 0.0
) -> ColdResult | None:
    """Serve one all-cold request with `workers` scatter ranks (0..workers-1). Every rank of the
    group calls this with the same request; ranks >= workers only take part in the barrier.

    `combine_share`: the combine's cost as a fraction of building all the request's segments on one
    worker (measured: benchmarks/segment_parallel.py); rank 0 starts the assignment with that much
    work queued, so it gets fewer segments and its combine overlaps the other ranks' builds.

    Rank 0 returns the result (TTFT measured from a common barrier to the first token chosen);
    other ranks return None. The engine's entry store is not used: every segment is cold.
    """
    if engine.config.entry_policy != "exact":
        raise ValueError("segment parallelism streams exact entries; entry_policy must be 'exact'")
    rank = dist.get_rank()
    device = engine.model.device
    w = engine.config.seam_window
    segs = req.segment_ids
    costs = [float(len(s)) for s in segs]
    if combine_share < 0:
        raise ValueError("combine_share must be >= 0")
    owner = assign(costs, workers, policy, rank0_queue=combine_share * sum(costs) if workers > 1 else 0.0)
    # Largest first on each worker, so the longest transfers start earliest.
    order = sorted(range(len(segs)), key=lambda i: (-costs[i], i))
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    if rank != 0:
        works = []
        if rank < workers:
            mine = [i for i in order if owner[i] == rank]
            works = build_and_send(engine, [segs[i] for i in mine], dst=0)
        for wk in works:
            wk.wait()
        _sync(device)
        dist.barrier()
        return None
    # rank 0: build its own share first, then post the receives in each sender's order: NCCL
    # receive kernels left pending on the GPU while it computes slow its builds (measured at
    # cbdb179, when receives were posted first). Senders stream each batch layer by layer, so the
    # forward below folds layer i while their layer i + 1 may still be computing.
    datas: dict[int, SpanData] = {}
    mine = [i for i in order if owner[i] == 0]
    for i, entry in zip(mine, engine.build_entries([segs[i] for i in mine])):
        datas[i] = entry.data
    for src in range(1, workers):
        theirs = [i for i in order if owner[i] == src]
        for i, data in zip(theirs, post_receives(engine, [segs[i] for i in theirs], src)):
            datas[i] = data
    _sync(device)
    t_built = time.perf_counter()
    layout, pos = [], 0
    if req.system_ids:
        layout.append(LiveRun(torch.tensor(req.system_ids), 0))
        pos = len(req.system_ids)
    for i, s in enumerate(segs):
        t = torch.tensor(s)
        if w:
            layout.append(LiveRun(t[:w], pos))
        layout.append(CachedSpan(datas[i], pos + w))
        pos += len(s)
    layout.append(LiveRun(torch.tensor(req.suffix_ids), pos))
    logits, _ = engine.model.forward_layout(engine.model.empty_state(), layout, "last")
    tok = int(torch.argmax(logits))
    t_end = time.perf_counter()
    dist.barrier()
    return ColdResult(
        ttft_s=t_end - t0,
        first_token=tok,
        assignment=owner,
        scatter_s={0: t_built - t0},
        combine_s=t_end - t_built,
    )
