"""Reference attention of live queries at absolute positions over a contiguous context, fp32.

    o[b, h, i] = softmax_j(scale * q[b, h, i] . k[b, h // G, j],  j <= q_pos[i]) @ v[b, h // G]

Query i sits at absolute position q_pos[i] (ascending, in [0, N - 1]) and sees the keys at
positions 0..q_pos[i]; key j sits at position j. G = Hq // Hkv query heads share one KV head
(query head h reads KV head h // G). Scores, softmax and the weighted sum are fp32; the output is
cast once to q's dtype, as the kernel does.
"""

from __future__ import annotations

import torch


def live_mask(q_pos: torch.Tensor, N: int) -> torch.Tensor:
    """[n, N] booleans: query i sees key j iff j <= q_pos[i]."""
    return torch.arange(N, device=q_pos.device)[None, :] <= q_pos.to(torch.long)[:, None]


def live_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Hq, n, dq], k [B, Hkv, N, dq], v [B, Hkv, N, dv], q_pos [n] -> o [B, Hq, n, dv] in q's dtype."""
    B, Hq, n, dq = q.shape
    Hkv, N, dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    qf = q.float().reshape(B, Hkv, G, n, dq)  # query head h = kv * G + g
    s = torch.einsum("bkgid,bkjd->bkgij", qf, k.float()) * scale
    s = s.masked_fill(~live_mask(q_pos, N), float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bkgij,bkjd->bkgid", p, v.float())
    return o.reshape(B, Hq, n, dv).to(q.dtype)
