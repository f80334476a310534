"""Tensors over a torch.distributed group (DESIGN §5): NCCL between GPUs of one host (NVLink),
gloo between processes. Metadata still travels as TensorChunk messages (over gRPC, a queue, ...);
each chunk names the sending rank, and its bytes follow as one point-to-point message, in chunk
order. Nothing is copied to the host: per-tensor checksums are computed on the device at both
ends (a Fletcher-style pair of sums over the bytes), so the entry needs no host-side sha256.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hybridcache.services.transport.base import TensorTransport, TransportError


def device_checksum(t: torch.Tensor) -> str:
    """'fl64:<s1>:<s2>' with s1 = sum of the bytes, s2 = sum of (n - i) * byte_i, on t's device."""
    b = t.detach().contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
    n = b.numel()
    if n == 0:
        return "fl64:0:0"
    weights = torch.arange(n, 0, -1, dtype=torch.int64, device=b.device)
    s1, s2 = torch.stack([b.sum(), (b * weights).sum()]).tolist()
    return f"fl64:{s1}:{s2}"


class CollectiveTransport(TensorTransport):
    """Sends each tensor to rank `dst` of the default process group. One instance per stream;
    close() waits for the sends (the receiver owns the bytes then)."""

    name = "collective"
    device_native = True  # the codec keeps tensors on their device and uses device_checksum

    def __init__(self, dst: int):
        if not dist.is_initialized():
            raise TransportError("the collective transport needs an initialised torch.distributed group")
        self.dst = dst
        self._pending: list[tuple[object, torch.Tensor]] = []
        self._bytes = 0

    def write(self, chunk, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous()
        chunk.collective_src = dist.get_rank() + 1
        self._pending.append((dist.isend(t, dst=self.dst), t))  # keep t alive until sent
        self._bytes += t.numel() * t.element_size()

    def close(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def bytes_moved(self) -> int:
        return self._bytes


def receive_tensor(chunk, dtype: torch.dtype, device) -> torch.Tensor:
    """The tensor a collective TensorChunk announces, received from its sender and verified."""
    t = torch.empty(tuple(chunk.shape), dtype=dtype, device=device)
    dist.recv(t, src=chunk.collective_src - 1)
    if device_checksum(t) != chunk.checksum:
        raise TransportError(f"layer {chunk.layer} {chunk.name}: checksum mismatch")
    return t
