"""Segment parallelism on CPU (gloo): 2 processes give the same first token as one, LPT balances."""

import os
import socket

import torch.multiprocessing as mp
from hybridcache.services.parallel.segment_parallel import assign


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, model_dir, out):
    import torch
    import torch.distributed as dist
    from hybridcache.services.parallel.segment_parallel import run_cold_request
    from hybridcache.services.runtime.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        eng = Engine.from_dir(model_dir, config=EngineConfig(mode="pic", seam_window=8))
        segs = [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate((90, 40, 120, 60, 75))]
        req = eng.parse_request({"system": [1, 2, 3], "segments": segs, "suffix": [9, 8, 7]})
        results = {}
        for workers in (1, 2):
            r = run_cold_request(eng, req, workers, "lpt")
            if rank == 0:
                results[workers] = (r.first_token, r.assignment)
        if rank == 0:
            # the in-process engine's pic answer for the same request
            ref = Engine.from_dir(model_dir, config=EngineConfig(mode="pic", seam_window=8))
            results["engine"] = int(ref.prefill(req).logits.argmax())
            out.put(results)
    finally:
        dist.destroy_process_group()


def test_two_workers_equal_one_and_the_engine(qwen35_dir):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [ctx.Process(target=_worker, args=(r, 2, port, str(qwen35_dir), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = out.get(timeout=240)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    tok1, owner1 = res[1]
    tok2, owner2 = res[2]
    assert set(owner1) == {0} and set(owner2) == {0, 1}
    assert tok1 == tok2 == res["engine"]


def test_lpt_beats_round_robin_on_skewed_lengths():
    lengths = [4000, 300, 3500, 200, 250, 3000, 100, 150]
    lpt = assign(lengths, 2, "lpt")
    rr = assign(lengths, 2, "round_robin")

    def makespan(a):
        return max(sum(c for c, w in zip(lengths, a) if w == k) for k in range(2))

    assert makespan(lpt) < makespan(rr)
    assert makespan(lpt) <= sum(lengths) / 2 * 4 / 3 + max(lengths) / 3  # Graham's LPT bound
