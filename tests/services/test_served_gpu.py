"""The served stack's GPU paths (marked gpu: the device machine runs them): entries between two
processes on one GPU by CUDA IPC without an arena, whole and layer by layer as the scatter
worker sends a batched build (one exported buffer a layer for all of its segments), equal to
what was sent, at a measured bandwidth and with the IPC handles opened counted; the served
stack with a scatter worker on the combine worker's GPU, sending its entries over CUDA IPC
(--scatter-same-gpu on) or not asked (the default). tests/services/test_ipc_pool_gpu.py covers the arena."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

N_ENTRIES, LINEAR, ATTN, TOKENS = 16, 6, 2, 1024


def _entry(i: int, device):
    """A synthetic entry of the Qwen3.5-9B shape cut to 8 layers (6 linear, 2 attention), 1k tokens,
    its tensors drawn from seed i (both processes make the same ones)."""
    from hybridcache.services.runtime.cache import SegmentEntry
    from hybridcache.services.runtime.sequence import AttnSpan, LinearSpan, SpanData

    g = torch.Generator(device=device).manual_seed(i)

    def r(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=g, device=device).to(dtype)

    linear = {l: LinearSpan(r(1, 32, 128, 128), r(1, 32, 128, 128), r(1, 8192, 3, dtype=torch.bfloat16))
              for l in range(LINEAR)}
    attn = {LINEAR + a: AttnSpan(r(1, 4, TOKENS, 256, dtype=torch.bfloat16), r(1, 4, TOKENS, 256, dtype=torch.bfloat16))
            for a in range(ATTN)}
    return SegmentEntry(key=f"k{i}", segment_tokens=TOKENS + 8, data=SpanData(TOKENS, 8, linear, attn),
                        build_seconds=0.0)


def _sender(q, done):
    from hybridcache.services.transport import get_transport
    from hybridcache.services.transport.codec import entry_chunks

    torch.cuda.init()
    entries = [_entry(i, "cuda") for i in range(N_ENTRIES)]
    torch.cuda.synchronize()
    transport = get_transport("cuda_ipc")
    for i, e in enumerate(entries):
        q.put([c.SerializeToString() for c in entry_chunks(e, i, transport)])
    del entries  # torch keeps the blocks until the receiver has released them
    q.put(None)
    done.wait(120)  # the exporting process must outlive the receiver's opening of its handles
    transport.close()


def _layered_sender(q, done):
    """The scatter worker's layered path (codec.layer_blocks): every layer of all N_ENTRIES
    segments of one build in one exported buffer, then a seal per entry."""
    from hybridcache.services.protocol import pb
    from hybridcache.services.transport import get_transport
    from hybridcache.services.transport.codec import LayeredEntry, layer_blocks, layer_tensors

    torch.cuda.init()
    entries = [_entry(i, "cuda") for i in range(N_ENTRIES)]
    torch.cuda.synchronize()
    transport = get_transport("cuda_ipc")
    n_tensors = LINEAR * 3 + ATTN * 2
    les = [LayeredEntry(i, e.key, e.segment_tokens, e.data.local_start, n_tensors, transport)
           for i, e in enumerate(entries)]
    out: list[pb.EntryChunk] = [le.header() for le in les]
    for layer in range(LINEAR + ATTN):
        pairs = [(le, [(n, t) for l, n, t in layer_tensors(e.data) if l == layer]) for le, e in zip(les, entries)]
        out.extend(layer_blocks(pairs, layer, transport))
    out.extend(le.seal(0.1) for le in les)
    q.put([c.SerializeToString() for c in out])
    del entries, pairs
    q.put(None)
    done.wait(120)
    transport.close()


def _receive(target):
    """Run `target` in a spawned process, feed what it sends to an EntryAssembler on this
    process's GPU; returns the results, the assembler and the seconds the feeding took."""
    from hybridcache.services.protocol import pb
    from hybridcache.services.transport.codec import EntryAssembler

    torch.cuda.init()
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(q, done))
    proc.start()
    try:
        batches = []
        while (item := q.get(timeout=180)) is not None:
            batches.append([pb.EntryChunk.FromString(raw) for raw in item])
        asm = EntryAssembler("cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = [r for chunks in batches for c in chunks if (r := asm.feed(c)) is not None]
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        done.set()
        proc.join(60)
    return got, asm, seconds


@pytest.mark.gpu
def test_cuda_ipc_layered_build_maps_one_buffer_a_layer():
    from hybridcache.services.transport.codec import layer_tensors

    got, asm, seconds = _receive(_layered_sender)
    assert [err for _, _, err in got] == [""] * N_ENTRIES
    for i, entry, _ in got:
        want = _entry(i, "cuda")
        for (la, na, a), (lb, nb, b) in zip(layer_tensors(entry.data), layer_tensors(want.data), strict=True):
            assert (la, na) == (lb, nb) and a.device.type == "cuda" and torch.equal(a, b)
    # one IPC open per layer of the build, not one per segment and layer
    assert asm.device_blocks == N_ENTRIES * (LINEAR + ATTN) and asm.ipc_opens == LINEAR + ATTN
    gbps = asm.bytes_received / seconds / 1e9
    print(f"cuda_ipc layered: {N_ENTRIES} segments x {LINEAR + ATTN} layers, {asm.device_blocks} blocks, "
          f"{asm.ipc_opens} IPC opens, {asm.bytes_received / 2**20:.0f} MiB in {seconds * 1e3:.1f} ms "
          f"= {gbps:.1f} GB/s")
    assert gbps > 10


@pytest.mark.gpu
def test_cuda_ipc_round_trip_between_two_processes():
    from hybridcache.services.transport.codec import layer_tensors

    got, asm, seconds = _receive(_sender)
    assert [err for _, _, err in got] == [""] * N_ENTRIES
    for i, entry, _ in got:
        want = _entry(i, "cuda")
        for (la, na, a), (lb, nb, b) in zip(layer_tensors(entry.data), layer_tensors(want.data), strict=True):
            assert (la, na) == (lb, nb) and a.device.type == "cuda" and torch.equal(a, b)
    gbps = asm.bytes_received / seconds / 1e9
    print(f"cuda_ipc: {asm.bytes_received / 2**20:.0f} MiB in {seconds * 1e3:.1f} ms = {gbps:.1f} GB/s")
    # far above any host path (shm and gRPC move 0.1-2 GB/s): a fallback to one would fail here
    assert gbps > 10


@pytest.mark.gpu
def test_served_stack_on_one_gpu_moves_entries_by_cuda_ipc(model_dir):
    """router, cache tier, combine and scatter worker on the GPU (`hybridcache up --device cuda`),
    over HTTP: the scatter worker's entries reach the combine worker by CUDA IPC, and the answer
    is the one the combine worker gives from its own cached entries afterwards."""
    from hybridcache.services.launcher import LocalCluster, free_port
    from serving_helpers import http

    docs = [list(range(10 + 7 * i, 10 + 7 * i + 60)) for i in range(4)]
    body = {"segments": docs, "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    # on one GPU the combine worker builds cold segments itself unless told to send them out
    with LocalCluster(model_dir, port=free_port(), scatter_workers=1, device="cuda", ready_timeout_s=600,
                      extra={"combine": ["--scatter-same-gpu", "on"]}) as c:
        status, cold = http("POST", f"{c.url}/generate", body, timeout=300)
        assert status == 200, cold
        st = cold["hybridcache"]
        assert st["scatter_path"] == "cuda_ipc" and st["scatter_bytes"] > 0 and st["scatter_seconds"] > 0
        # a handful of IPC opens for the request: one per layer of the build, its 4 segments'
        # blocks of a layer in one buffer
        assert st["scatter_blocks"] >= len(docs) and 0 < st["scatter_ipc_opens"] <= st["scatter_blocks"] // len(docs)
        assert st["built_tokens"] == sum(map(len, docs))
        status, warm = http("POST", f"{c.url}/generate", body, timeout=300)
        assert status == 200 and warm["text"] == cold["text"]
        assert warm["hybridcache"]["built_tokens"] == 0
        # another cold request: its entries go through the scatter worker's arena, mapped already
        body2 = dict(body, segments=[[t + 1 for t in d] for d in docs])
        status, cold2 = http("POST", f"{c.url}/generate", body2, timeout=300)
        assert status == 200 and cold2["hybridcache"]["scatter_path"] == "cuda_ipc"
        assert cold2["hybridcache"]["scatter_bytes"] > 0 and cold2["hybridcache"]["scatter_ipc_opens"] == 0
        print(f"served cuda_ipc: {st['scatter_bytes'] / st['scatter_seconds'] / 1e9:.2f} GB/s, "
              f"{st['scatter_blocks']} blocks, {st['scatter_ipc_opens']} IPC opens, "
              f"ttft {st['ttft_ms']:.1f} ms (engine {st['engine_ttft_ms']:.1f} ms)")


@pytest.mark.gpu
def test_served_stack_builds_cold_segments_on_the_combine_gpu_when_the_scatter_worker_shares_it(model_dir):
    """A scatter worker on the combine worker's GPU (the default, --scatter-same-gpu off): the
    combine worker builds the cold segments itself, nothing moves, the answer is the same."""
    from hybridcache.services.launcher import LocalCluster, free_port
    from serving_helpers import http

    docs = [list(range(10 + 7 * i, 10 + 7 * i + 60)) for i in range(4)]
    body = {"segments": docs, "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    with LocalCluster(model_dir, port=free_port(), scatter_workers=1, device="cuda", ready_timeout_s=600) as c:
        status, cold = http("POST", f"{c.url}/generate", body, timeout=300)
        assert status == 200, cold
        st = cold["hybridcache"]
        assert st["built_here_same_gpu"] == len(docs) and st["scatter_bytes"] == 0
        assert [s["source"] for s in st["segments"]] == ["built"] * len(docs)
        status, warm = http("POST", f"{c.url}/generate", body, timeout=300)
        assert status == 200 and warm["text"] == cold["text"] and warm["hybridcache"]["built_tokens"] == 0


@pytest.mark.gpu
def test_served_requests_of_the_warmup_shape_capture_no_graphs(model_dir):
    """After the combine worker's warm-up, requests of its warm-up shape (a first cold one, warm
    ones after other system prompts, cold ones after the same, cached, system prompt) only replay
    CUDA graphs: none captures on its own path (served_gpu.py's sequence, its shape cut small)."""
    import random

    from hybridcache.services.launcher import LocalCluster, free_port
    from serving_helpers import http

    system, n, length, question = 16, 4, 64, 16
    rng = random.Random(0)

    def ids(k):
        return [rng.randrange(5, 250) for _ in range(k)]

    sp = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    cold = {"system": ids(system), "segments": [ids(length) for _ in range(n)], "suffix": ids(question),
            "sampling_params": sp}
    sequence = [cold, dict(cold, system=ids(system), segments=cold["segments"][::-1])]
    sequence += [dict(cold, segments=[ids(length) for _ in range(n)]) for _ in range(3)]
    with LocalCluster(model_dir, port=free_port(), scatter_workers=0, device="cuda", ready_timeout_s=600,
                      warmup_shape=f"{system}+{n}x{length}+{question}") as c:
        stats = []
        for body in sequence:
            status, out = http("POST", f"{c.url}/generate", body, timeout=300)
            assert status == 200, out
            stats.append(out["hybridcache"])
    assert [s["graph_captures"] for s in stats] == [0] * len(sequence), stats
    assert all(s["graph_replays"] >= 1 for s in stats), stats


@pytest.fixture(scope="module")
def model_9b(tmp_path_factory):
    """The Qwen3.5-9B shape in bf16, random weights, written on the GPU by a process of its own
    (whatever it cached is freed when it exits, before a worker loads the model)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("q9b") / "q9b"
    code = ("import torch; from hybridcache.services.runtime.modelzoo import init_model_dir; "
            f"init_model_dir('qwen3_5_text', 'qwen3.5-9b', {str(out)!r}, dtype=torch.bfloat16, device='cuda')")
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=600)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("max_num_seqs", [None, 128], ids=["defaults", "seqs128"])
def test_a_9b_combine_worker_plans_its_memory_and_captures_every_decode_graph(model_9b, max_num_seqs):
    """`hybridcache up --device cuda` of the 9B shape with its defaults, and with --max-num-seqs
    128, on one GPU: the combine worker sizes its caches after its warm-up (their budgets and the
    activation peak in /health's memory plan, all within its share), captures the decode graph of
    every batch size up to max_num_seqs (none runs eagerly) and serves."""
    from hybridcache.services.launcher import LocalCluster, free_port
    from serving_helpers import http

    settings = {"max_num_seqs": max_num_seqs} if max_num_seqs else {}
    with LocalCluster(model_9b, port=free_port(), scatter_workers=0, device="cuda", dtype="bfloat16",
                      ready_timeout_s=1200, **settings) as c:
        combine = next(s for s in c.services if s.role == "combine")
        status, health = http("GET", f"http://{combine.http}/health", timeout=30)
        assert status == 200, health
        mem = health["memory"]
        print(f"memory plan (max_num_seqs {max_num_seqs or 'default'}): {mem['how']}; "
              f"warm-up {health['warmup']}")
        assert mem["decode_graphs"] == mem["decode_graphs_expected"] > 0, mem
        assert min(mem["kv_gib"], mem["entry_gib"], mem["prefix_gib"]) > 0.5, mem
        used = mem["held_gib"] + mem["transient_gib"] + mem["kv_gib"] + mem["entry_gib"] + mem["prefix_gib"]
        assert used <= mem["share_gib"] + 0.03, mem  # each figure rounded to 0.01 GiB
        body = {"input_ids": list(range(5, 69)), "sampling_params": {"max_new_tokens": 16, "ignore_eos": True,
                                                                       "temperature": 0.8, "top_p": 0.95}}
        status, out = http("POST", f"{c.url}/generate", body, timeout=300)
        assert status == 200 and len(out["output_ids"]) == 16, out


@pytest.mark.gpu
def test_start_up_measurement_of_the_cuda_ipc_device_work():
    from hybridcache.services.transport import measure_bandwidths

    bw = measure_bandwidths("cuda")
    print(f"start-up: cuda_ipc device work {bw['cuda_ipc'] / 1e9:.0f} GB/s, shm {bw['shm'] / 1e9:.2f} GB/s")
    assert bw["cuda_ipc"] > 10e9 and bw["shm"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_served_tp2_scatter_entries_reach_every_combine_rank(model_dir):
    """`hybridcache up --device cuda --gpus 0,1 --tensor-parallel-size 2`: the scatter worker's two
    ranks build each cold entry, rank 0 streams the bundle of both slices (CUDA IPC: the workers
    share the host and see both GPUs), the combine worker hands rank 1 its slice over the group;
    the cold answer (from the scatter worker) equals the warm one (the combine worker's own)."""
    from hybridcache.services.launcher import LocalCluster, free_port
    from serving_helpers import http

    docs = [list(range(10 + 7 * i, 10 + 7 * i + 60)) for i in range(4)]
    body = {"segments": docs, "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    with LocalCluster(model_dir, port=free_port(), scatter_workers=1, device="cuda", gpus=(0, 1),
                      tensor_parallel_size=2, ready_timeout_s=600,
                      extra={"combine": ["--scatter-same-gpu", "on"]}) as c:
        status, cold = http("POST", f"{c.url}/generate", body, timeout=300)
        assert status == 200, cold
        st = cold["hybridcache"]
        assert [s["source"] for s in st["segments"]] == ["scatter"] * len(docs), st["segments"]
        assert st["scatter_bytes"] > 0
        status, warm = http("POST", f"{c.url}/generate", body, timeout=300)
        assert status == 200 and warm["text"] == cold["text"]
        assert warm["hybridcache"]["built_tokens"] == 0
        print(f"served TP 2: entries over {st['scatter_path']}, {st['scatter_bytes'] / 1e6:.1f} MB")
