"""One token of a linear-attention recurrence for B sequences whose states lie in a pool, updated
in place through slot indices (pure PyTorch, fp32: the reference the kernel is tested against).

Per value head (S is K x V, o = S^T (scale q)), with a log decay g (one per head, or one per key
channel: KDA) and, for the delta rules, a write strength beta:

    delta rule (Gated DeltaNet, KDA)        S <- diag(exp g) S;  S <- S + k (beta (v - S^T k))^T
    plain (simple GLA, Lightning, Mamba2)   S <- exp(g) S + k v^T

Mamba2 is the plain form with q = C, k = dt B, v = x, g = dt A and scale 1 (its D skip stays
outside). A decode step reads each running request's state from its slot of the pool and writes
it back there: no stacked copy of the batch's states (vLLM's and SGLang's ssm_state_indices).
"""

from __future__ import annotations

import torch


def naive_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_scale: float = 1.0,
    l2norm_qk: bool = False,
) -> torch.Tensor:
    """One step of B sequences (the delta rule when beta is given, else the plain form).

    Args:
        q, k: [B, H, K]; the HV value heads share them in groups of HV // H (head hv reads hv // (HV // H)).
        v: [B, HV, V].
        g: [B, HV] log decay per head, or [B, HV, K] per key channel.
        beta: [B, HV] or None.
        pool: [S, HV, K, V] fp32, the states of every slot; rows `slots` are read and written.
        slots: [B] int64, distinct (a padding row may share the scratch slot: its result is undefined).
        scale: query scale, default K ** -0.5.
        A_log, dt_bias: [HV] each: g and beta are the raw projections a and b of the gated delta
            rule, whose gates are g = -exp(A_log) softplus(a + dt_bias), beta = beta_scale sigmoid(b).
        l2norm_qk: q and k are L2-normalized first (fp32, eps 1e-6).

    Returns:
        o [B, HV, V] in v's dtype; pool[slots] holds the states after the step.
    """
    B, H, K = k.shape
    HV = v.shape[1]
    scale = K**-0.5 if scale is None else scale
    rep = HV // H
    qf, kf = q.float(), k.float()
    if l2norm_qk:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    if A_log is not None:
        g = -A_log.float().exp() * torch.nn.functional.softplus(g.float() + dt_bias.float())
        beta = beta.float().sigmoid() * beta_scale
    qf = qf.repeat_interleave(rep, dim=1) * scale  # [B, HV, K]
    kf = kf.repeat_interleave(rep, dim=1)
    vf = v.float()
    S = pool[slots].float()  # [B, HV, K, V]
    decay = g.float().exp()
    S = S * (decay[..., None, None] if g.dim() == 2 else decay[..., None])
    if beta is not None:
        vf = (vf - (kf.unsqueeze(-2) @ S).squeeze(-2)) * beta.float()[..., None]
    S = S + kf[..., None] * vf[..., None, :]
    o = (qf.unsqueeze(-2) @ S).squeeze(-2)
    pool.index_copy_(0, slots, S.to(pool.dtype))
    return o.to(v.dtype)
