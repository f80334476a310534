"""Reference gated activation, fp32 inside. The Triton kernel (triton.py) is checked against it.

    silu_mul(gate, up) = silu(gate) * up        (gate's dtype)
    sigmoid_gate_heads(o, gate) = o as [B, n, H * d] (token-major) * sigmoid(gate)   (o's dtype)

The models' eager MLPs round silu(gate) to the activation dtype before the product; this reference
keeps fp32 to the end and casts once, as the kernel does, so in bf16 the two differ by one bf16
rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def sigmoid_gate_heads(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention output o [B, H, n, d] (head-major) gated per channel: [B, n, H * d] in o's dtype,
    o token-major times sigmoid(gate [B, n, H, d] or [B, n, H * d]) (Qwen3-Next / Qwen3.5 gated
    attention)."""
    B, H, n, d = o.shape
    g = gate.reshape(B, n, H * d).float()
    return (o.transpose(1, 2).reshape(B, n, H * d).float() * torch.sigmoid(g)).to(o.dtype)
