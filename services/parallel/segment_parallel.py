"""Segment parallelism over one torch.distributed group (DESIGN §5).

Rank 0 is the combine worker and a scatter worker; ranks 1..m-1 are scatter workers. Cold
segments are assigned by LPT (or round robin, for comparison) over the workers' queues; each
worker prefills its segments into entries (one batch) and sends every entry tensor by tensor,
layer by layer, to rank 0 (NCCL point-to-point between GPUs of one host, gloo between CPU
processes). Rank 0 builds its own share, then posts the receives into buffers whose shapes it
knows from the config and the segment lengths, and folds entries in as they arrive: the forward
waits for a layer's tensors only when it reaches that layer (`ArrivingLayers`), so assembly
overlaps the tail of the transfers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from hybridcache.services.router.assign import lpt_assign, round_robin_assign
from hybridcache.services.runtime.engine import Engine, Request
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


def _entry_tensors(data: SpanData):
    """The tensors of an entry in send order; T and S as fp32 (the receiver's buffers are)."""
    for layer in sorted(set(data.linear) | set(data.attn)):
        if layer in data.linear:
            s = data.linear[layer]
            yield s.T.float()
            yield s.S.float()
            yield s.conv_tail
        else:
            a = data.attn[layer]
            yield a.k
            yield a.v


def send_entry(data: SpanData, dst: int) -> list:
    """Post async sends of every tensor of an entry to rank `dst`, layer by layer; returns the works."""
    return [dist.isend(t.contiguous(), dst=dst) for t in _entry_tensors(data)]


def post_receive_entry(engine: Engine, body_tokens: int, local_start: int, src: int) -> SpanData:
    """Post async receives for one entry from `src`; the SpanData's layers wait on first use."""
    device = engine.model.device
    linear, attn, lw, aw = {}, {}, {}, {}
    buf = {}
    for layer, name, shape, dtype in entry_tensor_specs(engine, body_tokens):
        t = torch.empty(shape, dtype=dtype, device=device)
        work = dist.irecv(t, src=src)
        buf[(layer, name)] = t
        (lw if name in ("T", "S", "conv_tail") else aw).setdefault(layer, []).append(work)
    for layer, kind in enumerate(engine.cfg.layer_types):
        if kind == "linear_attention":
            linear[layer] = LinearSpan(buf[(layer, "T")], buf[(layer, "S")], buf[(layer, "conv_tail")])
        else:
            attn[layer] = AttnSpan(buf[(layer, "k")], buf[(layer, "v")])
    return SpanData(body_tokens, local_start, ArrivingLayers(linear, lw), ArrivingLayers(attn, aw))


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
def run_cold_request(engine: Engine, req: Request, workers: int, policy: str = "lpt") -> ColdResult | None:
    """Serve one all-cold request with `workers` scatter ranks (0..workers-1). Every rank of the
    group calls this with the same request; ranks >= workers only take part in the barrier.

    Rank 0 returns the result (TTFT measured from a common barrier to the first token chosen);
    other ranks return None. The engine's entry store is not used: every segment is cold.
    """
    rank = dist.get_rank()
    device = engine.model.device
    w = engine.config.seam_window
    segs = req.segment_ids
    costs = [float(len(s)) for s in segs]
    owner = assign(costs, workers, policy)
    # Largest first on each worker, so the longest transfers start earliest.
    order = sorted(range(len(segs)), key=lambda i: (-costs[i], i))
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    if rank != 0:
        works = []
        if rank < workers:
            mine = [i for i in order if owner[i] == rank]
            for entry in engine.build_entries([segs[i] for i in mine]):
                works += send_entry(entry.data, dst=0)
        for wk in works:
            wk.wait()
        _sync(device)
        dist.barrier()
        return None
    # rank 0: build its own share first (one batch), then post the receives in each sender's
    # order: NCCL receive kernels left pending on the GPU while it computes slow its builds
    # (measured at cbdb179, when receives were posted first).
    datas: dict[int, SpanData] = {}
    mine = [i for i in order if owner[i] == 0]
    for i, entry in zip(mine, engine.build_entries([segs[i] for i in mine])):
        datas[i] = entry.data
    for src in range(1, workers):
        for i in order:
            if owner[i] == src:
                datas[i] = post_receive_entry(engine, len(segs[i]) - w, w, src)
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
