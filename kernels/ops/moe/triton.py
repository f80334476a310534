"""Routed experts as a Triton fused-MoE kernel pair over expert-aligned row blocks (the
vLLM/SGLang scheme); reference: naive.py.

The token-expert pairs p = t * k + j are sorted by expert (grouped.sort_by_expert: a sort and a
search, no host synchronisation) and each expert's group is padded to a multiple of BM rows, so
that every block of BM rows belongs to one expert. A program of the first kernel takes one block
and BN intermediate channels: it gathers its pairs' token rows of x, multiplies them by that
expert's gate and up rows (two fp32 accumulators) and writes silu(gate) * up for its pairs. A
program of the second takes one block and BN output channels of the down projection and writes
its pairs' rows times their routing weights; the k rows of each token are then summed.

Where each block starts is computed by every program from the group ends (E values): the padded
group sizes, their running sum, the block's expert. The grid is fixed by n alone — P + min(P, E)
(BM - 1) padded rows at most — and programs past the last block return at once, so the launches
do not depend on the routing and a step that runs them can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from hybridcache.kernels.ops.moe.grouped import CHUNK_TOKENS, sort_by_expert


@dataclass(frozen=True)
class FusedConfig:
    """Tile sizes of both kernels: BM pair rows (a block: one expert), BN output channels, BK the
    reduction step."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(pairs: int, num_experts: int) -> FusedConfig:
    """64 x 128 tiles up to 16k token-expert pairs, 128 x 128 beyond: the fastest of the tiles
    benchmarks/moe_bench.py tries, or within 1 % of it, at 1, 32, 256, 2,048 and 8,192 tokens of
    the Qwen3.5-35B-A3B shape on an H100 (moe_bench_h100_72d9493.json)."""
    if pairs <= 16384:
        return FusedConfig(64, 128, 64, 8, 3)
    return FusedConfig(128, 128, 64, 8, 3)


@triton.jit
def _block_rows(ends, i_m, E: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr):
    """Block i_m's expert e (E past the last block) and its BM rows of the sorted pairs (with a
    mask of the rows inside the group). ends [E + 1]: group e is rows ends[e]:ends[e + 1]."""
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_lo = tl.load(ends + o_e, mask=m_e, other=0)
    b_hi = tl.load(ends + 1 + o_e, mask=m_e, other=0)
    b_pad = (b_hi - b_lo + BM - 1) // BM * BM
    b_pend = tl.cumsum(b_pad, axis=0)  # padded rows of groups <= e
    row0 = i_m * BM
    e = tl.sum((b_pend <= row0).to(tl.int32), axis=0)
    sel = o_e == e
    pstart = tl.sum(tl.where(sel, b_pend - b_pad, 0), axis=0)
    lo = tl.sum(tl.where(sel, b_lo, 0), axis=0)
    hi = tl.sum(tl.where(sel, b_hi, 0), axis=0)
    local = row0 - pstart + tl.arange(0, BM)
    return e, lo + local, local < hi - lo


@triton.jit(do_not_specialize=["P"])
def moe_gate_up_kernel(
    x, w, act, order, ends, P,
    s_xm, s_we, s_wn, s_am,
    E: tl.constexpr, BE: tl.constexpr, TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    e, rows, m_r = _block_rows(ends, i_m, E, BE, BM)
    if e >= E:
        return
    m_r = m_r & (rows < P)
    b_pair = tl.load(order + rows, mask=m_r, other=0)
    b_tok = b_pair // TOP_K
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    o_k = tl.arange(0, BK)
    p_x = x + b_tok[:, None] * s_xm + o_k[None, :]
    p_g = w + e.to(tl.int64) * s_we + o_n[None, :] * s_wn + o_k[:, None]
    p_u = p_g + I * s_wn
    b_ag = tl.zeros([BM, BN], dtype=tl.float32)
    b_au = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        m_k = k0 + o_k < H
        b_x = tl.load(p_x, mask=m_r[:, None] & m_k[None, :], other=0.0)
        b_g = tl.load(p_g, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_u = tl.load(p_u, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_ag = tl.dot(b_x, b_g, b_ag, input_precision=DOT_PRECISION)
        b_au = tl.dot(b_x, b_u, b_au, input_precision=DOT_PRECISION)
        p_x += BK
        p_g += BK
        p_u += BK
    b_y = b_ag * tl.sigmoid(b_ag) * b_au
    p_a = act + b_pair[:, None] * s_am + o_n[None, :]
    tl.store(p_a, b_y.to(act.dtype.element_ty), mask=m_r[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["P"])
def moe_down_kernel(
    act, w, top_w, y, order, ends, P,
    s_am, s_we, s_wn, s_ym,
    E: tl.constexpr, BE: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    e, rows, m_r = _block_rows(ends, i_m, E, BE, BM)
    if e >= E:
        return
    m_r = m_r & (rows < P)
    b_pair = tl.load(order + rows, mask=m_r, other=0)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    o_k = tl.arange(0, BK)
    p_a = act + b_pair[:, None] * s_am + o_k[None, :]
    p_w = w + e.to(tl.int64) * s_we + o_n[None, :] * s_wn + o_k[:, None]
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        m_k = k0 + o_k < I
        b_a = tl.load(p_a, mask=m_r[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc = tl.dot(b_a, b_w, b_acc, input_precision=DOT_PRECISION)
        p_a += BK
        p_w += BK
    b_rw = tl.load(top_w + b_pair, mask=m_r, other=0.0).to(tl.float32)
    b_acc = b_acc * b_rw[:, None]
    p_y = y + b_pair[:, None] * s_ym + o_n[None, :]
    tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_r[:, None] & m_n[None, :])


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_i: torch.Tensor,
                  top_w: torch.Tensor, config: FusedConfig | None = None) -> torch.Tensor:
    """x [n, h], gate_up [E, 2I, h], down [E, h, I], top_i / top_w [n, k] -> out [n, h] in x's
    dtype (fp32 inside; fp32 inputs multiply in full fp32, not TF32)."""
    n = x.shape[0]
    if n > CHUNK_TOKENS:
        return torch.cat([fused_experts(x[s: s + CHUNK_TOKENS], gate_up, down, top_i[s: s + CHUNK_TOKENS],
                                        top_w[s: s + CHUNK_TOKENS], config) for s in range(0, n, CHUNK_TOKENS)])
    E, two_i, h = gate_up.shape
    inter, k = two_i // 2, top_i.shape[1]
    if down.shape != (E, h, inter) or x.shape[1] != h or top_w.shape != top_i.shape:
        raise ValueError(f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
                         f"top_i {tuple(top_i.shape)}, top_w {tuple(top_w.shape)} do not fit")
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        raise ValueError("expert weights need unit stride along their input channels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    P = n * k
    cfg = config or default_config(P, E)
    _, order, ends = sort_by_expert(top_i, E, leading_zero=True)
    blocks = triton.cdiv(P + min(P, E) * (cfg.block_m - 1), cfg.block_m)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(E=E, BE=triton.next_power_of_2(E), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                  DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    moe_gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n))](
        x, gate_up, act, order, ends, P, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        TOP_K=k, H=h, I=inter, **common,
    )
    y = torch.empty(P, h, dtype=x.dtype, device=x.device)
    moe_down_kernel[(blocks, triton.cdiv(h, cfg.block_n))](
        act, down, top_w.reshape(-1).contiguous(), y, order, ends, P, act.stride(0), down.stride(0), down.stride(1),
        y.stride(0), H=h, I=inter, **common,
    )
    return y.view(n, k, h).sum(1)
