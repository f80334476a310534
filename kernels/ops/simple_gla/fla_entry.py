"""Scalar-decay linear attention on fla-core's GPU kernels, with the run's (T, S(run|0)).

T is diagonal (one scalar per head), so no second pass: T = exp(sum of the run's log-gates),
computed in torch, and S(run|0) = S_final - T * S_init (exact in exact arithmetic; both are fp32
states). `diagonal_entry` is that derivation alone (device-independent, tested on CPU). Imports
fla lazily: this module is importable without it.
"""

from __future__ import annotations

import torch

# Below this many tokens fla's fused recurrent kernel beats its chunked one (decode, seam windows).
SHORT_RUN = 16


def diagonal_entry(log_decay_sum: torch.Tensor, S_final: torch.Tensor, initial_state: torch.Tensor | None):
    """(T, S(run|0)) of a run with a diagonal transition from its summed log-gates.

    log_decay_sum: [B, H] (scalar T) or [B, H, K] (vector T, per key channel); S_final: [B, H, K, V]
    fp32, the state after the run from initial_state [B, H, K, V] (None: zeros).
    Returns T (fp32, the shape of log_decay_sum) and S(run|0) [B, H, K, V] fp32.
    """
    Tr = log_decay_sum.float().exp()
    if initial_state is None:
        return Tr, S_final
    Tb = Tr[..., None, None] if Tr.dim() == 2 else Tr[..., None]
    return Tr, S_final - Tb * initial_state.float()


def simple_gla_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_transition: bool = False,
):
    """fla's chunk_simple_gla (fused_recurrent_simple_gla below SHORT_RUN tokens).

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] per-step log decay, or g_gamma [H] a fixed log
    decay per head (Lightning); scale default K ** -0.5; initial_state [B, H, K, V] or None.
    Same contract as naive_recurrent_simple_gla: o (dtype of v), final_state fp32, and with
    output_transition (T [B, H] fp32, S(run|0) [B, H, K, V] fp32).
    """
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

    if (g is None) == (g_gamma is None):
        raise ValueError("give exactly one of g and g_gamma")
    B, n, H, K = k.shape
    scale = K**-0.5 if scale is None else scale
    # fla returns o in q's dtype; the reference returns v's
    q, k, v = (x.to(v.dtype).contiguous() for x in (q, k, v))
    g = g.float().contiguous() if g is not None else None
    g_gamma = g_gamma.float().contiguous() if g_gamma is not None else None
    state = initial_state.float().contiguous() if initial_state is not None else None
    fn = fused_recurrent_simple_gla if n < SHORT_RUN else chunk_simple_gla
    o, S_final = fn(q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=state, output_final_state=True)
    if not output_transition:
        return o, S_final
    log_sum = g.sum(1) if g is not None else (n * g_gamma)[None].expand(B, H)
    return o, S_final, diagonal_entry(log_sum, S_final, state)
