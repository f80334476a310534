"""Checksums computed where the bytes are (on the GPU for device transports): the three sums of
kernels/ops/checksum (the buffer read as 32-bit words in rows of ROW words), no copy to the host.

"blk64:<s1>:<s2>:<s3>": s1 the sum of all words, s2 the row sums weighted by row number, s3 the
column sums weighted by column number (the tail past the last full row counts as one more row).
Every changed word changes s1; a swap of two words changes s2 or s3. Sums are int64 and wrap on
overflow, which addition does the same way in any order, so a CPU and a GPU, or two GPUs, agree.
On CUDA the sums come from one Triton pass over the buffer (copy_checksum also writes the copy in
that pass); elsewhere from the reference.
"""

from __future__ import annotations

import functools

import torch
from hybridcache.kernels.ops.checksum import naive
from hybridcache.kernels.ops.checksum.naive import ROW

__all__ = ["ROW", "checksum_text", "copy_with_checksum", "device_checksum", "device_checksum_sums", "warm"]


def _fast(t: torch.Tensor) -> bool:
    from hybridcache.services.runtime.backends import use_fast_kernels

    return use_fast_kernels(t)


def device_checksum_sums(buf: torch.Tensor) -> torch.Tensor:
    """The three sums as an int64 tensor [3] on buf's device, not synchronised: callers copy it to
    the host when they need the text (checksum_text), so the reductions can queue behind other work."""
    if _fast(buf):
        from hybridcache.kernels.ops.checksum.triton import checksum_sums

        return checksum_sums(buf.detach().reshape(-1).view(torch.uint8) if buf.is_contiguous() else buf)
    return naive.checksum_sums(buf)


def copy_with_checksum(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst <- src (uint8 buffers of one length) and device_checksum_sums of the copy: on CUDA one
    pass over the bytes (kernels/ops/checksum/triton.py), not a copy and two reductions."""
    if not _fast(dst):
        return naive.copy_checksum(src, dst)
    if src.device != dst.device:  # another GPU's memory: the driver's peer copy, then one read
        dst.copy_(src)
        return device_checksum_sums(dst)
    from hybridcache.kernels.ops.checksum.triton import copy_checksum

    return copy_checksum(src, dst)


def checksum_text(sums) -> str:
    s1, s2, s3 = (int(x) for x in (sums.tolist() if isinstance(sums, torch.Tensor) else sums))
    return f"blk64:{s1}:{s2}:{s3}"


def device_checksum(buf: torch.Tensor) -> str:
    """The checksum of buf's bytes, computed on its device (synchronises on the result)."""
    return checksum_text(device_checksum_sums(buf))


@functools.cache
def warm(device) -> bool:
    """Compile the checksum kernels for `device` now (once per device and process): a sender's
    arena and a receiver's assembler call it before their first transfer, which would otherwise
    wait for Triton's compilation (about a second) while the other side ran out of arena slots.
    Returns whether there was anything to compile (CUDA)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    buf = torch.zeros(4 * ROW + 4, dtype=torch.uint8, device=dev)
    copy_with_checksum(buf, torch.empty_like(buf))
    device_checksum_sums(buf)
    torch.cuda.synchronize(dev)
    return True
