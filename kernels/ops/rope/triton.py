"""Rotary embedding of attention heads in one Triton kernel, optionally fused with the heads'
RMSNorm (q_norm / k_norm); reference: naive.py.

Eager, one rotation is about six launches (slices, negation, two concatenations, two products
and a sum) and the norm before it one more; a forward of the Qwen3.5-9B shape rotates queries,
keys and the cached keys' shifts in each of its 8 attention layers, a decode step included. Here
each is one launch.

One program handles BR rows (one row = one head of one token) of D channels, fp32 inside. The
input is addressed by strides (batch, token, head), so the projection's token-major [B, n, H, D]
views and head-major [B, H, n, D] tensors are read in place; the output is head-major
[B, H, n, D], contiguous, as attention reads it. cos/sin [n, R] hold the angles of each token;
channels from R on pass through (partial rotary).

norm_rope_into_pages serves a decode step's keys: the new tokens' keys normalized and rotated and
their values copied, straight into the K/V pages at each token's row, in one launch where the
rotation and two indexed copies took three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def norm_rotate(x, src, t, cols, m_r, m_c, cos, sin, scale, eps, D: tl.constexpr, R: tl.constexpr,
                 HAS_NORM: tl.constexpr):
    """Rows at x + src [BR] (channels unit-stride), token t [BR] of each: RMSNorm * scale when
    HAS_NORM, then rotated by cos/sin [tokens, R] (rotate-half; channels from R on pass through);
    fp32 [BR, BD]."""
    mask = m_r[:, None] & m_c[None, :]
    b_x = tl.load(x + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    half: tl.constexpr = R // 2
    # the rotate-half partner of each rotated channel, and its sign
    partner = tl.where(cols < half, cols + half, cols - half)
    m_rot = cols < R
    b_p = tl.load(x + src[:, None] + partner[None, :], mask=mask & m_rot[None, :], other=0.0).to(tl.float32)
    if HAS_NORM:
        r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
        b_s = tl.load(scale + cols, mask=m_c, other=0.0).to(tl.float32)
        b_sp = tl.load(scale + partner, mask=m_rot, other=0.0).to(tl.float32)
        b_x = b_x * r[:, None] * b_s[None, :]
        b_p = b_p * r[:, None] * b_sp[None, :]
    m_cs = m_r[:, None] & m_rot[None, :]
    b_cos = tl.load(cos + t[:, None] * R + cols[None, :], mask=m_cs, other=1.0).to(tl.float32)
    b_sin = tl.load(sin + t[:, None] * R + cols[None, :], mask=m_cs, other=0.0).to(tl.float32)
    sign = tl.where(cols < half, -1.0, 1.0)
    return b_x * b_cos + sign[None, :] * b_p * b_sin


@triton.jit(do_not_specialize=["n_rows", "n_tok"])
def rope_kernel(
    x, y, cos, sin, scale, n_rows, n_tok, s_b, s_t, s_h, eps,
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # output rows: (b * H + h) * n_tok + t
    cols = tl.arange(0, BD)
    m_r, m_c = rows < n_rows, cols < D
    mask = m_r[:, None] & m_c[None, :]
    t = rows % n_tok
    bh = rows // n_tok
    src = (bh // H) * s_b + t * s_t + (bh % H) * s_h
    b_y = norm_rotate(x, src, t, cols, m_r, m_c, cos, sin, scale, eps, D, R, HAS_NORM)
    tl.store(y + rows[:, None] * D + cols[None, :], b_y.to(y.dtype.element_ty), mask=mask)


def _rope(x4: torch.Tensor, strides, B: int, n: int, H: int, cos, sin, scale, eps: float) -> torch.Tensor:
    D = x4.shape[-1]
    R = cos.shape[-1]
    if x4.stride(-1) != 1:
        raise ValueError("the head dim must be unit-stride")
    if R % 2 or R > D or cos.shape != (n, R) or sin.shape != (n, R):
        raise ValueError(f"cos/sin must be [{n}, R] with an even R <= {D}, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    y = torch.empty(B, H, n, D, dtype=x4.dtype, device=x4.device)
    rows = B * H * n
    if rows == 0:
        return y
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 2048 // BD))
    s_b, s_t, s_h = strides
    rope_kernel[(triton.cdiv(rows, BR),)](
        x4, y, cos.float().contiguous(), sin.float().contiguous(), scale if scale is not None else cos,
        rows, n, s_b, s_t, s_h, float(eps),
        H=H, D=D, R=R, BD=BD, BR=BR, HAS_NORM=scale is not None, num_warps=4,
    )
    return y


def rope_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D] (any strides, D unit-stride) rotated -> [B, H, n, D] contiguous."""
    B, H, n, _ = x.shape
    return _rope(x, (x.stride(0), x.stride(2), x.stride(1)), B, n, H, cos, sin, None, 0.0)


def norm_rope_tokens(x: torch.Tensor, scale: torch.Tensor, eps: float, cos, sin) -> torch.Tensor:
    """x [B, n, H, D] (token-major, any strides, D unit-stride): RMSNorm * scale [D] (fp32), then
    rotated -> [B, H, n, D] contiguous."""
    B, n, H, D = x.shape
    if scale.shape != (D,):
        raise ValueError(f"scale {tuple(scale.shape)} does not match head dim {D}")
    return _rope(x, (x.stride(0), x.stride(1), x.stride(2)), B, n, H, cos, sin, scale.float().contiguous(), eps)


@triton.jit(do_not_specialize=["n_rows"])
def norm_rope_pages_kernel(
    k, v, kp, vp, rows_of, cos, sin, scale, n_rows, s_kt, s_kh, s_vt, s_vh, s_kpr, s_kph, s_vpr, s_vph, eps,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BR: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # (token, head): t * H + h
    m_r = rows < n_rows
    t = rows // H
    h = rows % H
    dst = tl.load(rows_of + t, mask=m_r, other=0).to(tl.int64)  # the token's row in the pages
    cols = tl.arange(0, BD)
    m_c = cols < D
    mask = m_r[:, None] & m_c[None, :]
    b_y = norm_rotate(k, t * s_kt + h * s_kh, t, cols, m_r, m_c, cos, sin, scale, eps, D, R, True)
    tl.store(kp + (dst * s_kpr + h * s_kph)[:, None] + cols[None, :], b_y.to(kp.dtype.element_ty), mask=mask)
    o_v = tl.arange(0, BDV)
    m_v = m_r[:, None] & (o_v < DV)[None, :]
    b_v = tl.load(v + (t * s_vt + h * s_vh)[:, None] + o_v[None, :], mask=m_v, other=0.0)
    tl.store(vp + (dst * s_vpr + h * s_vph)[:, None] + o_v[None, :], b_v.to(vp.dtype.element_ty), mask=m_v)


def norm_rope_into_pages(k, v, scale, eps: float, cos, sin, k_pages, v_pages, rows) -> None:
    """The n new tokens' keys k [n, H, D] (any token and head strides, D unit-stride): RMSNorm *
    scale [D] (fp32), rotated by cos/sin [n, R], written into k_pages [num_pages, P, H, D] at the
    flattened row rows[t] (page * P + slot, int64 [n]); their values v [n, H, DV] copied into
    v_pages at the same rows. One launch; the pools' dtype is the tokens'."""
    n, H, D = k.shape
    DV = v.shape[-1]
    R = cos.shape[-1]
    if v.shape[:2] != (n, H) or rows.shape != (n,) or scale.shape != (D,):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, rows {tuple(rows.shape)} and scale "
                         f"{tuple(scale.shape)} do not fit")
    if R % 2 or R > D or cos.shape != (n, R) or sin.shape != (n, R):
        raise ValueError(f"cos/sin must be [{n}, R] with an even R <= {D}, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    for name, pool, d in (("k_pages", k_pages, D), ("v_pages", v_pages, DV)):
        if pool.shape[2:] != (H, d) or pool.stride(0) != pool.shape[1] * pool.stride(1) or pool.stride(-1) != 1:
            raise ValueError(f"{name} {tuple(pool.shape)} must be [pages, P, {H}, {d}] with rows one stride apart")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the head dims must be unit-stride")
    if n == 0:
        return
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 2048 // BD))
    norm_rope_pages_kernel[(triton.cdiv(n * H, BR),)](
        k, v, k_pages, v_pages, rows, cos.float().contiguous(), sin.float().contiguous(), scale.float().contiguous(),
        n * H, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(1), v_pages.stride(2), float(eps),
        H=H, D=D, DV=DV, R=R, BD=BD, BDV=triton.next_power_of_2(DV), BR=BR, num_warps=4,
    )


@triton.jit(do_not_specialize=["n_rows"])
def spans_into_pages_kernel(
    tab, tok_span, tok_local, rows_of, cos, sin, kp, vp, kref, vref, n_rows, m,
    s_kpr, s_kph, s_vpr, s_vph,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BR: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # (token, head): t * H + h
    m_r = rows < n_rows
    t = rows // H
    h = rows % H
    j = tl.load(tok_span + t, mask=m_r, other=0).to(tl.int64)  # the token's span
    i = tl.load(tok_local + t, mask=m_r, other=0).to(tl.int64)  # its index in the span
    dst = tl.load(rows_of + t, mask=m_r, other=0).to(tl.int64)  # its row in the pages
    # the table's columns, m spans each: K and V addresses, then their head and token strides
    kb = tl.load(tab + j, mask=m_r, other=0).to(kref.dtype, bitcast=True)
    vb = tl.load(tab + m + j, mask=m_r, other=0).to(vref.dtype, bitcast=True)
    k_src = h * tl.load(tab + 2 * m + j, mask=m_r, other=0) + i * tl.load(tab + 3 * m + j, mask=m_r, other=0)
    v_src = h * tl.load(tab + 4 * m + j, mask=m_r, other=0) + i * tl.load(tab + 5 * m + j, mask=m_r, other=0)
    cols = tl.arange(0, BD)
    m_c = cols < D
    mask = m_r[:, None] & m_c[None, :]
    b_y = norm_rotate(kb[:, None], k_src, t, cols, m_r, m_c, cos, sin, cos, 0.0, D, R, False)
    tl.store(kp + (dst * s_kpr + h * s_kph)[:, None] + cols[None, :], b_y.to(kp.dtype.element_ty), mask=mask)
    o_v = tl.arange(0, BDV)
    m_v = m_r[:, None] & (o_v < DV)[None, :]
    b_v = tl.load(vb[:, None] + v_src[:, None] + o_v[None, :], mask=m_v, other=0.0)
    tl.store(vp + (dst * s_vpr + h * s_vph)[:, None] + o_v[None, :], b_v.to(vp.dtype.element_ty), mask=m_v)


def spans_into_pages(ks, vs, cos, sin, k_pages, v_pages, rows, tok_span=None, tok_local=None):
    """Cached spans' keys ks[j] [1, H, n_j, D] and values vs[j] [1, H, n_j, DV] (any head and token
    strides, the channels unit-stride; read where they lie through a table of their addresses: no
    concatenation), the keys rotated by cos/sin [S, R] (S = sum n_j, the spans' tokens in order;
    rotate-half, channels from R on pass through), written into k_pages [num_pages, P, H, D] /
    v_pages at the flattened rows rows[t] (page * P + slot, int64 [S]). One launch. tok_span,
    tok_local [S] (int, on the device): each token's span and its index there, when the caller has
    them (else made here from the lengths, on the device). The spans must stay alive until the
    launch has run, as they do while the caller holds them. Returns (tok_span, tok_local), for the
    next call over spans of the same lengths."""
    if not ks or len(ks) != len(vs):
        raise ValueError(f"need as many key blocks as value blocks, at least one (got {len(ks)} and {len(vs)})")
    H, D = ks[0].shape[1], ks[0].shape[3]
    DV = vs[0].shape[3]
    lens = [k.shape[2] for k in ks]
    for k, v, n in zip(ks, vs, lens):
        if k.dim() != 4 or v.dim() != 4 or k.shape != (1, H, n, D) or v.shape != (1, H, n, DV):
            raise ValueError(f"span K {tuple(k.shape)} / V {tuple(v.shape)} must be [1, {H}, n, {D}] and "
                             f"[1, {H}, n, {DV}]")
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("the spans' channels must be unit-stride")
        if k.dtype != ks[0].dtype or v.dtype != vs[0].dtype or k.device != k_pages.device:
            raise ValueError("the spans' K (and V) must share a dtype and the pages' device")
    S = sum(lens)
    R = cos.shape[-1]
    if rows.shape != (S,):
        raise ValueError(f"rows must be [{S}], got {tuple(rows.shape)}")
    if R % 2 or R > D or cos.shape != (S, R) or sin.shape != (S, R):
        raise ValueError(f"cos/sin must be [{S}, R] with an even R <= {D}, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    for name, pool, d in (("k_pages", k_pages, D), ("v_pages", v_pages, DV)):
        if pool.shape[2:] != (H, d) or pool.stride(0) != pool.shape[1] * pool.stride(1) or pool.stride(-1) != 1:
            raise ValueError(f"{name} {tuple(pool.shape)} must be [pages, P, {H}, {d}] with rows one stride apart")
    if S == 0:
        return tok_span, tok_local
    dev = k_pages.device
    host = torch.tensor([[k.data_ptr() for k in ks], [v.data_ptr() for v in vs], [k.stride(1) for k in ks],
                         [k.stride(2) for k in ks], [v.stride(1) for v in vs], [v.stride(2) for v in vs], lens],
                        dtype=torch.int64)
    table = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host.to(dev)
    m = len(ks)
    if tok_span is None or tok_local is None:
        lens_dev = table[6]
        tok_span = torch.repeat_interleave(torch.arange(m, device=dev), lens_dev, output_size=S)
        starts = torch.cumsum(lens_dev, 0) - lens_dev
        tok_local = torch.arange(S, device=dev) - starts.index_select(0, tok_span)
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 2048 // BD))
    spans_into_pages_kernel[(triton.cdiv(S * H, BR),)](
        table, tok_span, tok_local, rows, cos.float().contiguous(), sin.float().contiguous(), k_pages, v_pages,
        ks[0], vs[0], S * H, m, k_pages.stride(1), k_pages.stride(2), v_pages.stride(1), v_pages.stride(2),
        H=H, D=D, DV=DV, R=R, BD=BD, BDV=triton.next_power_of_2(DV), BR=BR, num_warps=4,
    )
    return tok_span, tok_local
