"""The gated case of fla's `chunk_bwd_dqkwg` in PyTorch, for training with fla's chunked gated
delta rule where fla refuses its own kernel (fla-core 0.6.0 on Hopper with Triton >= 3.4 and
< 3.7.1 raises: that Triton miscompiles the kernel, fla #640).

Within fla's backward of `chunk_gated_delta_rule` (fla/ops/gated_delta_rule/chunk.py), with chunks
of BT tokens, g the chunk-local cumulative log2 gate, h_t the state entering chunk t, v the
chunk's corrected values (v_new) and dh the gradient of the state leaving chunk t, the forward
terms this step differentiates are, per chunk (exp2 of log2 gates = exp of natural ones):

    o      = scale * (q * 2^g) h_t + scale * (tril(q k^T) * 2^(g_i - g_j)) v
    h_next = 2^g_last h_t + (k * 2^(g_last - g))^T v
    v_new  = u - w h_t

and it returns dq, dk (from o and h_next), dw (from v_new, given dv) and dg (per token, with
respect to the chunk-local cumulative gate in natural-log units; fla applies the reverse cumsum
after). Every chunk is independent given h and dh, so the whole step is a few batched matmuls.
The test (tests/kernels/test_fla_bwd_dqkwg.py) checks it against autograd of those terms.
"""

from __future__ import annotations

import torch


def chunk_bwd_dqkwg_gated(q, k, v, do, h, dh, w, g, dv, scale, state_v_first=False, chunk_size=64):
    """q, k [B, T, H, K]; v, do, dv [B, T, HV, V]; w [B, T, HV, K]; g [B, T, HV] (chunk-local
    cumulative, log2 units); h, dh [B, NT, HV, K, V] as fla-core 0.6.0 passes them, or flat
    [B * NT, HV, K, V] ([.., V, K] with state_v_first in both).
    Returns dq, dk [B, T, H, K] (q's and k's dtypes), dw (w's dtype, the gradient itself, i.e.
    minus dv h^T), dg [B, T, HV] fp32, as fla's chunk_bwd_dqkwg does for a gated rule."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    NT = -(-T // BT)
    pad = NT * BT - T
    f32 = torch.float32

    def chunks(x):  # [B, T, X, ...] -> [B, NT, X, BT, ...] fp32, zero-padded
        x = x.to(f32)
        if pad:
            x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
        x = x.view(B, NT, BT, *x.shape[2:])
        return x.transpose(2, 3)

    rep = HV // H
    qc = chunks(q.repeat_interleave(rep, dim=2) if rep > 1 else q)  # [B, NT, HV, BT, K]
    kc = chunks(k.repeat_interleave(rep, dim=2) if rep > 1 else k)
    vc, doc, dvc = chunks(v), chunks(do), chunks(dv)
    gc = chunks(g[..., None])[..., 0]  # [B, NT, HV, BT]
    for name, x in (("h", h), ("dh", dh)):
        if x.numel() != B * NT * HV * K * V or x.shape[-3] != HV:
            raise ValueError(f"{name} {tuple(x.shape)}: expected [B, NT, HV, K, V] or [B * NT, HV, K, V]")
    hs = h.to(f32).reshape(B, NT, HV, *h.shape[-2:])
    dhs = dh.to(f32).reshape(B, NT, HV, *dh.shape[-2:])
    if state_v_first:
        hs, dhs = hs.transpose(-1, -2), dhs.transpose(-1, -2)  # -> [.., K, V]

    pos = torch.arange(NT * BT, device=q.device).view(NT, BT)
    valid = (pos < T)[None, :, None, :]  # [1, NT, 1, BT]
    last = (torch.clamp(torch.arange(1, NT + 1, device=q.device) * BT, max=T) - 1) - torch.arange(
        NT, device=q.device
    ) * BT  # index of each chunk's last real token within the chunk
    g_last = gc.gather(-1, last.view(1, NT, 1, 1).expand(B, NT, HV, 1))  # [B, NT, HV, 1]

    dg_last = (hs * dhs).sum((-1, -2)) * torch.exp2(g_last[..., 0])  # [B, NT, HV]
    dq = doc @ hs.transpose(-1, -2) * (torch.exp2(gc) * scale)[..., None]
    decay = torch.where(valid, torch.exp2(g_last - gc), torch.zeros_like(gc))
    dk = vc @ dhs.transpose(-1, -2) * decay[..., None]
    dw = -(dvc @ hs.transpose(-1, -2))
    dg_last = dg_last + (dk * kc).sum((-1, -2))

    causal = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril()
    keep = causal & valid[..., :, None] & valid[..., None, :]  # [1, NT, 1, BT, BT]
    diff = torch.where(keep, gc[..., :, None] - gc[..., None, :], torch.full_like(gc[..., None], float("-inf")))
    ds = (doc @ vc.transpose(-1, -2)) * torch.exp2(diff) * scale
    dq = dq + ds @ kc
    dk = dk + ds.transpose(-1, -2) @ qc
    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)  # [B, NT, HV, BT]
    dg = dg.scatter_add(-1, last.view(1, NT, 1, 1).expand(B, NT, HV, 1), dg_last[..., None])

    def unchunk(x):  # [B, NT, HV, BT, ...] -> [B, T, HV, ...]
        x = x.transpose(2, 3).reshape(B, NT * BT, *x.shape[2:3], *x.shape[4:])
        return x[:, :T]

    dq, dk = unchunk(dq), unchunk(dk)
    if rep > 1:
        dq = dq.view(B, T, H, rep, K).sum(3)
        dk = dk.view(B, T, H, rep, K).sum(3)
    dg = unchunk(dg[..., None])[..., 0]
    return dq.to(q.dtype), dk.to(k.dtype), unchunk(dw).to(w.dtype), dg


def install_for_fla() -> bool:
    """Make fla's chunked gated delta rule use chunk_bwd_dqkwg_gated for its gated, fixed-length
    backward step (varlen and ungated calls keep fla's kernel). Returns True when installed."""
    import fla.ops.gated_delta_rule.chunk as gdn_chunk

    original = gdn_chunk.chunk_bwd_dqkwg
    if getattr(original, "_hybridcache_torch", False):
        return True

    def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                        state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
        if g is None or w is None or dv is None or cu_seqlens is not None or g_gamma is not None:
            return original(q, k, v, do, h, dh, w=w, g=g, g_gamma=g_gamma, dv=dv, scale=scale,
                            state_v_first=state_v_first, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                            chunk_indices=chunk_indices)
        if scale is None:
            scale = k.shape[-1] ** -0.5
        return chunk_bwd_dqkwg_gated(q, k, v, do, h, dh, w, g, dv, scale, state_v_first, chunk_size)

    chunk_bwd_dqkwg._hybridcache_torch = True
    gdn_chunk.chunk_bwd_dqkwg = chunk_bwd_dqkwg
    return True
