"""Attention of live query tokens at arbitrary absolute positions over a contiguous key/value
context, with GQA, in Triton; reference: naive.py.

The live tokens of a forward sit wherever the request left them: between cached spans (seams),
as a tail after the cached prefix, or one token at the end (decode). Query i at position q_pos[i]
sees keys 0..q_pos[i]. Eager, that is a masked SDPA call with an [n, N] boolean mask, which
PyTorch serves with its memory-efficient kernel, materializing the mask per layer. Here no mask
is built: the positions are read in the kernel.

GQA is folded into the rows: one program serves all G = Hq // Hkv query heads of one KV head, so
each key tile it loads feeds G times as many rows. Row r of the n * G rows of a (batch, KV head)
is query i = r // G of head kv * G + r % G (query-major), so a block of BLOCK_M rows spans
BLOCK_M / G consecutive queries and their positions are close together. Grid: (row blocks,
B * Hkv, key splits). A program loads its rows' positions and loops over key blocks only up to
the largest of them (+1), so a block of early queries stops early; key j > q_pos[row] gets -inf.
Online softmax in the exp2 domain (the scale folded with log2 e), fp32 accumulators, tl.dot for
QK^T and PV. Every key block is masked, also those all rows see in full: a separate unmasked loop
for those got its own pipeline buffers, doubling the shared memory, so d = 256 only fit BLOCK_N 32,
which is slower than one masked loop at BLOCK_M 128, BLOCK_N 64 (the mask is a compare and a
select per score, little next to two 256-deep dots).

When the row blocks times B * Hkv are too few to fill the GPU (decode: one program per KV head),
the keys are also split into chunks (flash-decoding): each program writes its chunk's normalized
partial output and log-sum-exp in fp32, and a second small kernel merges the chunks. The split
count is a launch argument, not a compile-time one, as are n and N (do_not_specialize): a new
context length or live-token count never recompiles; block sizes depend only on the head dims,
the dtype and, for few rows (decode: G rows), a smaller BLOCK_M (16, 32 or 64).

q, k and v are addressed by strides (any layout, e.g. token-major projection views); the head
dims need not be powers of two (BLOCK_D is padded, the padding masked) and dq may differ from dv
(MLA: 192 and 128). The output is [B, Hq, n, dv], contiguous, in q's dtype. q_pos is meant
ascending (that keeps a row block's positions close, hence its masked key blocks few), though
each row reads its own position and any order gives the right result. Its values are not checked
(that would sync with the device): a position past N - 1 is clamped to it, and a query at a
negative position sees no key and gets zeros.

`paged_live_attention` runs the same kernel (PAGED) over one sequence whose keys lie in the pages
of a pool [num_pages, P, Hkv, d] (paged.py): each key block reads its keys' page ids from the
sequence's table row, a device scalar, as the paged decode kernel does; nothing is gathered. A
long prompt's chunks and assemblies whose K/V are in their request's pages attend this way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hybridcache.kernels.ops.transition.compose_triton import _sm_count

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["n", "N", "chunk"])
def live_attention_kernel(
    Q, K, V, O, OP, LSE, QPOS, TABLE, ROW, qk_scale, n, N, chunk,
    s_qb, s_qh, s_qn, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_tr, s_tc,
    HKV: tl.constexpr, G: tl.constexpr, DQ: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
):
    # PAGED: K and V are pools [num_pages, PAGE, Hkv, d] (strides s_kb = page, s_kn = row in page,
    # s_kh, s_kd) and key j of the sequence lies in page TABLE[ROW[0], j // PAGE] at row j % PAGE;
    # ROW[1] is the sequence's length N and the split length is computed from it here, so that
    # neither the row nor the length is a launch argument (a CUDA graph replays for any); B is 1
    i_m = tl.program_id(0)
    i_bk = tl.program_id(1)
    i_s = tl.program_id(2)
    b = (i_bk // HKV).to(tl.int64)
    kv = (i_bk % HKV).to(tl.int64)
    HQ: tl.constexpr = HKV * G

    if PAGED:
        N = tl.load(ROW + 1).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(N, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    rows = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query-major: row = i * G + g
    m_row = rows < n * G
    i = rows // G
    h = kv * G + rows % G  # query head
    # positions clamped to the context (no out-of-bounds read for a bad q_pos); a padded row sees nothing
    pos = tl.minimum(tl.load(QPOS + i, mask=m_row, other=-1).to(tl.int32), N - 1)
    hi = tl.max(pos, axis=0) + 1  # keys [0, hi) are seen by some row of this block: the loop stops there
    # this program's key range: [lo, hi_s); chunk is a multiple of BLOCK_N
    lo = i_s * chunk
    hi_s = tl.minimum(hi, lo + chunk)

    o_dq = tl.arange(0, BLOCK_DQ)
    o_dv = tl.arange(0, BLOCK_DV)
    o_n = tl.arange(0, BLOCK_N)
    m_dq = o_dq < DQ
    m_dv = o_dv < DV
    p_q = Q + b * s_qb + h[:, None] * s_qh + i[:, None].to(tl.int64) * s_qn + o_dq[None, :] * s_qd
    b_q = tl.load(p_q, mask=m_row[:, None] & m_dq[None, :], other=0.0)  # [BLOCK_M, BLOCK_DQ]

    # K is read transposed: [BLOCK_DQ, BLOCK_N]
    p_k = K + b * s_kb + kv * s_kh + lo.to(tl.int64) * s_kn + o_n[None, :] * s_kn + o_dq[:, None] * s_kd
    p_v = V + b * s_vb + kv * s_vh + lo.to(tl.int64) * s_vn + o_n[:, None] * s_vn + o_dv[None, :] * s_vd
    if PAGED:
        p_row = TABLE + tl.load(ROW).to(tl.int64) * s_tr

    # a finite floor, not -inf: a row that sees no key of a block (or a padded row) keeps alpha = 1
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # key j is seen by row r iff j <= pos[r]; every block is masked (see the module docstring)
    for start in range(lo, hi_s, BLOCK_N):
        cols = start + o_n
        if PAGED:
            # each key's page from the table (keys past hi read page 0, masked)
            page = tl.load(p_row + (cols // PAGE).to(tl.int64) * s_tc, mask=cols < hi, other=0).to(tl.int64)
            in_page = (cols % PAGE).to(tl.int64)
            p_k = K + page[None, :] * s_kb + in_page[None, :] * s_kn + kv * s_kh + o_dq[:, None] * s_kd
            p_v = V + page[:, None] * s_vb + in_page[:, None] * s_vn + kv * s_vh + o_dv[None, :] * s_vd
        b_k = tl.load(p_k, mask=m_dq[:, None] & (cols < hi)[None, :], other=0.0)
        s = tl.dot(b_q, b_k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(cols[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        b_v = tl.load(p_v, mask=(cols < hi)[:, None] & m_dv[None, :], other=0.0)
        acc = tl.dot(p.to(b_v.dtype), b_v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
        if not PAGED:
            p_k += BLOCK_N * s_kn
            p_v += BLOCK_N * s_vn

    seen = l_i > 0.0
    b_o = acc / tl.where(seen, l_i, 1.0)[:, None]
    # output row (b, h, i) of a contiguous [B, Hq, n, DV]
    row_id = (b * HQ + h) * n + i.to(tl.int64)
    o_row = row_id * DV
    m_o = m_row[:, None] & m_dv[None, :]
    if SPLIT:
        # partial of split i_s: [S, B, Hq, n, DV] normalized outputs and [S, B, Hq, n] log2-sum-exp2
        n_rows = tl.num_programs(1).to(tl.int64) * G * n  # B * Hq * n
        tl.store(OP + i_s * n_rows * DV + o_row[:, None] + o_dv[None, :], b_o, mask=m_o)
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(LSE + i_s * n_rows + row_id, lse, mask=m_row)
    else:
        tl.store(O + o_row[:, None] + o_dv[None, :], b_o.to(O.dtype.element_ty), mask=m_o)


@triton.jit(do_not_specialize=["n_rows", "n_splits"])
def merge_splits_kernel(
    OP, LSE, O, n_rows, n_splits,
    DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """O[r] = sum_s 2^(lse_s[r] - lse[r]) OP[s, r] over the key splits s, lse = log2 sum_s 2^lse_s."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_dv = tl.arange(0, BLOCK_DV)
    m_r = rows < n_rows
    mask = m_r[:, None] & (o_dv < DV)[None, :]
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for s in range(0, n_splits):
        base = s * n_rows
        lse = tl.load(LSE + base + rows, mask=m_r, other=float("-inf"))
        b_o = tl.load(OP + (base + rows[:, None]) * DV + o_dv[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.math.exp2(m_i - m_new)
        w = tl.math.exp2(lse - m_new)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * b_o
        m_i = m_new
    b_o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(O + rows[:, None] * DV + o_dv[None, :], b_o.to(O.dtype.element_ty), mask=mask)


def _config(dq: int, dv: int, dtype: torch.dtype, rows: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the head dims, the dtype and n * G rows."""
    d = max(triton.next_power_of_2(dq), triton.next_power_of_2(dv))
    if dtype == torch.float32:  # exact fp32 dots (off the engine's path): tiles twice the bytes
        bm, bn, warps, stages = (64, 64, 4, 2) if d <= 64 else (64, 32, 8, 1)
    elif d <= 64:
        bm, bn, warps, stages = 64, 64, 4, 3
    elif d <= 256:
        # d 256, bf16: 128 x 64 tiles beat 64 x 64 and 128 x 32 for both seam/tail queries and long
        # tails. Shared memory: about Q 64 KiB + 2 stages x (K + V) 64 KiB of an H200's 227 KiB;
        # BLOCK_N 128 or a third stage exceeds it.
        bm, bn, warps, stages = 128, 64, 8, 2
    else:
        bm, bn, warps, stages = 64, 32, 8, 1
    # few rows (decode: G rows): a smaller row block, 16 at least (tl.dot)
    bm = min(bm, max(16, triton.next_power_of_2(rows)))
    return bm, bn, warps, stages


MIN_SPLIT_KEYS = 512  # keys per split at least: a split's fixed costs (Q tile, partial store) stay small


def _num_splits(programs: int, N: int, bn: int, device: torch.device) -> int:
    """Key splits so that the launch has about two programs per multiprocessor; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    want = triton.cdiv(2 * _sm_count(device), programs)
    return max(1, min(want, N // max(MIN_SPLIT_KEYS, bn)))


def _check(q, k, v, q_pos) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, tokens, d], got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {q.dtype} is not supported (float16, bfloat16, float32)")
    if k.device != q.device or v.device != q.device or q_pos.device != q.device:
        raise ValueError(
            f"q, k, v and q_pos must be on one device, got {q.device}, {k.device}, {v.device}, {q_pos.device}"
        )
    B, Hq, n, dq = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in [B, Hkv, N]")
    if k.shape[0] != B:
        raise ValueError(f"q has batch {B}, k and v have {k.shape[0]}")
    if k.shape[-1] != dq:
        raise ValueError(f"q's head dim {dq} differs from k's {k.shape[-1]}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"GQA needs Hq % Hkv == 0, got Hq {Hq}, Hkv {Hkv}")
    if q_pos.dim() != 1 or q_pos.shape[0] != n:
        raise ValueError(f"q_pos must be [n] = [{n}] (one position per query), got shape {tuple(q_pos.shape)}")
    if q_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"q_pos must be int32 or int64, got {q_pos.dtype}")
    if n and k.shape[2] == 0:
        raise ValueError("no keys (N = 0) for the live queries to attend to")


def live_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, n, dq], k [B, Hkv, N, dq], v [B, Hkv, N, dv] (any strides), q_pos [n] int (query
    i at absolute position q_pos[i] sees keys 0..q_pos[i]) -> o [B, Hq, n, dv] contiguous, q's dtype.
    `num_splits`: key splits (default: enough to fill the GPU; 1 off CUDA)."""
    _check(q, k, v, q_pos)
    return _launch(q, k, v, q_pos, scale, k.shape[1], k.shape[2], num_splits, *q.stride(), *k.stride(),
                   *v.stride())


def paged_live_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    row: torch.Tensor,
    q_pos: torch.Tensor,
    length: int | None,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """live_attention over one sequence's keys held in pages: q [1, Hq, n, dq], k_pages
    [num_pages, P, Hkv, dq], v_pages [num_pages, P, Hkv, dv], table [R, W] int (the sequence's
    pages in order in table row row[0]; row [2] int64 on the device holds that row and the
    sequence's length N (the keys any query may see: positions past it are clamped to it), read
    by the kernel, so that a CUDA graph replays for any row and length) -> o [1, Hq, n, dv]
    contiguous, q's dtype. No K/V is gathered: each key block reads its page ids from the table.
    `length`: N on the host when known (it sizes the default key splits), else None (splits from
    the program count alone)."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be [1, Hq, n, dq], got {tuple(q.shape)}")
    if k_pages.dim() != 4 or v_pages.shape[:3] != k_pages.shape[:3] or k_pages.shape[-1] != q.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit pages {tuple(k_pages.shape)}, {tuple(v_pages.shape)}")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"q and the pages must share a dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    Hkv = k_pages.shape[2]
    if q.shape[1] % Hkv:
        raise ValueError(f"GQA needs Hq % Hkv == 0, got Hq {q.shape[1]}, Hkv {Hkv}")
    if q_pos.dim() != 1 or q_pos.shape[0] != q.shape[2]:
        raise ValueError(f"q_pos must be [n] = [{q.shape[2]}], got shape {tuple(q_pos.shape)}")
    if row.numel() != 2:
        raise ValueError(f"row must hold the table row and the length (2 values), got {row.numel()}")
    if length is not None and length < 1 and q.shape[2]:
        raise ValueError("no keys (length 0) for the live queries to attend to")
    P = k_pages.shape[1]
    s_kp, s_ks, s_kh, s_kd = k_pages.stride()
    s_vp, s_vs, s_vh, s_vd = v_pages.stride()
    return _launch(q, k_pages, v_pages, q_pos, scale, Hkv, length or 0, num_splits, *q.stride(),
                   s_kp, s_kh, s_ks, s_kd, s_vp, s_vh, s_vs, s_vd, table=table, row=row, page=P)


def _launch(q, k, v, q_pos, scale, Hkv, N, num_splits, *strides, table=None, row=None, page=1):
    """One launch of live_attention_kernel (and the merge of its key splits); strides: q's, k's,
    v's as [B, H, tokens, d] (for pages: page, head, row in page, d)."""
    B, Hq, n, dq = q.shape
    dv = v.shape[-1]
    G = Hq // Hkv
    o = torch.empty(B, Hq, n, dv, dtype=q.dtype, device=q.device)
    if o.numel() == 0:
        return o
    bm, bn, warps, stages = _config(dq, dv, q.dtype, n * G)
    row_blocks = triton.cdiv(n * G, bm)
    paged = table is not None
    if num_splits is None:
        # (a paged launch without a known length: about two programs per multiprocessor, each
        # split at least MIN_SPLIT_KEYS of a long context; the kernel sizes the splits from the length)
        keys = N if N else (1 << 30 if paged else N)
        num_splits = _num_splits(row_blocks * B * Hkv, keys, bn, q.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    chunk = 0
    if N:  # the host knows the length: no empty trailing split (a paged kernel recomputes chunk alike)
        chunk = triton.cdiv(triton.cdiv(N, num_splits), bn) * bn
        num_splits = triton.cdiv(N, chunk)
    split = num_splits > 1
    if split:
        op = torch.empty(num_splits, B, Hq, n, dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, B, Hq, n, dtype=torch.float32, device=q.device)
    else:
        op = lse = o  # unused
    BLOCK_DQ = max(16, triton.next_power_of_2(dq))
    BLOCK_DV = max(16, triton.next_power_of_2(dv))
    live_attention_kernel[(row_blocks, B * Hkv, num_splits)](
        q, k, v, o, op, lse, q_pos if q_pos.is_contiguous() else q_pos.contiguous(),
        table if paged else q_pos, row if paged else q_pos,
        float(scale) * _LOG2E, n, N, chunk,
        *strides, *(table.stride() if paged else (0, 0)),
        HKV=Hkv, G=G, DQ=dq, DV=dv, BLOCK_M=bm, BLOCK_N=bn, BLOCK_DQ=BLOCK_DQ, BLOCK_DV=BLOCK_DV,
        SPLIT=split, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PAGED=paged, PAGE=page,
        num_warps=warps, num_stages=stages,
    )
    if split:
        rows = B * Hq * n
        br = max(1, min(64, 4096 // BLOCK_DV))
        merge_splits_kernel[(triton.cdiv(rows, br),)](
            op, lse, o, rows, num_splits, DV=dv, BLOCK_R=br, BLOCK_DV=BLOCK_DV, num_warps=4,
        )
    return o


__all__ = ["live_attention", "live_attention_kernel", "merge_splits_kernel", "paged_live_attention"]
