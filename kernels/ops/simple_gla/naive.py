"""Scalar-decay linear attention (simple GLA, RetNet, Lightning), pure PyTorch, fp32.

Per head (S is K x V, o_t = S_t^T q_t):

    S_t = gamma_t S_{t-1} + k_t v_t^T,   gamma_t = exp(g_t)

RetNet and Lightning attention use a fixed gamma per head (g_t = log gamma_h for every t);
simple GLA makes it data-dependent. A run's transition T = gamma_L ... gamma_1 is a scalar per
head (docs/concepts.md, "The math": a "scalar" T).
"""

from __future__ import annotations

import math

import torch


def naive_recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    output_transition: bool = False,
):
    """Run the recurrence over T tokens.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log of the per-step decay.
        scale: query scale, default K ** -0.5.
        initial_state: [B, H, K, V] or None (zeros).
        output_transition: also return (T [B, H], S(run|0) [B, H, K, V]); then
            final_state == T[..., None, None] * initial_state + S(run|0).

    Returns:
        o [B, T, H, V] (dtype of v), final_state [B, H, K, V] fp32 (or None), and with
        output_transition, (T, S0) as a third element.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = v.dtype
    q, k, v, g = (x.float() for x in (q, k, v, g))
    q = q * scale
    S = torch.zeros(B, H, K, V, dtype=torch.float32, device=v.device)
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=v.device)
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None] + k[:, t, ..., None] * v[:, t, :, None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    Tt = g.cumsum(1).exp()  # [B, T, H]
    Tr = Tt[:, -1] if T else torch.ones(B, H, dtype=torch.float32, device=v.device)
    S0 = S
    if initial_state is not None:
        init = initial_state.float()
        o = o + Tt[..., None] * torch.einsum("bthk,bhkv->bthv", q, init)
        S = Tr[..., None, None] * init + S0
    out = (o.to(dtype), S if output_final_state else None)
    return (*out, (Tr, S0)) if output_transition else out


def lightning_slopes(num_heads: int) -> torch.Tensor:
    """Per-head decay rates s_h of Lightning attention / ALiBi (gamma_h = exp(-s_h)), [H].

    The geometric sequence 2^(-8 h / H) of ALiBi for a power-of-two H, interleaved otherwise.
    """

    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = pow2(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = pow2(closest) + pow2(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def naive_lightning_attention(q, k, v, slopes: torch.Tensor, scale: float | None = 1.0, **kwargs):
    """Lightning (RetNet-style) attention: a fixed decay exp(-slopes[h]) per head, [H] slopes."""
    B, T, H, _ = k.shape
    g = (-slopes.float().to(k.device))[None, None, :].expand(B, T, H)
    return naive_recurrent_simple_gla(q, k, v, g, scale=scale, **kwargs)
