"""Gated linear attention (GLA), pure PyTorch, fp32, one step at a time.

Per head (S is K x V, o_t = S_t^T q_t), with a per-channel (diagonal) decay:

    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,   alpha_t = exp(gk_t) in (0, 1]^K

A run's transition T = alpha_L * ... * alpha_1 is a K-vector (docs/concepts.md, "The math": a "vector" T).
"""

from __future__ import annotations

import torch


def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    output_transition: bool = False,
):
    """Run the recurrence over T tokens.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; gk: [B, T, H, K] log of the per-channel decay.
        scale: query scale, default K ** -0.5.
        initial_state: [B, H, K, V] or None (zeros).
        output_transition: also return (T [B, H, K], S(run|0) [B, H, K, V]); then
            final_state == T[..., None] * initial_state + S(run|0).

    Returns:
        o [B, T, H, V] (dtype of v), final_state [B, H, K, V] fp32 (or None), and with
        output_transition, (T, S0) as a third element.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = v.dtype
    q, k, v, gk = (x.float() for x in (q, k, v, gk))
    q = q * scale
    S = torch.zeros(B, H, K, V, dtype=torch.float32, device=v.device)
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=v.device)
    for t in range(T):
        S = S * gk[:, t].exp()[..., None] + k[:, t, ..., None] * v[:, t, :, None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    # T_t = alpha_t ... alpha_1 for every t: o_t gains S_init^T (T_t * q_t)
    Tt = gk.cumsum(1).exp()  # [B, T, H, K]
    Tr = Tt[:, -1] if T else torch.ones(B, H, K, dtype=torch.float32, device=v.device)
    S0 = S
    if initial_state is not None:
        init = initial_state.float()
        o = o + torch.einsum("bthk,bhkv->bthv", Tt * q, init)
        S = Tr[..., None] * init + S0
    out = (o.to(dtype), S if output_final_state else None)
    return (*out, (Tr, S0)) if output_transition else out
