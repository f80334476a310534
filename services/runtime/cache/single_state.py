"""The "single state" policy: a reused segment's linear state is its own S(body|0) alone.

Exact composition gives S_end = T S_start + S(body|0); the single-state policy some papers argue
for drops everything before the segment (S_end = S(body|0)), which is composition with T = 0.
SingleStateStore wraps any EntryStore and stores every entry with a zero scalar T per linear
layer, so an Engine in `pic` mode runs the policy for every family (scalar, vector or matrix T)
without a separate code path, and the entry loses its T bytes.
"""

from __future__ import annotations

import torch
from hybridcache.services.runtime.cache.base import EntryStore
from hybridcache.services.runtime.cache.entry import SegmentEntry, entry_nbytes
from hybridcache.services.runtime.sequence import LinearSpan, SpanData


def single_state_view(data: SpanData) -> SpanData:
    """`data` with every linear layer's T replaced by a zero scalar per head, in place (returned)."""
    for i, span in data.linear.items():
        zero_t = torch.zeros(span.S.shape[:-2], dtype=torch.float32, device=span.S.device)  # [1, H]
        data.linear[i] = LinearSpan(T=zero_t, S=span.S, conv_tail=span.conv_tail)
    return data


def to_single_state(entry: SegmentEntry) -> SegmentEntry:
    """`entry` turned single-state in place (T dropped; bytes, checksum and meta updated); returned."""
    single_state_view(entry.data)
    return mark_single_state(entry)


def mark_single_state(entry: SegmentEntry) -> SegmentEntry:
    """The bytes, checksum and meta of an entry whose data is single-state already (single_state_view)."""
    entry.nbytes = entry_nbytes(entry.data)
    if entry.checksum:
        entry.seal()
    entry.meta["linear_state_policy"] = "single"
    return entry


class SingleStateStore(EntryStore):
    """An EntryStore that turns every entry put into it into a single-state entry.

    put() modifies the entry it is given (its T, nbytes and checksum), so the caller that built
    the entry uses the same policy as later hits.
    """

    def __init__(self, inner: EntryStore):
        self.inner = inner

    def get(self, key: str) -> SegmentEntry | None:
        return self.inner.get(key)

    def put(self, entry: SegmentEntry) -> bool:
        return self.inner.put(to_single_state(entry))

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes
