"""Decode attention over paged K/V: one new query token per request, its keys and values in
fixed-size pages of a pool that a block table names, with GQA.

    o[b, h] = softmax_j(scale * q[b, h] . K_b[j, h // G],  j < lengths[b]) @ V_b[:, h // G]

where request b's key j lies in page table[rows[b], j // P] at row j % P of the pools
k_pages [num_pages, P, Hkv, dq] and v_pages [num_pages, P, Hkv, dv]. G = Hq // Hkv query heads
share a KV head (query head h reads KV head h // G).

Two implementations with one contract:

`paged_decode_reference` (the CPU path and the reference of the kernel's tests): the pages of each
request gathered into a padded [B, Hkv, max_pages * P, d] batch (one gather per tensor for the
whole batch), SDPA under a key mask, the G query heads of a KV head as its query rows. The gather
copies the context once per layer and step; on the CPU that is what the math costs anyway.

`paged_decode_attention` (CUDA): a Triton kernel that reads the pages where they lie through the
block table, so no K/V is copied, with a flash-decoding split of each request's keys over programs
so that one request with a long context still fills the GPU, and a merge kernel: two launches a
layer whatever the batch size and context lengths. Why a kernel of our own rather than torch's:
SDPA takes contiguous (or padded) K/V only, which is the per-step copy this replaces; flex_attention
can express a block-table mask but compiles per shape through torch.compile (a new compile when
the batch size or page count changes, and its decode path still wants the pages as one logical
[B, H, N, d] tensor with a block mask built per step). The kernel's launch configuration depends
only on the head dims, dtype, G and the split count (a function of B and Hkv, see `num_splits`),
never on the lengths, which it reads on the device: a CUDA graph captured once per batch size
replays for any context lengths.

Prefill over paged K/V (a chunk of a long prompt, the live tokens of an assembly): the n live
queries of one sequence at absolute positions q_pos see keys 0..q_pos[i] of that sequence, held
in the pages of its table row. `sequence_keys` gathers them (the reference and the CPU path,
then `naive.live_attention` / SDPA); on CUDA `triton.paged_live_attention` reads them where they
lie, as the decode kernel does, so a long prompt's chunk copies no context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_pages(pages: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, max_pages: int) -> torch.Tensor:
    """The first max_pages pages of each request as one padded batch: pages [num_pages, P, H, d],
    table [R, W], rows [B] -> [B, H, max_pages * P, d] (a strided view of one gather)."""
    idx = table.index_select(0, rows)[:, :max_pages].long()  # [B, max_pages]
    g = pages[idx]  # [B, max_pages, P, H, d]
    B, n, P, H, d = g.shape
    return g.reshape(B, n * P, H, d).transpose(1, 2)


def sequence_keys(pages: torch.Tensor, table: torch.Tensor, row, length: int) -> torch.Tensor:
    """The first `length` keys (or values) of the sequence in table row `row` (an int, or a device
    tensor whose first element is the row): pages [num_pages, P, H, d] -> [1, H, length, d] (a
    strided view of one gather)."""
    P = pages.shape[1]
    n = -(-length // P)
    ids = (table[row, :n] if isinstance(row, int) else table.index_select(0, row.reshape(-1)[:1].long())[0, :n]).long()
    g = pages[ids].reshape(n * P, *pages.shape[2:])[:length]  # [length, H, d]
    return g.transpose(0, 1)[None]


def paged_prefill_reference(q, k_pages, v_pages, table, row, q_pos, length: int, scale: float):
    """Live queries q [1, Hq, n, dq] at positions q_pos [n] over the first `length` keys of table
    row `row` (sequence_keys' row; module docstring) -> [1, Hq, n, dv] in q's dtype, fp32 math
    (naive.live_attention)."""
    from hybridcache.kernels.ops.attention.naive import live_attention

    return live_attention(q, sequence_keys(k_pages, table, row, length), sequence_keys(v_pages, table, row, length),
                          q_pos, scale)


def paged_decode_reference(q, k_pages, v_pages, table, rows, lengths, scale: float, max_pages: int):
    """q [B, Hq, dq] -> o [B, Hq, dv] in q's dtype (module docstring); max_pages: pages gathered per
    request, at least ceil(max(lengths) / P) (a host integer: reading lengths would sync). Keys past a
    request's length are masked and their values zeroed (a page's unwritten rows may hold anything)."""
    B, Hq, dq = q.shape
    P, Hkv = k_pages.shape[1], k_pages.shape[2]
    K = gather_pages(k_pages, table, rows, max_pages)
    V = gather_pages(v_pages, table, rows, max_pages)
    valid = torch.arange(max_pages * P, device=q.device)[None, :] < lengths.long()[:, None]  # [B, N]
    mask = valid[:, None, None]  # [B, 1, 1, N]
    V = torch.where(mask.transpose(2, 3), V, V.new_zeros(()))
    qb = q.reshape(B, Hkv, Hq // Hkv, dq)  # the query heads of KV head kv are its rows
    o = F.scaled_dot_product_attention(qb, K.to(q.dtype), V.to(q.dtype), attn_mask=mask, scale=scale)
    # contiguous [B, Hq, dv] as the kernel's (SDPA's output strides depend on B, and so would the
    # copies of the caller's reshapes)
    return o.clone(memory_format=torch.contiguous_format).view(B, Hq, -1)


def num_splits(batch: int, kv_heads: int, device) -> int:
    """Key splits of the kernel's launch: about two programs per multiprocessor over B * Hkv
    (batch, KV head) pairs, at most 32; a function of the batch size and heads only, so a graph
    captured for a batch size serves every context length. 1 off CUDA."""
    if torch.device(device).type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(32, -(-2 * sms // (batch * kv_heads))))


def paged_decode_attention(q, k_pages, v_pages, table, rows, lengths, scale: float, splits: int | None = None,
                           gate=None, q_rope=None):
    """The Triton kernel of the module docstring: q [B, Hq, dq], pools [num_pages, P, Hkv, d],
    table [R, W] int32/int64, rows [B], lengths [B] (each >= 1) -> o [B, Hq, dv] in q's dtype
    (times sigmoid(gate [B, Hq, dv]) where a gate is given; q raw heads normalized and rotated in
    the kernel where q_rope is given, paged_triton.paged_decode)."""
    from hybridcache.kernels.ops.attention.paged_triton import paged_decode

    return paged_decode(q, k_pages, v_pages, table, rows, lengths, scale, splits, gate, q_rope)


__all__ = ["gather_pages", "num_splits", "paged_decode_attention", "paged_decode_reference", "paged_prefill_reference",
           "sequence_keys"]
