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
from hybridcache.kernels.ops.moe.naive import SharedExpert


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


# Few token-expert pairs (a decode step of a few requests): one program per (pair, tile of output
# channels), a GEMV over its expert's rows, no sort and no padding. Each pair reads its expert's
# weights on its own: where tokens share experts they are read again (backends.MOE_PAIR_MAX says
# up to how many pairs that pays).


@dataclass(frozen=True)
class PairConfig:
    """Tiles of the pair kernels: gate_up_n intermediate channels a program (both halves) over
    steps of gate_up_k input channels; down_n output channels over steps of down_k."""

    gate_up_n: int = 8
    gate_up_k: int = 256
    down_n: int = 8
    down_k: int = 256
    num_warps: int = 4
    # products summed into a [n, k] fp32 tile over the whole loop and reduced across it once at
    # the end, instead of a cross-thread reduction a step (benchmarks/moe_bench.py times both)
    reduce_once: bool = False


# The tiles pair_experts runs without a config (pair_config): the MoE block's fastest graphed
# tiles in benchmarks/moe_bench.py's block section on an H100 at one token and at 32
# (benchmarks/results/moe_bench_h100_d461794.json); PAIR_CONFIG, when set, for every count (the
# benchmark pins each candidate there).
ONE_TOKEN_PAIRS = PairConfig(4, 512, 4, 512, 4, reduce_once=True)
FEW_TOKEN_PAIRS = PairConfig(8, 256, 8, 256, 4, reduce_once=True)
PAIR_CONFIG: PairConfig | None = None


def pair_config(n: int) -> PairConfig:
    """The tiles of pair_experts for n tokens (PAIR_CONFIG where set)."""
    return PAIR_CONFIG or (ONE_TOKEN_PAIRS if n == 1 else FEW_TOKEN_PAIRS)


@triton.jit(do_not_specialize=["P"])
def moe_pair_gate_up_kernel(
    x, w, top_i, act, sg, su, sl, logit, P,
    s_xm, s_we, s_wn, s_sg, s_su, s_am,
    TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, I_S: tl.constexpr,
    HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    REDUCE_ONCE: tl.constexpr,
):
    """Program (p, i_n): act[p, tile] = silu(gate @ x[t]) * (up @ x[t]) over the tile's channels,
    pair p < P of token t = p // TOP_K and expert top_i[p], or (HAS_SHARED) p = P + t the shared
    expert of token t; program (P + t, 0) also writes logit[t] = x[t] @ sl (HAS_GATE)."""
    i_p, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    if i_p < P:
        i_t = i_p // TOP_K
        e = tl.load(top_i + i_p).to(tl.int64)
        p_g = w + e * s_we + o_n[:, None].to(tl.int64) * s_wn
        p_u = p_g + I * s_wn
        m_n = o_n < I
    else:
        i_t = i_p - P
        p_g = sg + o_n[:, None].to(tl.int64) * s_sg
        p_u = su + o_n[:, None].to(tl.int64) * s_su
        m_n = o_n < I_S
    # the shared expert's programs of tile 0 also reduce x[t] against the gate's row
    is_gate = (i_p >= P) & (i_n == 0)
    gate_k = tl.where(is_gate, H, 0)
    p_x = x + i_t.to(tl.int64) * s_xm
    b_ag = tl.zeros([BN], dtype=tl.float32)
    b_au = tl.zeros([BN], dtype=tl.float32)
    b_pg = tl.zeros([BN, BK], dtype=tl.float32)
    b_pu = tl.zeros([BN, BK], dtype=tl.float32)
    b_l = tl.zeros([BK], dtype=tl.float32)
    for k0 in tl.static_range(0, H, BK):
        m_k = k0 + o_k < H
        b_x = tl.load(p_x + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)
        m_w = m_n[:, None] & m_k[None, :]
        b_g = tl.load(p_g + k0 + o_k[None, :], mask=m_w, other=0.0).to(tl.float32)
        b_u = tl.load(p_u + k0 + o_k[None, :], mask=m_w, other=0.0).to(tl.float32)
        if REDUCE_ONCE:
            b_pg += b_g * b_x[None, :]
            b_pu += b_u * b_x[None, :]
        else:
            b_ag += tl.sum(b_g * b_x[None, :], axis=1)
            b_au += tl.sum(b_u * b_x[None, :], axis=1)
        if HAS_GATE:
            b_l += tl.load(sl + k0 + o_k, mask=k0 + o_k < gate_k, other=0.0).to(tl.float32) * b_x
    if REDUCE_ONCE:
        b_ag = tl.sum(b_pg, axis=1)
        b_au = tl.sum(b_pu, axis=1)
    b_y = b_ag * tl.sigmoid(b_ag) * b_au
    tl.store(act + i_p.to(tl.int64) * s_am + o_n, b_y, mask=m_n)
    if HAS_GATE:
        tl.store(logit + i_t, tl.sum(b_l, axis=0), mask=is_gate)


@triton.jit(do_not_specialize=["P"])
def moe_pair_down_kernel(
    act, w, top_i, top_w, out, sd, logit, P,
    s_am, s_we, s_wn, s_sd, s_om,
    TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, I_S: tl.constexpr,
    HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    REDUCE_ONCE: tl.constexpr,
):
    """Program (t, i_n): out[t, tile] = sum_j top_w[t, j] * down[top_i[t, j]] @ act[t k + j]
    (+ sigmoid(logit[t]) * shared_down @ act[P + t]), fp32 throughout, one store."""
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    o_k = tl.arange(0, BK)
    b_o = tl.zeros([BN], dtype=tl.float32)
    b_p = tl.zeros([BN, BK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        i_p = i_t * TOP_K + j
        e = tl.load(top_i + i_p).to(tl.int64)
        b_rw = tl.load(top_w + i_p).to(tl.float32)
        p_w = w + e * s_we + o_n[:, None].to(tl.int64) * s_wn
        p_a = act + i_p.to(tl.int64) * s_am
        b_y = tl.zeros([BN], dtype=tl.float32)
        for k0 in tl.static_range(0, I, BK):
            m_k = k0 + o_k < I
            b_a = tl.load(p_a + k0 + o_k, mask=m_k, other=0.0)
            b_w = tl.load(p_w + k0 + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            if REDUCE_ONCE:
                b_p += b_w * (b_rw * b_a)[None, :]
            else:
                b_y += tl.sum(b_w * b_a[None, :], axis=1)
        if not REDUCE_ONCE:
            b_o += b_rw * b_y
    if REDUCE_ONCE:
        b_o = tl.sum(b_p, axis=1)
    if HAS_SHARED:
        p_w = sd + o_n[:, None].to(tl.int64) * s_sd
        p_a = act + (P + i_t).to(tl.int64) * s_am
        b_y = tl.zeros([BN], dtype=tl.float32)
        for k0 in tl.static_range(0, I_S, BK):
            m_k = k0 + o_k < I_S
            b_a = tl.load(p_a + k0 + o_k, mask=m_k, other=0.0)
            b_w = tl.load(p_w + k0 + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            b_y += tl.sum(b_w * b_a[None, :], axis=1)
        if HAS_GATE:
            b_y *= tl.sigmoid(tl.load(logit + i_t))
        b_o += b_y
    tl.store(out + i_t.to(tl.int64) * s_om + o_n, b_o.to(out.dtype.element_ty), mask=m_n)


def pair_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_i: torch.Tensor,
                 top_w: torch.Tensor, shared: SharedExpert | None = None,
                 config: PairConfig | None = None) -> torch.Tensor:
    """x [n, h], gate_up [E, 2I, h], down [E, h, I], top_i / top_w [n, k] -> out [n, h] in x's
    dtype: the routed experts' weighted sum plus, given `shared`, the shared expert (and its
    sigmoid gate), in two launches whose grids depend on n alone. fp32 accumulation, one rounding
    of the output; act between the launches is fp32 ([n k (+ n), max(I, Is)])."""
    E, two_i, h = gate_up.shape
    inter = two_i // 2
    n, k = top_i.shape
    if down.shape != (E, h, inter) or x.shape != (n, h) or top_w.shape != top_i.shape:
        raise ValueError(f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
                         f"top_i {tuple(top_i.shape)}, top_w {tuple(top_w.shape)} do not fit")
    inter_s = 0
    if shared is not None:
        inter_s = shared.down.shape[1]
        if (shared.gate.shape != (inter_s, h) or shared.up.shape != (inter_s, h) or shared.down.shape != (h, inter_s)
                or (shared.gate_logit is not None and shared.gate_logit.numel() != h)):
            raise ValueError(f"shared expert gate {tuple(shared.gate.shape)}, up {tuple(shared.up.shape)}, "
                             f"down {tuple(shared.down.shape)} do not fit h = {h}")
    weights = [gate_up, down] + ([] if shared is None else [shared.gate, shared.up, shared.down])
    if any(t.stride(-1) != 1 for t in weights):
        raise ValueError("expert weights need unit stride along their input channels")
    out = torch.empty_like(x)
    if n == 0:
        return out
    cfg = config or pair_config(n)
    x = x if x.stride(-1) == 1 else x.contiguous()
    top_i, top_w = top_i.contiguous(), top_w.contiguous()
    P = n * k
    rows = P + (n if shared is not None else 0)
    act = torch.empty(rows, max(inter, inter_s), dtype=torch.float32, device=x.device)
    has_gate = shared is not None and shared.gate_logit is not None
    logit = torch.empty(n, dtype=torch.float32, device=x.device) if has_gate else act
    sg, su, sd = (gate_up, gate_up, down) if shared is None else (shared.gate, shared.up, shared.down)
    sl = shared.gate_logit.reshape(-1) if has_gate else x
    common = dict(TOP_K=k, H=h, I=inter, I_S=inter_s, HAS_SHARED=shared is not None, HAS_GATE=has_gate,
                  REDUCE_ONCE=cfg.reduce_once, num_warps=cfg.num_warps)
    moe_pair_gate_up_kernel[(rows, triton.cdiv(max(inter, inter_s), cfg.gate_up_n))](
        x, gate_up, top_i, act, sg, su, sl, logit, P,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), sg.stride(0), su.stride(0), act.stride(0),
        BN=cfg.gate_up_n, BK=cfg.gate_up_k, **common,
    )
    moe_pair_down_kernel[(n, triton.cdiv(h, cfg.down_n))](
        act, down, top_i, top_w, out, sd, logit, P,
        act.stride(0), down.stride(0), down.stride(1), sd.stride(0), out.stride(0),
        BN=cfg.down_n, BK=cfg.down_k, **common,
    )
    return out


@triton.jit
def _top_k_store(b_l, top_w, top_i, i_t, E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr, BKK: tl.constexpr,
                 RENORMALIZE: tl.constexpr):
    """Token i_t's k largest of its logits b_l [BE] (fp32, -inf past E) by k argmaxes (the lowest
    index among equal ones), in descending order, stored with their weights: the softmax of those
    k (RENORMALIZE) or their share of the whole row's softmax."""
    o_e = tl.arange(0, BE)
    o_j = tl.arange(0, BKK)
    b_tl = tl.full([BKK], float("-inf"), dtype=tl.float32)
    b_ti = tl.zeros([BKK], dtype=tl.int64)
    b_left = b_l
    for j in tl.static_range(K):
        b_v, b_i = tl.max(b_left, axis=0, return_indices=True, return_indices_tie_break_left=True)
        b_tl = tl.where(o_j == j, b_v, b_tl)
        b_ti = tl.where(o_j == j, b_i.to(tl.int64), b_ti)
        b_left = tl.where(o_e == b_i, float("-inf"), b_left)
    if RENORMALIZE:
        b_p = tl.exp(b_tl - tl.max(b_tl, axis=0))
        b_w = b_p / tl.sum(b_p, axis=0)
    else:
        b_m = tl.max(b_l, axis=0)
        b_w = tl.exp(b_tl - b_m) / tl.sum(tl.exp(b_l - b_m), axis=0)
    m_j = o_j < K
    tl.store(top_w + i_t * K + o_j, b_w.to(top_w.dtype.element_ty), mask=m_j)
    tl.store(top_i + i_t * K + o_j, b_ti, mask=m_j)


@triton.jit
def softmax_top_k_kernel(
    logits, top_w, top_i, s_lm,
    E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr, BKK: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    """Program t: token t's top k of its logits row (_top_k_store), computed in fp32."""
    i_t = tl.program_id(0)
    o_e = tl.arange(0, BE)
    b_l = tl.load(logits + i_t.to(tl.int64) * s_lm + o_e, mask=o_e < E, other=float("-inf")).to(tl.float32)
    _top_k_store(b_l, top_w, top_i, i_t, E, BE, K, BKK, RENORMALIZE)


def _top_k_outputs(n: int, E: int, k: int, dtype: torch.dtype, device):
    """The (weights [n, k] in `dtype`, experts [n, k] int64) a top-k of E experts writes."""
    if not 0 < k <= E:
        raise ValueError(f"top-{k} of {E} experts")
    return (torch.empty(n, k, dtype=dtype, device=device), torch.empty(n, k, dtype=torch.int64, device=device))


def softmax_top_k(logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype):
    """models/common.softmax_top_k in one launch: logits [n, E] -> (weights [n, k] in `dtype`,
    experts [n, k] int64), the k largest logits in descending order."""
    n, E = logits.shape
    top_w, top_i = _top_k_outputs(n, E, k, dtype, logits.device)
    if n == 0:
        return top_w, top_i
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    softmax_top_k_kernel[(n,)](
        logits, top_w, top_i, logits.stride(0), E=E, BE=triton.next_power_of_2(E), K=k,
        BKK=triton.next_power_of_2(k), RENORMALIZE=renormalize, num_warps=1 if E <= 1024 else 4,
    )
    return top_w, top_i


# The router and its top-k in one launch (router_top_k): ROUTER_ROWS router rows a program (a
# token's E logits over E / ROUTER_ROWS programs, each streaming its rows' ROUTER_ROWS x h weights
# ROUTER_K columns at a time), and the token's last program to finish picks the top k. cuBLAS runs
# the [E = 256, h = 2048] router of one token on a few thread blocks (10 us a layer on an H100,
# profile_decode_moe_h100_d461794.json, against 0.35 us for its 1 MB at the copy bandwidth).
ROUTER_ROWS = 2
ROUTER_K = 1024


@triton.jit
def router_top_k_kernel(
    x, w, logits, count, top_w, top_i, s_xm, s_we,
    E: tl.constexpr, H: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
    K: tl.constexpr, BKK: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    """Program (t, i): logits[t, i BN: (i + 1) BN] = w[rows] @ x[t] (fp32 sums, rounded to the
    logits' dtype as a linear layer's output is); then a count of token t's programs done, and the
    one that finds the others all done (it counts last) reads the row back and stores token t's
    top k (_top_k_store), resetting the count to zero for the next launch. The count's add is
    acquire-release at device scope after a barrier of the program's threads, so the logits every
    other program stored are visible to the last one; it reads them past the L1 cache."""
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < E
    o_k = tl.arange(0, BK)
    p_x = x + i_t.to(tl.int64) * s_xm
    p_w = w + o_n[:, None].to(tl.int64) * s_we
    b_acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in tl.static_range(0, H, BK):
        m_k = k0 + o_k < H
        b_x = tl.load(p_x + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_w = tl.load(p_w + k0 + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_acc += b_w * b_x[None, :]
    p_l = logits + i_t.to(tl.int64) * E
    tl.store(p_l + o_n, tl.sum(b_acc, axis=1).to(logits.dtype.element_ty), mask=m_n)
    tl.debug_barrier()
    done = tl.atomic_add(count + i_t, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(1) - 1:
        o_e = tl.arange(0, BE)
        b_l = tl.load(p_l + o_e, mask=o_e < E, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
        _top_k_store(b_l, top_w, top_i, i_t, E, BE, K, BKK, RENORMALIZE)
        tl.atomic_xchg(count + i_t, 0, sem="relaxed", scope="gpu")


# token counts of router_top_k by device: zeros between launches (each launch's last programs reset
# theirs); grown, never shrunk or freed (a captured CUDA graph keeps the one it was captured with)
_ROUTER_COUNTS: dict[torch.device, list[torch.Tensor]] = {}


def router_counts(n: int, device: torch.device) -> torch.Tensor | None:
    """The zeroed int32 counts router_top_k needs for n tokens on `device`, or None where none
    that large exists yet and a CUDA graph is being captured (a capture allocates nothing that
    outlives it): the caller then runs the router and softmax_top_k apart."""
    device = torch.device(device)
    held = _ROUTER_COUNTS.setdefault(device, [])
    if held and held[-1].numel() >= n:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    held.append(torch.zeros(max(n, 64), dtype=torch.int32, device=device))
    return held[-1]


def router_top_k(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype,
                 counts: torch.Tensor | None = None):
    """softmax_top_k(x @ weight^T, ...) in one launch: x [n, h], router weight [E, h] -> (weights
    [n, k] in `dtype`, experts [n, k] int64). The logits are x @ weight^T rounded to x's dtype
    before the top-k, as the unfused router's linear layer leaves them. counts: router_counts(n)."""
    n, h = x.shape
    E = weight.shape[0]
    if weight.shape != (E, h) or weight.stride(-1) != 1:
        raise ValueError(f"router weight {tuple(weight.shape)} (strides {weight.stride()}) does not fit x "
                         f"{tuple(x.shape)}: [E, {h}] with unit stride along h")
    top_w, top_i = _top_k_outputs(n, E, k, dtype, x.device)
    if n == 0:
        return top_w, top_i
    counts = router_counts(n, x.device) if counts is None else counts
    if counts is None or counts.numel() < n:
        raise ValueError(f"router_top_k needs {n} zeroed counts on {x.device}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    logits = torch.empty(n, E, dtype=x.dtype, device=x.device)
    bk = min(ROUTER_K, triton.next_power_of_2(h))
    router_top_k_kernel[(n, triton.cdiv(E, ROUTER_ROWS))](
        x, weight, logits, counts, top_w, top_i, x.stride(0), weight.stride(0),
        E=E, H=h, BN=ROUTER_ROWS, BK=bk, BE=triton.next_power_of_2(E), K=k, BKK=triton.next_power_of_2(k),
        RENORMALIZE=renormalize, num_warps=4,
    )
    return top_w, top_i
