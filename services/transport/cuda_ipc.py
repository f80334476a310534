"""Entry bytes that stay on the GPU: CUDA IPC between processes of one host (torch's CUDA tensor
sharing, torch.multiprocessing.reductions).

The sender packs the tensors of several blocks (the whole entries, or one layer of every segment
of a batched build that goes to one receiver: codec.LayeredEntry) into one slot of its arena
(services/transport/ipc_pool.py: a device buffer per GPU, kept for the life of the process and
exported once per receiving process), each block an offset range of the slot, computes the
slot's checksum on the device and reads it back (one synchronisation, after which the bytes are
written), and sends only the arena's export, the slot and the block's range in the stream's
messages. The receiver maps the arena once (ipc_pool.ArenaMappings) and keeps the mapping while
that sender sends from it, so that requests in steady state open no IPC handle; it copies each
slot into its own device memory with one device-to-device copy (on a side stream; over NVLink
when the GPUs differ) that also computes the slot's checksum (checksum.copy_with_checksum: one
pass over the bytes on one GPU), serves the slot's blocks as views of the copy, and releases
the slot once the copy is done (ipc_pool.ReleaseFile): polled, never waited for, by the
assembler as it is fed and when an entry completes, and by a thread of its own
(SlotReleaser) while the assembler waits on the stream. Checksums are read back together when an
entry completes (EntryAssembler), so receiving a block waits for nothing; the copies are timed on
the side stream (copy_timer: CUDA timing events, the host clock off CUDA), so that the assembler
reports the GPU time of the copies (copy_seconds) apart from its host time; a
verified entry's blocks are then copied back to back into memory of its own (own_buffer: one
kernel), of which its tensors are views, so that it does not keep the other entries of its build
alive through the slot copies they share.

Without an arena (ArenaPool off, or a write that does not fit it now) a write is packed into a
fresh buffer exported for it, each block with its own checksum: the receiver (DeviceMappings)
maps such a buffer once, on the GPU that holds it (matched by UUID, since the two processes may
number their GPUs differently), takes the later blocks of the same buffer as views of that
mapping, releasing their reference counters instead of opening them again, and unmaps it once
the next buffer from that GPU is mapped and the copies from it are done (an event on the side
stream, polled), which lets the sender's allocator reuse the buffer. A block its receiver never
opens (a combine worker that died mid-stream) stays allocated in the sender until the sender
exits; an arena slot nobody released is taken back after ipc_pool.STALE_S.

What it takes: both processes on one host with the same IPC namespace (the reference counters
and release files live in /dev/shm and CUDA IPC handles are opened through it) and the same PID
namespace (the driver resolves the exporting process), and the receiver able to see the sender's
GPU. The transport choice (services/transport/__init__.py) checks exactly that from the two Endpoints.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time

import torch
from hybridcache.services.runtime.packing import pack, padded
from hybridcache.services.transport.base import TensorTransport, TransportError
from hybridcache.services.transport.checksum import checksum_text, copy_with_checksum, device_checksum_sums
from hybridcache.services.transport.ipc_pool import ArenaMappings, ArenaPool, ReleaseFile

log = logging.getLogger("hybridcache.transport")


def device_uuid(index: int) -> str:
    """The UUID of CUDA device `index` of this process (the same GPU has the same UUID everywhere)."""
    return str(torch.cuda.get_device_properties(index).uuid)


@functools.cache
def visible_gpus() -> tuple[str, ...]:
    """UUIDs of this process's CUDA devices, in its own index order; () without CUDA."""
    if not torch.cuda.is_available():
        return ()
    return tuple(device_uuid(i) for i in range(torch.cuda.device_count()))


def local_index(uuid: str, gpus: tuple[str, ...] | None = None) -> int:
    """This process's index of the GPU with `uuid`; TransportError when it cannot see that GPU."""
    gpus = visible_gpus() if gpus is None else gpus
    if uuid not in gpus:
        raise TransportError(f"the GPU {uuid or '?'} holding the entry is not visible to this process",
                             unreachable=True)
    return gpus.index(uuid)


def share(buf: torch.Tensor, block) -> None:
    """Fill `block` (a DeviceBlock) with the CUDA IPC export of the uint8 CUDA buffer `buf`."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    fn, args = reduce_tensor(buf)
    if fn is not rebuild_cuda_tensor:
        raise TransportError("cuda_ipc needs a CUDA tensor")
    (_, _, _, tensor_offset, _, _, device, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    block.device_uuid = device_uuid(device)
    block.handle = handle
    block.storage_bytes = storage_bytes
    block.storage_offset = storage_offset
    block.tensor_offset = tensor_offset
    block.ref_counter_handle = ref_handle
    block.ref_counter_offset = ref_offset
    block.event_handle = event_handle or b""
    block.event_sync_required = bool(event_sync)


def open_shared(block, index: int) -> torch.Tensor:
    """The sender's whole exported buffer (storage_bytes bytes), mapped into this process on its
    CUDA device `index` (no copy); its blocks are ranges of it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        return rebuild_cuda_tensor(torch.Tensor, (block.storage_bytes,), (1,), 0, torch.storage.TypedStorage,
                                   torch.uint8, index, block.handle, block.storage_bytes, block.storage_offset,
                                   False, block.ref_counter_handle, block.ref_counter_offset,
                                   block.event_handle or None, block.event_sync_required)
    except (RuntimeError, OSError) as e:
        raise TransportError(f"cannot open the CUDA IPC handle: {e}", unreachable=True) from None


def release_counter(block, index: int) -> None:
    """Release the reference counter of a block whose buffer is already mapped here (as torch
    does for a storage it has open): the sender's allocator counts one reference per export."""
    try:
        torch.storage.TypedStorage._release_ipc_counter(block.ref_counter_handle, block.ref_counter_offset,
                                                        device=index)
    except (RuntimeError, OSError) as e:
        raise TransportError(f"cannot release the CUDA IPC reference counter: {e}", unreachable=True) from None


class CudaIpcTransport(TensorTransport):
    """Exports whole entries as device blocks (write_entry); one instance per stream. `share` is
    how a buffer is exported (the module's share: torch's CUDA IPC); `pool` the sender's arenas
    (None: a fresh buffer exported per write); `receiver` the receiving process's id, whose
    export of an arena is made once."""

    name = "cuda_ipc"
    packs_entries = True  # the codec hands it whole entries (write_entry)

    def __init__(self, share=None, pool: ArenaPool | None = None, receiver: str = ""):
        self._share = share
        self._pool = pool
        self._receiver = receiver
        self._moved = 0
        self.exports = 0  # blocks exported in fresh buffers (each a range of a buffer packed for several)
        self.slots = 0  # arena slots written
        self.fallbacks = 0  # writes that did not fit the arena then (a fresh buffer each)

    def write(self, chunk, tensor: torch.Tensor) -> None:
        raise TransportError("cuda_ipc moves whole entries: the codec calls write_entry")

    def write_entry(self, block, tensors: list[torch.Tensor], ready=None) -> None:
        """Pack `tensors` into one buffer and export it into `block` with its device checksum."""
        self.write_blocks([(block, tensors)], ready)

    def write_blocks(self, items, ready=None) -> None:
        """Export several blocks from one slot of the arena (or one fresh buffer): `items` is
        [(DeviceBlock, tensors)]; the tensors of all of them are packed back to back, each block
        an offset range, with one device checksum for the slot (a fresh buffer: one per block),
        read back with one synchronisation. On CUDA this runs on a side stream that waits only
        for `ready` (a CUDA event recorded once the tensors were computed): the builder's next
        batch, queued on the default stream meanwhile, neither delays the export nor is waited
        for by its checksums. The sender may drop the tensors afterwards."""
        items = list(items)
        if not items:
            return
        tensors = [t for _, ts in items for t in ts]
        device = tensors[0].device if tensors else None
        share_fn = self._share or globals()["share"]
        with _side_stream(device, ready):
            if not tensors:
                for block, _ in items:
                    block.nbytes, block.checksum = 0, checksum_text((0, 0, 0))
                return
            ranges, off = [], 0
            for _, ts in items:
                n = sum(padded(t.numel() * t.element_size()) for t in ts)
                ranges.append((off, n))
                off += n
            arena = self._pool.arena(device, off) if self._pool is not None else None
            # waits for room only until a write of this stream did not get it (a receiver that
            # stopped releasing costs one wait, not one per write)
            slot = arena.take(off, 0.0 if self.fallbacks else self._pool.wait_s) if arena is not None else None
            if slot is not None:
                self._write_slot(arena, slot, items, tensors, ranges, share_fn)
                return
            self.fallbacks += arena is not None
            buf = pack(tensors)
            sums = torch.stack([device_checksum_sums(buf[o:o + n]) for o, n in ranges]).tolist()
            for (block, _), (o, n), s in zip(items, ranges, sums):
                # torch records the IPC event on the current (side) stream: after the pack
                share_fn(buf[o:o + n], block)
                block.nbytes = n
                block.checksum = checksum_text(s)
                self._moved += n
        self.exports += len(items)

    def _write_slot(self, arena, slot, items, tensors, ranges, share_fn) -> None:
        """Pack into `slot` of `arena`, checksum the slot once, and fill each block with the
        arena's export, the slot and the block's range in it."""
        view = arena.buf[slot.offset: slot.offset + slot.nbytes]
        pack(tensors, out=view)
        checksum = checksum_text(device_checksum_sums(view).tolist())  # the bytes are written after this
        export = arena.export(self._receiver, share_fn, type(items[0][0]))
        for (block, _), (o, n) in zip(items, ranges):
            block.CopyFrom(export)
            block.tensor_offset, block.nbytes, block.checksum = o, n, ""
            block.slot.arena, block.slot.owner = arena.id, arena.owner
            block.slot.index, block.slot.generation = slot.index, slot.generation
            block.slot.offset = export.tensor_offset + slot.offset
            block.slot.nbytes, block.slot.checksum = slot.nbytes, checksum
            self._moved += n
        self.slots += 1

    def close(self) -> None:
        # blocks the receivers released wait in torch's IPC limbo until collected
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    def bytes_moved(self) -> int:
        return self._moved


class DeviceMappings:
    """The sender buffers this process has mapped, one per sender GPU (its latest): a block of a
    buffer already mapped is a view of that mapping, so a batched build's blocks, ranges of one
    buffer per layer, open the buffer once. `opened` counts the buffers mapped (IPC handles
    opened), `reused` the blocks served from a mapping already open."""

    def __init__(self):
        self._lock = threading.Lock()
        self._mapped: dict[str, tuple[tuple, torch.Tensor]] = {}  # sender GPU UUID -> (buffer key, mapping)
        # replaced CUDA mappings, each with an event recorded after the copies queued from it:
        # unmapped once the event has passed, so that replacing a mapping waits for nothing
        self._retiring: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        self.opened = 0
        self.reused = 0

    def _retire(self, old: torch.Tensor | None) -> None:
        if old is not None and old.is_cuda:
            event = torch.cuda.Event()
            event.record()  # on the current (side) stream, after the copies from `old`
            self._retiring.append((event, old))
        passed = [event.query() for event, _ in self._retiring]
        done = [r for r, p in zip(self._retiring, passed) if p]
        self._retiring = [r for r, p in zip(self._retiring, passed) if not p]
        while done:
            # torch synchronises the current stream when it unmaps a buffer: an idle one here
            with torch.cuda.stream(_idle_stream(done[-1][1].device)):
                done.pop()

    def view(self, block, index: int) -> tuple[torch.Tensor, bool]:
        """The block's bytes in the sender's buffer (mapped here, no copy) and whether its buffer
        was mapped for it (an IPC handle opened). Call on the stream the copies from it are
        queued on."""
        key = (block.handle, block.storage_offset, block.storage_bytes)
        with self._lock:
            current = self._mapped.get(block.device_uuid)
            if current is not None and current[0] == key:
                release_counter(block, index)
                self.reused += 1
                storage, opened = current[1], False
            else:
                storage, opened = open_shared(block, index), True
                self.opened += 1
                self._mapped[block.device_uuid] = (key, storage)
                # the previous buffer from that GPU is unmapped once the copies from it are done,
                # which releases the sender's reference counter
                self._retire(current[1] if current is not None else None)
        if block.tensor_offset < 0 or block.nbytes < 0 or block.tensor_offset + block.nbytes > storage.numel():
            raise TransportError(f"device block of {block.nbytes} bytes at {block.tensor_offset} lies outside "
                                 f"its buffer of {storage.numel()} bytes")
        return storage[block.tensor_offset: block.tensor_offset + block.nbytes], opened

    def clear(self) -> None:
        with self._lock:
            self._mapped.clear()
            self._retiring.clear()


MAPPINGS = DeviceMappings()
ARENAS = ArenaMappings()


class _HostTimer:
    """Off CUDA a copy is done once queued: its host time (perf_counter from start to stop)."""

    def __init__(self):
        self.counted = False  # added to an assembler's copy_seconds already
        self._t0 = time.perf_counter()
        self._seconds = 0.0

    def stop(self) -> None:
        self._seconds = time.perf_counter() - self._t0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def seconds(self) -> float:
        return self._seconds


class _CudaTimer:
    """Two timing events on the current (side) stream around a copy and its checksum: `query`
    polls whether they are done, `seconds` is the GPU time between them (waits for the end)."""

    def __init__(self):
        self.counted = False
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()
        self.end = torch.cuda.Event(enable_timing=True)

    def stop(self) -> None:
        self.end.record()

    def query(self) -> bool:
        return self.end.query()

    def synchronize(self) -> None:
        self.end.synchronize()

    def seconds(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def copy_timer(device):
    """A timer started now on the current stream of `device` (call on the stream the copy is
    queued on; stop() it after the copy's checksum): CUDA timing events there, the host clock off
    CUDA. Replaced by the tests with a fake whose copy is done when they say so."""
    return _CudaTimer() if torch.device(device).type == "cuda" else _HostTimer()


_RELEASE_LOCK = threading.Lock()


class SlotCopy:
    """The receiver's copy of one arena slot (its blocks are views of it), the device checksum
    sums of the copy (read back when an entry of it completes: `intact`), the timer of the copy
    and its checksum (copy_timer: whether they are done, and their GPU time), and the release of
    the sender's slot once the copy is done."""

    def __init__(self, slot, own: torch.Tensor, sums, timer, releases: ReleaseFile, opened: bool):
        self.slot = slot  # the ArenaSlot message it was received for
        self.own, self.sums, self.timer, self.releases, self.opened = own, sums, timer, releases, opened
        self.intact: bool | None = None
        self.released = False

    def matches(self, slot) -> bool:
        return slot == self.slot

    def release(self, wait: bool = False) -> bool:
        """Release the sender's slot if the copy from it is done (polled; with `wait`: once it is).
        Safe from several threads (the assembler's and the SlotReleaser's): the slot's entry of
        the release file is written once, never after the sender may have reused the slot."""
        if self.released:
            return True
        if wait:
            self.timer.synchronize()
        elif not self.timer.query():
            return False
        with _RELEASE_LOCK:
            if not self.released:
                self.releases.release(self.slot.index, self.slot.generation)
                self.released = True
        return True


class SlotReleaser:
    """Releases the arena slots whose copies were not done when their assembler last looked, on a
    thread of its own (started on first use): it waits for the oldest pending copy (its timer's
    synchronize: a CUDA event wait, which holds no GIL) and releases its slot, then the next (the
    copies of one side stream complete in order), and sleeps on a condition when none is pending.
    The assembler releases too (on every feed and when an entry completes), but not while it waits
    for the sender's next message on the gRPC stream; a sender short of arena room waits for
    releases (DeviceArena.take, up to ArenaPool.wait_s) before its next message, so without this
    thread that wait would end only in its timeout (a fallback to fresh buffers). It never polls:
    a thread that woke every fraction of a millisecond took the GIL from the receiving thread often
    enough to cut the loopback's host-side receive rate on an H200 from 137 to 38 GB/s."""

    def __init__(self):
        self._cv = threading.Condition()
        self._pending: collections.deque[SlotCopy] = collections.deque()
        self._thread: threading.Thread | None = None

    def add(self, copy: SlotCopy) -> None:
        with self._cv:
            self._pending.append(copy)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ipc-slot-release", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
                copy = self._pending[0]
            try:
                copy.release(wait=True)
            except Exception:  # noqa: BLE001 - a failed wait must not stop the releases of the others
                log.warning("waiting for an arena slot copy failed; the sender takes the slot back as stale",
                            exc_info=True)
            with self._cv:
                self._pending.popleft()


RELEASER = SlotReleaser()


def receive_slot(block, device) -> SlotCopy:
    """A copy of the arena slot `block` lies in, in this process's memory on `device` (one
    device-to-device copy, on the side stream, its checksum queued there too, both timed:
    copy_timer), the arena mapped here the first time (ARENAS). Waits for nothing: the copy's
    timer says when it is done."""
    index = local_index(block.device_uuid)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    with _side_stream(dev if cuda else None, after_default=False):
        src, releases, opened = ARENAS.slot(block, index, open_shared)
        own = torch.empty(block.slot.nbytes, dtype=torch.uint8, device=dev)
        timer = copy_timer(dev)
        sums = copy_with_checksum(src, own)
        timer.stop()
        del src
        if cuda:
            own.record_stream(torch.cuda.default_stream(dev))
    slot = type(block.slot)()
    slot.CopyFrom(block.slot)
    return SlotCopy(slot, own, sums, timer, releases, opened)


def own_buffer(blocks: list[torch.Tensor], device) -> torch.Tensor:
    """The uint8 `blocks` (an entry's ranges of arena slot copies) copied back to back into one
    buffer of their own (one kernel), on the side stream after the copies they were taken from;
    marked in use by the default stream."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    with _side_stream(dev if cuda else None, after_default=False):
        buf = torch.cat(blocks)
        if cuda:
            buf.record_stream(torch.cuda.default_stream(dev))
    return buf


def check_slots(copies, device) -> bool:
    """Do the slot copies match their slots' checksums? One read-back for those not checked yet."""
    pending = [c for c in copies if c.intact is None]
    if pending:
        dev = torch.device(device)
        with _side_stream(dev if dev.type == "cuda" else None, after_default=False):
            got = torch.stack([c.sums for c in pending]).tolist()
        for c, g in zip(pending, got):
            c.intact = checksum_text(g) == c.slot.checksum
    return all(c.intact for c in copies)


def receive_block(block, device) -> tuple[torch.Tensor, torch.Tensor | None, bool, object]:
    """A copy of the block's bytes in this process's memory on `device`, the device checksum
    sums of the copy (checksum.device_checksum_sums, not yet read back: the caller compares them
    with block.checksum, check_blocks, once it needs the bytes) and whether the sender's buffer
    was mapped for it (DeviceMappings.view), and the timer of the copy and its checksum
    (copy_timer; None for an empty block). On CUDA the copy and the
    checksum run on a side stream, so that they wait neither for nor behind the model's work on
    the default stream; the copy is marked in use by the default stream, where the engine reads
    it."""
    if block.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device), None, False, None
    index = local_index(block.device_uuid)
    dev = torch.device(device)
    # mapped on the side stream, so that the wait for the sender's IPC event lands there too; it
    # waits for nothing of this process (the copy goes to fresh memory)
    with _side_stream(dev if dev.type == "cuda" else None, after_default=False):
        src, opened = MAPPINGS.view(block, index)
        own = torch.empty(block.nbytes, dtype=torch.uint8, device=dev)
        timer = copy_timer(dev)
        sums = copy_with_checksum(src, own)
        timer.stop()
        del src
        if dev.type == "cuda":
            own.record_stream(torch.cuda.default_stream(dev))
    return own, sums, opened, timer


def check_blocks(blocks, device) -> bool:
    """Do received blocks match their checksums? `blocks`: [(DeviceBlock, sums or None)] as
    receive_block returned them on `device`; one read-back for all of them, on the side stream
    their checksums were queued on."""
    pending = [(b, s) for b, s in blocks if s is not None]
    if not pending:
        return True
    dev = torch.device(device)
    with _side_stream(dev if dev.type == "cuda" else None, after_default=False):
        got = torch.stack([s for _, s in pending]).tolist()
    return all(checksum_text(g) == b.checksum for (b, _), g in zip(pending, got))


_SIDE: dict = {}
_IDLE: dict = {}


def _idle_stream(device) -> torch.cuda.Stream:
    """A per-device stream nothing is queued on (made current where torch synchronises the
    current stream and there is nothing to wait for)."""
    stream = _IDLE.get(device)
    if stream is None:
        stream = _IDLE.setdefault(device, torch.cuda.Stream(device))
    return stream


@contextlib.contextmanager
def _side_stream(device, ready=None, after_default: bool = True):
    """A per-device side stream made current, after waiting for the event `ready` (or, without one
    and with `after_default`, for the work queued on the default stream so far); nothing off CUDA."""
    if device is None or torch.device(device).type != "cuda":
        yield
        return
    device = torch.device(device)
    stream = _SIDE.get(device)
    if stream is None:
        stream = _SIDE.setdefault(device, torch.cuda.Stream(device))
    if ready is not None:
        stream.wait_event(ready)
    elif after_default:
        stream.wait_stream(torch.cuda.default_stream(device))
    with torch.cuda.stream(stream):
        yield


def measure_bandwidth(device, nbytes: int = 256 << 20) -> float:
    """Bytes/s of the device work of one cuda_ipc move on `device`, both ends in this process:
    the sender's pack and checksum, the receiver's copy and checksum (the handle's export and
    opening, which need two processes, are not in it: the combine workers' measurements on
    requests are). A starting value for the router's cost model."""
    t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    for _ in range(2):  # the first round allocates and warms the kernels
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with _side_stream(device):
            buf = pack([t])
            checksum_text(device_checksum_sums(buf))
            own = torch.empty_like(buf)
            own.copy_(buf)
            checksum_text(device_checksum_sums(own))
        seconds = time.perf_counter() - t0
    return nbytes / seconds


DEVICE_SEAL_PREFIX = "hmac-sha256-dev:"


def device_seal(header, parts) -> str:
    """The seal of an entry sent in device blocks: an HMAC-SHA256 keyed by the deployment's
    sealing key (services/security.py, as cache/entry.py seals entries on the host) over the
    entry's key and lengths and, per block in order (one for the whole entry, or one per layer of
    a layered entry), every tensor's (layer, name, dtype, shape, offset in the block) and the
    block's size, offset in its buffer and device checksum, or in an arena slot its offset in
    the slot and the slot's arena, use, place, size and device checksum. `parts`: [(specs, block)].
    The bytes never reach the host, so the HMAC covers their device checksums, which the receiver
    recomputes on its copies: only a holder of the secret can make a seal the entry verifies against."""
    import hashlib
    import hmac

    from hybridcache.services.security import seal_key

    text = [f"{header.key}|{header.segment_tokens}|{header.num_tokens}|{header.local_start}"]
    for specs, block in parts:
        text.extend(f"|{layer}:{name}:{dtype}:{tuple(shape)}@{offset}" for layer, name, dtype, shape, offset in specs)
        text.append(f"|{block.nbytes}@{block.tensor_offset}:{block.checksum}")
        if block.HasField("slot"):
            s = block.slot
            text.append(f"|slot:{s.arena}:{s.owner}:{s.index}:{s.generation}:{s.nbytes}@{s.offset}:{s.checksum}")
    # one update over the joined text: the same HMAC as an update a part
    return DEVICE_SEAL_PREFIX + hmac.new(seal_key(), "".join(text).encode(), hashlib.sha256).hexdigest()


def verify_device_seal(seal: str, header, parts) -> bool:
    import hmac

    return bool(seal) and hmac.compare_digest(seal, device_seal(header, parts))
