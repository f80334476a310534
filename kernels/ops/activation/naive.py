"""Reference gated activation, fp32 inside. The Triton kernel (triton.py) is checked against it.

    silu_mul(gate, up) = silu(gate) * up        (gate's dtype)

The models' eager MLPs round silu(gate) to the activation dtype before the product; this reference
keeps fp32 to the end and casts once, as the kernel does, so in bf16 the two differ by one bf16
rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
