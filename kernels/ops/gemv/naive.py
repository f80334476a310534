"""Reference of the one-row GEMV: torch's own linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (one row in all) times w [N, K] transposed, plus bias [N]: [..., N]."""
    return F.linear(x, w, bias)
