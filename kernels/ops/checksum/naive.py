"""Reference checksum sums of a byte buffer read as 32-bit words laid out in rows of ROW words.

    s1 = sum of all words
    s2 = sum over words of word * (row + 1)      (row = word index // ROW)
    s3 = sum over words of word * (column + 1)   (column = word index % ROW)

The tail past the last full row counts as one more row. Sums are int64 and wrap on overflow, which
addition does the same way in any order, so a CPU and a GPU, or two GPUs, agree. Every changed
word changes s1; a swap of two words changes s2 or s3. A buffer whose length is no multiple of 4
bytes is zero-padded to one.
"""

from __future__ import annotations

import torch

ROW = 4096  # words per row


def words(buf: torch.Tensor) -> torch.Tensor:
    """buf's bytes as int32 words (zero-padded to a multiple of 4 bytes)."""
    b = buf.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        b = torch.cat([b, b.new_zeros(4 - b.numel() % 4)])
    return b.view(torch.int32)


def checksum_sums(buf: torch.Tensor) -> torch.Tensor:
    """(s1, s2, s3) as an int64 tensor [3] on buf's device, not synchronised: row sums and column
    sums of the full rows, weighted, plus the tail's."""
    w = words(buf)
    n = w.numel()
    full = n // ROW * ROW
    main, tail = w[:full].view(-1, ROW), w[full:]
    dev = w.device
    rows = main.sum(1, dtype=torch.int64)
    cols = main.sum(0, dtype=torch.int64) if full else torch.zeros(ROW, dtype=torch.int64, device=dev)
    r_w = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=dev)
    c_w = torch.arange(1, ROW + 1, dtype=torch.int64, device=dev)
    t = tail.to(torch.int64)
    s1 = rows.sum() + t.sum()
    s2 = (rows * r_w).sum() + t.sum() * (rows.numel() + 1)
    s3 = (cols * c_w).sum() + (t * c_w[: t.numel()]).sum()
    return torch.stack([s1, s2, s3])


def copy_checksum(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst <- src (uint8 buffers of one length), and checksum_sums of the copy."""
    dst.copy_(src)
    return checksum_sums(dst)
