"""Exact prefix cache at part boundaries (system prompt, segments): the state after a prefix.

Keys chain over the parts, so the same tokens split into different segments are different
prefixes (their assembled states differ under PIC). Exact prefixes live in the page tree
(radix.py, policies.py) at 64-token granularity; this store keeps only what the page tree must
not hold: PIC-assembled (approximate) states after whole parts, for modes pic and naive, keyed
by mode and seam window.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

from hybridcache.services.runtime.sequence import AttnState, LinearState, SequenceState


def chain_key(parent: str, kind: str, token_ids) -> str:
    h = hashlib.sha256(f"{parent}|{kind}|".encode())
    h.update(struct.pack(f"<{len(token_ids)}q", *[int(t) for t in token_ids]))
    return h.hexdigest()


@dataclass(slots=True)
class PrefixSnapshot:
    length: int
    linear: dict[int, LinearState]
    attn: dict[int, AttnState]
    nbytes: int

    def restore(self) -> SequenceState:
        """A fresh SequenceState equal to the one this snapshot was taken from (snapshot unchanged)."""
        return SequenceState(
            length=self.length,
            linear={i: LinearState(s.ssm.clone(), s.conv.clone()) for i, s in self.linear.items()},
            attn={i: AttnState(a.k, a.v) for i, a in self.attn.items()},
        )


class PrefixStore:
    """LRU map chain key -> PrefixSnapshot within a byte budget."""

    def __init__(self, capacity_bytes: int):
        self._capacity = capacity_bytes
        self._items: OrderedDict[str, PrefixSnapshot] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> PrefixSnapshot | None:
        with self._lock:
            snap = self._items.get(key)
            if snap is not None:
                self._items.move_to_end(key)
            return snap

    def put(self, key: str, snap: PrefixSnapshot) -> bool:
        with self._lock:
            if snap.nbytes > self._capacity:
                return False
            if key in self._items:
                self._used -= self._items.pop(key).nbytes
            while self._used + snap.nbytes > self._capacity:
                _, old = self._items.popitem(last=False)
                self._used -= old.nbytes
            self._items[key] = snap
            self._used += snap.nbytes
            return True

    def __len__(self) -> int:
        return len(self._items)

    @property
    def used_bytes(self) -> int:
        return self._used
