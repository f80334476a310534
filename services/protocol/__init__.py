"""gRPC protocol of the services: hybridcache.proto and its generated modules (checked in).

A Segment carries its token ids packed (little-endian int32 bytes): tens of thousands of ids
cross the router, combine and scatter workers per request, and packing them in C costs
microseconds where a repeated field built and read element by element costs milliseconds.
"""

from __future__ import annotations

import array
import sys

import numpy as np
from hybridcache.services.protocol import hybridcache_pb2 as pb
from hybridcache.services.protocol import hybridcache_pb2_grpc as rpc

__all__ = ["pb", "rpc", "pack_ids", "unpack_ids", "segment", "segment_ids", "segment_array", "narrow_ids"]

_INT32 = next(code for code in "ilh" if array.array(code).itemsize == 4)


def pack_ids(token_ids) -> bytes:
    """Token ids (each in int32 range) as little-endian int32 bytes; OverflowError outside it."""
    a = array.array(_INT32, token_ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    """The ids pack_ids packed; ValueError on a length that is not a multiple of 4."""
    if len(data) % 4:
        raise ValueError(f"packed token ids of {len(data)} bytes: not a multiple of 4")
    a = array.array(_INT32)
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def segment(index: int, token_ids, **fields) -> pb.Segment:
    """A Segment of these token ids (fields: cache_tier, live)."""
    return pb.Segment(index=index, ids=pack_ids(token_ids), **fields)


def segment_ids(seg: pb.Segment) -> list[int]:
    """A Segment's token ids."""
    return unpack_ids(seg.ids)


def segment_array(seg: pb.Segment) -> np.ndarray:
    """A Segment's token ids as an int32 numpy array over its bytes (no copy); ValueError on a
    length that is not a multiple of 4."""
    if len(seg.ids) % 4:
        raise ValueError(f"packed token ids of {len(seg.ids)} bytes: not a multiple of 4")
    return np.frombuffer(seg.ids, dtype="<i4")


def narrow_ids(packed64: bytes) -> bytes:
    """Little-endian int64 ids (plan.packed_ids' bytes, each id in int32 range) as pack_ids packs them."""
    return np.frombuffer(packed64, dtype="<i8").astype("<i4").tobytes()
