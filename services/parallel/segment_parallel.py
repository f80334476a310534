"""Segment parallelism over one torch.distributed group (DESIGN §5).

Rank 0 is the combine worker and a scatter worker; ranks 1..m-1 are scatter workers. Cold
segments are assigned by LPT (or round robin, for comparison) over the workers' queues, rank 0's
starting with the combine's share of the work; each worker prefills its segments in batches
(`stream_batches`: the largest batch last) and sends each batch's tensors to rank 0 layer by
layer, one packed message per layer, as the batched forward computes them (NCCL point-to-point
between GPUs of one host, gloo between CPU processes). Rank 0 builds its own share, then posts
the receives, in the senders' order, into buffers whose shapes it knows from the config and the
segment lengths, and folds entries in as they arrive: the
forward waits for a layer's tensors only when it reaches that layer (`ArrivingLayers`), so
assembly overlaps the other workers' builds and transfers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from hybridcache.services.router.assign import lpt_assign, round_robin_assign
from hybridcache.services.runtime.engine import Engine, Request, entry_batches
from hybridcache.services.runtime.packing import pack, packed_bytes, unpack_views
from hybridcache.services.runtime.sequence import (
    ArrivingLayers,
    AttnSpan,
    CachedSpan,
    LinearSpan,
    LiveRun,
    SpanData,
)


class _Message:
    """One posted receive (a packed buffer of several tensors); waited for once, on first use."""

    def __init__(self, work):
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


def entry_tensor_specs(engine: Engine, body_tokens: int):
    """(layer, name, shape, dtype) of every tensor of an entry with `body_tokens` body tokens, in
    the order they are sent: layer by layer, T, S, conv_tail or k, v."""
    cfg, dt, st = engine.cfg, engine.model.dtype, engine.config.state_dtype
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_dim = 2 * cfg.linear_num_key_heads * dk + hv * dv
    out = []
    for layer, kind in enumerate(cfg.layer_types):
        if kind == "linear_attention":
            out += [
                (layer, "T", (1, hv, dk, dk), st),
                (layer, "S", (1, hv, dk, dv), st),
                (layer, "conv_tail", (1, conv_dim, cfg.linear_conv_kernel_dim - 1), dt),
            ]
        else:
            shape = (1, cfg.num_key_value_heads, body_tokens, cfg.head_dim)
            out += [(layer, "k", shape, dt), (layer, "v", shape, dt)]
    return out


def _layer_tensors(data: SpanData, layer: int, state_dtype: torch.dtype):
    """One layer's tensors of an entry in send order; T and S in the engine's entry state dtype
    (the receiver's buffers are)."""
    if layer in data.linear:
        s = data.linear[layer]
        return [s.T.to(state_dtype), s.S.to(state_dtype), s.conv_tail]
    a = data.attn[layer]
    return [a.k, a.v]


class _EntryLayout:
    """Where an entry's tensors live once received: views into packed message buffers."""

    def __init__(self, engine: Engine, body_tokens: int, local_start: int):
        self.specs: dict[int, list] = {}
        for layer, name, shape, dtype in entry_tensor_specs(engine, body_tokens):
            self.specs.setdefault(layer, []).append((name, shape, dtype))
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}
        self.messages: dict[int, _Message] = {}  # layer -> the message carrying it
        self.body_tokens, self.local_start = body_tokens, local_start

    def layer_specs(self, layer: int):
        return [(shape, dtype) for _, shape, dtype in self.specs[layer]]

    def bind(self, layer: int, views: list[torch.Tensor], msg: _Message) -> None:
        for (name, _, _), t in zip(self.specs[layer], views):
            self.tensors[(layer, name)] = t
        self.messages[layer] = msg

    def data(self, engine: Engine) -> SpanData:
        linear, attn = {}, {}
        t = self.tensors
        for layer, kind in enumerate(engine.cfg.layer_types):
            if kind == "linear_attention":
                linear[layer] = LinearSpan(t[(layer, "T")], t[(layer, "S")], t[(layer, "conv_tail")])
            else:
                attn[layer] = AttnSpan(t[(layer, "k")], t[(layer, "v")])
        msgs = self.messages
        return SpanData(self.body_tokens, self.local_start, ArrivingLayers(linear, msgs), ArrivingLayers(attn, msgs))


def _post(engine: Engine, group: list[tuple[_EntryLayout, int]], src: int) -> None:
    """Post one receive for the layers `group` lists ((entry, layer) in send order)."""
    specs = [s for lay, layer in group for s in lay.layer_specs(layer)]
    buf = torch.empty(packed_bytes(specs), dtype=torch.uint8, device=engine.model.device)
    msg = _Message(dist.irecv(buf, src=src))
    views = iter(unpack_views(buf, specs))
    for lay, layer in group:
        lay.bind(layer, [next(views) for _ in lay.specs[layer]], msg)


def streams_layers(engine: Engine) -> bool:
    """Whether the model builds a batch of entries layer by layer with a callback
    (HybridLM.build_span_data(on_layer=...)): then a scatter worker sends each layer of a batch as
    soon as it is computed, and the combine's forward can fold layer i while layer i + 1 is built."""
    return getattr(engine.model, "build_span_data", None) is not None


def stream_batches(engine: Engine, segments: list[list[int]]) -> list[list[int]]:
    """entry_batches of `segments` in the order a worker builds and sends them: smallest (padded
    tokens) first, so the last batch is the largest. The combine rank, done with its own builds,
    folds layer i of that batch while the worker computes layer i + 1: a long last batch paces
    its arrivals at about the combine's speed, a short one would leave the whole combine after
    it."""
    batches = entry_batches([len(s) for s in segments], engine.config.entry_batch_tokens)
    return sorted(batches, key=lambda b: len(b) * max(len(segments[i]) for i in b))


def build_and_send(engine: Engine, segments: list[list[int]], dst: int) -> list:
    """Build the entries of `segments` and send them to `dst`: for streaming models one packed
    message per (batch, layer), batches in `stream_batches` order, each batch's layer i for all its
    segments as soon as it is computed; for others one message per entry (all layers). Returns
    (work, buffer) pairs; the buffers must live until the works complete. `post_receives` mirrors it."""
    w, st = engine.config.seam_window, engine.config.state_dtype
    n_layers = engine.cfg.num_hidden_layers
    if not streams_layers(engine):
        out = []
        for e in engine.build_entries(segments):
            buf = pack(t for layer in range(n_layers) for t in _layer_tensors(e.data, layer, st))
            out.append((dist.isend(buf, dst=dst), buf))
        return out
    out = []

    def on_layer(layer, datas):
        buf = pack(t for data in datas for t in _layer_tensors(data, layer, st))
        out.append((dist.isend(buf, dst=dst), buf))

    for batch in stream_batches(engine, segments):
        engine.model.build_span_data([segments[i] for i in batch], w, on_layer=on_layer)
    return out


def post_receives(engine: Engine, segments: list[list[int]], src: int) -> list[SpanData]:
    """Post the receives for what build_and_send(engine, segments, ...) sends from `src`, in the
    same order; returns the entries' SpanData (in `segments` order), whose layers wait on first use."""
    w = engine.config.seam_window
    lays = [_EntryLayout(engine, len(s) - w, w) for s in segments]
    layers = range(engine.cfg.num_hidden_layers)
    if not streams_layers(engine):
        for lay in lays:
            _post(engine, [(lay, layer) for layer in layers], src)
    else:
        for batch in stream_batches(engine, segments):
            for layer in layers:
                _post(engine, [(lays[i], layer) for i in batch], src)
    return [lay.data(engine) for lay in lays]


@dataclass
class ColdResult:
    ttft_s: float
    first_token: int
    assignment: list[int]
    scatter_s: dict[int, float] = field(default_factory=dict)  # rank -> its builds done (compute stream)
    sent_s: dict[int, float] = field(default_factory=dict)  # rank >= 1 -> its last send complete
    sent_bytes: dict[int, int] = field(default_factory=dict)  # rank >= 1 -> bytes it sent to rank 0
    combine_s: float = 0.0  # rank 0: end of its own builds to the first token (waits for arrivals included)
    # rank 0: the layout the combine ran (cached spans hold the received entries), for re-timing it
    layout: list | None = field(default=None, repr=False, compare=False)


def assign(
    costs: list[float], workers: int, policy: str, rank0_queue: float = 0.0, speeds: list[float] | None = None
) -> list[int]:
    queued = [rank0_queue] + [0.0] * (workers - 1)
    if policy == "lpt":
        return lpt_assign(costs, queued, speeds)
    if policy == "round_robin":
        return round_robin_assign(costs, queued)
    raise ValueError(f"unknown assignment policy {policy!r}")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather_split(device, built_s: float, sent_s: float, sent_bytes: int) -> list[list[float]]:
    """Every rank's (builds done, sends done, bytes sent), seconds from the common start: one
    all_gather, which also ends the request on every rank."""
    mine = torch.tensor([built_s, sent_s, float(sent_bytes)], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def _sync_compute(device):
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def measured_speeds(result: ColdResult, costs: list[float]) -> list[float]:
    """Each rank's build rate (cost units per second) over a finished request, relative to rank
    0's: the `speeds` for the next request's assignment. A rank that built nothing keeps 1."""
    workers = max(result.assignment) + 1
    rates = []
    for r in range(workers):
        work = sum(c for c, w in zip(costs, result.assignment) if w == r)
        t = result.scatter_s.get(r, 0.0)
        rates.append(work / t if work and t > 0 else None)
    base = rates[0]
    if not base:
        return [1.0] * workers
    return [x / base if x else 1.0 for x in rates]


@torch.no_grad()
def run_cold_request(
    engine: Engine,
    req: Request,
    workers: int,
    policy: str = "lpt",
    combine_share: float = 0.0,
    speeds: list[float] | None = None,
) -> ColdResult | None:
    """Serve one all-cold request with `workers` scatter ranks (0..workers-1). Every rank of the
    group calls this with the same request; ranks >= workers only take part in the barriers.

    `combine_share`: the combine's cost as a fraction of building all the request's segments on one
    worker (benchmarks/segment_parallel.py measures it); rank 0 starts the assignment with that much
    work queued, so it gets fewer segments and its combine overlaps the other ranks' builds.

    `speeds`: each rank's build rate relative to rank 0 (LPT only; default equal). A sending rank
    builds slower than rank 0 while its sends run, so rates measured on an earlier request give a
    better split (`measured_speeds`).

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
    if speeds is not None and len(speeds) != workers:
        raise ValueError(f"speeds: one per worker ({workers}), got {len(speeds)}")
    owner = assign(
        costs, workers, policy, rank0_queue=combine_share * sum(costs) if workers > 1 else 0.0, speeds=speeds
    )
    # Largest first on each worker (the send order of models without layer streaming; streaming
    # ones regroup a worker's segments into stream_batches).
    order = sorted(range(len(segs)), key=lambda i: (-costs[i], i))
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    if rank != 0:
        works = []
        if rank < workers:
            mine = [i for i in order if owner[i] == rank]
            works = build_and_send(engine, [segs[i] for i in mine], dst=0)
        _sync_compute(device)
        t_built = time.perf_counter()
        for wk, _buf in works:
            wk.wait()
        _sync(device)
        t_sent = time.perf_counter()
        sent = sum(buf.numel() for _, buf in works)
        _gather_split(device, t_built - t0 if works else 0.0, t_sent - t0 if works else 0.0, sent)
        return None
    # rank 0: build its own share first, then post the receives in each sender's order: NCCL
    # receive kernels left pending on the GPU while it computes slow its builds. Senders stream
    # each batch layer by layer, so the forward below folds layer i while their layer i + 1 may
    # still be computing.
    datas: dict[int, SpanData] = {}
    mine = [i for i in order if owner[i] == 0]
    for i, entry in zip(mine, engine.build_entries([segs[i] for i in mine])):
        datas[i] = entry.data
    # Only the compute stream: a device-wide sync would also wait for the receives just posted,
    # i.e. for the other workers' last layers, and the combine could not overlap their builds.
    _sync_compute(device)
    t_built = time.perf_counter()
    for src in range(1, workers):
        theirs = [i for i in order if owner[i] == src]
        for i, data in zip(theirs, post_receives(engine, [segs[i] for i in theirs], src)):
            datas[i] = data
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
    split = _gather_split(device, t_built - t0, 0.0, 0)
    return ColdResult(
        ttft_s=t_end - t0,
        first_token=tok,
        assignment=owner,
        scatter_s={r: split[r][0] for r in range(workers)},
        sent_s={r: split[r][1] for r in range(1, workers)},
        sent_bytes={r: int(split[r][2]) for r in range(1, workers)},
        combine_s=t_end - t_built,
        layout=layout,
    )
