"""Bulk-tensor transports, picked by where the two ends are (DESIGN §5), imported lazily."""

from __future__ import annotations

import importlib

from hybridcache.services.transport.base import TensorTransport, TransportError

_REGISTRY = {
    "grpc": ("hybridcache.services.transport.grpc_stream", "GrpcStreamTransport"),
    "shm": ("hybridcache.services.transport.shm", "ShmTransport"),
    # point-to-point in a torch.distributed group (NCCL between GPUs); takes dst=<rank>
    "collective": ("hybridcache.services.transport.collective", "CollectiveTransport"),
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


def choose_transport(peer_address: str) -> str:
    """Shared memory when the peer is on this host (loopback), the gRPC stream otherwise (another
    host, or another pod: pods do not share /dev/shm)."""
    return "shm" if host_of(peer_address) in LOOPBACK else "grpc"


__all__ = ["TRANSPORTS", "TensorTransport", "TransportError", "choose_transport", "get_transport", "host_of"]
