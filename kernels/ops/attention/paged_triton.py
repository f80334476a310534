"""Triton decode attention over paged K/V (contract and reference: paged.py).

Grid (B, Hkv, splits): a program serves the G query heads of one KV head of one request (GQA
folded into its rows, at least 16 for tl.dot) over one split of that request's keys. It reads the
request's table row and length on the device, so its split is [s * chunk, min((s + 1) * chunk, n))
with chunk = ceil(ceil(n / splits) / BLOCK_N) * BLOCK_N; a split past the end does nothing but
write an empty partial. Each key block gathers its keys' page ids from the table (key j: page
table[row, j // P], row j % P), loads K transposed and V through them and runs an online softmax
in the exp2 domain with fp32 accumulators. With one split the program writes the output; with
more, normalized partials and log2-sum-exp2 go to fp32 buffers merged by merge_paged_splits_kernel:
a program a (output row, block of channels) reads all the row's splits at once (a decode step has
few rows and up to 32 splits; a program a block of rows looping over the splits in turn took longer
than the attention itself). Pointer arithmetic is int64 (a pool can pass 2^31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hybridcache.kernels.ops.attention.paged import num_splits as default_splits
from hybridcache.kernels.ops.rope.triton import norm_rotate

_LOG2E = 1.4426950408889634


@triton.jit
def paged_decode_kernel(
    Q, K, V, TABLE, ROWS, LENS, O, OP, LSE, GATE, QSCALE, COS, SIN, qk_scale, q_eps,
    s_qb, s_qh, s_qd,
    s_gb, s_gh,
    s_kp, s_ks, s_kh, s_kd,
    s_vp, s_vs, s_vh, s_vd,
    s_tr, s_tc,
    HKV: tl.constexpr, G: tl.constexpr, DQ: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_GATE: tl.constexpr, Q_ROPE: tl.constexpr,
    R: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    HQ: tl.constexpr = HKV * G
    B = tl.num_programs(0).to(tl.int64)

    row = tl.load(ROWS + b).to(tl.int64)
    n = tl.load(LENS + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
    lo = i_s * chunk
    hi = tl.minimum(lo + chunk, n)

    o_g = tl.arange(0, BLOCK_G)
    o_dq = tl.arange(0, BLOCK_DQ)
    o_dv = tl.arange(0, BLOCK_DV)
    o_n = tl.arange(0, BLOCK_N)
    m_g = o_g < G
    m_dq = o_dq < DQ
    m_dv = o_dv < DV
    h = kv * G + o_g  # query heads of this KV head
    p_q = Q + b * s_qb + h[:, None] * s_qh + o_dq[None, :] * s_qd
    b_q = tl.load(p_q, mask=m_g[:, None] & m_dq[None, :], other=0.0)  # [BLOCK_G, BLOCK_DQ]
    if Q_ROPE:
        # the raw query heads (unit-stride channels): RMSNorm * QSCALE, then rotated by the request's
        # cos/sin [B, R] (rope's row math), rounded once to the query's dtype as the unfused path does
        b_rot = norm_rotate(Q, b * s_qb + h * s_qh, tl.zeros_like(h) + b, o_dq, m_g, m_dq, COS, SIN, QSCALE, q_eps,
                            DQ, R, True)
        b_q = b_rot.to(b_q.dtype)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + o_n
        valid = cols < hi
        page = tl.load(TABLE + row * s_tr + (cols // PAGE).to(tl.int64) * s_tc, mask=valid, other=0).to(tl.int64)
        slot = (cols % PAGE).to(tl.int64)
        p_k = K + page[None, :] * s_kp + slot[None, :] * s_ks + kv * s_kh + o_dq[:, None] * s_kd
        b_k = tl.load(p_k, mask=m_dq[:, None] & valid[None, :], other=0.0)  # [BLOCK_DQ, BLOCK_N]
        s = tl.dot(b_q, b_k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_v = V + page[:, None] * s_vp + slot[:, None] * s_vs + kv * s_vh + o_dv[None, :] * s_vd
        b_v = tl.load(p_v, mask=valid[:, None] & m_dv[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = tl.dot(p.to(b_v.dtype), b_v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    b_o = acc / tl.where(seen, l_i, 1.0)[:, None]
    row_id = b * HQ + h  # output row of a contiguous [B, Hq, DV]
    m_o = m_g[:, None] & m_dv[None, :]
    if SPLITS > 1:
        n_rows = B * HQ
        tl.store(OP + (i_s * n_rows + row_id)[:, None] * DV + o_dv[None, :], b_o, mask=m_o)
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(LSE + i_s * n_rows + row_id, lse, mask=m_g)
    else:
        if HAS_GATE:
            b_g = tl.load(GATE + b * s_gb + h[:, None] * s_gh + o_dv[None, :], mask=m_o, other=0.0).to(tl.float32)
            b_o = b_o * tl.sigmoid(b_g)
        tl.store(O + row_id[:, None] * DV + o_dv[None, :], b_o.to(O.dtype.element_ty), mask=m_o)


@triton.jit
def merge_paged_splits_kernel(OP, LSE, O, GATE, n_rows, s_gb, s_gh, DV: tl.constexpr, SPLITS: tl.constexpr,
                              SP: tl.constexpr, BLOCK_DV: tl.constexpr, HQ: tl.constexpr, HAS_GATE: tl.constexpr):
    """O[r] = sum_s 2^(lse_s[r] - lse[r]) OP[s, r] over the SPLITS key splits (SP: the next power of
    two), lse = log2 sum_s 2^lse_s; OP [SPLITS, n_rows, DV] and LSE [SPLITS, n_rows] fp32."""
    r = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, SP)
    o_dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    m_s = o_s < SPLITS
    m_dv = o_dv < DV
    lse = tl.load(LSE + o_s * n_rows + r, mask=m_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(m_s, tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m)), 0.0)
    b_o = tl.load(OP + (o_s[:, None] * n_rows + r) * DV + o_dv[None, :], mask=m_s[:, None] & m_dv[None, :], other=0.0)
    l_i = tl.sum(w, 0)
    b_o = tl.sum(w[:, None] * b_o, 0) / tl.where(l_i > 0.0, l_i, 1.0)
    if HAS_GATE:  # row r is head r % HQ of request r // HQ
        b_g = tl.load(GATE + (r // HQ) * s_gb + (r % HQ) * s_gh + o_dv, mask=m_dv, other=0.0).to(tl.float32)
        b_o = b_o * tl.sigmoid(b_g)
    tl.store(O + r * DV + o_dv, b_o.to(O.dtype.element_ty), mask=m_dv)


def _config(dq: int, dv: int, dtype: torch.dtype):
    """(BLOCK_N, num_warps, num_stages) for the head dims and dtype."""
    d = max(dq, dv)
    if dtype == torch.float32:
        return (32, 4, 1) if d > 64 else (64, 4, 2)
    return (64, 4, 2) if d <= 256 else (32, 8, 1)


def paged_decode(q, k_pages, v_pages, table, rows, lengths, scale: float, splits: int | None = None, gate=None,
                 q_rope=None):
    """q [B, Hq, dq], k_pages [num_pages, P, Hkv, dq], v_pages [num_pages, P, Hkv, dv], table [R, W],
    rows [B], lengths [B] -> o [B, Hq, dv] (q's dtype). `splits`: key splits (default num_splits).
    gate [B, Hq, dv] (any request and head strides, channels unit-stride): o times sigmoid(gate),
    applied to the fp32 output before its one rounding (a gated attention's output gate, no
    launch of its own). q_rope (scale [dq], eps, cos, sin [B, R]): q holds the raw query heads
    (any request and head strides), RMS-normalized with the scale and rotated at each request's angles in the
    kernel (rope.norm_rope_tokens' math, no launch of its own)."""
    B, Hq, dq = q.shape
    P, Hkv, dv = k_pages.shape[1], k_pages.shape[2], v_pages.shape[-1]
    if Hq % Hkv or k_pages.shape[-1] != dq or v_pages.shape[:3] != k_pages.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit pages {tuple(k_pages.shape)}, {tuple(v_pages.shape)}")
    if gate is not None and (gate.shape != (B, Hq, dv) or gate.stride(-1) != 1):
        raise ValueError(f"gate {tuple(gate.shape)} must be [{B}, {Hq}, {dv}] with unit-stride channels")
    s_gb, s_gh = (gate.stride(0), gate.stride(1)) if gate is not None else (0, 0)
    if q_rope is not None:
        q_scale, q_eps, cos, sin = q_rope
        R = cos.shape[-1]
        if q_scale.shape != (dq,) or R % 2 or R > dq or cos.shape != (B, R) or sin.shape != (B, R):
            raise ValueError(f"q_rope: scale {tuple(q_scale.shape)}, cos/sin {tuple(cos.shape)} do not fit q "
                             f"{tuple(q.shape)} (scale [{dq}], cos/sin [{B}, R], R even <= {dq})")
        q_scale, cos, sin = q_scale.float().contiguous(), cos.float().contiguous(), sin.float().contiguous()
        if q.stride(-1) != 1:
            q = q.contiguous()
    else:
        q_scale = cos = sin = q
        q_eps, R = 0.0, 2
    G = Hq // Hkv
    o = torch.empty(B, Hq, dv, dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    splits = splits or default_splits(B, Hkv, q.device)
    if splits > 1:
        op = torch.empty(splits, B, Hq, dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, B, Hq, dtype=torch.float32, device=q.device)
    else:
        op = lse = o  # unused
    bn, warps, stages = _config(dq, dv, q.dtype)
    paged_decode_kernel[(B, Hkv, splits)](
        q, k_pages, v_pages, table, rows, lengths, o, op, lse, gate if gate is not None else o, q_scale, cos, sin,
        float(scale) * _LOG2E, float(q_eps),
        *q.stride(), s_gb, s_gh, *k_pages.stride(), *v_pages.stride(), *table.stride(),
        HKV=Hkv, G=G, DQ=dq, DV=dv, PAGE=P, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=bn,
        BLOCK_DQ=max(16, triton.next_power_of_2(dq)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        SPLITS=splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_GATE=gate is not None,
        Q_ROPE=q_rope is not None, R=R,
        num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        n_rows = B * Hq
        bdv = min(64, max(16, triton.next_power_of_2(dv)))
        merge_paged_splits_kernel[(n_rows, triton.cdiv(dv, bdv))](
            op, lse, o, gate if gate is not None else o, n_rows, s_gb, s_gh, DV=dv, SPLITS=splits,
            SP=triton.next_power_of_2(splits), BLOCK_DV=bdv, HQ=Hq, HAS_GATE=gate is not None, num_warps=2,
        )
    return o


__all__ = ["merge_paged_splits_kernel", "paged_decode", "paged_decode_kernel"]
