"""A host-memory tier under the device entry cache, and layer-by-layer staging of its entries.

The device store (MemoryEntryStore on the model's device) holds the entries a request folds in
directly. What it evicts moves here instead of being dropped: each entry becomes one pinned
host buffer, packed layer by layer (a layer's tensors back to back, 16-byte aligned: runtime/packing.py), so that a
layer of many entries reaches the device in one pass of large copies. A request that hits here
stages all its host entries at once (`stage`): per layer, one device buffer for that layer of
every host entry, filled by copies queued on a side stream in layer order, and one event per
layer. The spans it gets are ArrivingLayers: the forward waits for layer i's event only when
it reaches layer i, so the copies of later layers overlap the compute of earlier ones (the
same overlap the segment-parallel combine gets from layer-streamed receives).

Host hits are staged for each request that uses them and are not promoted back into the device
store: a promoted entry would evict another one down here, and the staged buffers are shared by
all entries of a request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from hybridcache.services.runtime.cache.base import EntryStore
from hybridcache.services.runtime.cache.entry import SegmentEntry
from hybridcache.services.runtime.cache.memory import MemoryEntryStore
from hybridcache.services.runtime.packing import packed_bytes, unpack_views
from hybridcache.services.runtime.sequence import ArrivingLayers, AttnSpan, LinearSpan, SpanData


def _layer_tensors(data: SpanData, layer: int) -> list[torch.Tensor]:
    if layer in data.linear:
        s = data.linear[layer]
        return [s.T, s.S, s.conv_tail]
    a = data.attn[layer]
    return [a.k, a.v]


def _layers(data: SpanData) -> list[int]:
    return sorted([*data.linear, *data.attn])


def _views(buf: torch.Tensor, start: int, like: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Views of buf from byte `start`, packed as runtime/packing.py packs the tensors `like`;
    returns them and the end."""
    specs = [(t.shape, t.dtype) for t in like]
    end = start + packed_bytes(specs)
    return unpack_views(buf[start:end], specs), end


def _span(data: SpanData, layer: int, tensors: list[torch.Tensor]):
    return LinearSpan(*tensors) if layer in data.linear else AttnSpan(*tensors)


class HostEntry:
    """An entry's tensors in one host buffer (pinned when CUDA is present), layer after layer.
    `layers[l] = (offset, nbytes)` of layer l; `data` views the buffer (shapes and dtypes kept)."""

    def __init__(self, entry: SegmentEntry):
        src = entry.data
        layers = _layers(src)
        size = packed_bytes([(t.shape, t.dtype) for lay in layers for t in _layer_tensors(src, lay)])
        self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.layers: dict[int, tuple[int, int]] = {}
        self.specs: dict[int, list[tuple]] = {}  # layer -> [(shape, stride, dtype, byte offset in the layer)]
        linear, attn, off = {}, {}, 0
        for lay in layers:
            tensors = _layer_tensors(src, lay)
            views, end = _views(self.buffer, off, tensors)
            for v, t in zip(views, tensors):
                v.copy_(t)  # device -> host (synchronous: the entry is leaving the device)
            (linear if lay in src.linear else attn)[lay] = _span(src, lay, views)
            # where each tensor lies in the layer's bytes, for stage's one-call views
            self.specs[lay] = [
                (v.shape, v.stride(), v.dtype, v.storage_offset() * v.element_size() - off) for v in views
            ]
            self.layers[lay] = (off, end - off)
            off = end
        self.data = SpanData(src.num_tokens, src.local_start, linear, attn)


def to_host(entry: SegmentEntry) -> SegmentEntry:
    """A copy of `entry` held in host memory (meta["host"] keeps the HostEntry); same key, bytes,
    checksum and build time, so the host store weighs it as the device store did."""
    host = HostEntry(entry)
    meta = dict(entry.meta, host=host)
    return SegmentEntry(entry.key, entry.segment_tokens, host.data, entry.build_seconds, entry.nbytes,
                        entry.checksum, meta)


def is_host(entry: SegmentEntry) -> bool:
    return "host" in entry.meta


class _Stager:
    """The copies of staged layers, queued on the copy stream in layer order as stage() allocates
    each layer's buffer."""

    def __init__(self, stream, layers: list[int]):
        self.stream = stream
        self.layers = layers
        self.copies: dict[int, list] = {lay: [] for lay in layers}  # layer -> [(dst, src)]
        self.buffers: dict[int, torch.Tensor] = {}
        self.events: dict[int, torch.cuda.Event] = {}
        self.queued = 0  # layers[:queued] are on the copy stream

    def queue_through(self, n: int) -> None:
        """Queue the copies of layers[:n] not queued yet."""
        n = min(n, len(self.layers))
        if n <= self.queued:
            return
        with torch.cuda.stream(self.stream):
            for lay in self.layers[self.queued : n]:
                for dst, src in self.copies.pop(lay):
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
                # allocated on the compute stream, written on the copy stream: the allocator must
                # not hand its memory out again before those copies are done, even if the forward
                # stops before it reaches this layer
                self.buffers.pop(lay).record_stream(self.stream)
                self.events[lay] = event
        self.queued = n

    def waiter(self, layer: int, device):
        return _EventWait(self, layer, device)


class _EventWait:
    """Makes the device's current stream wait for a staged layer's copies (no host synchronization),
    queuing them first if they are not queued yet."""

    def __init__(self, stager: _Stager, layer: int, device: torch.device):
        self._stager, self._layer, self._device = stager, layer, device
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        st = self._stager
        st.queue_through(st.layers.index(self._layer) + 1)
        torch.cuda.current_stream(self._device).wait_event(st.events[self._layer])
        self._done = True


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}
_copy_lock = threading.Lock()


def _copy_stream(device: torch.device):
    with _copy_lock:
        if device not in _copy_streams:
            _copy_streams[device] = torch.cuda.Stream(device=device)
        return _copy_streams[device]


def stage(entries: list[SegmentEntry], device: torch.device | str) -> list[SpanData]:
    """Device-side SpanData of host entries (to_host copies), layer by layer: for each layer one
    device buffer with that layer of every entry, filled on a side stream (CUDA) and waited for on
    first use of the layer. Each layer's copies are queued as soon as its buffer is allocated, so
    the copy engine runs while the rest of staging builds the views (at 32 x 1k that host work had
    held the copies back for tens of milliseconds). On the CPU the copies run in place and nothing
    waits."""
    device = torch.device(device)
    hosts = [e.meta["host"] for e in entries]
    if not hosts:
        return []
    layers = sorted(hosts[0].layers)
    cuda = device.type == "cuda"
    stager = None
    if cuda:
        stager = _Stager(_copy_stream(device), layers)
        # the buffers are allocated on the compute stream; the copy stream must not run ahead of that
        stager.stream.wait_stream(torch.cuda.current_stream(device))
    spans = [({}, {}) for _ in hosts]
    waits: dict[int, _EventWait] = {}
    for k, lay in enumerate(layers):
        total = sum(h.layers[lay][1] for h in hosts)
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        off = 0
        for h in hosts:
            start, n = h.layers[lay]
            if cuda:
                stager.copies[lay].append((buf[off : off + n], h.buffer[start : start + n]))
            else:
                buf[off : off + n].copy_(h.buffer[start : start + n])
            off += n
        if cuda:
            stager.buffers[lay] = buf
            waits[lay] = stager.waiter(lay, device)
            stager.queue_through(k + 1)  # the copy engine starts while the views are made
        typed: dict[torch.dtype, torch.Tensor] = {}
        off = 0
        for j, h in enumerate(hosts):
            views = []
            for shape, stride, dtype, rel in h.specs[lay]:
                whole = typed.get(dtype)
                if whole is None:
                    whole = typed[dtype] = buf.view(dtype)  # sizes are 16-byte padded (packing.py)
                views.append(whole.as_strided(shape, stride, (off + rel) // whole.element_size()))
            off += h.layers[lay][1]
            src = h.data
            (spans[j][0] if lay in src.linear else spans[j][1])[lay] = _span(src, lay, views)
    out = []
    for h, (linear, attn) in zip(hosts, spans):
        out.append(SpanData(h.data.num_tokens, h.data.local_start, ArrivingLayers(linear, waits),
                            ArrivingLayers(attn, waits)))
    return out


class TieredEntryStore(EntryStore):
    """Entries on the device (`device`, a MemoryEntryStore) over a host tier of `host_bytes`:
    the device store's evictions move down (to_host) instead of being dropped. get() answers from
    the device first, then from the host (an entry with is_host(entry), to be staged)."""

    def __init__(self, device_bytes: int, host_bytes: int, verify_checksums: bool = False,
                 to_host_fn: Callable[[SegmentEntry], SegmentEntry] = to_host):
        self.host = MemoryEntryStore(host_bytes, verify_checksums)
        self._to_host = to_host_fn
        self.device = MemoryEntryStore(device_bytes, verify_checksums, on_evict=self._demote)
        self.demotions = 0

    def _demote(self, entry: SegmentEntry) -> None:
        if entry.nbytes <= self.host.capacity_bytes and self.host.put(self._to_host(entry)):
            self.demotions += 1

    def demote_all(self) -> None:
        """Move every device entry to the host tier (warm-up, tests, benchmarks of host hits)."""
        for key in self.device.keys():
            e = self.device.get(key)
            if e is not None:
                self.device.delete(key)
                self._demote(e)

    def get(self, key: str) -> SegmentEntry | None:
        e = self.device.get(key)
        return e if e is not None else self.host.get(key)

    def put(self, entry: SegmentEntry) -> bool:
        self.host.delete(entry.key)  # one copy of an entry, in one tier
        return self.device.put(entry)

    def contains(self, key: str) -> bool:
        return self.device.contains(key) or self.host.contains(key)

    def delete(self, key: str) -> None:
        self.device.delete(key)
        self.host.delete(key)

    def __len__(self) -> int:
        return len(self.device) + len(self.host)

    @property
    def used_bytes(self) -> int:
        return self.device.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.device.capacity_bytes

    @property
    def evictions(self) -> int:
        return self.host.evictions
