"""MoE models at engine speed (issue 42): prints one JSON object.

Qwen3.5-35B-A3B shape (`--preset qwen3.5-35b-a3b`: 30 Gated DeltaNet + 10 attention layers, 256
experts top-8 + a shared expert), random bf16 weights made on the GPU, every parameter drawn from
a generator seeded by its name, so that the peer built later holds the same weights. Sections:

- block: one MoE block (router, routed experts, shared expert) on n tokens, for each expert path
  (backends.OpDispatch.moe: the per-expert loop, torch's grouped GEMM, the Triton fused-MoE kernel
  at its default tiles and at a few others, and up to 32 tokens the pair-major kernels that take
  decode batches of up to 64 token-expert pairs): ms, relative RMS error against the loop, and the
  fastest path within bf16 rounding of it (`moe_block_fastest_<n>`); `moe_auto_path_<n>` is what the
  engine takes. On a GPU, up to 256 tokens, also each path's block replayed from a CUDA graph
  (`moe_block_graph_us_<path>_<n>`, `moe_block_fastest_graphed_<n>`): the eager times of decode
  sizes are mostly launches, which a decode step's graph does not pay.
- prefill: ours (LayoutLM.forward_layout of the whole prompt), then, ours freed, transformers'
  Qwen3_5MoeForCausalLM (fla's kernels when fla-core is installed, transformers' grouped_mm
  experts) of the same config, layer count and weights: `moe_prefill_speedup_vs_peer_8k`, `_32k`.
- decode: a decode step of B requests (a ModelRunner's over its StatePool, replayed from its CUDA
  graph) against the bytes the step must read at the device-to-device copy bandwidth measured in
  the same run (`copy_gb_per_s`, read + write bytes over time): the weights of the experts the
  step's tokens route to (distinct experts per layer, counted from eager steps of the same
  requests), the router, shared expert, attention and linear-attention weights, norms, the LM head,
  the tokens' embedding rows, the linear states (read and written) and the K/V of the context:
  `moe_decode_fraction_of_floor_1` and `_32` (floor time / step time).

Layers (`--layers`, 0: all): the run keeps the largest count that fits the GPU's free memory with
`--reserve-gib` left for activations, states and graphs (`layers_run`, `layers_requested`);
nothing is scaled to layers it did not run. Ours and the peer are never on the GPU together.

    python benchmarks/moe_bench.py --out moe.json                    # H100/H200, ~6 min
    python benchmarks/moe_bench.py --quick --layers 4                 # smoke run on a GPU
    python benchmarks/moe_bench.py --device cpu --preset tiny --quick # CPU (CI), fp32
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

ARCH = "qwen3_5_moe_text"
SECTIONS = ("block", "prefill", "decode")
ROOT = Path(__file__).resolve().parents[1]


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeat=3, warmup=1):
    """Median wall time of fn() in ms (device-synchronised) and its last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


@torch.no_grad()
def init_by_name_(model, seed=0, std=0.02):
    """Random weights, each parameter from a generator seeded by its name (the same values in any
    model with the same parameter names and shapes, ours and transformers')."""
    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))

        def draw(shape=p.shape, gen=gen, p=p):
            return torch.randn(shape, device=p.device, generator=gen, dtype=torch.float32)

        if name.endswith("A_log"):
            vals = torch.empty(p.shape, device=p.device).uniform_(math.log(1e-3), math.log(4.0), generator=gen)
        elif name.endswith("dt_bias"):
            vals = torch.rand(p.shape, device=p.device, generator=gen) * 2 - 1
        elif name.endswith("linear_attn.norm.weight"):
            vals = 1.0 + 0.1 * draw()
        elif "norm" in name.split(".")[-2]:
            vals = 0.1 * draw()  # zero-centred RMSNorms: scale 1 + weight
        elif name.endswith("conv1d.weight"):
            vals = draw() / math.sqrt(p.shape[-1])
        elif p.dim() == 3:  # fused experts: one expert at a time keeps the fp32 draw small
            for e in range(p.shape[0]):
                p[e].copy_(torch.randn(p.shape[1:], device=p.device, generator=gen) * std)
            continue
        else:
            vals = draw() * std
        p.copy_(vals.to(p.dtype))


def hf_dict(preset, layers):
    from hybridcache.services.runtime.modelzoo import hf_config

    return hf_config(ARCH, preset, {"num_hidden_layers": layers} if layers else None)


def param_bytes(cfg_dict, dtype) -> tuple[int, int]:
    """(bytes outside the layers, bytes of one layer on average) of our model, from a meta build."""
    from hybridcache.services.runtime.config import ModelConfig
    from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM

    with torch.device("meta"):
        m = HybridLM(ModelConfig.from_dict(cfg_dict))
    size = torch.tensor([], dtype=dtype).element_size()
    total = sum(p.numel() for p in m.parameters()) * size
    layers = sum(p.numel() for p in m.model.layers.parameters()) * size
    return total - layers, layers // len(m.model.layers)


def layers_that_fit(preset, requested, device, dtype, reserve_gib) -> int:
    n = requested or hf_dict(preset, 0)["num_hidden_layers"]
    if torch.device(device).type != "cuda":
        return n
    outside, per_layer = param_bytes(hf_dict(preset, n), dtype)
    free = torch.cuda.mem_get_info()[0] - reserve_gib * 2**30
    return max(1, min(n, int((free - outside) // per_layer)))


def build_ours(preset, layers, device, dtype):
    from hybridcache.services.runtime.config import ModelConfig
    from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM

    cfg = ModelConfig.from_dict(hf_dict(preset, layers))
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = HybridLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    init_by_name_(model)
    model.merge_projections()  # as the loader does
    return cfg, model


def build_peer(preset, layers, device, dtype):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    raw = dict(hf_dict(preset, layers))
    raw.pop("model_type")
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            peer = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**raw)).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    init_by_name_(peer)
    return peer


def peer_kernels(peer) -> dict:
    """Which experts implementation and chunked gated delta rule transformers' model runs (the
    latter resolved to fla's when importable, kept in the wrapper's closure)."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mq

    fn = getattr(mq, "torch_chunk_gated_delta_rule", None)
    gdn = getattr(fn, "__module__", None)
    for cell in getattr(fn, "__closure__", None) or ():
        impl = cell.cell_contents
        if callable(impl) and str(getattr(impl, "__module__", "")).startswith("fla"):
            gdn = impl.__module__
    return {"experts": getattr(peer.config, "_experts_implementation", None), "gated_delta_rule": gdn}


def free():
    """Return what the caller dropped to the GPU (its references must be gone first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth(device, nbytes) -> float:
    """Device-to-device copy rate in GB/s, read + write bytes (as the hardware floor counts them)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t, _ = timed(lambda: dst.copy_(src), device, repeat=10, warmup=2)
    return 2 * nbytes / (t / 1e3) / 1e9


# ---------------------------------------------------------------------------------------- block

def graphed_us(fn, replays=50):
    """Mean µs of fn() replayed from a CUDA graph: its kernels without the host's launches, as a
    decode step's graph runs them (fn must not synchronise the host)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / replays * 1e6


def moe_dispatch(path):
    from hybridcache.services.runtime import backends

    return backends.dispatching(dataclasses.replace(backends.current_dispatch(), moe=path))


# token counts up to which a block is also timed replayed from a CUDA graph (decode batches)
GRAPHED_TOKENS = 256
# token counts up to which the pair-major path is timed (auto takes it up to 64 pairs: batch 8 at
# top-8; batch 32 shows the sorted path's lead beyond)
PAIR_TOKENS = 32


def block_floor_us(block, x, bw_gbs) -> float:
    """The least time a block on x [1, n, h] can take at bw_gbs: the bytes of the experts its tokens
    route to (each distinct one once), the router and the shared expert with its gate, and x and the
    output, read or written once."""
    k = block.cfg.num_experts_per_tok
    flat = x.reshape(-1, x.shape[-1])
    active = torch.topk(torch.nn.functional.linear(flat, block.gate.weight), k, dim=-1).indices.unique().numel()
    ex = block.experts
    per_expert = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * ex.down_proj.element_size()
    fixed = sum(p.numel() * p.element_size() for m in (block.gate, block.shared_expert, block.shared_expert_gate)
                for p in m.parameters())
    return (active * per_expert + fixed + 2 * x.numel() * x.element_size()) / (bw_gbs * 1e9) * 1e6


def block_figures(cfg, device, dtype, token_counts, figures, bw_gbs):
    """One SparseMoE block (layer-sized, random weights) per expert path and token count: eagerly
    (`moe_block_ms_*`, launches included) and, up to GRAPHED_TOKENS, replayed from a CUDA graph
    (`moe_block_graph_us_*`: what a decode step's graph pays, the figure that picks decode tiles),
    beside the block's floor at the measured copy bandwidth (`moe_block_floor_us_<n>`, and the
    fastest graphed path's `moe_block_graph_fraction_of_floor_<n>`)."""
    from hybridcache.kernels.ops.moe import grouped_mm_supported
    from hybridcache.services.runtime import backends
    from hybridcache.services.runtime.models.qwen3_hybrid import SparseMoE

    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            block = SparseMoE(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    init_by_name_(block, seed=1)
    block.shared_expert.merge_projections()
    ex = block.experts
    probe = torch.zeros(1, cfg.hidden_size, device=device, dtype=dtype)
    k = cfg.num_experts_per_tok
    figures["moe_auto_path"] = backends.moe_path(probe, ex.gate_up_proj, ex.down_proj)
    for n in token_counts:
        probe_n = torch.zeros(n, cfg.hidden_size, device=device, dtype=dtype)
        figures[f"moe_auto_path_{n}"] = backends.moe_path(probe_n, ex.gate_up_proj, ex.down_proj, k)
    candidates = [("loop", "loop", None)]
    if grouped_mm_supported(probe, ex.gate_up_proj, ex.down_proj):
        candidates.append(("grouped_mm", "grouped_mm", None))
    if torch.device(device).type == "cuda":
        from hybridcache.kernels.ops.moe import triton as moe_triton

        candidates.append(("triton", "triton", None))
        for c in (moe_triton.FusedConfig(16, 32, 64, 4, 3), moe_triton.FusedConfig(16, 64, 64, 4, 3),
                  moe_triton.FusedConfig(16, 32, 128, 4, 4), moe_triton.FusedConfig(32, 64, 64, 4, 3),
                  moe_triton.FusedConfig(64, 128, 64, 8, 3), moe_triton.FusedConfig(128, 128, 64, 8, 3)):
            candidates.append((f"triton_m{c.block_m}_n{c.block_n}_k{c.block_k}_w{c.num_warps}_s{c.num_stages}",
                               "triton", c))
        # the pair-major kernels (router, routed and shared experts in three launches) at their
        # tiles pair_config picks by the token count ("pairs") and others (_once: PairConfig.reduce_once), up to
        # PAIR_TOKENS tokens
        candidates.append(("pairs", "pairs", None))
        # the router's linear layer and softmax_top_k as two launches (models/common.FUSED_ROUTER off)
        candidates.append(("pairs_split_router", "pairs", SPLIT_ROUTER))
        once = dict(reduce_once=True)
        for c in (moe_triton.PairConfig(16, 256, 16, 256, 4), moe_triton.PairConfig(4, 512, 4, 512, 4),
                  moe_triton.PairConfig(8, 512, 8, 512, 8), moe_triton.PairConfig(16, 512, 16, 512, 8),
                  moe_triton.PairConfig(32, 128, 32, 128, 4), moe_triton.PairConfig(4, 256, 8, 256, 2),
                  moe_triton.PairConfig(8, 256, 8, 256, 4, **once), moe_triton.PairConfig(4, 512, 4, 512, 4, **once),
                  moe_triton.PairConfig(8, 512, 8, 512, 8, **once), moe_triton.PairConfig(16, 256, 16, 256, 8, **once)):
            name = f"pairs_n{c.gate_up_n}_k{c.gate_up_k}_dn{c.down_n}_dk{c.down_k}_w{c.num_warps}"
            candidates.append((name + ("_once" if c.reduce_once else ""), "pairs", c))
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # within the activation dtype's rounding of the loop
    gen = torch.Generator().manual_seed(0)
    for n in token_counts:
        x = torch.randn(1, n, cfg.hidden_size, generator=gen).to(device, dtype)
        floor_us = block_floor_us(block, x, bw_gbs)
        figures[f"moe_block_floor_us_{n}"] = round(floor_us, 2)
        ref, best, best_graph = None, None, None
        for name, path, tiles in candidates:
            if path == "pairs" and n > PAIR_TOKENS:
                continue
            ctx = contextlib.nullcontext()
            if tiles is not None:
                ctx = _fused_tiles(moe_triton, tiles)
            try:
                with moe_dispatch(path), ctx:
                    t, out = timed(lambda x=x: block(x), device, repeat=5 if n <= 512 else 3, warmup=2)
            except Exception as e:  # noqa: BLE001 - a tile choice that does not compile must not cost the others
                figures[f"moe_block_error_{name}_{n}"] = f"{type(e).__name__}: {e}"[:200]
                continue
            figures[f"moe_block_ms_{name}_{n}"] = round(t, 4)
            if path != "loop" and n <= GRAPHED_TOKENS and torch.device(device).type == "cuda":
                # a decode step's view: the block's kernels replayed from a graph, no launches
                try:
                    tiled = _fused_tiles(moe_triton, tiles) if tiles is not None else contextlib.nullcontext()
                    with moe_dispatch(path), tiled:
                        us = graphed_us(lambda x=x: block(x))
                    figures[f"moe_block_graph_us_{name}_{n}"] = round(us, 2)
                    if best_graph is None or us < best_graph[1]:
                        best_graph = (name, us)
                except Exception as e:  # noqa: BLE001 - a path that cannot be captured is reported, not fatal
                    figures[f"moe_block_graph_error_{name}_{n}"] = f"{type(e).__name__}: {e}"[:200]
            if ref is None:
                ref = out.float()
                continue
            err = ((out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
            figures[f"moe_block_rel_err_{name}_{n}"] = float(f"{err:.3g}")
            if err <= tol and (best is None or t < best[1]):
                best = (name, t)
        figures[f"moe_block_fastest_{n}"] = best[0] if best else "loop"
        if best_graph is not None:
            figures[f"moe_block_fastest_graphed_{n}"] = best_graph[0]
            figures[f"moe_block_graph_fraction_of_floor_{n}"] = float(f"{floor_us / best_graph[1]:.3g}")
        if best:
            figures[f"moe_block_speedup_vs_loop_{n}"] = round(figures[f"moe_block_ms_loop_{n}"] / best[1], 2)


SPLIT_ROUTER = "split_router"


@contextlib.contextmanager
def _fused_tiles(moe_triton, tiles):
    """The Triton path (sorted or pair-major, by the tiles' type) with these tiles for every token
    count inside the block; SPLIT_ROUTER: the pair path's default tiles, its router unfused."""
    if tiles is SPLIT_ROUTER:
        from hybridcache.services.runtime.models import common

        common.FUSED_ROUTER = False
        try:
            yield
        finally:
            common.FUSED_ROUTER = True
        return
    if isinstance(tiles, moe_triton.PairConfig):
        prev_pair = moe_triton.PAIR_CONFIG
        moe_triton.PAIR_CONFIG = tiles
        try:
            yield
        finally:
            moe_triton.PAIR_CONFIG = prev_pair
        return
    prev = moe_triton.default_config
    moe_triton.default_config = lambda pairs, experts: tiles
    try:
        yield
    finally:
        moe_triton.default_config = prev


# -------------------------------------------------------------------------------------- prefill

def prefill_ours(model, device, lengths, figures, vocab):
    from hybridcache.services.runtime.sequence import LiveRun

    for n, tag in lengths:
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))
        t, _ = timed(lambda ids=ids: model.forward_layout(model.empty_state(), [LiveRun(ids, 0)], "last"),
                     device, repeat=2)
        figures[f"moe_prefill_ms_ours_{tag}"] = round(t, 2)
        figures[f"moe_prefill_tokens_per_s_ours_{tag}"] = round(n / t * 1e3)


def prefill_peer(peer, device, lengths, figures, vocab):
    for n, tag in lengths:
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))[None].to(device)
        t, _ = timed(lambda ids=ids: peer(input_ids=ids, use_cache=True, logits_to_keep=1), device, repeat=2)
        figures[f"moe_prefill_ms_peer_{tag}"] = round(t, 2)
        ours = figures.get(f"moe_prefill_ms_ours_{tag}")
        if ours:
            figures[f"moe_prefill_speedup_vs_peer_{tag}"] = round(t / ours, 3)


# --------------------------------------------------------------------------------------- decode

def step_bytes(model, cfg, pool, batch, context, active) -> dict:
    """What one decode step of `batch` requests at `context` tokens each must move, in bytes:
    active[layer] distinct experts of that MoE layer."""
    dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if ".mlp.experts." not in name and "embed_tokens" not in name)
    emb = model.model.embed_tokens.weight
    expert_bytes = 0
    for i, layer in enumerate(model.model.layers):
        ex = getattr(layer.mlp, "experts", None)
        if ex is not None:
            per = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * ex.gate_up_proj.element_size()
            expert_bytes += active.get(i, 0) * per
    # linear states: read and written back; K/V: read over the context, one token written
    states = sum(2 * batch * (t[0].numel() * t.element_size()) for d in (pool.ssm, pool.conv) for t in d.values())
    kv = 0
    if pool.kv is not None:
        kvh, d = cfg.num_key_value_heads, cfg.head_dim
        size = torch.tensor([], dtype=model.dtype).element_size()
        attn = sum(layer.kind == "full_attention" for layer in model.model.layers)
        kv = attn * batch * (context + 1) * 2 * kvh * d * size
    return {"weights_dense": dense, "weights_experts": expert_bytes, "embedding_rows": batch * emb[0].numel() *
            emb.element_size(), "linear_states": states, "kv": kv}


def decode_figures(model, cfg, device, batch, prompt, steps, bw_gbs, figures):
    from hybridcache.services.config import RuntimeConfig
    from hybridcache.services.runtime import backends
    from hybridcache.services.runtime.runner import ModelRunner
    from hybridcache.services.runtime.sequence import LiveRun

    gen = torch.Generator().manual_seed(batch)
    max_len = prompt + 2 * steps + 16
    # the decode step's CUDA graphs are a runner's: an eager one for the routing count, a graphed one
    # for the timed steps, over one pool; both take the MoE path in force here
    runners = {g: ModelRunner(model, RuntimeConfig(decode_cuda_graphs=g, max_model_len=max_len),
                              dispatch=backends.current_dispatch()) for g in (False, True)}
    pool = runners[True].new_state_pool(batch, batch * max_len)
    slots = []
    for _ in range(batch):
        s = model.empty_state()
        model.forward_layout(s, [LiveRun(torch.randint(0, cfg.vocab_size, (prompt,), generator=gen), 0)], "none")
        slots.append(pool.assign(s))
    toks = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).tolist()
    # the experts this batch's tokens route to, per MoE layer (eager steps: hooks do not run in graphs)
    seen: dict[int, list[int]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        ex = getattr(layer.mlp, "experts", None)
        if ex is not None:
            hooks.append(ex.register_forward_pre_hook(
                lambda _m, args, i=i: seen.setdefault(i, []).append(int(torch.unique(args[1]).numel()))))
    try:
        for _ in range(2):
            logits, _ = runners[False].decode(pool, slots, toks)
            toks = logits.argmax(-1).tolist()
    finally:
        for h in hooks:
            h.remove()
    active = {i: statistics.mean(v) for i, v in seen.items()}
    # graph capture and a warm replay, then the timed steps (the host prepares step i + 1 while
    # the GPU runs step i: no synchronisation inside the loop)
    for _ in range(2):
        logits, _ = runners[True].decode(pool, slots, toks)
    context0 = prompt + 4
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, _ = runners[True].decode(pool, slots, toks)
    sync(device)
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    parts = step_bytes(model, cfg, pool, batch, context0 + steps // 2, active)
    total = sum(parts.values())
    floor_ms = total / (bw_gbs * 1e9) * 1e3
    graphs = runners[True].decode_graphs(pool)
    ex = next(layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    probe = torch.zeros(batch, cfg.hidden_size, device=device, dtype=ex.down_proj.dtype)
    figures[f"moe_decode_path_{batch}"] = backends.moe_path(probe, ex.gate_up_proj, ex.down_proj,
                                                            cfg.num_experts_per_tok)
    figures[f"moe_decode_step_ms_{batch}"] = round(step_ms, 3)
    figures[f"moe_decode_tokens_per_s_{batch}"] = round(batch / step_ms * 1e3, 1)
    figures[f"moe_decode_floor_ms_{batch}"] = round(floor_ms, 3)
    figures[f"moe_decode_fraction_of_floor_{batch}"] = float(f"{floor_ms / step_ms:.3g}")
    figures[f"moe_decode_bytes_{batch}"] = {k: int(v) for k, v in parts.items()}
    figures[f"moe_decode_active_experts_per_layer_{batch}"] = round(statistics.mean(active.values()), 4)
    figures[f"moe_decode_graph_stats_{batch}"] = dict(graphs.stats) if graphs is not None else None
    if graphs is not None and graphs.failed:
        figures[f"moe_decode_graph_failures_{batch}"] = list(graphs.failed.values())[:2]


# ----------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--preset", default="qwen3.5-35b-a3b", help="a preset of qwen3_5_moe_text (tiny for CPU runs)")
    ap.add_argument("--layers", type=int, default=0, help="layers of the preset (0: all); fewer when they do not fit")
    ap.add_argument("--reserve-gib", type=float, default=12.0,
                    help="GPU memory kept free of weights for activations, states and graphs")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' model in the prefill section")
    ap.add_argument("--quick", action="store_true", help="short prompts and few steps (smoke run)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from hybridcache.services.runtime.modelzoo import preset_names

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    problems = []
    if not sections or any(s not in SECTIONS for s in sections):
        problems.append(f"--sections: choose from {', '.join(SECTIONS)}, got {args.sections!r}")
    if args.preset not in preset_names(ARCH):
        problems.append(f"--preset: one of {', '.join(preset_names(ARCH))}, got {args.preset!r}")
    if args.layers < 0:
        problems.append("--layers must be >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        problems.append("--device cuda needs a CUDA GPU")
    if problems:
        print(f"moe_bench: error: {problems[0]}", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    requested = args.layers or hf_dict(args.preset, 0)["num_hidden_layers"]
    layers = layers_that_fit(args.preset, args.layers, device, dtype, args.reserve_gib)
    tiny = args.preset == "tiny"
    if tiny:
        lengths = [(48, "48")]
    elif args.quick:
        lengths = [(1024, "1k"), (2048, "2k")]
    else:
        lengths = [(8192, "8k"), (32768, "32k")]
    token_counts = (1, 32) if tiny else (1, 32, 256) if args.quick else (1, 32, 256, 2048, 8192)
    batches, prompt, steps = ((1, 4), 16, 3) if tiny else ((1, 32), 256, 8) if args.quick else ((1, 32), 1024, 24)
    figures, errors = {}, {}
    commit = os.environ.get("HYBRIDCACHE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()

    def result():
        return {
            "benchmark": "moe_bench",
            "gpu": torch.cuda.get_device_name() if device == "cuda" else "none (CPU)",
            "commit": commit or "unknown",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/moe_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "torch": torch.__version__,
            "shape": {"arch": ARCH, "preset": args.preset, "dtype": str(dtype).removeprefix("torch."),
                      "layers_requested": requested, "layers_run": layers},
            "figures": figures,
            "errors": errors,
        }

    def section(name, fn, *a):
        # one failing section must not cost the others' figures; the figures so far are written
        # after every section (a run cut off at its time limit keeps them)
        t0 = time.perf_counter()
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {e}"[:500]
        free()  # what the section held is dropped with its frame
        print(f"moe_bench: {name} done in {time.perf_counter() - t0:.1f} s" + (f" ({errors[name]})" if name in errors
              else ""), file=sys.stderr, flush=True)
        if args.out:
            args.out.write_text(json.dumps({**result(), "partial": True}, indent=2) + "\n")

    if device == "cuda":
        bw = copy_bandwidth(device, 2**30)
    else:
        bw = copy_bandwidth(device, 2**26)
    figures["copy_gb_per_s"] = float(f"{bw:.4g}")
    cfg = None
    if "block" in sections:
        from hybridcache.services.runtime.config import ModelConfig

        section("block", block_figures, ModelConfig.from_dict(hf_dict(args.preset, layers)), device, dtype,
                token_counts, figures, bw)
    if "prefill" in sections or "decode" in sections:
        holder = {}

        def build():
            holder["cfg"], holder["model"] = build_ours(args.preset, layers, device, dtype)

        section("build_ours", build)
        model = holder.get("model")
        if model is not None:
            cfg = holder["cfg"]
            if "prefill" in sections:
                section("prefill_ours", prefill_ours, model, device, lengths, figures, cfg.vocab_size)
            if "decode" in sections:
                for b in batches:
                    section(f"decode_{b}", decode_figures, model, cfg, device, b, prompt, steps, bw, figures)
            holder.clear()
            model = None
            free()
        if "prefill" in sections and not args.no_peer:
            def peer_run():
                peer = build_peer(args.preset, layers, device, dtype)
                figures["peer_kernels"] = peer_kernels(peer)
                try:
                    prefill_peer(peer, device, lengths, figures, peer.config.vocab_size)
                finally:
                    del peer
                    free()

            section("prefill_peer", peer_run)
    text = json.dumps(result(), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
