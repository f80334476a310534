"""A persistent device buffer per sending process and GPU (an arena), exported over CUDA IPC once
per receiver, that entries are written into slot by slot (services/transport/cuda_ipc.py).

Sender: an ArenaPool holds one DeviceArena per device. A DeviceArena is one device allocation of
`capacity` bytes, sub-allocated into slots (SlotAllocator: first fit, at most `n_slots` held at
once), and a release file in /dev/shm with one int64 per slot. Each slot use gets a new
generation number; the receiver releases the slot, once its copy of the bytes is done, by writing
that generation into the slot's entry of the file, and the sender takes the slot back the next
time it allocates. A slot nobody released within `stale_s` is taken back too (a receiver that
died): bytes overwritten under a receiver that was still to copy them fail its checksum, so the
entry is a miss, never wrong. The arena is exported (torch's CUDA IPC export: a handle, a
reference counter and an event) once per receiving process; the export travels in every block's
message, a few hundred bytes.

Receiver: ArenaMappings maps each sender's arena once (an IPC handle opened) and keeps it for as
long as that sender sends from it: a block of an arena mapped already opens nothing. A sender's
new arena (it grew, or the process restarted under the same id) replaces its old mapping.

The allocator, the release file and the mappings are plain Python and CPU tensors testable
without a GPU; the CUDA calls are the callers' (cuda_ipc.share and cuda_ipc.open_shared).
"""

from __future__ import annotations

import mmap
import os
import re
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hybridcache.services.transport.base import TransportError
from hybridcache.services.transport.shm import SHM_DIR

ALIGN = 256  # bytes: every slot starts at a multiple of this
DEFAULT_SLOTS = 256
STALE_S = 60.0
# not matched by shm.sweep_stale's "hybridcache-*": the file lives as long as its arena
RELEASE_PREFIX = "hybridcache_arena-"
_ARENA_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class Slot:
    index: int  # its entry in the release file
    generation: int  # this use of it (unique in the arena)
    offset: int  # bytes from the arena's start
    nbytes: int


class SlotAllocator:
    """First-fit sub-allocation of `capacity` bytes into slots, at most `n_slots` held at once.
    Not thread-safe (DeviceArena locks around it)."""

    def __init__(self, capacity: int, n_slots: int = DEFAULT_SLOTS, align: int = ALIGN, stale_s: float = STALE_S):
        if capacity <= 0 or n_slots <= 0:
            raise ValueError("an arena needs a positive capacity and slot count")
        self.capacity, self.n_slots, self.align, self.stale_s = capacity, n_slots, align, stale_s
        self._free = list(range(n_slots - 1, -1, -1))  # slot indices not in use (popped from the end)
        self._held: dict[int, tuple[Slot, float]] = {}  # index -> (slot, when it was taken)
        self._generation = 0
        self.reclaimed_stale = 0

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return sum(s.nbytes for s, _ in self._held.values())

    def allocate(self, nbytes: int, now: float | None = None) -> Slot | None:
        """A slot of `nbytes` bytes at the lowest offset that fits, or None (no room, or no slot index free)."""
        if nbytes <= 0 or nbytes > self.capacity or not self._free:
            return None
        pos = 0
        for start, end in sorted((s.offset, s.offset + s.nbytes) for s, _ in self._held.values()):
            if start - pos >= nbytes:
                break
            pos = max(pos, -(-end // self.align) * self.align)
        if pos + nbytes > self.capacity:
            return None
        self._generation += 1
        slot = Slot(self._free.pop(), self._generation, pos, nbytes)
        self._held[slot.index] = (slot, time.monotonic() if now is None else now)
        return slot

    def reap(self, released: Callable[[int], int], now: float | None = None) -> int:
        """Take back the slots whose release file entry (`released(index)`) holds their
        generation, and those held past stale_s; returns how many."""
        now = time.monotonic() if now is None else now
        back = [i for i, (s, t) in self._held.items() if released(i) == s.generation or now - t > self.stale_s]
        for i in back:
            slot, t = self._held.pop(i)
            if released(i) != slot.generation:
                self.reclaimed_stale += 1
            self._free.append(i)
        return len(back)


def release_name(arena_id: str) -> str:
    if not _ARENA_ID.fullmatch(arena_id or ""):
        raise TransportError(f"bad arena id {arena_id!r}")
    return RELEASE_PREFIX + arena_id


class ReleaseFile:
    """One int64 per slot in a /dev/shm file both ends map: the generation of the slot's last
    use the receiver is done with."""

    def __init__(self, arena_id: str, n_slots: int | None = None, create: bool = False):
        self.path = SHM_DIR / release_name(arena_id)
        try:
            if create:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, 8 * n_slots)
            else:
                fd = os.open(self.path, os.O_RDWR)
        except OSError as e:
            raise TransportError(f"arena release file {self.path.name}: {e.strerror}", unreachable=True) from None
        try:
            size = os.fstat(fd).st_size
            if size == 0 or size % 8:
                raise TransportError(f"arena release file {self.path.name} has {size} bytes", unreachable=True)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")
        self.n_slots = size // 8

    def generation(self, index: int) -> int:
        return self._words[index]

    def release(self, index: int, generation: int) -> None:
        if 0 <= index < self.n_slots:
            self._words[index] = generation

    def unlink(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class DeviceArena:
    """One device buffer of `capacity` bytes, its slots and release file (see the module doc)."""

    def __init__(self, device, capacity: int, n_slots: int = DEFAULT_SLOTS, owner: str = "",
                 stale_s: float = STALE_S):
        self.id = uuid.uuid4().hex
        self.owner = owner or uuid.uuid4().hex
        self.device = torch.device(device)
        self.buf = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self.allocator = SlotAllocator(capacity, n_slots, stale_s=stale_s)
        self.releases = ReleaseFile(self.id, n_slots, create=True)
        # the release file goes with the arena, or at the latest when the process exits
        self._finalizer = weakref.finalize(self, _unlink, self.releases.path)
        self._exports: dict[str, object] = {}  # receiving process -> its export (a DeviceBlock)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def exports(self) -> int:
        return len(self._exports)

    def take(self, nbytes: int, wait_s: float = 0.0) -> Slot | None:
        """A slot of nbytes (the released ones taken back first), or None when it does not fit
        within `wait_s` seconds (waited only while slots are held: their release can make room)."""
        if nbytes > self.capacity:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                self.allocator.reap(self.releases.generation)
                slot = self.allocator.allocate(nbytes)
                held = self.allocator.held
            if slot is not None or not held or time.monotonic() >= deadline:
                return slot
            time.sleep(2e-4)

    def idle(self) -> bool:
        with self._lock:
            self.allocator.reap(self.releases.generation)
            return self.allocator.held == 0

    def export(self, receiver: str, share: Callable, make_block: Callable):
        """The arena's export for process `receiver`, made (share(self.buf, block)) the first time."""
        with self._lock:
            block = self._exports.get(receiver)
            if block is None:
                block = make_block()
                share(self.buf, block)
                self._exports[receiver] = block
            return block

    def close(self) -> None:
        self._finalizer()


def _unlink(path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class ArenaPool:
    """A sending process's arenas, one per device, of `capacity` bytes each (one is replaced by a
    larger one when a write does not fit it at all and it holds nothing). A write waits up to
    `wait_s` for the receivers to release room before it goes out in a fresh buffer instead."""

    def __init__(self, capacity: int, n_slots: int = DEFAULT_SLOTS, owner: str = "", stale_s: float = STALE_S,
                 wait_s: float = 0.5):
        self.capacity, self.n_slots, self.stale_s, self.wait_s = capacity, n_slots, stale_s, wait_s
        self.owner = owner or uuid.uuid4().hex
        self._arenas: dict[torch.device, DeviceArena] = {}
        self._lock = threading.Lock()
        self.created = 0

    def arena(self, device, need: int) -> DeviceArena | None:
        """The arena of `device` for a write of `need` bytes (None: the pool is off)."""
        if self.capacity <= 0:
            return None
        device = torch.device(device)
        with self._lock:
            arena = self._arenas.get(device)
            if arena is not None and need > arena.capacity and arena.idle():
                arena.close()
                arena = None
            if arena is None:
                from hybridcache.services.transport import checksum

                checksum.warm(device)  # the slots' checksum kernel compiled before the first write waits for it
                size = max(self.capacity, 1 << max(0, need - 1).bit_length())
                arena = self._arenas[device] = DeviceArena(device, size, self.n_slots, self.owner, self.stale_s)
                self.created += 1
            return arena

    def close(self) -> None:
        with self._lock:
            for arena in self._arenas.values():
                arena.close()
            self._arenas.clear()


@dataclass
class _Mapped:
    arena: str
    storage: torch.Tensor
    releases: ReleaseFile


class ArenaMappings:
    """The arenas this process has mapped, the latest one per sending process (at most
    `max_senders` senders, least recently used dropped first). `opened` counts the arenas mapped
    (IPC handles opened), `reused` the blocks served from a mapping already open."""

    def __init__(self, max_senders: int = 16):
        self.max_senders = max_senders
        self._lock = threading.Lock()
        self._by_owner: OrderedDict[str, _Mapped] = OrderedDict()
        # replaced mappings, each with an event after the copies queued from it (CUDA), dropped once passed
        self._retiring: list[tuple[object, torch.Tensor]] = []
        self.opened = 0
        self.reused = 0

    def slot(self, block, index: int, open_shared: Callable) -> tuple[torch.Tensor, ReleaseFile, bool]:
        """The bytes of `block`'s arena slot in the sender's arena (mapped here, no copy), the
        arena's release file and whether the arena was mapped for it. Call on the stream the
        copies from it are queued on."""
        s = block.slot
        if not s.owner:
            raise TransportError("arena slot without its sender's id")
        with self._lock:
            current = self._by_owner.get(s.owner)
            if current is not None and current.arena == s.arena:
                self._by_owner.move_to_end(s.owner)
                self.reused += 1
                mapped, opened = current, False
            else:
                releases = ReleaseFile(s.arena)
                mapped = _Mapped(s.arena, open_shared(block, index), releases)
                self.opened += 1
                opened = True
                self._by_owner[s.owner] = mapped
                self._by_owner.move_to_end(s.owner)
                old = [current] if current is not None else []
                while len(self._by_owner) > self.max_senders:
                    old.append(self._by_owner.popitem(last=False)[1])
                self._retire([m.storage for m in old])
        storage = mapped.storage
        if s.offset < 0 or s.nbytes <= 0 or s.offset + s.nbytes > storage.numel():
            raise TransportError(f"arena slot of {s.nbytes} bytes at {s.offset} lies outside its arena of "
                                 f"{storage.numel()} bytes")
        if not 0 <= s.index < mapped.releases.n_slots:
            raise TransportError(f"arena slot {s.index} is not one of the arena's {mapped.releases.n_slots}")
        return storage[s.offset: s.offset + s.nbytes], mapped.releases, opened

    def _retire(self, old: list[torch.Tensor]) -> None:
        for storage in old:
            if storage.is_cuda:
                event = torch.cuda.Event()
                event.record()  # on the current (side) stream, after the copies from it
                self._retiring.append((event, storage))
        self._retiring = [(e, t) for e, t in self._retiring if not e.query()]

    def mapped(self) -> dict[str, str]:
        """Sender id -> the id of its arena mapped here."""
        with self._lock:
            return {owner: m.arena for owner, m in self._by_owner.items()}

    def clear(self) -> None:
        with self._lock:
            self._by_owner.clear()
            self._retiring.clear()
