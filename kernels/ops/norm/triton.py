"""Row norms in one Triton kernel; reference: naive.py.

Why not fla's norm kernels: for rows of at most 512 features they are autotuned over nine configs
with a key that holds NB = cdiv(rows, 2048), so every new bucket of row counts (a new prompt
length, a new live-token count) compiles and times nine kernels again, which can take longer
than a benchmark's whole time budget. This kernel has one
configuration per feature width, chosen from the width alone, and the row count is a runtime
argument (not specialized), so each (width, dtypes, kind) compiles once.

One program normalizes BR rows of D features (D padded to the next power of two, BD), fp32
inside: mean or sum of squares, rsqrt, times the weight, times silu(gate) for the gated norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RMS, L2 = 0, 1


@triton.jit(do_not_specialize=["n_rows"])
def row_norm_kernel(
    x,
    z,
    w,
    y,
    n_rows,
    stride_x,
    stride_zt,
    stride_zh,
    z_heads,
    stride_y,
    eps,
    D: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
    KIND: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m_r = rows < n_rows
    m_c = cols < D
    mask = m_r[:, None] & m_c[None, :]
    b_x = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ss = tl.sum(b_x * b_x, axis=1)
    if KIND == 0:
        r = 1.0 / tl.sqrt(ss / D + eps)
    else:
        r = 1.0 / tl.sqrt(ss + eps)
    b_y = b_x * r[:, None]
    if HAS_WEIGHT:
        b_w = tl.load(w + cols, mask=m_c, other=0.0).to(tl.float32)
        b_y = b_y * b_w[None, :]
    if HAS_GATE:
        # the gate's row r is head r % z_heads of its token r // z_heads (a strided view's heads)
        z_row = (rows // z_heads) * stride_zt + (rows % z_heads) * stride_zh
        b_z = tl.load(z + z_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b_y = b_y * b_z * tl.sigmoid(b_z)
    tl.store(y + rows[:, None] * stride_y + cols[None, :], b_y.to(y.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """t as [rows, D] with unit stride along D (a copy only when no such view exists)."""
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _heads(t: torch.Tensor, D: int) -> torch.Tensor:
    """t [..., H, D] as [tokens, H, D] with unit stride along D, a view wherever the leading dims
    flatten (a gate sliced out of a wider projection: its heads a fixed stride apart within a
    token, its tokens another), else a contiguous copy."""
    H = t.shape[-2] if t.dim() >= 2 else 1
    try:
        t3 = t.view(-1, H, D)
    except RuntimeError:
        t3 = t.contiguous().view(-1, H, D)
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def row_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-6,
    kind: int = RMS,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Normalize x over its last dim: RMS (mean of squares) or L2 (sum of squares), times weight
    [D] if given, times silu(gate) if given (x's rows in order, any shape with x's last dim: a
    [..., H, D] view is read through its token and head strides). Output x's shape in out_dtype
    (default x's)."""
    D = x.shape[-1]
    if weight is not None and weight.shape != (D,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match feature dim {D}")
    if gate is not None and (gate.shape[-1] != D or gate.numel() != x.numel()):
        raise ValueError(f"gate {tuple(gate.shape)} does not match x {tuple(x.shape)}")
    if D > 16384:
        raise ValueError(f"feature dim {D} is above the kernel's 16384")
    x2 = _rows(x, D)
    # the gate is read through a (token, head) index and need not be one row stride
    z3 = _heads(gate, D) if gate is not None else x2[:, None]
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    y2 = y.view(-1, D)
    n = x2.shape[0]
    if n == 0:
        return y
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 2048 // BD))  # about 2k elements a program
    num_warps = 4 if BD * BR <= 4096 else 8
    w = weight.contiguous() if weight is not None else x2
    row_norm_kernel[(triton.cdiv(n, BR),)](
        x2,
        z3,
        w,
        y2,
        n,
        x2.stride(0),
        z3.stride(0),
        z3.stride(1),
        z3.shape[1],
        y2.stride(0),
        float(eps),
        D=D,
        BD=BD,
        BR=BR,
        KIND=kind,
        HAS_WEIGHT=weight is not None,
        HAS_GATE=gate is not None,
        num_warps=num_warps,
    )
    return y


def rms_norm(x, weight, eps: float):
    return row_norm(x, weight, None, eps, RMS)


def rms_norm_gated(x, gate, weight, eps: float):
    return row_norm(x, weight, gate, eps, RMS)


def l2norm(x, eps: float = 1e-6):
    return row_norm(x, None, None, eps, L2, torch.float32)


@triton.jit(do_not_specialize=["n_rows"])
def l2norm_heads_kernel(
    x, y, n_rows, stride_t, stride_h, eps, HV: tl.constexpr, REP: tl.constexpr, D: tl.constexpr,
    BD: tl.constexpr, BR: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # output rows: token * HV + head
    cols = tl.arange(0, BD)
    m_r, m_c = rows < n_rows, cols < D
    mask = m_r[:, None] & m_c[None, :]
    src = (rows // HV) * stride_t + ((rows % HV) // REP) * stride_h
    b_x = tl.load(x + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + eps)
    tl.store(y + rows[:, None] * D + cols[None, :], (b_x * r[:, None]).to(y.dtype.element_ty), mask=mask)


def l2norm_heads(x: torch.Tensor, repeat: int = 1, eps: float = 1e-6, out_dtype: torch.dtype | None = None):
    """L2 norm of every head of x [..., H, D] (fp32 inside), each head written `repeat` times in a
    row: x.repeat_interleave(repeat, dim=-2) normalized, in one launch and without the repeated
    copy (grouped value heads of the delta rules share a key head). x may be a strided view (q or k
    columns of the conv output) as long as its leading dims flatten to one stride and D is
    unit-stride. Output [..., H * repeat, D] contiguous, in out_dtype (default x's)."""
    *lead, H, D = x.shape
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if D > 16384:
        raise ValueError(f"feature dim {D} is above the kernel's 16384")
    try:
        x3 = x.view(-1, H, D)
    except RuntimeError:
        x3 = x.contiguous().view(-1, H, D)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    y = torch.empty(*lead, H * repeat, D, dtype=out_dtype or x.dtype, device=x.device)
    n = y.numel() // D
    if n == 0:
        return y
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 2048 // BD))
    l2norm_heads_kernel[(triton.cdiv(n, BR),)](
        x3, y, n, x3.stride(0), x3.stride(1), float(eps),
        HV=H * repeat, REP=repeat, D=D, BD=BD, BR=BR, num_warps=4 if BD * BR <= 4096 else 8,
    )
    return y


@triton.jit(do_not_specialize=["n_rows"])
def add_rms_norm_kernel(x, r, w, s, y, n_rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m_c = cols < D
    mask = (rows < n_rows)[:, None] & m_c[None, :]
    off = rows[:, None] * D + cols[None, :]
    b_s = tl.load(x + off, mask=mask, other=0.0).to(tl.float32) + tl.load(r + off, mask=mask, other=0.0).to(tl.float32)
    b_s = b_s.to(s.dtype.element_ty)  # the residual stream keeps x's dtype, and the norm reads it rounded
    tl.store(s + off, b_s, mask=mask)
    b_f = b_s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_f * b_f, axis=1) / D + eps)
    b_w = tl.load(w + cols, mask=m_c, other=0.0).to(tl.float32)
    tl.store(y + off, (b_f * rstd[:, None] * b_w[None, :]).to(y.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float):
    """s = x + r (x's dtype) and RMSNorm(s) * weight in one launch (a residual add and the norm
    after it); x, r [..., D] of one shape, made contiguous. Returns (s, y)."""
    if r.shape != x.shape:
        raise ValueError(f"residual {tuple(r.shape)} does not match x {tuple(x.shape)}")
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match feature dim {D}")
    if D > 16384:
        raise ValueError(f"feature dim {D} is above the kernel's 16384")
    x, r = x.contiguous(), r.contiguous()
    s, y = torch.empty_like(x), torch.empty_like(x)
    n = x.numel() // D
    if n == 0:
        return s, y
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 2048 // BD))
    add_rms_norm_kernel[(triton.cdiv(n, BR),)](
        x, r.to(x.dtype), weight.contiguous(), s, y, n, float(eps), D=D, BD=BD, BR=BR,
        num_warps=4 if BD * BR <= 4096 else 8,
    )
    return s, y
