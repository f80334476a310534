"""Segment-entry construction fused with the chunked prefill, on fla-core's GPU kernels.

fla's chunked forward is three stages: the intra-chunk WY representation (w, u from a C x C
triangular solve), the inter-chunk state recurrence (h per chunk, v_new = u - w h), and the
output. The transition T of the run is the same recurrence started from I with u = 0
(README.md here), so it needs only the middle stage again, sharing w and the decay cumsum: the T
run is its own launch after the value run, with no copies. (Stacking the two runs on the batch
axis, or the T run on a side stream, were measured at the Qwen3.5-9B shape: the stack's copies
cost more than the idle SMs it fills, and the side stream gains nothing.) The WY stage and the
output stage run once.

S(run|0) comes out as S_final - T S_init (exact in exact arithmetic; both terms are fp32 states
of the same kernel). Imports fla lazily: this module is importable without it.
"""

from __future__ import annotations

import torch


def chunk_gated_delta_rule_entry(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    output_query_transition: bool = False,
):
    """Chunked gated delta rule that also returns the run's (T, S(run|0)); with
    output_query_transition also u [B, T, HV, K] (v's dtype), u_t = scale T_t^T q_t: the outputs of
    the T run itself, from the state kernel's per-chunk T and its corrected values.

    Args: q, k [B, T, H, K]; v [B, T, HV, V]; g (log decay), beta [B, T, HV]; initial_state
    [B, HV, K, V] fp32 or None. Same contract as naive_recurrent_gated_delta_rule(...,
    output_transition=True).

    Returns: o [B, T, HV, V] (dtype of v), final_state [B, HV, K, V] fp32,
    (T [B, HV, K, K] fp32, S0 [B, HV, K, V] fp32).
    """
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    B, _, _, K = k.shape
    HV = v.shape[2]
    if scale is None:
        scale = K**-0.5
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g_cum = local_cumsum_one_row(g, chunk_size, lambda x: chunk_local_cumsum(x, chunk_size=chunk_size, scale=RCP_LN2))
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta, chunk_size=chunk_size)
    h0 = initial_state.float() if initial_state is not None else None
    if h0 is None and output_query_transition and k.shape[1] <= chunk_size:
        # the pieces of runs of one chunk from a zero state (a planned assembly's sub-runs): closed
        # forms, no per-chunk states written and read back (the final state is S0 itself)
        o, S0, Tr, u_t = single_chunk_from_zero(q, k, u, w, g_cum, scale, True)
        return o, S0, (Tr, S0), u_t
    # a zero start goes to fla as None (no [B, H, K, V] of zeros written and read a call)
    h, v_new, S_final = chunk_gated_delta_rule_fwd_h(
        k=k,
        w=w,
        u=u,
        g=g_cum,
        initial_state=h0.contiguous() if h0 is not None else None,
        output_final_state=True,
        chunk_size=chunk_size,
    )
    if k.shape[1] <= chunk_size:
        Tr, h_t, v_new_t = single_chunk_transition(k, w, g_cum, output_query_transition)
    else:
        # the T run: the same recurrence from I with zero values
        eye = torch.eye(K, dtype=torch.float32, device=k.device).expand(B, HV, K, K)
        h_t, v_new_t, Tr = chunk_gated_delta_rule_fwd_h(
            k=k,
            w=w,
            u=u.new_zeros(*u.shape[:-1], K),
            g=g_cum,
            initial_state=eye.contiguous(),
            output_final_state=True,
            chunk_size=chunk_size,
            save_new_value=output_query_transition,
        )
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_cum, scale=scale, chunk_size=chunk_size)
    S0 = S_final if h0 is None else S_final - Tr @ h0
    if output_query_transition:
        u_t = chunk_fwd_o(q=q, k=k, v=v_new_t, h=h_t, g=g_cum, scale=scale, chunk_size=chunk_size)
        return o, S_final, (Tr, S0), u_t
    return o, S_final, (Tr, S0)


def single_chunk_transition(k: torch.Tensor, w: torch.Tensor, g_cum: torch.Tensor, with_query: bool):
    """The T run of runs no longer than one chunk, in closed form: from h = I with zero values the
    chunk's corrected values are -w (w I), and the state after it is

        T = exp2(g_L) I - k^T (w * exp2(g_L - g_t))      (g_cum in log2, as fla's kernels take it)

    one batched product instead of fla's state kernel over an identity start (which reads a
    [B, HV, K, K] fp32 identity and writes the per-chunk states back). fla rounds the scaled
    values to k's dtype before that product; here it is fp32 throughout. Returns (T [B, HV, K, K]
    fp32, h_t, v_new_t): with `with_query` the chunk's entering states (I, [B, 1, HV, K, K] in k's
    dtype) and values (-w) that chunk_fwd_o turns into u, else None, None."""
    B, L, H, K = k.shape
    HV = w.shape[2]
    g_last = g_cum[:, -1]  # [B, HV]
    # -w * exp2(g_L - g): the sign goes on the [B, L, HV] factor, not on the [B, HV, K, K] product
    wd = w.float() * torch.exp2(g_last[:, None] - g_cum).neg_()[..., None]  # [B, L, HV, K]
    kf = k.float() if H == HV else k.float().repeat_interleave(HV // H, dim=2)
    Tr = torch.matmul(kf.permute(0, 2, 3, 1), wd.transpose(1, 2))  # [B, HV, K, K]
    Tr.diagonal(dim1=-2, dim2=-1).add_(torch.exp2(g_last)[..., None])
    if not with_query:
        return Tr, None, None
    return Tr, identity_states(B, HV, K, k.dtype, k.device), w.neg()


def single_chunk_from_zero(q, k, u, w, g_cum, scale: float, with_query: bool):
    """A run of at most one chunk from a zero state, in closed form from fla's WY stage (w, u
    [B, L, HV, K / V], g_cum [B, L, HV] the chunk-local cumsum in log2): with h = 0 the corrected
    values are u itself, so

        o   = A u,                    A = scale (q k^T * exp2(g_i - g_j)), causal (diagonal kept)
        S0  = k^T (u * exp2(g_L - g))  (the final state)
        T   = single_chunk_transition's,  u_t = scale exp2(g) q - A w  (the T run's outputs)

    in fp32 (fla's state and output kernels write and read the chunk's zero state and, for u_t,
    an identity). q, k [B, L, H, K] (HV a multiple of H). Returns (o [B, L, HV, V] in u's dtype,
    S0 [B, HV, K, V] fp32, T [B, HV, K, K] fp32, u_t [B, L, HV, K] in u's dtype or None)."""
    B, L, H, K = k.shape
    HV = u.shape[2]
    rep = HV // H

    def heads(x):  # [B, L, H, K] -> [B, HV, L, K] fp32
        x = x.float()
        return (x if rep == 1 else x.repeat_interleave(rep, dim=2)).transpose(1, 2)

    qh, kh = heads(q), heads(k)
    g = g_cum.float().transpose(1, 2)  # [B, HV, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()
    decay = torch.exp2((g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")))
    A = (qh @ kh.transpose(-1, -2)).mul_(decay).mul_(scale)  # [B, HV, L, L]
    uh = u.float().transpose(1, 2)  # [B, HV, L, V]
    o = (A @ uh).transpose(1, 2).to(u.dtype)
    kd = kh * torch.exp2(g[..., -1:] - g)[..., None]  # [B, HV, L, K]
    S0 = kd.transpose(-1, -2) @ uh  # [B, HV, K, V]
    Tr, _, _ = single_chunk_transition(k, w, g_cum, False)
    if not with_query:
        return o, S0, Tr, None
    wh = w.float().transpose(1, 2)  # [B, HV, L, K]
    u_t = (qh * torch.exp2(g)[..., None]).mul_(scale).sub_(A @ wh).transpose(1, 2).to(u.dtype)
    return o, S0, Tr, u_t


_IDENTITY: dict = {}


def identity_states(B: int, HV: int, K: int, dtype, device) -> torch.Tensor:
    """[B, 1, HV, K, K] identities in `dtype`: a view of one buffer per (HV, K, dtype, device),
    made for the next power of two of the largest B asked. Buffers are never written after they
    are made and never freed (a CUDA graph may read one)."""
    key = (HV, K, dtype, str(device))
    bufs = _IDENTITY.setdefault(key, [])
    if not bufs or bufs[-1].shape[0] < B:
        n = 1 << (B - 1).bit_length()
        bufs.append(torch.eye(K, dtype=dtype, device=device).expand(n, 1, HV, K, K).contiguous())
    return bufs[-1][:B]


def local_cumsum_one_row(g: torch.Tensor, chunk_size: int, cumsum) -> torch.Tensor:
    """Chunk-local cumsum of g [B, T, H] (fp32) through `cumsum`, called with a batch of one:
    the B runs, each padded to whole chunks, are laid end to end on the time axis. fla's cumsum
    kernel takes B as a compile-time constant and autotunes per B, so every new number of runs
    (one per reused segment in a pic request, one per segment in a batched build) compiled and
    benchmarked four configurations again; padding adds zeros after each run's last chunk, which
    no earlier position's cumsum sees."""
    B, T, H = g.shape
    g = g.float()
    if B == 1:
        return cumsum(g.contiguous())
    Tp = -(-T // chunk_size) * chunk_size
    if Tp != T:
        g = torch.nn.functional.pad(g, (0, 0, 0, Tp - T))
    out = cumsum(g.reshape(1, B * Tp, H).contiguous()).view(B, Tp, H)
    return out if Tp == T else out[:, :T].contiguous()


def transition_by_identity_start(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The unfused baseline: T as the final state of fla's whole chunked forward from S0 = I, v = 0."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, T, H, K = k.shape
    HV = beta.shape[2]
    eye = torch.eye(K, dtype=torch.float32, device=k.device).expand(B, HV, K, K).contiguous()
    zeros_v = k.new_zeros(B, T, HV, K)
    _, Tr = chunk_gated_delta_rule(k, k, zeros_v, g, beta, initial_state=eye, output_final_state=True)
    return Tr
