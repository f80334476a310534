"""Bulk-tensor transports, picked by where the two ends are (docs/architecture.md), imported lazily.

| the two ends | transport |
|---|---|
| one host, one IPC and PID namespace, entries on a GPU the receiver can see | `cuda_ipc` (device to device) |
| one host, one IPC namespace (a shared /dev/shm) | `shm` |
| anything else, and the fallback | `grpc` (bytes inline in the stream) |

Each process describes itself as an Endpoint (local_endpoint); the receiver sends its own with
the request and the sender, which knows where its tensors are, picks (choose_transport).
"""

from __future__ import annotations

import functools
import importlib
import os
import uuid
from dataclasses import dataclass

from hybridcache.services.transport.base import TensorTransport, TransportError

_REGISTRY = {
    "grpc": ("hybridcache.services.transport.grpc_stream", "GrpcStreamTransport"),
    "shm": ("hybridcache.services.transport.shm", "ShmTransport"),
    "cuda_ipc": ("hybridcache.services.transport.cuda_ipc", "CudaIpcTransport"),
}
TRANSPORTS = tuple(_REGISTRY)


def get_transport(name: str, **kwargs) -> TensorTransport:
    if name not in _REGISTRY:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0] if ":" in address else address


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def transport_for_address(peer_address: str) -> str:
    """The guess when only the peer's address is known (the cache tier, whose Endpoint nobody
    asks): shared memory when the peer is on loopback, the gRPC stream otherwise (another host,
    or another pod: pods share /dev/shm only with hostIPC)."""
    return "shm" if host_of(peer_address) in LOOPBACK else "grpc"


@dataclass(frozen=True)
class Endpoint:
    """Where a process runs, as far as moving tensors to or from it is concerned."""

    host: str = ""  # the kernel's boot id: the same in every process and container of one host
    ipc_ns: str = ""  # its IPC namespace: shared between pods only with hostIPC
    pid_ns: str = ""  # its PID namespace: shared between pods only with hostPID
    device: str = ""  # UUID of the GPU holding its tensors; "" on the CPU
    gpus: tuple[str, ...] = ()  # UUIDs of the GPUs it can open memory on
    process: str = ""  # a random id of the process: a sender's arena is exported once per receiver

    def to_pb(self, msg) -> None:
        msg.host, msg.ipc_ns, msg.pid_ns, msg.device = self.host, self.ipc_ns, self.pid_ns, self.device
        msg.gpus[:] = list(self.gpus)
        msg.process = self.process

    def to_msg(self):
        """This Endpoint as a new pb.Endpoint."""
        from hybridcache.services.protocol import pb

        msg = pb.Endpoint()
        self.to_pb(msg)
        return msg

    @classmethod
    def from_pb(cls, msg) -> Endpoint:
        return cls(msg.host, msg.ipc_ns, msg.pid_ns, msg.device, tuple(msg.gpus), msg.process)

    def same_gpu(self, other: Endpoint) -> bool:
        """Do the two hold their tensors on one GPU of one host (known UUIDs and boot id)?"""
        return bool(self.host and self.device) and (self.host, self.device) == (other.host, other.device)


PROCESS_ID = uuid.uuid4().hex  # this process's Endpoint.process


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


@functools.cache
def _host_identity() -> tuple[str, str, str]:
    return (_read("/proc/sys/kernel/random/boot_id"), _link("/proc/self/ns/ipc"), _link("/proc/self/ns/pid"))


def local_endpoint(device=None) -> Endpoint:
    """This process's Endpoint, its tensors on `device` (a torch device; None or cpu: the host,
    and then it opens no GPU memory either: entries it receives land in host memory)."""
    host, ipc, pid = _host_identity()
    dev, gpus = "", ()
    if device is not None and str(device).startswith("cuda"):
        import torch
        from hybridcache.services.transport.cuda_ipc import device_uuid, visible_gpus

        d = torch.device(device)
        dev = device_uuid(d.index if d.index is not None else torch.cuda.current_device())
        gpus = visible_gpus()
    return Endpoint(host, ipc, pid, dev, gpus, PROCESS_ID)


def choose_transport(sender: Endpoint, receiver: Endpoint) -> str:
    """The transport from `sender` to `receiver`: cuda_ipc when they share a host, an IPC and a PID
    namespace and the sender's tensors are on a GPU the receiver can see; shm on one host and IPC
    namespace; grpc otherwise. An unknown identity ("") never counts as shared."""
    same_host = bool(sender.host) and sender.host == receiver.host
    same_ipc = same_host and bool(sender.ipc_ns) and sender.ipc_ns == receiver.ipc_ns
    same_pid = same_ipc and bool(sender.pid_ns) and sender.pid_ns == receiver.pid_ns
    if same_pid and sender.device and sender.device in receiver.gpus:
        return "cuda_ipc"
    return "shm" if same_ipc else "grpc"


def measure_bandwidths(device=None) -> dict[str, float]:
    """Bytes/s of the receiving end's part of each entry path it can take, measured now (a
    combine worker does at start-up and reports them to the router): shm always, cuda_ipc on a
    CUDA device. Paths that could not be measured are left out."""
    from hybridcache.services.transport import shm

    out = {"shm": shm.measure_bandwidth()}
    if device is not None and str(device).startswith("cuda"):
        from hybridcache.services.transport import cuda_ipc

        out["cuda_ipc"] = cuda_ipc.measure_bandwidth(device)
    return {k: v for k, v in out.items() if v > 0}


__all__ = ["TRANSPORTS", "Endpoint", "TensorTransport", "TransportError", "choose_transport", "get_transport",
           "host_of", "local_endpoint", "measure_bandwidths", "transport_for_address"]
