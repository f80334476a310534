"""Tensor bytes through POSIX shared memory (tmpfs /dev/shm): processes of one host.

The sender writes one block per tensor and sends only its name; the receiver copies the bytes
out and unlinks the block, so gRPC carries a few hundred bytes of metadata per tensor. Blocks
are plain files under /dev/shm (no resource tracker that would unlink them behind the receiver).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch
from hybridcache.services.transport.base import TensorTransport, TransportError

SHM_DIR = Path(os.environ.get("HYBRIDCACHE_SHM_DIR", "/dev/shm"))
PREFIX = "hybridcache-"


class ShmTransport(TensorTransport):
    name = "shm"

    def __init__(self):
        self._moved = 0

    def write(self, chunk, tensor: torch.Tensor) -> None:
        c = tensor.detach().contiguous().cpu()
        n = c.numel() * c.element_size()
        if n == 0:
            chunk.data = b""
            return
        name = f"{PREFIX}{uuid.uuid4().hex}"
        # readable by this user alone (the receiver runs as the same user): a new file, never one there
        fd = os.open(SHM_DIR / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(c.view(torch.uint8).reshape(-1).numpy()))
        chunk.shm_name = name
        chunk.shm_offset = 0
        self._moved += n

    def bytes_moved(self) -> int:
        return self._moved


def read_shm(name: str, offset: int, nbytes: int) -> bytearray:
    """Copy a block's bytes out and unlink it (each block is read exactly once)."""
    if not name.startswith(PREFIX) or "/" in name:
        raise TransportError(f"bad shared-memory block name {name!r}")
    path = SHM_DIR / name
    try:
        raw = bytearray(nbytes)
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            got = f.readinto(raw)
    except FileNotFoundError:
        raise TransportError(f"shared-memory block {name} is gone") from None
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    if got != nbytes:
        raise TransportError(f"shared-memory block {name} is shorter than {offset + nbytes} bytes")
    return raw


def sweep_stale(max_age_s: float = 300.0) -> int:
    """Unlink blocks nobody read within max_age_s (their receiver died); returns how many."""
    import time

    removed, now = 0, time.time()
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            if now - path.stat().st_mtime > max_age_s:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def measure_bandwidth(nbytes: int = 8 << 20) -> float:
    """Bytes/s of one block through /dev/shm as the two ends move it (written, read back and
    unlinked), measured here; 0.0 when /dev/shm cannot be written."""
    import time

    t = torch.ones(nbytes, dtype=torch.uint8)
    chunk = type("Chunk", (), {})()
    transport = ShmTransport()
    try:
        t0 = time.perf_counter()
        transport.write(chunk, t)
        read_shm(chunk.shm_name, chunk.shm_offset, nbytes)
        return nbytes / (time.perf_counter() - t0)
    except (OSError, TransportError):
        return 0.0
