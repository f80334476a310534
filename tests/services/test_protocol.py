"""The internal gRPC messages carry segments' token ids packed: exact round trips, clear errors."""

from __future__ import annotations

import random
import sys

import pytest
from hybridcache.services.protocol import pack_ids, pb, segment, segment_ids, unpack_ids


def test_packed_ids_round_trip_through_the_wire():
    rng = random.Random(0)
    ids = [0, 1, 2**31 - 1, -1] + [rng.randrange(300_000) for _ in range(4099)]
    seg = pb.Segment.FromString(segment(7, ids, cache_tier="tier-a", live=True).SerializeToString())
    assert segment_ids(seg) == ids and seg.index == 7 and seg.cache_tier == "tier-a" and seg.live
    assert len(seg.ids) == 4 * len(ids)
    assert segment_ids(segment(0, [])) == []


def test_packed_ids_are_little_endian_int32():
    assert pack_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert unpack_ids(b"\xff\xff\xff\x7f") == [2**31 - 1]
    assert sys.byteorder == "little" or unpack_ids(pack_ids([5])) == [5]


def test_ids_outside_int32_and_torn_bytes_are_errors():
    with pytest.raises(OverflowError):
        pack_ids([2**31])
    with pytest.raises(ValueError, match="not a multiple of 4"):
        unpack_ids(b"\x01\x00\x00")


def test_a_segment_of_the_old_layout_carries_no_ids():
    """Field 2 (repeated int32 token ids) is reserved: bytes a peer of that layout sends are an
    unknown field here, so its segment reads as empty (a request error), never as other ids."""
    old_field_2 = bytes([0x12, 3, 5, 6, 7])  # field 2, length-delimited, packed varints 5, 6, 7
    seg = pb.Segment.FromString(bytes([0x08, 1]) + old_field_2)
    assert seg.index == 1 and segment_ids(seg) == []


def test_a_segment_reads_as_an_int32_array_and_int64_ids_narrow_to_its_bytes():
    import numpy as np
    from hybridcache.services.protocol import narrow_ids, segment_array
    from hybridcache.services.runtime.plan import packed_ids

    ids = [0, 5, 2**31 - 1, 151_000]
    arr = segment_array(pb.Segment.FromString(segment(3, ids).SerializeToString()))
    assert arr.dtype == np.dtype("<i4") and arr.tolist() == ids
    assert narrow_ids(packed_ids(ids)) == pack_ids(ids)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        segment_array(pb.Segment(index=0, ids=b"\x01\x00"))
