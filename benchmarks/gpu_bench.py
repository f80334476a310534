"""H200 benchmarks of the CUDA engine path (issue 3); prints one JSON object.

Qwen3.5-9B shape, random bf16 weights made on the GPU. Figures: cold prefill vs transformers +
fla (same weights, same GPU, same run), entry-construction overhead, composition per segment,
TTFT of pic / prefix / full for 8 x 1k and 32 x 1k segments + a 64-token question (entries on the
GPU and in pinned host memory), decode tokens/s, and pic-vs-full numerics in bf16.

    python benchmarks/gpu_bench.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

SEG, QUESTION, SEAM = 1024, 64, 8


def timed(fn, repeat=3, warmup=1):
    """Median wall time of fn() in ms (CUDA-synchronised), and its last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


@torch.no_grad()
def random_init_cuda_(model, seed=0, std=0.02):
    """modelzoo.random_init_ on the GPU (no 18 GB host round trip)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device="cuda").uniform_(math.log(1e-3), math.log(4.0), generator=gen))
        elif name.endswith("dt_bias"):
            p.copy_(torch.rand(p.shape, device="cuda", generator=gen) * 2 - 1)
        elif name.endswith("linear_attn.norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, device="cuda", generator=gen))
        elif "norm" in name.split(".")[-2]:
            p.copy_(0.1 * torch.randn(p.shape, device="cuda", generator=gen))
        elif name.endswith("conv1d.weight"):
            p.copy_(torch.randn(p.shape, device="cuda", generator=gen) / math.sqrt(p.shape[-1]))
        else:
            p.normal_(0.0, std, generator=gen)


def peer_gdn_kernel():
    """The module of the chunked gated delta rule transformers' Qwen3.5 runs: transformers wraps
    its torch function and resolves fla's (when importable) when the module is imported; the
    wrapper keeps the resolved function in its closure."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    fn = mq.torch_chunk_gated_delta_rule
    for cell in getattr(fn, "__closure__", None) or ():
        impl = cell.cell_contents
        if callable(impl) and str(getattr(impl, "__module__", "")).startswith("fla"):
            return impl.__module__
    return fn.__module__


def build_models(preset, with_peer):
    from hybridcache.services.runtime.config import ModelConfig
    from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
    from hybridcache.services.runtime.modelzoo import hf_config

    hf = hf_config("qwen3_5_text", preset)
    cfg = ModelConfig.from_dict(hf)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = HybridLM(cfg).eval()
    random_init_cuda_(model)
    model.merge_projections()  # as the loader does
    peer, load_report = None, None
    if with_peer:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        with torch.device("cuda"):
            peer = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hf)).eval()
        missing, unexpected = peer.load_state_dict(model.state_dict(), strict=False)
        load_report = {
            "missing": len(missing),
            "unexpected": len(unexpected),
            "peer_gdn_kernel": peer_gdn_kernel(),
        }
    torch.set_default_dtype(torch.float32)
    return cfg, model, peer, load_report


def cold_prefill(model, peer, n, vocab, figures, tag):
    from hybridcache.services.runtime.sequence import LiveRun

    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))
    t_ours, _ = timed(lambda: model.forward_layout(model.empty_state(), [LiveRun(ids, 0)], "last"), repeat=2)
    figures[f"cold_prefill_ms_{tag}"] = round(t_ours, 2)
    figures[f"cold_prefill_tokens_per_s_{tag}"] = round(n / t_ours * 1e3)
    if peer is not None:
        x = ids[None].cuda()
        t_peer, _ = timed(lambda: peer(input_ids=x, use_cache=True, logits_to_keep=1), repeat=2)
        figures[f"transformers_fla_prefill_ms_{tag}"] = round(t_peer, 2)
        figures[f"cold_prefill_speedup_vs_transformers_{tag}"] = round(t_peer / t_ours, 3)
    layout_entry = [LiveRun(ids, 0, record="entry")]
    # five timed runs each: at two, run-to-run spread of ~2 % gave a negative overhead once
    t_entry, _ = timed(lambda: model.forward_layout(model.empty_state(), layout_entry, "none"), repeat=5)
    t_plain, _ = timed(lambda: model.forward_layout(model.empty_state(), [LiveRun(ids, 0)], "none"), repeat=5)
    figures[f"construction_overhead_pct_{tag}"] = round((t_entry / t_plain - 1) * 100, 2)


def compose_figures(cfg, figures, n_seg=32):
    from hybridcache.kernels.ops.transition.compose_triton import compose_states_fwd

    G = len([t for t in cfg.layer_types if t == "linear_attention"]) * cfg.linear_num_value_heads
    K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    h0 = torch.randn(G, K, V, device="cuda")
    for dtype, tag in ((torch.bfloat16, ""), (torch.float32, "_fp32_entries")):
        T = (torch.eye(K, device="cuda") * 0.9).expand(n_seg, G, K, K).to(dtype).contiguous()
        S = torch.randn(n_seg, G, K, V, device="cuda").to(dtype)
        t, out = timed(lambda T=T, S=S: compose_states_fwd(T, S, h0), repeat=20, warmup=3)
        figures[f"compose_us_per_segment{tag}"] = round(t * 1e3 / n_seg, 2)
        # the torch path the engine would use otherwise: one baddbmm per segment
        def torch_path(T=T, S=S):
            h = h0.clone()
            for i in range(n_seg):
                h = torch.baddbmm(S[i].float(), T[i].float(), h)
            return h

        t_ref, ref = timed(torch_path, repeat=5, warmup=1)
        figures[f"compose_torch_baddbmm_us_per_segment{tag}"] = round(t_ref * 1e3 / n_seg, 2)
        figures[f"compose_rel_err_vs_torch{tag}"] = float(f"{((out - ref).norm() / ref.norm()).item():.3g}")
        # Variants (precision, columns, warps, stages (0: Triton's), column blocks side by side).
        # bf16 entries' default since 2026-12-02: bf16x2, 64 columns, side by side, 8 warps, 2 stages
        # (one TF32 pass, 128 columns, 16 warps, 2 stages before: tf32_bv128_w16_s2; 8 warps and
        # Triton's stages before that: tf32_bv128_w8). fp32 entries: tf32x3, 64 columns, side by side.
        if dtype == torch.bfloat16:
            variants = [("tf32", 128, 16, 2, False), ("tf32", 128, 8, 0, False), ("tf32", 64, 4, 2, True)]
            variants += [("bf16x2", bv, w, st, vg) for bv, w, st, vg in
                         ((128, 8, 2, False), (64, 4, 2, True), (64, 8, 3, True), (32, 4, 2, True))]
        else:
            variants = [("tf32x3", 64, 8, 0, False), ("tf32x3", 32, 8, 0, True), ("tf32x3", 64, 4, 2, True)]
        for prec, bv, nw, st, vg in variants:
            name = f"{prec}_bv{bv}_w{nw}" + (f"_s{st}" if st else "") + ("_vg" if vg else "") + tag
            try:
                t_v, out_v = timed(
                    lambda T=T, S=S, prec=prec, bv=bv, nw=nw, st=st, vg=vg: compose_states_fwd(
                        T, S, h0, block_v=bv, dot_precision=prec, num_warps=nw, num_stages=st or 3, grid_vg=vg
                    ),
                    repeat=20,
                    warmup=3,
                )
            except Exception as e:  # noqa: BLE001 (a variant that does not compile must not cost the others)
                figures[f"compose_{name}_error"] = f"{type(e).__name__}: {e}"[:200]
                continue
            figures[f"compose_us_per_segment_{name}"] = round(t_v * 1e3 / n_seg, 2)
            err = ((out_v - ref).norm() / ref.norm()).item()
            figures[f"compose_rel_err_vs_torch_{name}"] = float(f"{err:.3g}")


def build_entries(model, segs):
    from hybridcache.services.runtime.sequence import LiveRun

    entries = []
    for seg in segs:
        layout = [LiveRun(seg[:SEAM], 0), LiveRun(seg[SEAM:], SEAM, record="entry")]
        _, rec = model.forward_layout(model.empty_state(), layout, "none")
        entries.append(rec.entries[1])
    return entries


def to_device(data, device, pin=False):
    from hybridcache.services.runtime.sequence import AttnSpan, LinearSpan, SpanData

    def mv(t):
        return t.to(device).pin_memory() if pin else t.to(device, non_blocking=True)

    return SpanData(
        data.num_tokens,
        data.local_start,
        {i: LinearSpan(mv(s.T), mv(s.S), mv(s.conv_tail)) for i, s in data.linear.items()},
        {i: AttnSpan(mv(a.k), mv(a.v)) for i, a in data.attn.items()},
    )


def pic_layout(segs, entries, question):
    from hybridcache.services.runtime.sequence import CachedSpan, LiveRun

    layout, pos = [], 0
    for seg, data in zip(segs, entries):
        layout.append(LiveRun(seg[:SEAM], pos))
        layout.append(CachedSpan(data, pos + SEAM))
        pos += seg.numel()
    layout.append(LiveRun(question, pos))
    return layout


_RUNNERS: dict = {}


def runner_of(model, **settings):
    """The ModelRunner over `model` with these RuntimeConfig settings (one per model and settings,
    kept: its CUDA graphs of assemblies serve every section, as a worker's do)."""
    from hybridcache.services.config import RuntimeConfig
    from hybridcache.services.runtime.runner import ModelRunner

    key = (id(model), tuple(sorted(settings.items())))
    if key not in _RUNNERS:
        _RUNNERS[key] = ModelRunner(model, RuntimeConfig(**settings))
    return _RUNNERS[key]


def ttft_figures(model, cfg, n_seg, figures, numerics):
    from hybridcache.services.runtime.sequence import LiveRun

    runner = runner_of(model)
    graphed_forward = runner.forward

    gen = torch.Generator().manual_seed(n_seg)
    segs = [torch.randint(0, cfg.vocab_size, (SEG,), generator=gen) for _ in range(n_seg)]
    question = torch.randint(0, cfg.vocab_size, (QUESTION,), generator=gen)
    entries = build_entries(model, segs)
    tag = f"{n_seg}x1k"
    all_ids = torch.cat(segs + [question])

    t_full, (logits_full, _) = timed(
        lambda: model.forward_layout(model.empty_state(), [LiveRun(all_ids, 0)], "last"), repeat=2
    )
    # prefix: the exact state after the first segment is cached; the rest is prefilled
    after_first = model.empty_state()
    model.forward_layout(after_first, [LiveRun(segs[0], 0)], "none")
    rest = all_ids[SEG:]
    t_prefix, _ = timed(lambda: model.forward_layout(after_first.clone(), [LiveRun(rest, SEG)], "last"), repeat=2)

    def run_pic():
        state = model.empty_state()
        logits, _ = graphed_forward(state, pic_layout(segs, entries, question), "last")
        return logits, state

    # The live pass runs from CUDA graphs of its shape (services/runtime/graphs.py): captured at a
    # shape's second sighting (the first compiles and autotunes eagerly), replayed after. The timed
    # runs are replays; the eager pass and the capturing request are timed on their own.
    with runner.eager():
        t_eager, (logits_eager, _) = timed(run_pic, repeat=5)
    run_pic()  # first sighting of the shape with graphs on (the eager runs above do not count)
    torch.cuda.synchronize()
    graphs = runner.layout_graphs
    buffers = graphs.buffer_bytes if graphs is not None else 0
    allocated = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    run_pic()  # second: captured (answered by the eager pass on the graphs' buffers, then checked)
    torch.cuda.synchronize()
    t_capture = (time.perf_counter() - t0) * 1e3
    figures[f"pic_graph_memory_mb_{tag}"] = round((torch.cuda.memory_allocated() - allocated) / 2**20, 1)
    t_pic, (logits_pic, state_pic) = timed(run_pic, repeat=5)
    figures[f"pic_ttft_ms_{tag}_gpu_resident_eager"] = round(t_eager, 2)
    figures[f"pic_capture_request_ms_{tag}"] = round(t_capture, 2)
    figures[f"pic_graphs_vs_eager_logits_max_abs_diff_{tag}"] = float(
        f"{(logits_pic.float() - logits_eager.float()).abs().max().item():.3g}"
    )
    figures[f"pic_graph_stats_{tag}"] = dict(graphs.stats) if graphs is not None else None
    if graphs is not None:  # the captured shape's static entry buffers
        figures[f"pic_graph_entry_buffers_mb_{tag}"] = round((graphs.buffer_bytes - buffers) / 2**20, 1)
    figures[f"pic_graph_failures_{tag}"] = list(graphs.failed.values())[:3] if graphs is not None else None
    # Entries in the engine's host tier (cache/host_tier.py): one pinned buffer per entry, staged
    # layer by layer on a side stream while the forward runs (the engine's path for host hits).
    from hybridcache.services.runtime.cache import SegmentEntry
    from hybridcache.services.runtime.cache.host_tier import stage, to_host

    def pic_from_host(ents, name):
        """A timed pic assembly of `ents` moved to the host tier first (staged on every run)."""
        host_ents = [to_host(SegmentEntry(f"{name}-{i}", SEG, e, 0.0)) for i, e in enumerate(ents)]

        def run():
            staged = stage(host_ents, "cuda")
            return graphed_forward(model.empty_state(), pic_layout(segs, staged, question), "last")

        return run

    t_host, (logits_host, _) = timed(pic_from_host(entries, "bench"), repeat=5)
    figures[f"pic_host_vs_gpu_logits_max_abs_diff_{tag}"] = float(
        f"{(logits_host.float() - logits_pic.float()).abs().max().item():.3g}"
    )
    # the earlier way, for comparison: every tensor copied on its own before the forward
    host = [to_device(e, "cpu", pin=True) for e in entries]

    def run_pic_host_per_tensor():
        on_gpu = [to_device(e, "cuda") for e in host]
        return graphed_forward(model.empty_state(), pic_layout(segs, on_gpu, question), "last")

    t_host_tensor, _ = timed(run_pic_host_per_tensor, repeat=3)
    figures[f"pic_ttft_ms_{tag}_host_per_tensor_copies"] = round(t_host_tensor, 2)
    from hybridcache.services.runtime.cache import cast_entry_states, entry_nbytes

    entry_bytes = sum(map(entry_nbytes, entries))
    figures[f"ttft_ms_full_{tag}"] = round(t_full, 2)
    figures[f"ttft_ms_prefix_{tag}"] = round(t_prefix, 2)
    figures[f"pic_ttft_ms_{tag}_gpu_resident"] = round(t_pic, 2)
    figures[f"pic_ttft_ms_{tag}_host"] = round(t_host, 2)
    figures[f"pic_ttft_speedup_vs_prefix_{tag}_gpu_resident"] = round(t_prefix / t_pic, 2)
    figures[f"pic_ttft_speedup_vs_prefix_{tag}_host"] = round(t_prefix / t_host, 2)
    figures[f"entry_mb_per_segment_{tag}"] = round(entry_bytes / n_seg / 2**20, 1)
    # the same entries with T and S in bf16 (EngineConfig.entry_state_dtype="bfloat16"): bytes,
    # TTFT GPU-resident and from the host tier, and how far the logits move from fp32 states
    import dataclasses

    e16 = [
        cast_entry_states(dataclasses.replace(e, linear=dict(e.linear), attn=dict(e.attn)), torch.bfloat16)
        for e in entries
    ]
    t16, (logits16, _) = timed(
        lambda: graphed_forward(model.empty_state(), pic_layout(segs, e16, question), "last"), repeat=5, warmup=3
    )
    t16_host, _ = timed(pic_from_host(e16, "bench16"), repeat=5)
    figures[f"entry_mb_per_segment_{tag}_bf16_states"] = round(sum(map(entry_nbytes, e16)) / n_seg / 2**20, 1)
    figures[f"pic_ttft_ms_{tag}_gpu_resident_bf16_states"] = round(t16, 2)
    figures[f"pic_ttft_ms_{tag}_host_bf16_states"] = round(t16_host, 2)
    figures[f"pic_bf16_states_vs_fp32_logits_max_abs_diff_{tag}"] = float(
        f"{(logits16.float() - logits_pic.float()).abs().max().item():.3g}"
    )
    figures[f"pic_bf16_states_top1_agrees_{tag}"] = int(logits16.argmax() == logits_pic.argmax())
    # numerics of pic vs full in bf16 on this prompt
    state_full = model.empty_state()
    model.forward_layout(state_full, [LiveRun(all_ids, 0)], "none")
    errs = [
        ((state_pic.linear[i].ssm - state_full.linear[i].ssm).norm() / state_full.linear[i].ssm.norm()).item()
        for i in state_full.linear
    ]
    # linear layers below the first attention layer see exactly the same inputs under pic
    first_attn = min(state_full.attn)
    exact = [e for i, e in zip(state_full.linear, errs) if i < first_attn]
    numerics.append(
        {
            "segments": n_seg,
            "top1_agree": int(logits_pic.argmax() == logits_full.argmax()),
            "state_rel_err_mean": statistics.mean(errs),
            "state_rel_err_max": max(errs),
            "state_rel_err_max_below_first_attention": max(exact) if exact else None,
        }
    )


def shape_churn_figures(model, cfg, figures, n_seg=8, fresh=4, steps=16):
    """What a never-seen shape costs: pic assemblies whose question length (so live-token count
    and context length) is new, and decode steps (each a new context length), under torch's own
    SDPA backend choice (cuDNN included) and under the engine's default (flash, efficient, math)."""
    from hybridcache.services.runtime import backends
    from hybridcache.services.runtime.sequence import LiveRun

    gen = torch.Generator().manual_seed(99)
    segs = [torch.randint(0, cfg.vocab_size, (SEG,), generator=gen) for _ in range(n_seg)]
    entries = build_entries(model, segs)
    base = 40
    for tag, spec in (("torch", "torch"), ("default", backends.DEFAULT_SDPA_BACKENDS)):
        # the runner enters its own op choice for its forwards; the plain forwards below, this one
        graphed_forward = runner_of(model, sdpa_backends=spec).forward
        with backends.dispatching(backends.OpDispatch(sdpa_backends=spec)):
            first, again = [], []
            for i in range(fresh):
                q = torch.randint(0, cfg.vocab_size, (base + i,), generator=gen)
                for times in (first, again):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    graphed_forward(model.empty_state(), pic_layout(segs, entries, q), "last")
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
            base += fresh
            figures[f"pic_ms_new_shape_8x1k_sdpa_{tag}"] = round(statistics.median(first), 2)
            figures[f"pic_ms_same_shape_8x1k_sdpa_{tag}"] = round(statistics.median(again), 2)
            state = model.empty_state()
            logits, _ = model.forward_layout(state, [LiveRun(torch.cat(segs[:2]), 0)], "last")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = logits.argmax().view(1).cpu()
                logits, _ = model.forward_layout(state, [LiveRun(tok, state.length)], "last")
            torch.cuda.synchronize()
            figures[f"decode_tokens_per_s_batch1_sdpa_{tag}"] = round(steps / (time.perf_counter() - t0), 1)


def decode_figures(model, cfg, figures, prompt=1024, steps=32):
    from hybridcache.services.runtime.sequence import LiveRun

    ids = torch.randint(0, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(7))
    state = model.empty_state()
    logits, _ = model.forward_layout(state, [LiveRun(ids, 0)], "last")

    def decode():
        nonlocal logits
        for _ in range(steps):
            tok = logits.argmax().view(1).cpu()
            logits, _ = model.forward_layout(state, [LiveRun(tok, state.length)], "last")

    t, _ = timed(decode, repeat=1, warmup=1)
    figures["decode_tokens_per_s_batch1"] = round(steps / t * 1e3, 1)

    # batch 32: equal-length sequences, states stacked on the batch axis
    batch, prompt_b = 32, 512
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, cfg.vocab_size, (prompt_b,), generator=gen) for _ in range(batch)]
    singles = []
    for ids_b in seqs:
        st = model.empty_state()
        lo, _ = model.forward_layout(st, [LiveRun(ids_b, 0)], "last")
        singles.append((st, lo))
    stacked = {}
    for i in singles[0][0].linear:
        stacked[i] = {
            "ssm": torch.cat([st.linear[i].ssm for st, _ in singles]),
            "conv": torch.cat([st.linear[i].conv for st, _ in singles]),
        }
    for i in singles[0][0].attn:
        stacked[i] = {
            "k": torch.cat([st.attn[i].k for st, _ in singles]),
            "v": torch.cat([st.attn[i].v for st, _ in singles]),
        }
    toks = torch.stack([lo.argmax() for _, lo in singles])
    # check the batched step against the engine's own single-sequence step for sequence 0
    st0 = singles[0][0].clone()
    ref0, _ = model.forward_layout(st0, [LiveRun(toks[:1].cpu(), prompt_b)], "last")
    pos = prompt_b

    def decode_b():
        nonlocal toks, pos
        for _ in range(steps):
            logits_b = decode_step_batched(model, stacked, toks, pos)
            if pos == prompt_b:
                figures["decode_batch32_vs_single_rel_err"] = float(
                    f"{((logits_b[0] - ref0).norm() / ref0.norm()).item():.3g}"
                )
            toks = logits_b.argmax(-1)
            pos += 1

    # warm-up on a copy of the states (kernels compile and autotune for batch 32 here, not in the
    # timed steps); the timed run then starts from the prompt's states
    saved = {i: {name: t.clone() for name, t in st.items()} for i, st in stacked.items()}
    decode_b()
    stacked.clear()
    stacked.update(saved)
    toks, pos = torch.stack([lo.argmax() for _, lo in singles]), prompt_b
    t_b, _ = timed(decode_b, repeat=1, warmup=0)
    figures["decode_tokens_per_s_batch32"] = round(batch * steps / t_b * 1e3, 1)


@torch.no_grad()
def decode_step_batched(model, states, toks, pos):
    """One decode step for B sequences of equal length: HybridLM's layer math batched over
    sequences (forward_layout runs one sequence at a time). States are updated in place."""
    import torch.nn.functional as F
    from hybridcache.services.runtime import backends
    from hybridcache.services.runtime.models.qwen3_hybrid import apply_rope

    B = toks.shape[0]
    x = model.model.embed_tokens(toks)[:, None]  # [B, 1, h]
    for i, layer in enumerate(model.model.layers):
        h = layer.input_layernorm(x)
        st = states[i]
        if layer.kind == "linear_attention":
            la = layer.linear_attn
            mixed, z, b, a = la.projections(h.view(1, B, -1))
            conv_out, st["conv"] = backends.causal_conv1d(
                mixed.view(B, 1, -1), la.conv1d.weight.squeeze(1), None, st["conv"], "silu"
            )
            q, k, v = torch.split(conv_out, [la.key_dim, la.key_dim, la.value_dim], dim=-1)
            r = la.hv // la.hk
            q = q.reshape(B, 1, la.hk, la.dk).repeat_interleave(r, dim=2)
            k = k.reshape(B, 1, la.hk, la.dk).repeat_interleave(r, dim=2)
            v = v.reshape(B, 1, la.hv, la.dv)
            q, k = backends.l2norm_fp32(q), backends.l2norm_fp32(k)
            beta = b.view(B, 1, -1).float().sigmoid()
            g = -la.A_log.float().exp() * F.softplus(a.view(B, 1, -1).float() + la.dt_bias.float())
            o, st["ssm"] = backends.gated_delta_rule(q, k, v, g, beta, st["ssm"], False)
            o = la.norm(o.reshape(-1, la.dv), z.reshape(-1, la.dv)).view(B, 1, -1)
            h = la.out_proj(o)
        else:
            at = layer.self_attn
            q, gate = torch.chunk(at.q_proj(h).view(B, 1, at.hq, 2 * at.d), 2, dim=-1)
            q = at.q_norm(q).transpose(1, 2)  # [B, Hq, 1, d]
            k = at.k_norm(at.k_proj(h).view(B, 1, at.hkv, at.d)).transpose(1, 2)
            v = at.v_proj(h).view(B, 1, at.hkv, at.d).transpose(1, 2)
            cos, sin = at.rope(torch.tensor([pos], device=x.device), q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            st["k"], st["v"] = torch.cat([st["k"], k], dim=2), torch.cat([st["v"], v], dim=2)
            out = backends.sdpa(q, st["k"], st["v"], scale=at.d**-0.5, enable_gqa=True)
            h = at.o_proj(out.transpose(1, 2).reshape(B, 1, -1) * torch.sigmoid(gate.reshape(B, 1, -1)))
        x = x + h
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))[:, 0].float()  # [B, vocab]


SECTIONS = ("cold_prefill", "compose", "ttft", "decode", "shape_churn")


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--quick", action="store_true", help="short prompts only (smoke run)")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers + fla")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma list of the sections to run (default all: {','.join(SECTIONS)})",
    )
    args = ap.parse_args(argv)
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    bad = [x for x in sections if x not in SECTIONS]
    if bad or not sections:
        print(f"gpu_bench: error: --sections: unknown {bad or 'empty list'}; choose from {', '.join(SECTIONS)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_bench: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    # transformers' forward would otherwise keep autograd buffers (out of memory at 8k)
    torch.set_grad_enabled(False)
    cfg, model, peer, load_report = build_models(args.preset, not args.no_peer and "cold_prefill" in sections)
    figures, numerics, errors = {}, [], {}

    commit = os.environ.get("HYBRIDCACHE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()

    def result():
        return {
            "gpu": torch.cuda.get_device_name(),
            "commit": commit or "unknown",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/gpu_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "preset": args.preset,
            "torch": torch.__version__,
            "peer_state_dict_load": load_report,
            "numerics": numerics,
            "errors": errors,
            "figures": figures,
        }

    def section(name, fn, *a):
        # one failing section must not cost the others' figures (device time is scarce), and the
        # figures so far are written after every section (a run cut off at its limit keeps them)
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {e}"[:500]
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps({**result(), "partial": True}, indent=2) + "\n")

    lengths = [(1024, "1k")] if args.quick else [(8192, "8k"), (32768, "32k")]
    if "cold_prefill" in sections:
        for n, tag in lengths:
            section(f"cold_prefill_{tag}", cold_prefill, model, peer, n, cfg.vocab_size, figures, tag)
        overheads = [figures[f"construction_overhead_pct_{tag}"] for _, tag in lengths
                     if f"construction_overhead_pct_{tag}" in figures]
        if overheads:  # the goal holds only if it holds at every length: the worst one
            figures["construction_overhead_pct"] = max(overheads)
    if peer is not None:
        del peer
        torch.cuda.empty_cache()
    if "compose" in sections:
        section("compose", compose_figures, cfg, figures)
    if "ttft" in sections:
        for n_seg in [2] if args.quick else [8, 32]:
            section(f"ttft_{n_seg}x1k", ttft_figures, model, cfg, n_seg, figures, numerics)
    if "decode" in sections:
        section("decode", decode_figures, model, cfg, figures)
    if "shape_churn" in sections:
        section("shape_churn", shape_churn_figures, model, cfg, figures)
    if numerics:
        figures["pic_vs_full_top1_agreement"] = statistics.mean(x["top1_agree"] for x in numerics)
        figures["pic_vs_full_state_rel_err_max"] = float(f"{max(x['state_rel_err_max'] for x in numerics):.3g}")
    text = json.dumps(result(), indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
