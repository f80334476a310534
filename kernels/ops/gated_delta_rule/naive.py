"""Gated delta rule, pure PyTorch, fp32, one step at a time (the reference every kernel is tested against).

Per value head h (S is K x V, o_t = S_t^T q_t):

    S_t = A_t S_{t-1} + beta_t k_t v_t^T,   A_t = alpha_t (I - beta_t k_t k_t^T),   alpha_t = exp(g_t)

The derivation of the transition operator T and of composition is in this folder's README.md.
"""

from __future__ import annotations

import torch


def naive_recurrent_gated_delta_rule(
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
        q, k: [B, T, H, K] (already L2-normalised if the model does that; heads already repeated
            to the value heads).
        v: [B, T, H, V].
        g: [B, T, H] log of the per-step decay alpha_t.
        beta: [B, T, H].
        scale: query scale, default K ** -0.5.
        initial_state: [B, H, K, V] or None (zeros).
        output_transition: also return the run's transition operator T = A_T ... A_1 ([B, H, K, K])
            and its zero-start state S(run|0) ([B, H, K, V]), computed in the same pass. Then
            final_state == T @ initial_state + S(run|0).
        output_query_transition: (with output_transition) also return u [B, T, H, K] fp32,
            u_t = scale T_t^T q_t, the outputs of the same run started from T = I with zero
            values: the output from any initial state is then o_t + S_init^T u_t, so runs folded
            after cached spans need no second pass once their entering states are known.

    Returns:
        o [B, T, H, V] (dtype of v), final_state [B, H, K, V] fp32 (or None), with
        output_transition (T, S0) as a third element, and with output_query_transition u fourth.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q * scale
    S = torch.zeros(B, H, K, V, dtype=torch.float32, device=v.device)
    if initial_state is not None and not output_transition:
        S = initial_state.float().clone()
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=v.device)
    if output_transition:
        # T_t = A_t T_{t-1}; u_t = T_t^T q_t lets the true output include the initial state:
        # o_t = (T_t S_init + S_t^0)^T q_t = S_t^0T q_t + S_init^T u_t.
        Tr = torch.eye(K, dtype=torch.float32, device=v.device).expand(B, H, K, K).clone()
        u = torch.empty(B, T, H, K, dtype=torch.float32, device=v.device)
    # The contractions as batched matmuls of [1, K] rows: on the CPU, einsum's "bhkv,bhk->bhv"
    # takes a path about ten times slower once B > 1 (every batched decode step runs this).
    for t in range(T):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        a_t = g[:, t].exp()[..., None, None]  # [B, H, 1, 1]
        b_t = beta[:, t][..., None]  # [B, H, 1]
        S = S * a_t
        kv_mem = (k_t.unsqueeze(-2) @ S).squeeze(-2)  # [B, H, V]
        S = S + k_t.unsqueeze(-1) * ((v_t - kv_mem) * b_t).unsqueeze(-2)
        o[:, t] = (q_t.unsqueeze(-2) @ S).squeeze(-2)
        if output_transition:
            Tr = Tr * a_t
            kT = torch.einsum("bhkj,bhk->bhj", Tr, k_t)
            Tr = Tr - torch.einsum("bhk,bhj->bhkj", k_t * b_t, kT)
            u[:, t] = torch.einsum("bhkj,bhk->bhj", Tr, q_t)
    if output_query_transition and not output_transition:
        raise ValueError("output_query_transition needs output_transition")
    if not output_transition:
        return o.to(dtype), (S if output_final_state else None)
    S0 = S
    if initial_state is not None:
        init = initial_state.float()
        o = o + torch.einsum("bthk,bhkv->bthv", u, init)
        S = torch.einsum("bhkj,bhjv->bhkv", Tr, init) + S0
    if output_query_transition:
        return o.to(dtype), (S if output_final_state else None), (Tr, S0), u
    return o.to(dtype), (S if output_final_state else None), (Tr, S0)


def naive_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """T = A_T ... A_1 as the final state of the same recurrence from S_0 = I with all values zero.

    This is the definition-level reference (docs/concepts.md, "The math"); production paths compute T fused with the
    prefill (naive_recurrent_gated_delta_rule(..., output_transition=True)).

    Args: k [B, T, H, K], g [B, T, H], beta [B, T, H].  Returns: [B, H, K, K] fp32.
    """
    B, T, H, K = k.shape
    eye = torch.eye(K, dtype=torch.float32, device=k.device).expand(B, H, K, K)
    zeros_v = torch.zeros(B, T, H, K, dtype=torch.float32, device=k.device)
    _, S = naive_recurrent_gated_delta_rule(k, k, zeros_v, g, beta, initial_state=eye)
    return S


def gdn_gates_reference(a, b, A_log, dt_bias):
    """The per-token gates from the projections a, b [..., H] (Qwen3-Next, Qwen3.5, OLMo-Hybrid):
    g = -exp(A_log) softplus(a + dt_bias) (log decay) and beta = sigmoid(b), both fp32 [..., H].
    gates.py computes them in one Triton launch."""
    beta = b.float().sigmoid()
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return g, beta
