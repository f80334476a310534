"""The cuda_ipc arena (services/transport/ipc_pool.py) with the CUDA calls replaced by an
in-process stand-in: sub-allocation, release through the release file, reuse across requests
with no new IPC open, a sender's new arena, and corrupt or forged slots being misses."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hybridcache.services.protocol import pb
from hybridcache.services.protocol import segment as pb_segment
from hybridcache.services.transport import TransportError, cuda_ipc, ipc_pool
from hybridcache.services.transport.codec import EntryAssembler, layer_tensors, read_entries
from hybridcache.services.transport.ipc_pool import ArenaPool, ReleaseFile, SlotAllocator
from serving_helpers import FakeCudaIpc

GPU_A = "GPU-aaaa"


@pytest.fixture
def fake_ipc(monkeypatch):
    """CUDA IPC as an in-process registry of CPU buffers (serving_helpers.FakeCudaIpc): (buffers by
    handle, handles opened, handles exported)."""
    fake = FakeCudaIpc(monkeypatch, GPU_A, (GPU_A,))
    return fake.shared, fake.opened_handles, fake.exports


class _Context:
    def invocation_metadata(self):
        return ()

    def add_callback(self, fn):
        return True


@pytest.fixture
def servicer(engine):
    from hybridcache.services.scatter.worker import ScatterServicer

    made = []

    def make(arena_bytes=8 << 20):
        s = ScatterServicer(engine, max_batch_tokens=10_000, arena_bytes=arena_bytes)
        s.transport_for = lambda request: "cuda_ipc"
        made.append(s)
        return s

    yield make
    for s in made:
        if s.arenas is not None:
            s.arenas.close()


def _segments(seed, lengths=(30, 47, 52)):
    rng = random.Random(seed)
    return [[rng.randrange(5, 250) for _ in range(n)] for n in lengths]


def _prefill(servicer, segs, receiver="combine-1"):
    request = pb.PrefillRequest(segments=[pb_segment(i, s) for i, s in enumerate(segs)])
    request.receiver.process = receiver
    return [pb.EntryChunk.FromString(c.SerializeToString()) for c in servicer.Prefill(request, _Context())]


def _receive(chunks):
    asm = EntryAssembler()
    out = [r for c in chunks if (r := asm.feed(c)) is not None]
    asm.close()
    return out, asm


def _same(got, want):
    pairs = zip(layer_tensors(got.data), layer_tensors(want.data), strict=True)
    return all((la, na) == (lb, nb) and torch.allclose(a, b, atol=1e-6) for (la, na, a), (lb, nb, b) in pairs)


def test_slot_allocator_sub_allocates_releases_and_reclaims():
    alloc = SlotAllocator(4096, n_slots=3, align=256, stale_s=10.0)
    a = alloc.allocate(1000, now=0.0)
    b = alloc.allocate(300, now=0.0)
    assert (a.offset, b.offset) == (0, 1024) and a.generation != b.generation
    assert alloc.allocate(5000, now=0.0) is None  # larger than the arena
    c = alloc.allocate(2000, now=0.0)
    assert c.offset == 1536 and alloc.held == 3
    assert alloc.allocate(16, now=0.0) is None  # every slot index in use
    released = {a.index: a.generation}
    assert alloc.reap(lambda i: released.get(i, 0), now=1.0) == 1 and alloc.held == 2
    d = alloc.allocate(900, now=1.0)
    assert d.offset == 0 and d.index == a.index and d.generation > c.generation  # first fit, a new use
    # an old release of that index (a's generation) does not free d
    assert alloc.reap(lambda i: released.get(i, 0), now=2.0) == 0
    assert alloc.allocate(2000, now=2.0) is None  # 512 bytes left at the end, 124 in the gap
    # a slot nobody released is taken back after stale_s
    assert alloc.reap(lambda i: 0, now=11.5) == 3 and alloc.held == 0 and alloc.reclaimed_stale == 3
    assert alloc.allocate(4096, now=12.0).offset == 0


def test_release_file_is_shared_through_dev_shm():
    arena_id = "ab" * 16
    mine = ReleaseFile(arena_id, 8, create=True)
    try:
        theirs = ReleaseFile(arena_id)  # the receiver's mapping of the same file
        assert theirs.n_slots == 8 and mine.generation(3) == 0
        theirs.release(3, 41)
        theirs.release(99, 7)  # out of range: ignored
        assert mine.generation(3) == 41
        with pytest.raises(TransportError, match="already exists|File exists"):
            ReleaseFile(arena_id, 8, create=True)
    finally:
        mine.unlink()
    with pytest.raises(TransportError) as e:
        ReleaseFile(arena_id)
    assert e.value.unreachable
    for bad in ("../etc", "AB" * 16, "ab" * 15):
        with pytest.raises(TransportError, match="bad arena id"):
            ReleaseFile(bad)


def test_entries_through_the_arena_reuse_it_across_requests(engine, fake_ipc, servicer):
    """One arena, exported once per receiver: every layer of a batch is one slot (one copy, one
    checksum); the receiver maps the arena on the first request and opens nothing on the next
    ones; the slots are released, so the later requests write to the same offsets; the entries
    equal the ones built."""
    shared, opened, exports = fake_ipc
    scatter = servicer()
    n_layers = engine.cfg.num_hidden_layers
    offsets = []
    for request in range(3):
        segs = _segments(request)
        chunks = _prefill(scatter, segs)
        blocks = [c.layer_block.block for c in chunks if c.HasField("layer_block")]
        assert len(blocks) == 3 * n_layers and all(b.HasField("slot") and not b.checksum for b in blocks)
        assert len({(b.slot.index, b.slot.generation) for b in blocks}) == n_layers  # a slot a layer
        offsets.append(sorted({b.slot.offset for b in blocks}))
        out, asm = _receive(chunks)
        assert [(i, err) for i, _, err in out] == [(0, ""), (1, ""), (2, "")]
        assert asm.ipc_opens == (1 if request == 0 else 0) and asm.slots_received == n_layers
        assert asm.device_blocks == 3 * n_layers
        for (_, got, _), want in zip(out, engine.build_entries(segs)):
            assert got.key == want.key and _same(got, want)
        # every slot released once copied and checked: the arena holds nothing between requests
        assert scatter.arenas._arenas[torch.device("cpu")].idle()
    assert len(shared) == 1 and len(opened) == 1 and len(exports) == 1 and cuda_ipc.ARENAS.opened == 1
    assert offsets[0] == offsets[1] == offsets[2]  # the released slots are written again
    # the receiver's copies are its own: the sender overwriting its arena changes nothing received
    got = out[0][1]
    before = got.data.linear[0].S.clone()
    next(iter(shared.values())).zero_()
    assert torch.equal(got.data.linear[0].S, before)
    # another receiving process gets its own export of the same arena (no new buffer)
    assert [err for _, _, err in _receive(_prefill(scatter, _segments(7), receiver="combine-2"))[0]] == [""] * 3
    assert len(shared) == 1 and len(exports) == 2


def test_a_restarted_sender_arena_is_mapped_anew(engine, fake_ipc, servicer):
    """A new arena (a sender that restarted, or grew its arena) is another id: the receiver maps
    it once and drops its mapping of the sender's old one; entries from both are right."""
    shared, opened, _ = fake_ipc
    first = servicer()
    assert [e for _, _, e in _receive(_prefill(first, _segments(1)))[0]] == [""] * 3
    owner = first.endpoint.process
    old = cuda_ipc.ARENAS.mapped()[owner]
    first.arenas.close()
    first.arenas = ArenaPool(8 << 20, owner=owner)  # the same process id, a new arena
    segs = _segments(2)
    out, asm = _receive(_prefill(first, segs))
    assert [e for _, _, e in out] == [""] * 3 and asm.ipc_opens == 1 and len(opened) == 2
    assert cuda_ipc.ARENAS.mapped()[owner] not in ("", old)
    assert all(_same(got, want) for (_, got, _), want in zip(out, engine.build_entries(segs)))
    # a new process (another id) is one more sender
    second = servicer()
    second.arenas.close()
    second.arenas = ArenaPool(8 << 20, owner="another-process")
    assert _receive(_prefill(second, _segments(3)))[1].ipc_opens == 1 and len(cuda_ipc.ARENAS.mapped()) == 2


def test_a_write_larger_than_free_arena_space_takes_a_fresh_buffer(engine, fake_ipc, servicer):
    """A layer batch that does not fit the arena now (slots still held) goes out in a fresh
    exported buffer, as without an arena; an idle arena too small for a write is replaced by a
    larger one."""
    from hybridcache.services.transport import get_transport

    scatter = servicer(arena_bytes=4096)
    arena = scatter.arenas.arena(torch.device("cpu"), 16)
    held = arena.take(4096)
    chunks = _prefill(scatter, _segments(4))
    blocks = [c.layer_block.block for c in chunks if c.HasField("layer_block")]
    assert not any(b.HasField("slot") for b in blocks) and all(b.checksum for b in blocks)
    assert [e for _, _, e in _receive(chunks)[0]] == [""] * 3
    arena.releases.release(held.index, held.generation)
    transport = get_transport("cuda_ipc", pool=scatter.arenas, receiver="r")
    block = pb.DeviceBlock()
    transport.write_entry(block, [torch.ones(3000)])  # 12,000 bytes: more than the arena holds
    assert block.HasField("slot") and transport.slots == 1 and scatter.arenas.created == 2
    assert scatter.arenas.arena(torch.device("cpu"), 16).capacity >= 12_000


def _forge(chunks, edit):
    out = [pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks]
    edit(out)
    return out


def _first_block(chunks, segment=0, layer=None):
    return next(c.layer_block.block for c in chunks if c.HasField("layer_block") and c.segment_index == segment
                and (layer is None or c.layer_block.layer == layer))


def test_corrupt_or_forged_slots_are_misses(engine, fake_ipc, servicer):
    shared, _, _ = fake_ipc
    scatter = servicer()
    chunks = _prefill(scatter, _segments(5))
    assert [e for _, _, e in _receive(chunks)[0]] == [""] * 3

    def errors(bad, segment=0):
        out, _ = _receive(bad)
        assert all(entry is None for i, entry, _ in out if i == segment)
        return next(err for i, _, err in out if i == segment)

    # the arena's bytes changed after the sender's checksum: the whole slot's entries are misses
    (arena_buf,) = shared.values()
    slot = _first_block(chunks).slot
    arena_buf[slot.offset + 5] ^= 1
    out, _ = _receive(chunks)
    assert all(e is None and "checksum mismatch" in err for _, e, err in out)
    arena_buf[slot.offset + 5] ^= 1
    linear = engine.cfg.linear_layers[0]

    def moved_block(c):  # segment 0's block pointed at segment 1's range (same size) of the slot
        a, b = _first_block(c, 0, linear), _first_block(c, 1, linear)
        assert a.nbytes == b.nbytes
        a.tensor_offset = b.tensor_offset

    assert "seal does not verify" in errors(_forge(chunks, moved_block))
    # another checksum claimed for the slot: by its first block, which the copy is checked against,
    # or by a later one, which then disagrees with the first
    for segment, error in ((0, "checksum mismatch"), (1, "describe it differently")):
        assert error in errors(_forge(chunks, lambda c, segment=segment: setattr(
            _first_block(c, segment, linear).slot, "checksum", "blk64:1:2:3")), segment)

    def all_checksums(c):
        for m in c:
            if m.HasField("layer_block"):
                m.layer_block.block.slot.checksum = "blk64:1:2:3"
    assert "checksum mismatch" in errors(_forge(chunks, all_checksums))
    # a slot outside the arena, a block outside its slot, a slot index the arena does not have
    assert "outside its arena" in errors(_forge(chunks, lambda c: setattr(_first_block(c).slot, "offset", 1 << 40)))
    assert "outside its arena slot" in errors(_forge(chunks, lambda c: setattr(
        _first_block(c), "tensor_offset", 1 << 40)))
    assert "is not one of the arena's" in errors(_forge(chunks, lambda c: setattr(
        _first_block(c).slot, "index", 1 << 20)))
    # a tensor at an offset its dtype cannot start at, a block no sender pads that way: errors
    # before any view of the bytes is made, never an exception out of the assembler

    def first_tensor(c):
        return next(m for m in c if m.HasField("layer_block") and m.segment_index == 0).layer_block.tensors[0]

    assert "outside its device block" in errors(_forge(chunks, lambda c: setattr(first_tensor(c), "block_offset", 1)))
    assert "not a multiple of 16" in errors(_forge(chunks, lambda c: setattr(
        _first_block(c), "nbytes", _first_block(c).nbytes - 4)))
    # a forged seal, and an arena id no sender made (no release file: unreachable, counted apart)
    assert "seal does not verify" in errors(_forge(chunks, lambda c: setattr(
        next(m for m in c if m.HasField("seal")).seal, "checksum", "hmac-sha256-dev:" + "1" * 64)))
    cuda_ipc.ARENAS.clear()
    bad = _forge(chunks, lambda c: [setattr(m.layer_block.block.slot, "arena", "f" * 32)
                                    for m in c if m.HasField("layer_block")])
    out, asm = _receive(bad)
    assert all(e is None for _, e, _ in out) and asm.device_errors >= 1 and "release file" in asm.last_device_error
    # the untouched stream still arrives whole
    out = list(read_entries(chunks))
    assert [e for _, _, e in out] == [""] * 3


def test_an_arenas_release_file_goes_with_it():
    pool = ArenaPool(1 << 16)
    arena = pool.arena(torch.device("cpu"), 100)
    path = arena.releases.path
    assert path.is_file() and ReleaseFile(arena.id).n_slots == ipc_pool.DEFAULT_SLOTS
    pool.close()
    assert not path.exists()
    other = ArenaPool(1 << 16).arena(torch.device("cpu"), 100)  # dropped without close: unlinked when collected
    path = other.releases.path
    del other
    import gc

    gc.collect()
    assert not path.exists()


def test_an_entry_from_the_arena_holds_memory_of_its_own(engine, fake_ipc, servicer):
    """Entries of one build share slot copies while they arrive; once verified each is packed
    into a buffer of its own, so that one kept in a cache does not hold the others' bytes."""
    out, _ = _receive(_prefill(servicer(), _segments(8)))
    storages = []
    for _, entry, _ in out:
        tensors = [t for _, _, t in layer_tensors(entry.data)]
        own = {t.untyped_storage().data_ptr() for t in tensors}
        assert len(own) == 1  # one buffer per entry
        (ptr,) = own
        assert tensors[0].untyped_storage().nbytes() == sum(-(-t.numel() * t.element_size() // 16) * 16
                                                            for t in tensors)
        storages.append(ptr)
    assert len(set(storages)) == len(out)


def test_a_write_larger_than_a_busy_arena_does_not_wait():
    arena = ArenaPool(4096, wait_s=5.0).arena(torch.device("cpu"), 16)
    try:
        held = arena.take(1000)
        t0 = time.monotonic()
        assert arena.take(8192, wait_s=5.0) is None and time.monotonic() - t0 < 1.0  # can never fit: no wait
        t0 = time.monotonic()
        assert arena.take(4000, wait_s=0.2) is None and time.monotonic() - t0 >= 0.2  # could, once released
        arena.releases.release(held.index, held.generation)
        assert arena.take(4000).offset == 0
    finally:
        arena.close()


class _FakeCopyTimer:
    """A copy timer (cuda_ipc.copy_timer) whose copy is done only once the test says so (`done`),
    as a CUDA copy still queued behind the sender's kernels would be; synchronize() waits for
    it as the CUDA event does (here: the copy completes), and it took `took` seconds."""

    def __init__(self, took: float):
        self.counted, self.done, self.took, self.waited = False, False, took, 0
        self._done = threading.Event()
        self.blocks = self.BLOCKS  # synchronize() waits for `done` (a CUDA event's wait), else completes the copy

    BLOCKS = False

    def stop(self) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name == "done" and value:
            self._done.set()

    def synchronize(self) -> None:
        self.waited += 1
        if self.blocks:
            self._done.wait()
        self.done = True

    def seconds(self) -> float:
        return self.took


@pytest.fixture
def fake_timers(monkeypatch):
    """The copy timers the receiver makes, in order, fake ones (the k-th took (k + 1) ms)."""
    made: list[_FakeCopyTimer] = []

    def make(device):
        made.append(_FakeCopyTimer((len(made) + 1) * 1e-3))
        return made[-1]

    monkeypatch.setattr(cuda_ipc, "copy_timer", make)
    return made


class _NoReleaser:
    def add(self, copy) -> None:
        pass


def _held(scatter) -> int:
    arena = scatter.arenas._arenas[torch.device("cpu")]
    arena.idle()  # takes back what the receiver released
    return arena.allocator.held


def test_receiving_waits_for_no_copy_and_releases_a_slot_only_once_its_copy_is_done(
        engine, fake_ipc, servicer, fake_timers, monkeypatch):
    """The receiver never blocks on a slot's copy: the entries come out while no copy is done,
    and no slot is released then; a feed after a copy is done releases its slot (polled), and
    close() waits for the rest and releases every slot."""
    from hybridcache.services.transport import codec

    monkeypatch.setattr(codec, "RELEASER", _NoReleaser())  # the assembler's own polls alone
    scatter = servicer()
    n_layers = engine.cfg.num_hidden_layers
    chunks = _prefill(scatter, _segments(10))
    asm = EntryAssembler()
    out = [r for c in chunks if (r := asm.feed(c)) is not None]
    assert [(i, err) for i, _, err in out] == [(0, ""), (1, ""), (2, "")]
    assert len(fake_timers) == n_layers and not any(t.waited for t in fake_timers)
    assert _held(scatter) == n_layers and not any(c.released for c in asm._slots.values())
    fake_timers[0].done = True
    asm.feed(pb.EntryChunk(segment_index=99, error="nothing"))  # any feed polls
    released = [c.released for c in asm._slots.values()]
    assert released == [True] + [False] * (n_layers - 1) and _held(scatter) == n_layers - 1
    asm.close()
    assert all(c.released for c in asm._slots.values()) and _held(scatter) == 0
    assert all(t.waited == (k > 0) for k, t in enumerate(fake_timers))  # close() waited for those not done


def test_the_releaser_thread_releases_slots_while_the_receiver_waits_on_the_stream(
        engine, fake_ipc, servicer, fake_timers, monkeypatch):
    """A copy done while the assembler is not fed (it waits for the sender's next message, the
    sender for arena room) has its slot released all the same, by cuda_ipc.RELEASER."""
    scatter = servicer()
    chunks = _prefill(scatter, _segments(11))
    asm = EntryAssembler()
    monkeypatch.setattr(_FakeCopyTimer, "BLOCKS", True)  # its waits wait, as CUDA events' do
    for c in chunks:
        asm.feed(c)
    n = len(fake_timers)
    assert n == engine.cfg.num_hidden_layers and _held(scatter) == n
    for t in fake_timers[:2]:
        t.done = True
    deadline = time.monotonic() + 5.0
    while _held(scatter) > n - 2 and time.monotonic() < deadline:
        time.sleep(1e-3)
    assert _held(scatter) == n - 2
    time.sleep(0.05)  # the thread waits for the third copy: no more is released
    assert [c.released for c in asm._slots.values()] == [True, True] + [False] * (n - 2)
    for t in fake_timers:
        t.done = True
    asm.close()
    assert _held(scatter) == 0


def test_close_releases_every_slot_of_a_stream_cut_short(engine, fake_ipc, servicer, fake_timers, monkeypatch):
    scatter = servicer()
    chunks = _prefill(scatter, _segments(12))
    cut = [c for c in chunks if not c.HasField("seal")][: len(chunks) // 2]  # the sender died mid-stream
    asm = EntryAssembler()
    monkeypatch.setattr(_FakeCopyTimer, "BLOCKS", True)  # the copies are still queued
    assert all(asm.feed(c) is None for c in cut)
    n_layers = engine.cfg.num_hidden_layers
    assert 0 < asm.slots_received < n_layers and _held(scatter) == n_layers
    for t in fake_timers:
        t.done = True
    asm.close()
    # every slot it copied is released (those it never saw come back to the sender as stale)
    assert all(c.released for c in asm._slots.values()) and _held(scatter) == n_layers - asm.slots_received
    # the copies of the entries that never completed count at close(), each once
    assert asm.copy_seconds == pytest.approx(sum(t.took for t in fake_timers))


def test_copy_seconds_counts_each_slot_copy_once(engine, fake_ipc, servicer, fake_timers):
    """copy_seconds is the copies' own time (the timers'), an arena slot's once though its
    blocks belong to several entries; device_seconds stays the host time spent receiving."""
    for t in fake_timers:
        t.done = True
    out, asm = _receive(_prefill(servicer(), _segments(13)))
    assert [e for _, _, e in out] == [""] * 3
    assert len(fake_timers) == asm.slots_received == engine.cfg.num_hidden_layers
    assert asm.copy_seconds == pytest.approx(sum(t.took for t in fake_timers))
    assert asm.device_seconds > 0


@pytest.mark.parametrize("arena_bytes", [8 << 20, 0])
def test_copy_seconds_on_the_cpu_is_the_host_time_of_the_copies(engine, fake_ipc, servicer, monkeypatch,
                                                                 arena_bytes):
    """Off CUDA the copies are timed on the host: each slot's (or, without an arena, each
    block's) copy and checksum, within the host time the assembler spent receiving them."""
    made = []
    real = cuda_ipc.copy_timer

    def recording(device):
        made.append(real(device))
        return made[-1]

    monkeypatch.setattr(cuda_ipc, "copy_timer", recording)
    out, asm = _receive(_prefill(servicer(arena_bytes), _segments(14)))
    assert [e for _, _, e in out] == [""] * 3
    n_layers = engine.cfg.num_hidden_layers
    assert len(made) == (n_layers if arena_bytes else 3 * n_layers) and all(t.counted for t in made)
    assert 0 < asm.copy_seconds == pytest.approx(sum(t.seconds() for t in made))
    assert asm.copy_seconds < asm.device_seconds
