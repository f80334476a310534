"""Checksums computed where the bytes are (on the GPU for device transports): two reductions over
the buffer read as 32-bit words laid out in rows of ROW words, no copy to the host.

"blk64:<s1>:<s2>:<s3>": s1 the sum of all words, s2 the row sums weighted by row number, s3 the
column sums weighted by column number (the tail past the last full row counts as one more row).
Every changed word changes s1; a swap of two words changes s2 or s3. Sums are int64 and wrap on
overflow, which addition does the same way in any order, so a CPU and a GPU, or two GPUs, agree.
"""

from __future__ import annotations

import torch

ROW = 4096  # words per row


def _words(buf: torch.Tensor) -> torch.Tensor:
    b = buf.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        b = torch.cat([b, b.new_zeros(4 - b.numel() % 4)])
    return b.view(torch.int32)


def device_checksum_sums(buf: torch.Tensor) -> torch.Tensor:
    """The three sums as an int64 tensor [3] on buf's device, not synchronised: callers copy it to
    the host when they need the text (checksum_text), so the reductions can queue behind other work."""
    w = _words(buf)
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


def checksum_text(sums) -> str:
    s1, s2, s3 = (int(x) for x in (sums.tolist() if isinstance(sums, torch.Tensor) else sums))
    return f"blk64:{s1}:{s2}:{s3}"


def device_checksum(buf: torch.Tensor) -> str:
    """The checksum of buf's bytes, computed on its device (synchronises on the result)."""
    return checksum_text(device_checksum_sums(buf))
