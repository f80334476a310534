"""Reference row norms, fp32 inside. The Triton kernel (triton.py) is checked against these.

    rms_norm(x, w)             = x * rsqrt(mean(x^2) + eps) * w                    (x's dtype)
    rms_norm_gated(x, z, w)    = rms_norm(x, w) * silu(z)                          (x's dtype)
    l2norm(x)                  = x * rsqrt(sum(x^2) + eps)                         (fp32)
    add_rms_norm(x, r, w)      = (s, rms_norm(s, w)), s = x + r in x's dtype      (a residual add and the norm after it)

The models' eager modules round in their own places (qwen3_hybrid.GatedRMSNorm casts the
normalized x back to x's dtype before the weight); these references keep fp32 to the end and cast
once, as the kernel does, so in bf16 the two differ by bf16 rounding only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual sum s = x + r (rounded to x's dtype, as the eager add is) and rms_norm(s, w)."""
    s = (x.float() + r.float()).to(x.dtype)
    return s, rms_norm(s, weight, eps)
