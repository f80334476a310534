"""The transport choice from the two ends' Endpoints, the CUDA IPC path's host-side logic (export
fields, device matching by UUID, packing, checksums, refusals) with the CUDA calls replaced by an
in-process stand-in, and the cost model with the scatter path."""

from __future__ import annotations

import random

import pytest
import torch
from hybridcache.services.protocol import pb, segment, segment_ids
from hybridcache.services.router.cost import CostModel, parse_bandwidths
from hybridcache.services.transport import (
    Endpoint,
    TransportError,
    choose_transport,
    cuda_ipc,
    get_transport,
    local_endpoint,
)
from hybridcache.services.transport.checksum import device_checksum
from hybridcache.services.transport.codec import EntryAssembler, entry_chunks, layer_tensors, read_entries
from serving_helpers import FakeCudaIpc

GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"
NODE = Endpoint(host="boot-1", ipc_ns="ipc:[1]", pid_ns="pid:[1]")


def ep(base=NODE, **kw):
    return Endpoint(**{**base.__dict__, **kw})


@pytest.mark.parametrize("sender, receiver, want", [
    # one host, shared IPC and PID namespaces, the receiver sees the sender's GPU
    (ep(device=GPU_A, gpus=(GPU_A,)), ep(device=GPU_A, gpus=(GPU_A,)), "cuda_ipc"),
    (ep(device=GPU_B, gpus=(GPU_B, GPU_A)), ep(device=GPU_A, gpus=(GPU_A, GPU_B)), "cuda_ipc"),
    # the receiver cannot see the sender's GPU (a pod given only its own): host memory
    (ep(device=GPU_B, gpus=(GPU_B,)), ep(device=GPU_A, gpus=(GPU_A,)), "shm"),
    # the sender's entries are on the CPU
    (ep(), ep(device=GPU_A, gpus=(GPU_A,)), "shm"),
    # separate PID namespaces (pods without hostPID): no CUDA IPC, /dev/shm still shared
    (ep(device=GPU_A, gpus=(GPU_A,)), ep(pid_ns="pid:[2]", device=GPU_A, gpus=(GPU_A,)), "shm"),
    # separate IPC namespaces (pods without hostIPC): neither
    (ep(device=GPU_A, gpus=(GPU_A,)), ep(ipc_ns="ipc:[2]", device=GPU_A, gpus=(GPU_A,)), "grpc"),
    # another host
    (ep(device=GPU_A, gpus=(GPU_A,)), ep(host="boot-2", device=GPU_A, gpus=(GPU_A,)), "grpc"),
    # an identity nobody could read never counts as shared
    (Endpoint(device=GPU_A, gpus=(GPU_A,)), Endpoint(device=GPU_A, gpus=(GPU_A,)), "grpc"),
    (ep(ipc_ns="", device=GPU_A), ep(ipc_ns="", gpus=(GPU_A,)), "grpc"),
])
def test_transport_choice_from_endpoints(sender, receiver, want):
    assert choose_transport(sender, receiver) == want


def test_local_endpoint_on_this_host_and_its_wire_form():
    me = local_endpoint("cpu")
    assert me.host and me.ipc_ns.startswith("ipc:") and me.pid_ns.startswith("pid:")
    assert me.device == "" and me.gpus == ()
    # two processes of this machine share host and namespaces: shm, and no CUDA IPC from the CPU
    assert choose_transport(me, local_endpoint()) == "shm"
    msg = pb.Endpoint()
    ep(device=GPU_A, gpus=(GPU_A, GPU_B)).to_pb(msg)
    assert Endpoint.from_pb(pb.Endpoint.FromString(msg.SerializeToString())) == ep(device=GPU_A, gpus=(GPU_A, GPU_B))


@pytest.fixture
def fake_ipc(monkeypatch):
    """CUDA IPC as an in-process registry of CPU buffers (serving_helpers.FakeCudaIpc): (buffers by
    handle, block indices opened, handles whose reference counter was released)."""
    fake = FakeCudaIpc(monkeypatch, GPU_A, (GPU_B, GPU_A))
    return fake.shared, fake.opened_indices, fake.released


@pytest.fixture(scope="module")
def entries(engine):
    rng = random.Random(3)
    return [engine.build_entry([rng.randrange(256) for _ in range(n)]) for n in (24, 57)]


def test_cuda_ipc_entries_round_trip(entries, fake_ipc):
    shared, opened, _ = fake_ipc
    transport = get_transport("cuda_ipc")
    chunks = [c for i, e in enumerate(entries) for c in entry_chunks(e, i, transport)]
    headers = [c.header for c in chunks if c.WhichOneof("body") == "header"]
    # one device block per entry, its checksum in the header, no bytes in any message: each entry
    # is one message (its header holds the tensors' layout)
    assert len(chunks) == 2 and len(shared) == 2
    assert all(h.HasField("block") and h.block.checksum.startswith("blk64:") for h in headers)
    # sealed over the layout and the block's device checksum (the bytes never reach the host)
    assert all(h.transport == "cuda_ipc" and h.checksum.startswith("hmac-sha256-dev:") for h in headers)
    assert all(not t.data and not t.shm_name for h in headers for t in h.tensors)
    assert transport.bytes_moved() == sum(h.block.nbytes for h in headers)
    # no entry was sealed on the host on the way (the sender's sha256 is what cuda_ipc avoids)
    assert all(not e.checksum for e in entries)
    out = list(read_entries(pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks))
    assert [(i, err) for i, _, err in out] == [(0, ""), (1, "")]
    assert opened == [1, 1]  # the sender's GPU by UUID: index 1 in this process's numbering
    for (_, got, _), want in zip(out, entries):
        assert got.key == want.key and got.segment_tokens == want.segment_tokens
        for (la, na, a), (lb, nb, b) in zip(layer_tensors(got.data), layer_tensors(want.data), strict=True):
            assert (la, na) == (lb, nb) and a.dtype == b.dtype and torch.equal(a, b)
    # the receiver holds its own copy: the sender reusing its buffer changes nothing received
    got0 = out[0][1]
    before = got0.data.linear[0].S.clone()
    for buf in shared.values():
        buf.zero_()
    assert torch.equal(got0.data.linear[0].S, before)


def test_cuda_ipc_corruption_and_refusals(entries, fake_ipc, monkeypatch):
    shared, _, _ = fake_ipc
    chunks = list(entry_chunks(entries[0], 0, get_transport("cuda_ipc")))
    (buf,) = shared.values()
    buf[5] ^= 1  # the bytes changed after the sender's checksum
    (res,) = list(read_entries(chunks))
    assert res[1] is None and "checksum mismatch" in res[2]
    buf[5] ^= 1
    assert list(read_entries(chunks))[0][2] == ""
    # a tensor pointing outside its block
    bad = [pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks]
    bad[0].header.tensors[0].block_offset = buf.numel()
    assert "outside its device block" in list(read_entries(bad))[0][2]
    # a cuda_ipc header without its block (it would skip the host checksum otherwise)
    bad = [pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks]
    bad[0].header.ClearField("block")
    assert "without its device block" in list(read_entries(bad))[0][2]
    # offsets moved inside the block (tensors read from elsewhere): the seal covers them
    bad = [pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks]
    tensors = list(bad[0].header.tensors)
    same = next(t for t in tensors[1:] if (t.dtype, list(t.shape)) == (tensors[0].dtype, list(tensors[0].shape)))
    tensors[0].block_offset, same.block_offset = same.block_offset, tensors[0].block_offset
    assert "seal does not verify" in list(read_entries(bad))[0][2]
    # a forged header: another block checksum without the secret's seal
    bad = [pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks]
    bad[0].header.checksum = "hmac-sha256-dev:" + "0" * 64
    assert "seal does not verify" in list(read_entries(bad))[0][2]
    # the sender's GPU is not visible here: unreachable, which the receiver counts apart
    monkeypatch.setattr(cuda_ipc, "visible_gpus", lambda: (GPU_B,))
    asm = EntryAssembler()
    res = [r for c in chunks if (r := asm.feed(c)) is not None]
    assert len(res) == 1 and res[0][1] is None and "not visible" in res[0][2]
    assert asm.device_errors == 1 and "not visible" in asm.last_device_error
    # a failed entry leaves the assembler usable for the next one
    monkeypatch.setattr(cuda_ipc, "visible_gpus", lambda: (GPU_A,))
    asm = EntryAssembler()
    results = [r for c in chunks + chunks for r in [asm.feed(c)] if r is not None]
    assert [err for _, _, err in results] == ["", ""] and asm.transport == "cuda_ipc" and asm.transfer_seconds > 0


def test_cuda_ipc_seal_is_bound_to_the_deployment_secret(entries, fake_ipc):
    from hybridcache.services import security

    security.install(security.DeploymentSecret.generate())
    try:
        chunks = list(entry_chunks(entries[1], 0, get_transport("cuda_ipc")))
        assert list(read_entries(chunks))[0][2] == ""
        security.install(security.DeploymentSecret.generate())  # a receiver of another deployment
        assert "seal does not verify" in list(read_entries(chunks))[0][2]
    finally:
        security.install(None)


def test_combine_worker_stops_offering_cuda_ipc_to_a_sender_it_failed_with(engine, fake_ipc, monkeypatch):
    """A scatter worker (in-process gRPC) sends device blocks of a GPU the combine worker cannot
    see: the entries are missing (rebuilt elsewhere), and the next Prefill to that worker carries
    an Endpoint without GPUs, so that it picks a host transport."""
    from concurrent import futures

    import grpc
    from hybridcache.services.combine.worker import CombineServicer
    from hybridcache.services.launcher import free_port
    from hybridcache.services.protocol import rpc

    monkeypatch.setattr(cuda_ipc, "visible_gpus", lambda: (GPU_B,))  # GPU_A's blocks cannot be opened
    asked = []

    class Scatter(rpc.ScatterServicer):
        def Prefill(self, request, context):
            asked.append(Endpoint.from_pb(request.receiver))
            transport = get_transport("cuda_ipc")
            for seg in request.segments:
                yield from entry_chunks(engine.build_entry(segment_ids(seg)), seg.index, transport)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    rpc.add_ScatterServicer_to_server(Scatter(), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    combine = CombineServicer(engine)
    try:
        combine.endpoint = ep(device=GPU_B, gpus=(GPU_B, GPU_A))  # claims it can see both
        segments = [list(range(20, 70))]
        request = pb.CombineRequest(plan=[pb.SegmentPlan(index=0, key=engine.entry_key(segments[0]), source="scatter",
                                                         address=address)])
        pinned, source, moved = combine._gather(request, segments)
        assert pinned == {} and source == {} and moved["scatter_path"] == "cuda_ipc"
        assert asked[0].gpus == (GPU_B, GPU_A) and address in combine._no_device_path
        combine._gather(request, segments)
        assert asked[1].gpus == () and choose_transport(ep(device=GPU_A), asked[1]) != "cuda_ipc"
    finally:
        combine.close()
        server.stop(0)


def test_cuda_ipc_refuses_host_tensors():
    with pytest.raises(TransportError, match="CUDA tensor"):
        cuda_ipc.share(torch.zeros(16, dtype=torch.uint8), pb.DeviceBlock())
    with pytest.raises(TransportError, match="whole entries"):
        get_transport("cuda_ipc").write(pb.TensorChunk(), torch.zeros(4))


def test_device_checksum_sees_changes_and_swaps():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (3 * 4 * 4096 + 13,), dtype=torch.uint8, generator=g)
    base = device_checksum(a)
    assert device_checksum(a.clone()) == base
    flipped = a.clone()
    flipped[-1] ^= 0x80  # in the tail past the last full row
    words = a[: 4 * 4096 * 2].view(torch.int32)
    in_row, across = words.clone(), words.clone()
    in_row[[0, 1]] = in_row[[1, 0]]
    across[[0, 4096]] = across[[4096, 0]]
    rest = a[4 * 4096 * 2:]
    swapped = [device_checksum(torch.cat([w.view(torch.uint8), rest])) for w in (in_row, across)]
    assert len({base, device_checksum(flipped), *swapped}) == 4


def test_cost_model_charges_the_scatter_path():
    cm = CostModel(prefill_tokens_per_s=10_000.0)
    nbytes, tokens = 20_000_000, 1000  # 0.1 s of prefill
    # fetching 20 MB over gRPC (0.08 GB/s: 0.25 s) loses to recomputing on the combine worker...
    assert cm.choose(nbytes, tokens, "grpc", "local") == "recompute"
    # ...and wins when the rebuilt entry would come back over gRPC too
    assert cm.choose(nbytes, tokens, "grpc", "grpc") == "fetch"
    # over CUDA IPC the move costs ~1 ms: recompute on a scatter worker again
    assert cm.recompute_seconds(tokens, nbytes, "cuda_ipc") < 0.102
    assert cm.choose(nbytes, tokens, "grpc", "cuda_ipc") == "recompute"
    # what the combine workers measure sets the path and moves its bandwidth
    assert cm.scatter_path == "grpc"
    cm.observe_scatter("cuda_ipc", 10**9, 0.01)
    assert cm.scatter_path == "cuda_ipc" and cm.bandwidth["cuda_ipc"] > 20e9
    cm.observe_scatter("", 0, 0.0)  # a request with no scatter work changes nothing
    assert cm.scatter_path == "cuda_ipc"


def test_transport_bandwidth_setting():
    assert parse_bandwidths("cuda_ipc=80, grpc=0.5") == {"cuda_ipc": 80e9, "grpc": 0.5e9}
    assert parse_bandwidths(None) == {}
    for bad in ("nvlink=5", "grpc", "grpc=fast", "shm=0", "shm=-1"):
        with pytest.raises(ValueError, match="transport-bandwidth"):
            parse_bandwidths(bad)


class _Context:
    """What ScatterServicer.Prefill asks of a gRPC context."""

    def invocation_metadata(self):
        return ()

    def add_callback(self, fn):
        return True


def test_scatter_worker_streams_cuda_ipc_entries_layer_by_layer(engine, fake_ipc, monkeypatch):
    """Over cuda_ipc without an arena (a fresh buffer exported per layer batch, also the path of a
    write that does not fit the arena) the scatter worker sends each layer of a batch as it is computed: the header,
    then per layer one device block per segment (every segment's layer 0 before any layer 1), all
    of a layer ranges of one exported buffer, then the seal; the receiver maps each buffer once
    (one IPC open per layer of the build, not per segment and layer); the entries that arrive
    equal the ones built, and a seal that does not cover every layer, or a block moved to
    another range of its buffer, fails."""
    from hybridcache.services.scatter.worker import ScatterServicer

    shared, opened, released = fake_ipc
    servicer = ScatterServicer(engine, max_batch_tokens=10_000, arena_bytes=0)
    monkeypatch.setattr(servicer, "transport_for", lambda request: "cuda_ipc")
    rng = random.Random(11)
    segs = [[rng.randrange(5, 250) for _ in range(n)] for n in (30, 47, 52)]
    request = pb.PrefillRequest(segments=[segment(i, s) for i, s in enumerate(segs)])
    chunks = [pb.EntryChunk.FromString(c.SerializeToString()) for c in servicer.Prefill(request, _Context())]
    kinds = [(c.WhichOneof("body"), c.segment_index) for c in chunks]
    n_layers = engine.cfg.num_hidden_layers
    assert [k for k, _ in kinds].count("layer_block") == 3 * n_layers and len(shared) == n_layers
    assert [k for k, _ in kinds].count("seal") == 3 and all(c.header.layered for c in chunks if c.HasField("header"))
    layers = [c.layer_block.layer for c in chunks if c.WhichOneof("body") == "layer_block"]
    assert layers == sorted(layers)  # the whole batch's layer i before its layer i + 1
    seals = [n for n, (k, _) in enumerate(kinds) if k == "seal"]
    assert max(n for n, (k, _) in enumerate(kinds) if k == "layer_block") < min(seals)
    blocks = [c.layer_block.block for c in chunks if c.HasField("layer_block")]
    for layer in range(n_layers):
        of_layer = blocks[3 * layer: 3 * layer + 3]
        assert len({b.handle for b in of_layer}) == 1  # one buffer a layer
        assert [b.tensor_offset for b in of_layer] == [0, of_layer[0].nbytes, of_layer[0].nbytes + of_layer[1].nbytes]
    out = list(read_entries(chunks))
    assert [(i, err) for i, _, err in out] == [(0, ""), (1, ""), (2, "")]
    # IPC opens for the request: one per buffer; its other blocks' reference counters released
    assert len(opened) == n_layers == cuda_ipc.MAPPINGS.opened
    assert cuda_ipc.MAPPINGS.reused == 2 * n_layers and len(released) == 2 * n_layers
    want = engine.build_entries(segs)
    for (_, got, _), ref in zip(out, want):
        assert got.key == ref.key and got.build_seconds > 0
        for (la, na, a), (lb, nb, b) in zip(layer_tensors(got.data), layer_tensors(ref.data), strict=True):
            assert (la, na) == (lb, nb) and torch.allclose(a, b, atol=1e-6)
    # a seal over fewer layers than the entry has, or one not made with the secret
    # one message per layer block, its tensors' layout inside
    assert [k for k, _ in kinds].count("tensor") == 0
    assert all(len(c.layer_block.tensors) in (2, 3) for c in chunks if c.HasField("layer_block"))
    short = [c for c in chunks if not (c.segment_index == 0 and c.HasField("layer_block") and c.layer_block.layer == 0)]
    assert "sealed with" in next(err for i, _, err in read_entries(short) if i == 0)
    forged = [pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks]
    next(c for c in forged if c.WhichOneof("body") == "seal").seal.checksum = "hmac-sha256-dev:" + "1" * 64
    assert "seal does not verify" in list(read_entries(forged))[0][2]
    # segment 0's block of a linear layer pointed at segment 1's range of the same buffer (same
    # size): its copy does not match its checksum; with segment 1's checksum too, the seal (over
    # the checksums and the offsets) does not verify
    linear = engine.cfg.linear_layers[0]
    for take_checksum, error in ((False, "checksum mismatch"), (True, "seal does not verify")):
        moved = [pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks]
        of_layer = {c.segment_index: c.layer_block.block for c in moved
                    if c.HasField("layer_block") and c.layer_block.layer == linear}
        assert of_layer[0].nbytes == of_layer[1].nbytes
        of_layer[0].tensor_offset = of_layer[1].tensor_offset
        if take_checksum:
            of_layer[0].checksum = of_layer[1].checksum
        assert error in list(read_entries(moved))[0][2]
    # the seal covers each block's offset in its buffer, not only its bytes' checksum
    header = next(c.header for c in chunks if c.HasField("header") and c.segment_index == 0)
    block = pb.DeviceBlock(nbytes=64, tensor_offset=128, checksum="blk64:1:2:3")
    elsewhere = pb.DeviceBlock(nbytes=64, tensor_offset=192, checksum="blk64:1:2:3")
    assert cuda_ipc.device_seal(header, [([], block)]) != cuda_ipc.device_seal(header, [([], elsewhere)])
    # a range past the end of its buffer
    past = [pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks]
    next(c for c in past if c.HasField("layer_block")).layer_block.block.tensor_offset = 1 << 40
    assert "outside its buffer" in list(read_entries(past))[0][2]


def test_a_mapped_buffer_is_opened_once_across_requests(entries, fake_ipc):
    """Blocks of a buffer this process has mapped already open nothing: the same entry received
    by three requests maps its buffer once (the later ones release their reference counters);
    a block of another buffer from the same GPU maps that one, and its own checksum still holds."""
    shared, opened, released = fake_ipc
    chunks = list(entry_chunks(entries[0], 0, get_transport("cuda_ipc")))
    for _ in range(3):
        assert [err for _, _, err in read_entries(chunks)] == [""]
    assert len(opened) == 1 and cuda_ipc.MAPPINGS.opened == 1 and len(released) == 2
    other = list(entry_chunks(entries[1], 1, get_transport("cuda_ipc")))
    assert [err for _, _, err in read_entries(other)] == [""] and cuda_ipc.MAPPINGS.opened == 2
    shared[other[0].header.block.handle][7] ^= 1
    assert "checksum mismatch" in list(read_entries(other))[0][2]


def test_bandwidths_measured_at_start_up_reach_the_cost_model(engine, model_dir):
    """The combine worker measures its end of the entry paths when it starts and reports them in
    Info; the router's cost model starts from them, except where --transport-bandwidth is given."""
    from hybridcache.services.combine.worker import CombineServicer
    from hybridcache.services.config import RuntimeConfig
    from hybridcache.services.directory import InProcessDirectory
    from hybridcache.services.router.router import Router

    combine = CombineServicer(engine)
    try:
        info = combine.Info(pb.InfoRequest(), None)
    finally:
        combine.close()
    assert set(info.transport_bandwidth) == {"shm"} and info.transport_bandwidth["shm"] > 0  # no GPU here
    measured = pb.InfoReply(fingerprint=engine.fingerprint, seam_window=8, mode="pic",
                            transport_bandwidth={"shm": 3e9, "cuda_ipc": 90e9, "carrier": 1.0})
    router = Router(model_dir, InProcessDirectory({}))
    router.adopt(measured)
    assert router.cost.bandwidth["shm"] == 3e9 and router.cost.bandwidth["cuda_ipc"] == 90e9
    assert "carrier" not in router.cost.bandwidth
    configured = Router(model_dir, InProcessDirectory({}), runtime=RuntimeConfig(transport_bandwidth="cuda_ipc=40"))
    configured.adopt(measured)
    assert configured.cost.bandwidth["cuda_ipc"] == 40e9 and configured.cost.bandwidth["shm"] == 3e9


def test_calls_built_in_one_batch_each_get_a_buffer_a_layer(engine, fake_ipc, monkeypatch):
    """Two cuda_ipc Prefill calls (no arena) whose segments the scatter worker builds in one batch: each call
    gets its own exported buffer per layer holding its segments' blocks (a receiver maps only
    what it asked for), and both receive the entries built alone."""
    import threading

    from hybridcache.services.scatter.worker import ScatterServicer

    shared, _, _ = fake_ipc
    servicer = ScatterServicer(engine, max_batch_tokens=10_000, arena_bytes=0)
    monkeypatch.setattr(servicer, "transport_for", lambda request: "cuda_ipc")
    gate, first, builds = threading.Event(), threading.Event(), []
    build = engine.build_entries

    def gated(segments, **kw):
        builds.append(len(segments))
        if len(builds) == 1:
            first.set()
            assert gate.wait(30)
        return build(segments, **kw)

    monkeypatch.setattr(engine, "build_entries", gated)
    rng = random.Random(5)
    segs = {name: [[rng.randrange(5, 250) for _ in range(n)] for n in lens]
            for name, lens in (("blocker", (20,)), ("x", (31, 44)), ("y", (38,)))}
    streams: dict[str, list] = {}

    def call(name):
        request = pb.PrefillRequest(segments=[segment(i, s) for i, s in enumerate(segs[name])])
        streams[name] = [pb.EntryChunk.FromString(c.SerializeToString()) for c in servicer.Prefill(request, _Context())]

    threads = [threading.Thread(target=call, args=("blocker",))]
    threads[0].start()
    assert first.wait(30)
    for name, queued in (("x", 2), ("y", 3)):
        threads.append(threading.Thread(target=call, args=(name,)))
        threads[-1].start()
        for _ in range(500):
            if len(servicer._pending) >= queued:
                break
            threading.Event().wait(0.02)
        assert len(servicer._pending) == queued
    gate.set()
    for t in threads:
        t.join(60)
    assert builds == [1, 3]  # x's and y's segments in one build
    n_layers = engine.cfg.num_hidden_layers
    assert len(shared) == 3 * n_layers
    handles = {}
    for name in ("x", "y"):
        blocks = [c for c in streams[name] if c.HasField("layer_block")]
        assert len(blocks) == len(segs[name]) * n_layers
        per_layer = {}
        for c in blocks:
            per_layer.setdefault(c.layer_block.layer, set()).add(c.layer_block.block.handle)
        assert all(len(h) == 1 for h in per_layer.values())
        handles[name] = set().union(*per_layer.values())
        out = list(read_entries(streams[name]))
        assert [err for _, _, err in out] == [""] * len(segs[name])
        for (i, got, _) in out:
            want = engine.build_entry(segs[name][i])
            for (la, na, a), (lb, nb, b) in zip(layer_tensors(got.data), layer_tensors(want.data), strict=True):
                assert (la, na) == (lb, nb) and torch.allclose(a, b, atol=1e-5)
    assert not handles["x"] & handles["y"]
