"""The gated delta rule's per-token gates in one Triton kernel; reference: naive.gdn_gates_reference.

Qwen3-Next / Qwen3.5 (and OLMo-Hybrid) derive from the projections a, b [..., H]:

    g    = -exp(A_log) * softplus(a + dt_bias)     (log decay, fp32)
    beta = sigmoid(b)                              (fp32)

Eager torch spends about ten launches on that per layer (casts of a, b and both parameters, exp,
add, softplus, product, negation, sigmoid); in a launch-bound forward (a decode step, a warm pic
assembly) every layer pays them. One program here covers BR rows of H heads; a and b may be
column slices of the merged projection's output (rows strided, heads unit-stride). softplus
follows torch's (x above 20 passes through).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hybridcache.kernels.ops.gated_delta_rule.naive import gdn_gates_reference

__all__ = ["gdn_gates", "gdn_gates_reference"]


@triton.jit(do_not_specialize=["n_rows"])
def gdn_gates_kernel(a, b, A_log, dt_bias, g, beta, n_rows, stride_a, stride_b, H: tl.constexpr,
                     BH: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BH)
    m_r, m_c = rows < n_rows, cols < H
    mask = m_r[:, None] & m_c[None, :]
    b_a = tl.load(a + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b_b = tl.load(b + rows[:, None] * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b_A = tl.load(A_log + cols, mask=m_c, other=0.0).to(tl.float32)
    b_dt = tl.load(dt_bias + cols, mask=m_c, other=0.0).to(tl.float32)
    x = b_a + b_dt[None, :]
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    b_g = -tl.exp(b_A)[None, :] * softplus
    b_beta = tl.sigmoid(b_b)
    out = rows[:, None] * H + cols[None, :]
    tl.store(g + out, b_g, mask=mask)
    tl.store(beta + out, b_beta, mask=mask)


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    t2 = t.reshape(-1, H)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """g, beta [..., H] fp32 (contiguous) from a, b [..., H] and the per-head A_log, dt_bias [H]."""
    H = a.shape[-1]
    if b.shape != a.shape:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} differ in shape")
    if A_log.shape != (H,) or dt_bias.shape != (H,):
        raise ValueError(f"A_log {tuple(A_log.shape)} and dt_bias {tuple(dt_bias.shape)} must be [{H}]")
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    if a.numel() == 0:
        return g, beta
    a2, b2 = _rows(a, H), _rows(b, H)
    n = a2.shape[0]
    BH = triton.next_power_of_2(H)
    BR = max(1, min(64, 2048 // BH))
    gdn_gates_kernel[(triton.cdiv(n, BR),)](
        a2, b2, A_log.contiguous(), dt_bias.contiguous(), g, beta, n, a2.stride(0), b2.stride(0),
        H=H, BH=BH, BR=BR, num_warps=4,
    )
    return g, beta
