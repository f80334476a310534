"""Several tensors in one uint8 buffer, each starting at a 16-byte boundary: one transfer (an
CUDA IPC export, a host-to-device copy) instead of one per tensor, and views to read them back.
Used by the cuda_ipc transport (services/transport/cuda_ipc.py) and the host entry tier
(cache/host_tier.py)."""

from __future__ import annotations

import math

import torch

ALIGN = 16  # bytes: every tensor of a packed buffer starts at a multiple of this


def nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(tensors, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' bytes back to back in one uint8 buffer, each padded to ALIGN bytes: one transfer
    instead of one per tensor (per-tensor transfers cost a launch, a handle or a wait each). With
    `out` (a contiguous uint8 tensor of exactly that size, e.g. a slot of a preallocated buffer)
    the bytes are written there."""
    parts = []
    for t in tensors:
        b = t.contiguous().reshape(-1).view(torch.uint8)
        parts.append(b)
        pad = padded(b.numel()) - b.numel()
        if pad:
            parts.append(b.new_zeros(pad))
    if out is None:
        return torch.cat(parts)
    return torch.cat(parts, out=out)


def unpack_views(buf: torch.Tensor, specs) -> list[torch.Tensor]:
    """Views of `buf` (filled by pack of tensors with these (shape, dtype) specs) as those tensors."""
    need = packed_bytes(specs)
    if need != buf.numel():
        raise ValueError(f"packed buffer holds {buf.numel()} bytes, the specs need {need}")
    out, off = [], 0
    for shape, dtype in specs:
        n = nbytes(shape, dtype)
        out.append(buf[off : off + n].view(dtype).view(shape))
        off += padded(n)
    return out


def packed_bytes(specs) -> int:
    return sum(padded(nbytes(shape, dtype)) for shape, dtype in specs)
