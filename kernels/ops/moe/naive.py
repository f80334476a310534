"""Reference routed experts: one GEMM pair per expert that some token chose.

    x            [n, h]        tokens
    gate_up      [E, 2I, h]    each expert's gate and up projections (gate rows first)
    down         [E, h, I]     each expert's down projection
    top_i, top_w [n, k]        each token's k experts and their routing weights
    out[t] = sum_j top_w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = top_i[t, j]

The loop reads the routing on the host (which experts were chosen), so it synchronises with the
device and its op count depends on the routing: the CPU reference the fast paths are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def naive_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_i: torch.Tensor,
                  top_w: torch.Tensor) -> torch.Tensor:
    """out [n, h] in x's dtype (each expert's weighted output added in x's dtype)."""
    out = torch.zeros_like(x)
    for e in torch.unique(top_i).tolist():
        tok, slot = torch.where(top_i == e)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * top_w[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


@dataclass(frozen=True)
class SharedExpert:
    """An always-on SwiGLU expert beside the routed ones (Qwen3-Next / Qwen3.5-MoE, Kimi-Linear):
    gate, up [Is, h], down [h, Is]; gate_logit [1, h] (or None: weight 1) scales its output by
    sigmoid(x @ gate_logit^T) per token."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_logit: torch.Tensor | None = None


def naive_shared_expert(x: torch.Tensor, shared: SharedExpert) -> torch.Tensor:
    """[n, h] in x's dtype: sigmoid(x @ gate_logit^T) * down @ (silu(gate @ x) * (up @ x)) per token."""
    y = F.linear(F.silu(F.linear(x, shared.gate)) * F.linear(x, shared.up), shared.down)
    if shared.gate_logit is not None:
        y = torch.sigmoid(F.linear(x, shared.gate_logit)) * y
    return y
