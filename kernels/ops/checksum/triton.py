"""Copy a byte buffer and checksum the copy in one pass (reference: naive.py).

The reference's copy reads and writes the buffer, and its sums read it twice more (row sums, then
column sums: a strided reduction), in about a dozen launches. Here one program takes one row of
ROW words: it loads them once, stores them to the destination and reduces them to the row's three
partial sums (s1, s1 * (row + 1), sum of word * (column + 1)) in int64; a second launch adds the
rows' partials. Integer sums wrap as the reference's do, so the result is the reference's exactly.
A buffer whose length is no multiple of 4 bytes goes to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hybridcache.kernels.ops.checksum import naive
from hybridcache.kernels.ops.checksum.naive import ROW


@triton.jit(do_not_specialize=["n_words"])
def copy_checksum_kernel(src, dst, part, n_words, ROW: tl.constexpr, COPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, ROW)
    offs = row * ROW + col
    m = offs < n_words
    w = tl.load(src + offs, mask=m, other=0)
    if COPY:
        tl.store(dst + offs, w, mask=m)
    w64 = w.to(tl.int64)
    s1 = tl.sum(w64, axis=0)
    s3 = tl.sum(w64 * (col.to(tl.int64) + 1), axis=0)
    tl.store(part + row * 3, s1)
    tl.store(part + row * 3 + 1, s1 * (row + 1))
    tl.store(part + row * 3 + 2, s3)


def _launch(src_words: torch.Tensor, dst_words: torch.Tensor | None) -> torch.Tensor:
    n = src_words.numel()
    rows = triton.cdiv(n, ROW)
    part = torch.empty(rows, 3, dtype=torch.int64, device=src_words.device)
    copy_checksum_kernel[(rows,)](src_words, dst_words if dst_words is not None else src_words, part, n,
                                  ROW=ROW, COPY=dst_words is not None, num_warps=8)
    return part.sum(0)


def copy_checksum(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst <- src (contiguous uint8 buffers of one length on one device), and the checksum sums of
    the copy (naive.checksum_sums' values, int64 [3] on the device, not synchronised)."""
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"copy_checksum takes two uint8 buffers of one length, got {src.dtype}{tuple(src.shape)} "
                         f"and {dst.dtype}{tuple(dst.shape)}")
    if not (src.is_contiguous() and dst.is_contiguous()) or src.numel() % 4 or src.numel() == 0:
        return naive.copy_checksum(src, dst)
    return _launch(src.view(torch.int32), dst.view(torch.int32))


def checksum_sums(buf: torch.Tensor) -> torch.Tensor:
    """naive.checksum_sums of a contiguous uint8 buffer in one read (the reference for other buffers)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.numel() % 4 or buf.numel() == 0:
        return naive.checksum_sums(buf)
    return _launch(buf.view(torch.int32), None)


__all__ = ["checksum_sums", "copy_checksum", "copy_checksum_kernel"]
