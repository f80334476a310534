"""Kimi delta attention on fla-core's GPU kernels, with the run's dense (T, S(run|0)).

fla's chunk_kda does not expose its stages the way the gated delta rule's do (fla_entry.py there
re-runs only the state stage), so T comes from the same chunk_kda call with K extra value columns:
every value column of the state evolves independently under S_t = A_t S_{t-1} + beta_t k_t v_t^T,
so columns started from I with zero values end as T = A_L ... A_1. One launch, V -> V + K value
columns; the output columns of the T part are discarded. S(run|0) = S_final - T S_init (exact in
exact arithmetic; both are fp32 states of the same kernel). Imports fla lazily.
"""

from __future__ import annotations

import functools

import torch
from hybridcache.kernels.ops.simple_gla.fla_entry import SHORT_RUN


def kda_fla(q, k, v, g, beta, scale=None, initial_state=None, output_transition: bool = False):
    """Same arguments and contract as naive_recurrent_kda: q, k [B, T, H, K] (already
    L2-normalised); v [B, T, H, V]; g [B, T, H, K] per-step log gate; beta [B, T, H] (after the
    sigmoid); initial_state [B, H, K, V] fp32 or None. Returns o (dtype of v), final_state fp32,
    and with output_transition (T [B, H, K, K] fp32, S(run|0) [B, H, K, V] fp32)."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    n = k.shape[1]
    q, k, beta = (x.to(v.dtype).contiguous() for x in (q, k, beta))
    g = g.float().contiguous()
    state = initial_state.float().contiguous() if initial_state is not None else None
    if not output_transition:
        fn = fused_recurrent_kda if n < SHORT_RUN else chunk_kda
        return fn(q, k, v.contiguous(), g, beta, scale=scale, initial_state=state, output_final_state=True)
    run = functools.partial(chunk_kda, output_final_state=True)
    return transition_by_value_columns(run, q, k, v, g, beta, scale, state)


def kda_fla_pieces(q, k, v, g, beta, scale=None):
    """Runs from a zero state with their query transitions, for the batched scan of live runs:
    (o0 (dtype of v), T [B, H, K, K] fp32, S(run|0) fp32, u [B, T, H, K] (dtype of v)). u_t =
    scale T_t^T q_t are the outputs of the K extra value columns, whose state is T_t: the same
    single chunk_kda call that gives T."""
    from fla.ops.kda import chunk_kda

    q, k, beta = (x.to(v.dtype).contiguous() for x in (q, k, beta))
    run = functools.partial(chunk_kda, output_final_state=True)
    o, _, (Tr, S0), u = transition_by_value_columns(
        run, q, k, v, g.float().contiguous(), beta, scale, None, query_transition=True
    )
    return o, Tr, S0, u


def transition_by_value_columns(run, q, k, v, g, beta, scale, initial_state, query_transition: bool = False):
    """One call of run(q, k, v, g, beta, scale=, initial_state=) -> (o, final_state) with K extra
    value columns started from I (module docstring). Returns (o, S_final, (T, S(run|0))), and with
    query_transition the extra columns' outputs u (scale T_t^T q_t) fourth."""
    Bsz, n, H, K = k.shape
    V = v.shape[-1]
    eye = torch.eye(K, dtype=torch.float32, device=v.device).expand(Bsz, H, K, K)
    h0 = initial_state if initial_state is not None else torch.zeros(Bsz, H, K, V, device=v.device)
    v_ext = torch.cat([v, v.new_zeros(Bsz, n, H, K)], dim=-1).contiguous()
    o, final = run(q, k, v_ext, g, beta, scale=scale, initial_state=torch.cat([h0, eye], dim=-1).contiguous())
    S_final, Tr = final[..., :V], final[..., V:]
    S0 = S_final if initial_state is None else S_final - Tr @ initial_state
    if query_transition:
        return o[..., :V], S_final.contiguous(), (Tr.contiguous(), S0.contiguous()), o[..., V:]
    return o[..., :V], S_final.contiguous(), (Tr.contiguous(), S0.contiguous())
