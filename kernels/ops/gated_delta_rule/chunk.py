"""Gated delta rule in chunks (pure PyTorch): the fast CPU path, same results as naive.py.

Within a chunk of C tokens the product of the per-step operators is expressed through the WY
representation (one C x C triangular solve), so the Python loop runs T / C times instead of T
times. The transition operator of the whole run comes out of the same pass (README.md here).
"""

from __future__ import annotations

import torch


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    output_transition: bool = False,
    chunk_size: int = 64,
    output_query_transition: bool = False,
):
    """Same contract as naive_recurrent_gated_delta_rule (q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]),
    including output_query_transition (a fourth element u [B, T, H, K], u_t = scale T_t^T q_t)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    dtype = v.dtype
    dev = v.device
    q, k, v, g, beta = (x.float().transpose(1, 2) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    q = q * scale
    C = chunk_size
    S = torch.zeros(B, H, K, V, dtype=torch.float32, device=dev)
    if initial_state is not None:
        S = initial_state.float().clone()
    if output_query_transition and not output_transition:
        raise ValueError("output_query_transition needs output_transition")
    if output_transition:
        Tr = torch.eye(K, dtype=torch.float32, device=dev).expand(B, H, K, K).clone()
        S0 = torch.zeros(B, H, K, V, dtype=torch.float32, device=dev)
    if output_query_transition:
        u = torch.empty(B, H, T, K, dtype=torch.float32, device=dev)
    o = torch.empty(B, H, T, V, dtype=torch.float32, device=dev)
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    strict = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
    for s in range(0, T, C):
        e = min(s + C, T)
        n = e - s
        qc, kc, vc, bc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e]
        gc = g[:, :, s:e].cumsum(-1)  # [B, H, n] log decay from the chunk start through t
        diff = gc[..., :, None] - gc[..., None, :]
        decay = torch.where(causal[:n, :n], diff, torch.full_like(diff, float("-inf"))).exp()
        kbeta = kc * bc[..., None]
        A = ((kbeta @ kc.transpose(-1, -2)) * decay).masked_fill(~strict[:n, :n], 0.0)
        eye_n = torch.eye(n, dtype=torch.float32, device=dev)
        Linv = torch.linalg.solve_triangular(eye_n + A, eye_n, upper=False)
        U = Linv @ (vc * bc[..., None])  # [B, H, n, V]
        W = Linv @ (kbeta * gc.exp()[..., None])  # [B, H, n, K]
        attn = ((qc @ kc.transpose(-1, -2)) * decay).masked_fill(~causal[:n, :n], 0.0)
        g_last = gc[..., -1]
        k_dec = kc * (g_last[..., None] - gc).exp()[..., None]  # [B, H, n, K]
        d_last = g_last.exp()[..., None, None]
        v_new = U - W @ S  # [B, H, n, V]
        o[:, :, s:e] = (qc * gc.exp()[..., None]) @ S + attn @ v_new
        S = S * d_last + k_dec.transpose(-1, -2) @ v_new
        if output_query_transition:
            # the outputs of the T run (state T, values zero): u_t = T_t^T q_t within the chunk
            wt = W @ Tr
            u[:, :, s:e] = (qc * gc.exp()[..., None]) @ Tr - attn @ wt
        if output_transition:
            # The same chunk update applied to a zero-start state and to T (values zero).
            S0 = S0 * d_last + k_dec.transpose(-1, -2) @ (U - W @ S0)
            Tr = Tr * d_last - k_dec.transpose(-1, -2) @ (W @ Tr)
    o = o.transpose(1, 2).to(dtype)
    final = S if output_final_state else None
    if output_query_transition:
        return o, final, (Tr, S0), u.transpose(1, 2)
    if output_transition:
        return o, final, (Tr, S0)
    return o, final
