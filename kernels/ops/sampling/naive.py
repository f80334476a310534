"""A token's distribution under temperature, top-k, top-p and min-p, written plainly (the
reference the sampling kernel is tested against).

Per row of logits x: divide by the temperature; keep the k largest (ties at the k-th kept) and
renormalize; keep the smallest set of most likely tokens whose mass reaches top_p (a token is kept
when the mass of those more likely than it is at most top_p); drop tokens below min_p times the
most likely one's probability; renormalize.
"""

from __future__ import annotations

import torch


def naive_sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                         min_p: float = 0.0) -> torch.Tensor:
    """logits [V] -> probabilities [V] fp32 (the steps of the module docstring, in order)."""
    x = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(x, min(top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0)
        sorted_p = sorted_p.masked_fill(cum - sorted_p > top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()
