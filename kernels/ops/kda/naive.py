"""Kimi delta attention (KDA), pure PyTorch, fp32, one step at a time.

Per head (S is K x V, o_t = S_t^T q_t), a delta rule with a per-channel forget gate:

    S_t = A_t S_{t-1} + beta_t k_t v_t^T,   A_t = (I - beta_t k_t k_t^T) diag(alpha_t),   alpha_t = exp(g_t)

A run's transition T = A_L ... A_1 is a dense K x K matrix (docs/concepts.md, "The math").
"""

from __future__ import annotations

import torch


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    output_transition: bool = False,
    output_query_transition: bool = False,
):
    """Run the recurrence over T tokens.

    Args:
        q, k: [B, T, H, K] (already L2-normalised if the model does that); v: [B, T, H, V];
        g: [B, T, H, K] log of the per-channel gate; beta: [B, T, H].
        scale: query scale, default K ** -0.5.
        initial_state: [B, H, K, V] or None (zeros).
        output_transition: also return (T [B, H, K, K], S(run|0) [B, H, K, V]); then
            final_state == T @ initial_state + S(run|0).
        output_query_transition: (with output_transition) also return u [B, T, H, K] fp32,
            u_t = scale T_t^T q_t, so that the outputs from any state S_in are o(0) + u S_in.

    Returns:
        o [B, T, H, V] (dtype of v), final_state [B, H, K, V] fp32 (or None), with
        output_transition (T, S0) as a third element, and with output_query_transition u fourth.
    """
    if output_query_transition and not output_transition:
        raise ValueError("output_query_transition needs output_transition")
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q * scale
    S = torch.zeros(B, H, K, V, dtype=torch.float32, device=v.device)
    if initial_state is not None and not output_transition:
        S = initial_state.float().clone()
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=v.device)
    if output_transition:
        # T_t = A_t T_{t-1}; u_t = T_t^T q_t adds the initial state's share to o_t
        Tr = torch.eye(K, dtype=torch.float32, device=v.device).expand(B, H, K, K).clone()
        u = torch.empty(B, T, H, K, dtype=torch.float32, device=v.device)
    for t in range(T):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        a_t = g[:, t].exp()[..., None]  # [B, H, K, 1]
        b_t = beta[:, t][..., None]  # [B, H, 1]
        S = S * a_t
        kv_mem = torch.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, (v_t - kv_mem) * b_t)
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q_t)
        if output_transition:
            Tr = Tr * a_t
            kT = torch.einsum("bhkj,bhk->bhj", Tr, k_t)
            Tr = Tr - torch.einsum("bhk,bhj->bhkj", k_t * b_t, kT)
            u[:, t] = torch.einsum("bhkj,bhk->bhj", Tr, q_t)
    if not output_transition:
        return o.to(dtype), (S if output_final_state else None)
    S0 = S
    if initial_state is not None:
        init = initial_state.float()
        o = o + torch.einsum("bthk,bhkv->bthv", u, init)
        S = Tr @ init + S0
    if output_query_transition:
        return o.to(dtype), (S if output_final_state else None), (Tr, S0), u
    return o.to(dtype), (S if output_final_state else None), (Tr, S0)
