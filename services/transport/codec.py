"""SegmentEntry <-> stream of EntryChunk messages: a header, then the tensors layer by layer.

Each tensor carries dtype, shape, layer and a CRC32 of its bytes; the header carries the entry's
seal (an HMAC keyed by the deployment secret, cache/entry.py). A reader rebuilds the entry and checks
both: a mismatch is an error, never an entry, and is counted in hybridcache_entries_rejected_total.
On cuda_ipc the bytes never reach the host: the entry is packed into one device block (or one per
layer, each a range of an arena slot shared with the other segments of its build), the messages
carry the device checksums (of each slot, or of each block of a fresh buffer) and a seal over
them and the entry's layout (services/transport/cuda_ipc.py), and the receiver checks both on
its copies when the entry is complete.
"""

from __future__ import annotations

import functools
import math
import time
import zlib
from collections.abc import Iterable, Iterator

import torch
from hybridcache.services.observability import metrics
from hybridcache.services.protocol import pb
from hybridcache.services.runtime.cache import SegmentEntry
from hybridcache.services.runtime.packing import ALIGN, padded
from hybridcache.services.runtime.sequence import AttnSpan, LinearSpan, SpanData
from hybridcache.services.transport import checksum
from hybridcache.services.transport.base import TensorTransport, TransportError
from hybridcache.services.transport.cuda_ipc import (
    RELEASER,
    SlotCopy,
    check_blocks,
    check_slots,
    device_seal,
    own_buffer,
    receive_block,
    receive_slot,
    verify_device_seal,
)
from hybridcache.services.transport.shm import read_shm

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
LINEAR_FIELDS = ("T", "S", "conv_tail")
ATTN_FIELDS = ("k", "v")


def layer_tensors(data: SpanData) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(layer, name, tensor) in layer order."""
    for layer in sorted(set(data.linear) | set(data.attn)):
        if layer in data.linear:
            s = data.linear[layer]
            yield from ((layer, n, getattr(s, n)) for n in LINEAR_FIELDS)
        else:
            a = data.attn[layer]
            yield from ((layer, n, getattr(a, n)) for n in ATTN_FIELDS)


def _digest(raw) -> str:
    # Per tensor a CRC (cheap, checked as each layer arrives); the entry's sha256 covers the whole.
    return f"crc32:{zlib.crc32(raw):08x}"


def _header(entry: SegmentEntry, n_tensors: int, transport: TensorTransport, checksum: str) -> pb.EntryHeader:
    return pb.EntryHeader(
        key=entry.key, segment_tokens=entry.segment_tokens, num_tokens=entry.data.num_tokens,
        local_start=entry.data.local_start, build_seconds=entry.build_seconds, nbytes=entry.nbytes,
        checksum=checksum, num_tensors=n_tensors, transport=transport.name)


def _block_chunks(entry: SegmentEntry, index: int, transport) -> Iterator[pb.EntryChunk]:
    """The entry as one message: its header with the device block, sealed over the entry's layout
    and the block's device checksum (cuda_ipc.device_seal), and a metadata-only TensorChunk per
    tensor (its offset in the block)."""
    # not made contiguous here: the transport packs them on its own stream, after `cuda_ready`
    tensors = [(layer, name, t.detach()) for layer, name, t in layer_tensors(entry.data)]
    header = _header(entry, len(tensors), transport, "")
    chunks, off = [], 0
    for layer, name, t in tensors:
        n = t.numel() * t.element_size()
        chunks.append(pb.TensorChunk(layer=layer, name=name, dtype=str(t.dtype).removeprefix("torch."),
                                     shape=list(t.shape), nbytes=n, block_offset=off))
        off += padded(n)
    transport.write_entry(header.block, [t for _, _, t in tensors], ready=entry.meta.get("cuda_ready"))
    header.checksum = device_seal(header, [([_spec(c) for c in chunks], header.block)])
    header.tensors.extend(chunks)
    yield pb.EntryChunk(segment_index=index, header=header)


def _spec(chunk) -> tuple:
    return chunk.layer, chunk.name, chunk.dtype, tuple(chunk.shape), chunk.block_offset


class LayeredEntry:
    """An entry sent layer by layer over cuda_ipc while its build is still running: `header()`
    first, then `layer(i, tensors)` for each layer as it is computed (its tensors packed into one
    device block, one message with their layout), then `seal(build_seconds)` with the seal over
    every layer block."""

    def __init__(self, index: int, key: str, segment_tokens: int, seam: int, num_tensors: int, transport):
        self.index, self.transport = index, transport
        self.head = pb.EntryHeader(key=key, segment_tokens=segment_tokens, num_tokens=segment_tokens - seam,
                                   local_start=seam, num_tensors=num_tensors, transport=transport.name, layered=True)
        self.parts: list[tuple[list, pb.DeviceBlock]] = []

    def header(self) -> pb.EntryChunk:
        return pb.EntryChunk(segment_index=self.index, header=self.head)

    def layer(self, layer: int, named: list[tuple[str, torch.Tensor]], ready=None) -> Iterator[pb.EntryChunk]:
        yield from layer_blocks([(self, named)], layer, self.transport, ready)

    def _layer_message(self, layer: int, named: list[tuple[str, torch.Tensor]]) -> pb.LayerBlock:
        msg = pb.LayerBlock(layer=layer)
        off = 0
        for name, t in named:
            n = t.numel() * t.element_size()
            msg.tensors.append(pb.TensorChunk(layer=layer, name=name, dtype=str(t.dtype).removeprefix("torch."),
                                              shape=list(t.shape), nbytes=n, block_offset=off))
            off += padded(n)
        return msg

    def seal(self, build_seconds: float) -> pb.EntryChunk:
        return pb.EntryChunk(segment_index=self.index, seal=pb.EntrySeal(
            checksum=device_seal(self.head, self.parts), build_seconds=build_seconds))


def layer_blocks(pairs, layer: int, transport, ready=None) -> Iterator[pb.EntryChunk]:
    """One layer of several entries being sent (`pairs`: [(LayeredEntry, [(name, tensor)])], the
    segments of one batched build): their blocks are ranges of one exported buffer
    (CudaIpcTransport.write_blocks), so the receiver maps it once; then a LayerBlock message per
    entry with its range and its tensors' layout."""
    msgs = [(le, le._layer_message(layer, named), named) for le, named in pairs]
    transport.write_blocks([(msg.block, [t.detach() for _, t in named]) for _, msg, named in msgs], ready=ready)
    for le, msg, _ in msgs:
        le.parts.append(([_spec(c) for c in msg.tensors], msg.block))
        yield pb.EntryChunk(segment_index=le.index, layer_block=msg)


def entry_chunks(entry: SegmentEntry, index: int, transport: TensorTransport) -> Iterator[pb.EntryChunk]:
    if getattr(transport, "packs_entries", False):
        yield from _block_chunks(entry, index, transport)
        return
    if not entry.checksum:
        entry.seal()
    tensors = list(layer_tensors(entry.data))
    yield pb.EntryChunk(segment_index=index, header=_header(entry, len(tensors), transport, entry.checksum))
    for layer, name, t in tensors:
        c = t.detach().contiguous().cpu()
        raw = memoryview(c.view(torch.uint8).reshape(-1).numpy()) if c.numel() else b""
        chunk = pb.TensorChunk(layer=layer, name=name, dtype=str(c.dtype).removeprefix("torch."),
                               shape=list(c.shape), checksum=_digest(raw), nbytes=len(raw))
        transport.write(chunk, c)
        yield pb.EntryChunk(segment_index=index, tensor=chunk)


def _tensor(chunk) -> torch.Tensor:
    if chunk.dtype not in _DTYPES:
        raise TransportError(f"unsupported dtype {chunk.dtype!r}")
    raw = read_shm(chunk.shm_name, chunk.shm_offset, chunk.nbytes) if chunk.shm_name else chunk.data
    if len(raw) != chunk.nbytes or _digest(raw) != chunk.checksum:
        raise TransportError(f"layer {chunk.layer} {chunk.name}: checksum mismatch")
    if chunk.nbytes == 0:
        return torch.empty(tuple(chunk.shape), dtype=_DTYPES[chunk.dtype])
    buf = raw if isinstance(raw, bytearray) else bytearray(raw)
    return torch.frombuffer(buf, dtype=torch.uint8).view(_DTYPES[chunk.dtype]).reshape(tuple(chunk.shape))


def _block_spec(chunk, size: int) -> tuple:
    """The (layer, name, dtype, shape, offset) of a TensorChunk of a device block of `size` bytes,
    checked to describe a tensor that lies in the block (its view is made once the entry verifies)."""
    dtype = _DTYPES.get(chunk.dtype)
    if dtype is None:
        raise TransportError(f"unsupported dtype {chunk.dtype!r}")
    n, off, shape = chunk.nbytes, chunk.block_offset, tuple(chunk.shape)
    if n != math.prod(shape) * dtype.itemsize or off < 0 or off + n > size or off % dtype.itemsize:
        raise TransportError(f"layer {chunk.layer} {chunk.name}: outside its device block")
    return chunk.layer, chunk.name, chunk.dtype, shape, off


@functools.lru_cache(maxsize=256)
def _strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of `shape` (an entry's shapes repeat layer after layer)."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _block_views(blocks, device) -> list[tuple[int, str, torch.Tensor]]:
    """An entry's tensors from its verified device blocks (`blocks`: [(bytes, specs, whether the
    bytes lie in an arena slot copy)]), as (layer, name, view). Blocks that are ranges of arena
    slot copies, which the other entries of the build share, are first copied back to back into
    one buffer of the entry's own (one kernel: cuda_ipc.own_buffer), so that the entry holds what
    it counts; a block copied on its own is already the entry's. Every view is one as_strided of
    its buffer seen as its dtype."""
    if any(in_slot for _, _, in_slot in blocks):
        buf = own_buffer([data for data, _, _ in blocks], device)
        bases, start = [], 0
        for data, _, _ in blocks:
            bases.append((buf, start))
            start += data.numel()
    else:
        bases = [(data, 0) for data, _, _ in blocks]
    typed: dict = {}
    out = []
    for (base, start), (_, specs, _) in zip(bases, blocks):
        for layer, name, dtype, shape, off in specs:
            dt = _DTYPES[dtype]
            key = (id(base), dt)
            v = typed.get(key)
            if v is None:
                v = typed[key] = base.view(dt)
            at = v.storage_offset() + (start + off) // dt.itemsize
            out.append((layer, name, v.as_strided(shape, _strides(shape), at)))
    return out


class EntryAssembler:
    """Feed EntryChunks (possibly of several entries interleaved); completed entries come out."""

    def __init__(self, device="cpu"):
        checksum.warm(torch.device(device))  # its device blocks' checksum kernels compiled before they come
        self._open: dict[int, tuple[pb.EntryHeader, list]] = {}
        self._blocks: dict[int, torch.Tensor] = {}  # segment index -> its received device block
        self._started: dict[int, float] = {}  # segment index -> when its header arrived
        # segment index -> its device blocks so far, each with its tensors' (layer, name, dtype, shape,
        # offset), the device checksum sums of its copy or the copy of the arena slot it lies in
        # (checked when the entry completes), the timer of that copy (cuda_ipc.copy_timer) and the
        # block's bytes here (its copy, or its range of the slot's copy)
        self._parts: dict[int, list[tuple[pb.DeviceBlock, list, torch.Tensor | SlotCopy | None, object,
                                          torch.Tensor]]] = {}
        # arena slots copied here, by (arena, index, generation): their blocks are views of the copy
        self._slots: dict[tuple[str, int, int], SlotCopy] = {}
        self._unreleased: list[SlotCopy] = []  # copies whose sender slot is not released yet
        self._failed: set[int] = set()  # entries already reported failed: their later tensors are dropped
        self.bytes_received = 0
        # the time entries took to arrive and be checked once built, summed: for host transports
        # from each entry's header to its last tensor (the sender streams an entry once built), for
        # device blocks the time spent opening, copying and checking them (a layered entry's
        # header comes before its build is done)
        self.seconds = 0.0
        # host seconds spent receiving device blocks: mapping, queuing the copies and checksums,
        # reading the checksums back and packing verified entries (the host's time, not the link's)
        self.device_seconds = 0.0
        # the time of the device blocks' copies and their checksums themselves, summed once per
        # copy (an arena slot's copy serves several blocks): on CUDA measured on the GPU (timing
        # events on the side stream, read once the entry's checksums are back), off CUDA the host
        # time of the copies. Counted when an entry of the copy completes, or at close().
        self.copy_seconds = 0.0
        # device blocks received, and the sender buffers mapped for them (CUDA IPC handles opened;
        # the blocks of a buffer mapped already open none)
        self.device_blocks = 0
        self.ipc_opens = 0
        self.slots_received = 0  # arena slots copied (one device-to-device copy each)
        self.transport = ""  # the transport of the last header
        # device blocks that could not be opened or copied here (not checksum mismatches): the
        # receiver then asks that sender for host transports
        self.device_errors = 0
        self.last_device_error = ""
        # where cuda_ipc's block copies land (host transports' tensors arrive in host memory)
        self.device = device

    @property
    def transfer_seconds(self) -> float:
        """Seconds the received entries took to arrive and be checked (seconds + device_seconds)."""
        return self.seconds + self.device_seconds

    def feed(self, chunk) -> tuple[int, SegmentEntry | None, str] | None:
        """Returns (segment_index, entry, "") when an entry completes, (index, None, error) on a
        failed one, None otherwise. Never returns an entry whose checksums do not verify.
        Releases the sender's arena slots whose copies are done first (polled, waits for nothing)."""
        if self._unreleased:
            self.release_slots()
        i = chunk.segment_index
        kind = chunk.WhichOneof("body")
        if kind == "error":
            self._drop(i)
            return i, None, chunk.error
        if kind == "header":
            self._drop(i)
            self._failed.discard(i)
            self._open[i] = (chunk.header, [])
            self._parts[i] = []
            self._started[i] = time.perf_counter()
            self.transport = chunk.header.transport
            if chunk.header.HasField("block"):
                failed = self._receive(i, chunk.header.block)
                if failed is not None:
                    return failed
            parts = self._open[i][1]
            for tensor in chunk.header.tensors:
                failed = self._tensor_chunk(i, chunk.header, parts, tensor)
                if failed is not None:
                    return failed
            if len(parts) == chunk.header.num_tensors and not chunk.header.layered:
                return self._finish(i)
            return None
        if i not in self._open:
            if i in self._failed:
                return None
            return i, None, f"{kind} chunk before its entry header"
        header, parts = self._open[i]
        if kind == "layer_block":
            if not header.layered:
                return self._fail(i, "layer block in an entry that is not layered")
            failed = self._receive(i, chunk.layer_block.block)
            if failed is not None:
                return failed
            for tensor in chunk.layer_block.tensors:
                failed = self._tensor_chunk(i, header, parts, tensor)
                if failed is not None:
                    return failed
            return None
        if kind == "seal":
            if not header.layered or len(parts) != header.num_tensors:
                return self._fail(i, f"entry {header.key[:12]}: sealed with {len(parts)} of "
                                     f"{header.num_tensors} tensors")
            return self._finish(i, chunk.seal)
        failed = self._tensor_chunk(i, header, parts, chunk.tensor)
        if failed is not None:
            return failed
        if len(parts) == header.num_tensors and not header.layered:
            return self._finish(i)
        return None

    def _tensor_chunk(self, i: int, header, parts: list, tensor):
        """Take one tensor of entry i (from its device block, or its own bytes); an error result or None."""
        try:
            if i in self._blocks:
                # the view is made once the entry's checksums and seal verify (_finish)
                self._parts[i][-1][1].append(_block_spec(tensor, self._blocks[i].numel()))
                t = None
            elif header.transport == "cuda_ipc":
                raise TransportError("cuda_ipc entry without its device block")
            else:
                t = _tensor(tensor)
            parts.append((tensor.layer, tensor.name, t))
        except TransportError as e:
            metrics.ENTRIES_REJECTED.labels(reason="checksum").inc()
            return self._fail(i, str(e))
        self.bytes_received += tensor.nbytes
        return None

    def _drop(self, i: int) -> None:
        for d in (self._open, self._blocks, self._parts, self._started):
            d.pop(i, None)

    def _fail(self, i: int, message: str):
        self._drop(i)
        self._failed.add(i)
        return i, None, message

    def _receive(self, i: int, block):
        """Copy device block `block` of entry i here (its tensors follow); an error result or None."""
        t0 = time.perf_counter()
        try:
            if block.nbytes % ALIGN:
                # a sender packs every tensor at an ALIGN boundary and pads the block to one
                raise TransportError(f"device block of {block.nbytes} bytes: not a multiple of {ALIGN}")
            if block.HasField("slot"):
                part = self._slot_block(i, block)
                timer = part.timer
            else:
                self._blocks[i], part, opened, timer = receive_block(block, self.device)
                self.ipc_opens += opened
        except TransportError as e:
            if e.unreachable:
                self.device_errors += 1
                self.last_device_error = str(e)
            else:
                metrics.ENTRIES_REJECTED.labels(reason="checksum").inc()
            return self._fail(i, str(e))
        self.device_seconds += time.perf_counter() - t0
        self.device_blocks += 1
        self._parts[i].append((block, [], part, timer, self._blocks[i]))
        return None

    def _slot_block(self, i: int, block) -> SlotCopy:
        """Block `block` of entry i, in an arena slot: a view of this assembler's copy of the slot
        (made when the slot's first block arrives)."""
        s = block.slot
        key = (s.arena, s.index, s.generation)
        copy = self._slots.get(key)
        if copy is None:
            copy = self._slots[key] = receive_slot(block, self.device)
            self.ipc_opens += copy.opened
            self.slots_received += 1
            # the sender's slot back once the copy is done (a sender short of room waits for it):
            # polled on the next feeds and when an entry completes, and meanwhile by the releaser
            # thread, which also covers the wait for the sender's next message
            if not copy.release():
                self._unreleased.append(copy)
                RELEASER.add(copy)
        elif not copy.matches(s):
            raise TransportError(f"arena slot {s.index}: its blocks describe it differently")
        if block.tensor_offset < 0 or block.nbytes < 0 or block.tensor_offset + block.nbytes > copy.own.numel():
            raise TransportError(f"device block of {block.nbytes} bytes at {block.tensor_offset} lies outside "
                                 f"its arena slot of {copy.own.numel()} bytes")
        self._blocks[i] = copy.own[block.tensor_offset: block.tensor_offset + block.nbytes]
        return copy

    def release_slots(self, wait: bool = False) -> None:
        """Release the sender's arena slots whose copies are done (polled; with `wait`: all of
        them, waiting for those still copying). The copies run in order on one side stream, so a
        poll stops at the first copy not done: a feed queries one event, not one a pending copy
        (each query is a driver call, and a request's stream is a thousand feeds)."""
        if wait:
            self._unreleased = [c for c in self._unreleased if not c.release(True)]
            return
        done = 0
        for c in self._unreleased:
            if not c.release():
                break
            done += 1
        if done:
            del self._unreleased[:done]

    def _count_copy(self, timer) -> None:
        """Add a finished copy's time to copy_seconds, once per copy."""
        if timer is not None and not timer.counted:
            timer.counted = True
            self.copy_seconds += timer.seconds()

    def close(self) -> None:
        """Release every arena slot still held (the stream ended: waits for their copies); the
        copies stay valid. The copies of entries that did not complete count in copy_seconds here."""
        self.release_slots(wait=True)
        for copy in self._slots.values():
            self._count_copy(copy.timer)

    def _finish(self, i: int, seal=None):
        header, parts = self._open.pop(i)
        self._blocks.pop(i, None)
        blocks = self._parts.pop(i, [])
        started = self._started.pop(i, time.perf_counter())
        if not blocks:
            self.seconds += time.perf_counter() - started
        else:
            # An entry of device blocks (cuda_ipc) carries a seal over its layout and the blocks'
            # checksums, which are checked on the copies received here: the blocks' checksums all
            # read back at once (an arena slot's copy once, for all of its blocks), then the seal;
            # its tensors are views made only once both verify.
            t0 = time.perf_counter()
            copies = list({id(p): p for _, _, p, _, _ in blocks if isinstance(p, SlotCopy)}.values())
            intact = check_blocks([(b, p) for b, _, p, _, _ in blocks if not isinstance(p, SlotCopy)], self.device)
            intact = check_slots(copies, self.device) and intact
            self.release_slots()  # checked: those copies are done
            for _, _, _, timer, _ in blocks:  # their checksums are back, so their timers have passed
                self._count_copy(timer)
            self.device_seconds += time.perf_counter() - t0
            if not intact:
                metrics.ENTRIES_REJECTED.labels(reason="checksum").inc()
                return i, None, f"entry {header.key[:12]}: device block checksum mismatch"
            checksum = seal.checksum if seal is not None else header.checksum
            if not verify_device_seal(checksum, header, [(specs, block) for block, specs, _, _, _ in blocks]):
                metrics.ENTRIES_REJECTED.labels(reason="seal").inc()
                return i, None, f"entry {header.key[:12]}: seal does not verify (forged, corrupt or unsealed)"
            t0 = time.perf_counter()
            parts = _block_views([(data, specs, isinstance(p, SlotCopy)) for _, specs, p, _, data in blocks],
                                 self.device)
            self.device_seconds += time.perf_counter() - t0
        linear, attn, by_layer = {}, {}, {}
        for layer, name, t in parts:
            by_layer.setdefault(layer, {})[name] = t
        for layer, d in by_layer.items():
            if set(d) == set(LINEAR_FIELDS):
                linear[layer] = LinearSpan(d["T"], d["S"], d["conv_tail"])
            elif set(d) == set(ATTN_FIELDS):
                attn[layer] = AttnSpan(d["k"], d["v"])
            else:
                metrics.ENTRIES_REJECTED.labels(reason="layout").inc()
                return i, None, f"layer {layer} has tensors {sorted(d)}"
        data = SpanData(header.num_tokens, header.local_start, linear, attn)
        build_seconds = seal.build_seconds if seal is not None else header.build_seconds
        # verified device blocks: unsealed from here on, so that passing the entry on (to a cache
        # tier) seals its bytes; every other entry must carry a seal over its bytes that verifies
        # (what the header says about its transport is not trusted)
        entry = SegmentEntry(key=header.key, segment_tokens=header.segment_tokens, data=data,
                             build_seconds=build_seconds, checksum="" if blocks else header.checksum)
        if not blocks and (header.layered or not header.checksum or not entry.verify()):
            metrics.ENTRIES_REJECTED.labels(reason="seal").inc()
            return i, None, f"entry {header.key[:12]}: seal does not verify (forged, corrupt or unsealed)"
        return i, entry, ""


def read_entries(chunks: Iterable) -> Iterator[tuple[int, SegmentEntry | None, str]]:
    asm = EntryAssembler()
    for chunk in chunks:
        out = asm.feed(chunk)
        if out is not None:
            yield out


def entry_to(entry: SegmentEntry, device) -> SegmentEntry:
    """The entry with its tensors on `device` (entries arrive on the host; the model may be on a GPU)."""
    d = entry.data
    if all(t.device == torch.device(device) for _, _, t in layer_tensors(d)):
        return entry
    linear = {i: LinearSpan(s.T.to(device), s.S.to(device), s.conv_tail.to(device)) for i, s in d.linear.items()}
    attn = {i: AttnSpan(a.k.to(device), a.v.to(device)) for i, a in d.attn.items()}
    data = SpanData(d.num_tokens, d.local_start, linear, attn)
    return SegmentEntry(key=entry.key, segment_tokens=entry.segment_tokens, data=data,
                        build_seconds=entry.build_seconds, nbytes=entry.nbytes, checksum=entry.checksum)
