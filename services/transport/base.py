"""The bulk-tensor transport interface (docs/architecture.md): where a tensor's bytes travel.

Entries move as a stream of TensorChunk messages (dtype, shape, layer, checksum per tensor). A
transport decides where the bytes go: inline in the message (gRPC stream, any two hosts) or into
a block both ends can map (shared memory, processes of one host). Readers accept every kind, so
the sender alone picks the path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class TransportError(RuntimeError):
    """Bytes could not be moved or read back (missing block, short read, checksum mismatch).
    `unreachable`: the bytes could not be reached at all from here (a GPU this process cannot see,
    a CUDA IPC handle it cannot open), as opposed to bytes that arrived wrong."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


class TensorTransport(ABC):
    """Writes tensors for one message stream. Not thread-safe: one instance per stream."""

    name: str = ""

    @abstractmethod
    def write(self, chunk, tensor: torch.Tensor) -> None:
        """Put `tensor`'s bytes where the receiver will find them and fill chunk's location fields
        (data, or shm_name/shm_offset). Does not modify `tensor`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release sender-side resources once the stream is finished (the receiver owns the bytes then)."""

    @abstractmethod
    def bytes_moved(self) -> int:
        """Bytes written so far."""
