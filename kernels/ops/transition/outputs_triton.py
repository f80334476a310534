"""A batch of live runs' outputs from the states entering them, read where the fold left them (Triton).

A planned assembly (services/runtime/models/assembly.py) scans its m live sub-runs of L tokens
from zero states, giving each run's outputs o0 [m, L, H, V] and query transitions u [m, L, H, K];
the fold (compose_triton.compose_states_table with store_initial) leaves the state entering every
pair in one stack hs [R, H, K, V] fp32. The outputs are

    o[r] = o0[r] + u[r] hs[rows[r]]          for each run r (one [L, K] x [K, V] product a head)

One program owns a run, a head and a BV-wide column block: it reads that block of its entering
state once, straight from the stack by its row (no gathered copy of the entering states, no
select between the stack and the initial state), and all of the run's L tokens against it. The
products run in TF32 on the GPU (the outputs are rounded to o0's dtype, coarser than TF32 where
that is bf16) and in fp32 under the interpreter. Reference: `run_outputs_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def run_outputs_kernel(
    o0,
    u,
    hs,
    rows,
    out,
    L,
    s_o0m, s_o0l, s_o0h,
    s_um, s_ul, s_uh,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BL: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_r, i_h, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    row = tl.load(rows + i_r).to(tl.int64)
    p_s = hs + row * H * K * V + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0)  # [BK, BV] fp32
    for l0 in range(0, L, BL):
        o_l = l0 + tl.arange(0, BL)
        m_l = o_l < L
        p_u = u + i_r * s_um + o_l[:, None] * s_ul + i_h * s_uh + o_k[None, :]
        b_u = tl.load(p_u, mask=m_l[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BL, BK]
        b_o = tl.dot(b_u, b_s, input_precision=DOT_PRECISION)  # [BL, BV]
        m_lv = m_l[:, None] & m_v[None, :]
        p_o0 = o0 + i_r * s_o0m + o_l[:, None] * s_o0l + i_h * s_o0h + o_v[None, :]
        b_o += tl.load(p_o0, mask=m_lv, other=0.0).to(tl.float32)
        p_out = out + ((i_r * L + o_l[:, None]) * H + i_h) * V + o_v[None, :]
        tl.store(p_out, b_o.to(out.dtype.element_ty), mask=m_lv)


def run_outputs_reference(o0: torch.Tensor, u: torch.Tensor, hs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """o0 [m, L, H, V] + u [m, L, H, K] hs[rows] ([R, H, K, V] fp32, rows [m]) in fp32, -> o0's dtype."""
    s_in = hs.index_select(0, rows)
    return (o0.float() + torch.einsum("mlhk,mhkv->mlhv", u.float(), s_in.float())).to(o0.dtype)


def run_outputs(o0: torch.Tensor, u: torch.Tensor, hs: torch.Tensor, rows: torch.Tensor,
                dot_precision: str | None = None, block_v: int | None = None) -> torch.Tensor:
    """run_outputs_reference in one launch (module docstring). o0 [m, L, H, V] and u [m, L, H, K]
    with unit stride in their last dimension (any dtype; read as fp32), hs [R, H, K, V] fp32
    contiguous, rows [m] int (device data: every row must be one of hs's). dot_precision: tl.dot's
    input precision (default "tf32" on the GPU, "ieee" under the interpreter). Returns [m, L, H, V]
    contiguous in o0's dtype."""
    m, L, H, V = o0.shape
    K = u.shape[-1]
    if u.shape[:3] != (m, L, H) or hs.dim() != 4 or tuple(hs.shape[1:]) != (H, K, V):
        raise ValueError(f"o0 {tuple(o0.shape)}, u {tuple(u.shape)} and hs {tuple(hs.shape)} do not match "
                         "[m, L, H, V], [m, L, H, K], [R, H, K, V]")
    if rows.shape != (m,) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be [{m}] int32/int64, got {rows.dtype} {tuple(rows.shape)}")
    if hs.dtype != torch.float32 or not hs.is_contiguous():
        raise ValueError(f"hs must be contiguous fp32, got {hs.dtype} (contiguous: {hs.is_contiguous()})")
    if o0.stride(-1) != 1 or u.stride(-1) != 1:
        raise ValueError("o0 and u need unit stride in their last dimension")
    out = torch.empty(m, L, H, V, dtype=o0.dtype, device=o0.device)
    if not m or not L:
        return out
    BK = max(16, triton.next_power_of_2(K))
    BV = block_v or min(64, max(16, triton.next_power_of_2(V)))
    BL = min(64, max(16, triton.next_power_of_2(L)))
    precision = dot_precision or ("tf32" if o0.is_cuda else "ieee")
    grid = (m, H, triton.cdiv(V, BV))
    run_outputs_kernel[grid](
        o0, u, hs, rows, out, L,
        o0.stride(0), o0.stride(1), o0.stride(2),
        u.stride(0), u.stride(1), u.stride(2),
        H=H, K=K, V=V, BL=BL, BK=BK, BV=BV, DOT_PRECISION=precision,
        num_warps=4,
    )
    return out
