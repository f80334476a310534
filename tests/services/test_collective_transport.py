"""The collective transport (torch.distributed point-to-point; gloo here, NCCL on GPUs) behind the
same TensorTransport interface and entry codec as the gRPC and shared-memory transports."""

import socket

import torch
import torch.multiprocessing as mp
from hybridcache.services.transport.collective import device_checksum


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peer(rank, port, model_dir, out):
    import torch.distributed as dist
    from hybridcache.services.protocol import pb
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.transport import get_transport
    from hybridcache.services.transport.codec import EntryAssembler, entry_chunks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        eng = Engine.from_dir(model_dir, config=EngineConfig())
        segs = [list(range(20, 90)), list(range(100, 140))]
        if rank == 1:
            transport = get_transport("collective", dst=0)
            for i, seg in enumerate(segs):
                for chunk in entry_chunks(eng.build_entry(seg), i, transport):
                    if i == 1 and chunk.WhichOneof("body") == "tensor" and chunk.tensor.name == "S":
                        chunk.tensor.checksum = "fl64:0:0"  # a corrupted tensor in the second entry
                    out.put(chunk.SerializeToString())
            transport.close()
            out.put(b"")
            dist.barrier()
            return
        asm, results = EntryAssembler(), []
        while (raw := out.get(timeout=120)) != b"":
            chunk = pb.EntryChunk()
            chunk.ParseFromString(raw)
            got = asm.feed(chunk)
            if got is not None:
                results.append(got)
        dist.barrier()
        ref = eng.build_entry(segs[0])
        (i0, e0, err0), *rest = results
        same = all(
            torch.equal(getattr(e0.data.linear[i], f), getattr(ref.data.linear[i], f))
            for i in ref.data.linear
            for f in ("T", "S", "conv_tail")
        ) and all(torch.equal(e0.data.attn[i].k, ref.data.attn[i].k) for i in ref.data.attn)
        failed = [(i, e is None, err) for i, e, err in rest]
        out.put((i0, err0, same, e0.key == ref.key, failed, asm.bytes_received))
    finally:
        dist.destroy_process_group()


def test_entries_over_the_collective_transport(qwen35_dir):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_peer, args=(r, port, str(qwen35_dir), q)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs)
    i0, err0, same, same_key, failed, nbytes = q.get(timeout=5)
    assert (i0, err0, same, same_key) == (0, "", True, True)
    # the corrupted entry is refused, never handed out, and the stream stays in step
    assert failed and all(idx == 1 and refused for idx, refused, _ in failed)
    assert "checksum mismatch" in failed[0][2]
    assert nbytes > 0


def test_device_checksum_sees_changes():
    t = torch.randn(3, 5, dtype=torch.bfloat16)
    c = device_checksum(t)
    assert c == device_checksum(t.clone())
    u = t.clone()
    u[1, 2] += 1
    assert device_checksum(u) != c
    # a swap of two bytes keeps the plain sum but not the weighted one
    raw = t.view(torch.uint8).reshape(-1).clone()
    raw[[0, 1]] = raw[[1, 0]]
    if raw[0] != raw[1]:
        assert device_checksum(raw) != device_checksum(t.view(torch.uint8).reshape(-1))
