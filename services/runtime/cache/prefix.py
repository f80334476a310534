"""Exact prefix cache at part boundaries (system prompt, segments): the state after a prefix.

Keys chain over the parts, so the same tokens split into different segments are different
prefixes (their assembled states differ under PIC). Exact prefixes live in the page tree
(radix.py, policies.py) at 64-token granularity; this store keeps only what the page tree must
not hold: PIC-assembled (approximate) states after whole parts, for modes pic and naive, keyed
by mode and seam window.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from hybridcache.services.runtime.plan import chain_key  # noqa: F401 (re-exported)
from hybridcache.services.runtime.sequence import AttnState, LinearState, SequenceState


@dataclass(slots=True)
class PrefixSnapshot:
    length: int
    linear: dict[int, LinearState]
    attn: dict[int, AttnState]

    def restore(self) -> SequenceState:
        """A fresh SequenceState equal to the one this snapshot was taken from (snapshot unchanged)."""
        return SequenceState(
            length=self.length,
            linear={i: LinearState(s.ssm.clone(), s.conv.clone()) for i, s in self.linear.items()},
            attn={i: AttnState(a.k, a.v) for i, a in self.attn.items()},
        )


def _storages(snap: PrefixSnapshot) -> dict[int, int]:
    """The storages a snapshot keeps alive (data pointer -> bytes). Its attention K/V are views of
    the whole prompt's K/V, so a snapshot after the first part pins every token of the request."""
    out: dict[int, int] = {}
    tensors = [t for s in snap.linear.values() for t in (s.ssm, s.conv)]
    tensors += [t for a in snap.attn.values() for t in (a.k, a.v)]
    for t in tensors:
        st = t.untyped_storage()
        out[st.data_ptr()] = st.nbytes()
    return out


class PrefixStore:
    """LRU map chain key -> PrefixSnapshot within a byte budget. The budget counts the storages
    the snapshots keep alive, each once however many snapshots share it (the snapshots of one
    request share its K/V), not the sizes of their views."""

    def __init__(self, capacity_bytes: int):
        self._capacity = capacity_bytes
        self._items: OrderedDict[str, PrefixSnapshot] = OrderedDict()
        self._held: dict[str, dict[int, int]] = {}  # key -> its storages
        self._refs: dict[int, int] = {}  # storage -> snapshots holding it
        self._used = 0
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._capacity

    def get(self, key: str) -> PrefixSnapshot | None:
        with self._lock:
            snap = self._items.get(key)
            if snap is not None:
                self._items.move_to_end(key)
            return snap

    def _release(self, key: str) -> None:
        self._items.pop(key)
        for ptr, size in self._held.pop(key).items():
            self._refs[ptr] -= 1
            if not self._refs[ptr]:
                del self._refs[ptr]
                self._used -= size

    def put(self, key: str, snap: PrefixSnapshot) -> bool:
        with self._lock:
            held = _storages(snap)
            if sum(held.values()) > self._capacity:
                return False
            if key in self._items:
                self._release(key)
            while self._items and self._used + sum(n for p, n in held.items() if p not in self._refs) > self._capacity:
                self._release(next(iter(self._items)))
            self._items[key] = snap
            self._held[key] = held
            for ptr, size in held.items():
                if ptr not in self._refs:
                    self._refs[ptr] = 0
                    self._used += size
                self._refs[ptr] += 1
            return True

    def __len__(self) -> int:
        return len(self._items)

    @property
    def used_bytes(self) -> int:
        return self._used
