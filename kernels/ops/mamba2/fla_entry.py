"""Mamba2 SSD on fla-core's simple GLA kernels (GPU), with the run's scalar (T, S(run|0)).

The scan maps onto simple GLA exactly as naive_ssd does: q = C, k = dt * B, v = x, per-step log
decay g = dt * A_h, scale 1; the D skip is added outside the recurrence. Imports fla lazily.
"""

from __future__ import annotations

from hybridcache.kernels.ops.simple_gla.fla_entry import simple_gla_fla


def ssd_fla(x, dt, A, B, C, D=None, initial_state=None, output_transition: bool = False):
    """Same arguments and contract as naive_ssd: x [B, T, H, P]; dt [B, T, H]; A [H]; B, C
    [B, T, G, N]; D [H] or None; initial_state [B, H, N, P] fp32 or None."""
    H = x.shape[2]
    rep = H // B.shape[2]
    dtf = dt.float()
    Bh = B.float().repeat_interleave(rep, dim=2)  # [B, T, H, N]
    Ch = C.repeat_interleave(rep, dim=2)
    res = simple_gla_fla(
        Ch,
        Bh * dtf[..., None],
        x,
        g=dtf * A.float()[None, None, :],
        scale=1.0,
        initial_state=initial_state,
        output_transition=output_transition,
    )
    y = res[0]
    if D is not None:
        y = (y.float() + D.float()[None, None, :, None] * x.float()).to(x.dtype)
    return (y, *res[1:])
