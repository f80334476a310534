"""Mamba2 state-space duality (SSD) scan, pure PyTorch, fp32, one step at a time.

Per head h, with the state S [N, P] (N = ssm state size playing the key role, P = head dim the
value role; transformers stores its transpose [P, N]):

    S_t = exp(dt_t A_h) S_{t-1} + dt_t B_t x_t^T,   y_t = S_t^T C_t + D_h x_t

A_t = exp(dt_t A_h) I, so a run's transition T = exp(A_h sum_t dt_t) is one scalar per head
(docs/concepts.md, "The math"). The D skip and the output gate are stateless: D is applied here, outside the
recurrence; the gate (and its RMSNorm) belongs to the layer.
"""

from __future__ import annotations

import torch
from hybridcache.kernels.ops.simple_gla.naive import naive_recurrent_simple_gla


def naive_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    output_transition: bool = False,
):
    """Run the SSD recurrence over T tokens.

    Args:
        x: [B, T, H, P] inputs; dt: [B, T, H] time steps (after softplus / clamping);
        A: [H] (negative); B, C: [B, T, G, N] with H a multiple of the G groups; D: [H] or None.
        initial_state: [B, H, N, P] or None (zeros).
        output_transition: also return (T [B, H], S(run|0) [B, H, N, P]).

    Returns:
        y [B, T, H, P] (dtype of x), final_state [B, H, N, P] fp32 (or None), and with
        output_transition, (T, S0) as a third element.
    """
    H = x.shape[2]
    rep = H // B.shape[2]
    Bh = B.float().repeat_interleave(rep, dim=2)  # [B, T, H, N]
    Ch = C.float().repeat_interleave(rep, dim=2)
    dtf = dt.float()
    g = dtf * A.float()[None, None, :]
    res = naive_recurrent_simple_gla(
        Ch,
        Bh * dtf[..., None],
        x.float(),
        g,
        scale=1.0,
        initial_state=initial_state,
        output_final_state=output_final_state,
        output_transition=output_transition,
    )
    y = res[0]
    if D is not None:
        y = y + D.float()[None, None, :, None] * x.float()
    return (y.to(x.dtype), *res[1:])
