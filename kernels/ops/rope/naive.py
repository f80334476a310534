"""Reference rotary embedding (the rotate-half form of Qwen3-Next / Qwen3.5 / OLMo-Hybrid), fp32.

    rope(x)[..., :R]  = x_rot * cos + rotate_half(x_rot) * sin,   x_rot = x[..., :R]
    rope(x)[..., R:]  = x[..., R:]                                   (partial rotary: R < D)
    rotate_half(x_rot) = cat(-x_rot[..., R/2:], x_rot[..., :R/2])

norm_rope first applies the head's RMSNorm with a per-channel scale (x * rsqrt(mean(x^2) + eps) *
scale). The model's eager code rounds to the activation dtype after the norm and after each
product; this reference keeps fp32 to the end and casts once, as the kernel does.
"""

from __future__ import annotations

import torch


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D], cos/sin [n, R] -> [B, H, n, D] in x's dtype."""
    xf = x.float()
    R, half = cos.shape[-1], cos.shape[-1] // 2
    x_rot, x_pass = xf[..., :R], xf[..., R:]
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos.float() + rotated * sin.float(), x_pass), dim=-1).to(x.dtype)


def norm_rope(x: torch.Tensor, scale: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n, H, D] (token-major, as projections come out) -> RMSNorm(x) * scale, rotated, as
    [B, H, n, D] in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale.float()
    return rope(y.transpose(1, 2), cos, sin).to(x.dtype)
