"""gRPC protocol of the services: hybridcache.proto and its generated modules (checked in)."""

from hybridcache.services.protocol import hybridcache_pb2 as pb
from hybridcache.services.protocol import hybridcache_pb2_grpc as rpc

__all__ = ["pb", "rpc"]
