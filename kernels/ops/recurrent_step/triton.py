"""One token of a linear-attention recurrence, states updated in place in their pool slots
(Triton); reference and the recurrences: naive.py.

One program updates a [K, BV] block of one sequence's state of one value head: it reads the
sequence's slot, loads the block from the pool, decays it, writes k v^T (the delta rule's
corrected v), stores it back where it was and writes the block's outputs. The whole key dimension
is in the block (the delta rule's S^T k sums over it); the value dimension is split over programs.
Feature flags (fla style): a per-key gate (KDA), the delta rule's beta, the gated delta rule's
gates computed from the raw projections (g = -exp(A_log) softplus(a + dt_bias), beta =
beta_scale sigmoid(b)) and q, k L2-normalized in the kernel: with both, a Gated DeltaNet layer's
decode recurrence is this one launch, fed by views of its conv output and its projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.heuristics(
    {
        "DELTA": lambda args: args["beta"] is not None,
        "GDN_GATES": lambda args: args["A_log"] is not None,
    }
)
@triton.jit(do_not_specialize=["scale", "beta_scale"])
def recurrent_step_kernel(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    pool,
    slots,
    o,
    scale,
    beta_scale,
    stride_q,
    stride_k,
    stride_v,
    stride_g,
    stride_beta,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE_PER_KEY: tl.constexpr,
    L2NORM_QK: tl.constexpr,
    DELTA: tl.constexpr,
    GDN_GATES: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    slot = tl.load(slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]

    p_h = pool + (slot * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(p_h, mask=m_h, other=0.0)
    b_q = tl.load(q + i_b * stride_q + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_b * stride_k + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_b * stride_v + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    if L2NORM_QK:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_q = b_q * scale

    if GATE_PER_KEY:
        b_g = tl.load(g + i_b * stride_g + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_h *= tl.exp(b_g)[:, None]
    else:
        b_g = tl.load(g + i_b * stride_g + i_hv).to(tl.float32)
        if GDN_GATES:
            x = b_g + tl.load(dt_bias + i_hv).to(tl.float32)
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * softplus
        b_h *= tl.exp(b_g)
    if DELTA:
        b_beta = tl.load(beta + i_b * stride_beta + i_hv).to(tl.float32)
        if GDN_GATES:
            b_beta = tl.sigmoid(b_beta) * beta_scale
        b_v = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
    b_h += b_k[:, None] * b_v[None, :]
    b_o = tl.sum(b_h * b_q[:, None], 0)
    tl.store(o + (i_b * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=m_h)


def _rows(t: torch.Tensor, inner: tuple[int, ...]) -> torch.Tensor:
    """t [B, *inner] with its trailing dims packed (row-major, unit inner stride): a row-strided
    view as it is (a slice of a projection's columns), else a contiguous copy."""
    packed = t.stride(-1) == 1 and all(
        t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(1, t.dim() - 1)
    )
    if tuple(t.shape[1:]) != inner:
        raise ValueError(f"expected [B, {', '.join(map(str, inner))}], got {tuple(t.shape)}")
    return t if packed else t.contiguous()


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_scale: float = 1.0,
    l2norm_qk: bool = False,
    block_v: int | None = None,
) -> torch.Tensor:
    """naive_recurrent_step's contract (q, k [B, H, K], v [B, HV, V], g [B, HV] or [B, HV, K],
    beta [B, HV] or None, pool [S, HV, K, V] fp32 contiguous, slots [B]): o [B, HV, V] in v's
    dtype, pool[slots] advanced in place. q, k, v, g and beta may be row-strided views."""
    B, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    if HV % H:
        raise ValueError(f"{HV} value heads are not a multiple of {H} key heads")
    if pool.dtype != torch.float32 or not pool.is_contiguous() or tuple(pool.shape[1:]) != (HV, K, V):
        raise ValueError(f"pool must be contiguous fp32 [S, {HV}, {K}, {V}], got {pool.dtype} {tuple(pool.shape)}")
    if (A_log is None) != (dt_bias is None) or (A_log is not None and beta is None):
        raise ValueError("the gated delta rule's gates need A_log, dt_bias and beta together")
    per_key = g.dim() == 3
    if per_key and A_log is not None:
        raise ValueError("gates from A_log are per head: g must be [B, HV]")
    q, k, v = _rows(q, (H, K)), _rows(k, (H, K)), _rows(v, (HV, V))
    g = _rows(g, (HV, K) if per_key else (HV,))
    if beta is not None:
        beta = _rows(beta, (HV,))
    slots = slots if slots.is_contiguous() else slots.contiguous()
    o = torch.empty(B, HV, V, dtype=v.dtype, device=v.device)
    if B == 0:
        return o
    BK = triton.next_power_of_2(K)
    BV = block_v or min(triton.next_power_of_2(V), 32 if v.is_cuda else 64)
    grid = (triton.cdiv(V, BV), B * HV)
    recurrent_step_kernel[grid](
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        pool=pool,
        slots=slots,
        o=o,
        scale=float(K**-0.5 if scale is None else scale),
        beta_scale=float(beta_scale),
        stride_q=q.stride(0),
        stride_k=k.stride(0),
        stride_v=v.stride(0),
        stride_g=g.stride(0),
        stride_beta=beta.stride(0) if beta is not None else 0,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        GATE_PER_KEY=per_key,
        L2NORM_QK=l2norm_qk,
        num_warps=4,
    )
    return o
