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
