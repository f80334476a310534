"""Segment entries of a tensor-parallel worker as they travel: every rank's slice in one entry.

Each rank of a worker split over N ranks builds its slice of an entry: T, S and the conv tail of
its linear heads, K/V of its key/value heads, all [1, ...] tensors of equal shapes on every
rank. Between processes (a scatter worker's stream, the cache tier) such an entry travels as one
*bundle*: each tensor the N slices' tensors concatenated along the leading dim, rank order, so
[N, ...]. A bundle is a SegmentEntry like any other: the codec streams and seals it, the tier
stores it, under the key of its tensor-parallel size (plan.Planner.entry_tag carries `tp=N`, so
a consumer split otherwise never finds it: a miss). `unbundle` cuts it back into the N slices,
each marked with its rank's layout (`meta["tensor_parallel"]`, what Engine.prefill requires).
"""

from __future__ import annotations

import torch
from hybridcache.services.runtime.cache import SegmentEntry
from hybridcache.services.runtime.sequence import AttnSpan, LinearSpan, SpanData

LINEAR, ATTN = ("T", "S", "conv_tail"), ("k", "v")


def _map(data: SpanData, fn) -> SpanData:
    """data with fn(tensors of one field) applied per field: fn takes and returns a tensor."""
    linear = {i: LinearSpan(fn(s.T), fn(s.S), fn(s.conv_tail)) for i, s in data.linear.items()}
    attn = {i: AttnSpan(fn(a.k), fn(a.v)) for i, a in data.attn.items()}
    return SpanData(data.num_tokens, data.local_start, linear, attn)


def bundle(slices: list[SegmentEntry]) -> SegmentEntry:
    """One entry of the ranks' slices of a segment (slices[r]: rank r's, on one device): each
    tensor the slices' [1, ...] tensors concatenated along dim 0. ValueError when the slices are
    not of one segment and layout."""
    first = slices[0]
    for r, s in enumerate(slices):
        if (s.key, s.segment_tokens, set(s.data.linear), set(s.data.attn)) != (
                first.key, first.segment_tokens, set(first.data.linear), set(first.data.attn)):
            raise ValueError(f"rank {r}'s slice is not of entry {first.key[:12]}")
    d = first.data
    linear = {i: LinearSpan(*(torch.cat([getattr(s.data.linear[i], f) for s in slices]) for f in LINEAR))
              for i in d.linear}
    attn = {i: AttnSpan(*(torch.cat([getattr(s.data.attn[i], f) for s in slices]) for f in ATTN)) for i in d.attn}
    return SegmentEntry(first.key, first.segment_tokens, SpanData(d.num_tokens, d.local_start, linear, attn),
                        max(s.build_seconds for s in slices))


def unbundle(entry: SegmentEntry, size: int) -> list[SegmentEntry] | str:
    """The `size` slices of a bundle, slice r marked as rank r's (meta tensor_parallel "r/size"),
    or what is wrong with it (a tensor whose leading dim is not `size`)."""
    for i, s in entry.data.linear.items():
        for f in LINEAR:
            if getattr(s, f).shape[:1] != (size,):
                return f"layer {i} {f}: {tuple(getattr(s, f).shape)} holds no {size} rank slices"
    for i, a in entry.data.attn.items():
        for f in ATTN:
            if getattr(a, f).shape[:1] != (size,):
                return f"layer {i} {f}: {tuple(getattr(a, f).shape)} holds no {size} rank slices"
    out = []
    for r in range(size):
        data = _map(entry.data, lambda t, r=r: t[r:r + 1].clone())
        out.append(SegmentEntry(entry.key, entry.segment_tokens, data, entry.build_seconds,
                                meta={"tensor_parallel": f"{r}/{size}"}))
    return out


def gather_entries(group, entries: list[SegmentEntry]) -> list[SegmentEntry]:
    """Bundles of entries every rank of `group` built (`entries`: rank 0's, each named across the
    ranks), on rank 0's device. The followers' bytes count in hybridcache_bytes_moved_total
    (path tensor_parallel)."""
    per_rank = group.gather(list(entries))
    _count(e for slices in per_rank[1:] for e in slices)
    return [bundle(list(slices)) for slices in zip(*per_rank)]


def scatter_entries(group, slices: list[list[SegmentEntry]]) -> list[SegmentEntry]:
    """Hand each rank its slices (slices[j][r]: rank r's of entry j, from unbundle): rank r gets
    [slices[j][r] for every j] on its device; rank 0's list comes back, each entry named across
    the ranks (pass it to the engine's broadcast calls, where each rank finds its own). The bytes
    handed to the followers count in hybridcache_bytes_moved_total (path tensor_parallel)."""
    if not slices:
        return []
    mine = group.scatter([[s[r] for s in slices] for r in range(group.size)])
    _count(e for s in slices for e in s[1:])
    return mine


def _count(entries) -> None:
    from hybridcache.services.observability import metrics

    metrics.BYTES_MOVED.labels(path="tensor_parallel").inc(sum(e.nbytes for e in entries))
