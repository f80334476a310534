"""Gated linear attention (per-channel decay) on fla-core's GPU kernels, with the run's
(T, S(run|0)).

T is diagonal (a K-vector per head): T = exp(sum over the run of the log-gates), computed in
torch, and S(run|0) = S_final - T * S_init (`diagonal_entry`, shared with simple GLA); no second
pass. Imports fla lazily: this module is importable without it.
"""

from __future__ import annotations

import torch
from hybridcache.kernels.ops.simple_gla.fla_entry import SHORT_RUN, diagonal_entry


def gla_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_transition: bool = False,
):
    """fla's chunk_gla (fused_recurrent_gla below SHORT_RUN tokens).

    q, k [B, T, H, K]; v [B, T, H, V]; gk [B, T, H, K] per-step log decay of each key channel;
    scale default K ** -0.5; initial_state [B, H, K, V] or None. Same contract as
    naive_recurrent_gla: o (dtype of v), final_state fp32, and with output_transition
    (T [B, H, K] fp32, S(run|0) [B, H, K, V] fp32).
    """
    from fla.ops.gla import chunk_gla, fused_recurrent_gla

    n, K = k.shape[1], k.shape[-1]
    scale = K**-0.5 if scale is None else scale
    # fla returns o in q's dtype; the reference returns v's
    q, k, v = (x.to(v.dtype).contiguous() for x in (q, k, v))
    gk = gk.float().contiguous()
    state = initial_state.float().contiguous() if initial_state is not None else None
    if n < SHORT_RUN:
        o, S_final = fused_recurrent_gla(q, k, v, gk=gk, scale=scale, initial_state=state, output_final_state=True)
    else:
        o, S_final = chunk_gla(q, k, v, g=gk, scale=scale, initial_state=state, output_final_state=True)
    if not output_transition:
        return o, S_final
    return o, S_final, diagonal_entry(gk.sum(1), S_final, state)
