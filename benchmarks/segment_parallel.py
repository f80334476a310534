"""Segment parallelism on the GPUs of one host (issue 9); prints one JSON object.

One process per GPU (NCCL). Rank 0 is the combine worker and a scatter worker. Qwen3.5-9B shape,
random bf16 weights made on each GPU from the same seed. Figures:
- cold TTFT of 32 x 1k segments + a 64-token question with 1..m scatter workers (LPT), and the
  split into scatter (rank 0's own builds), transfer wait and combine;
- LPT vs round robin on heavy-tailed segment lengths;
- NCCL point-to-point GB/s (1 GiB) and the bytes of one 1k-token entry;
- sustainable QPS under a 1 s p50 TTFT SLO, pic vs prefix, on a Zipf RAG trace: per-request
  service times measured on GPU 0 over the trace, then Poisson arrivals replayed through a FIFO
  single-server queue (the simulation is stated in the output).

    python benchmarks/segment_parallel.py [--gpus 2] [--quick] [--out FILE]
    python benchmarks/segment_parallel.py --preset tiny --quick --segment-tokens 256 --no-qps --gpus 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue as queue_mod
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEG, QUESTION, SEAM = 1024, 64, 8


def build_engine(preset: str, mode: str = "pic", **cfg_kw):
    from hybridcache.services.runtime.config import ModelConfig
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
    from hybridcache.services.runtime.modelzoo import hf_config, random_init_
    from hybridcache.services.runtime.tokenizer import Tokenizer, build_byte_tokenizer

    cfg = ModelConfig.from_dict(hf_config("qwen3_5_text", preset))
    if not torch.cuda.is_available():  # CPU smoke run of the same code (gloo, tiny preset)
        model = HybridLM(cfg).eval()
        random_init_(model, seed=0, std=0.08)
    else:
        from gpu_bench import random_init_cuda_

        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = HybridLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
        random_init_cuda_(model, seed=0)
    model.merge_projections()  # as the loader does
    model.fingerprint = f"random-{preset}-seed0"
    return Engine(model, Tokenizer(build_byte_tokenizer()), EngineConfig(mode=mode, seam_window=SEAM, **cfg_kw))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rand_ids(rng, n, vocab=250):
    return [rng.randrange(0, vocab) for _ in range(n)]


def pareto_lengths(seed, n, total, lo=128, hi=8192, alpha=1.1):
    rng = random.Random(seed)
    raw = [rng.paretovariate(alpha) for _ in range(n)]
    scale = total / sum(raw)
    return [max(lo, min(hi, int(r * scale))) for r in raw]


def token_balance_bound(lengths, workers):
    """Round robin's token makespan over LPT's for one draw: what LPT can gain if build time were
    proportional to tokens (the measured ratio is compared with it)."""
    from hybridcache.services.router.assign import lpt_assign, makespan, round_robin_assign

    queued = [0.0] * workers
    return makespan(lengths, queued, round_robin_assign(lengths, queued)) / makespan(
        lengths, queued, lpt_assign(lengths, queued)
    )


def token_balance_bounds(n, total, lo, hi, workers, draws=200):
    """Mean and median of token_balance_bound over `draws` seeded Pareto draws."""
    vals = sorted(token_balance_bound(pareto_lengths(s, n, total, lo, hi), workers) for s in range(draws))
    return {"mean": statistics.mean(vals), "median": statistics.median(vals), "draws": draws}


def cold_runs(engine, req, workers, policy, repeats, combine_share=0.0, speeds=None):
    from hybridcache.services.parallel.segment_parallel import run_cold_request

    out = []
    for i in range(repeats + 1):  # first run warms up kernels and the allocator
        r = run_cold_request(engine, req, workers, policy, combine_share, speeds)
        if r is not None and i > 0:
            out.append(r)
    return out


def rerun_ms(engine, layout, repeats):
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        logits, _ = engine.model.forward_layout(engine.model.empty_state(), layout, "last")
        int(torch.argmax(logits))
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def summarize(results):
    if not results:
        return None
    return {
        "ttft_ms": statistics.median(r.ttft_s for r in results) * 1e3,
        "scatter_rank0_ms": statistics.median(r.scatter_s[0] for r in results) * 1e3,
        "combine_ms": statistics.median(r.combine_s for r in results) * 1e3,
        # the split: when each rank's builds were done, when each sender's last send completed
        # (ms from the common start), and what each sender moved
        "scatter_ms_per_rank": {
            k: statistics.median(r.scatter_s[k] for r in results) * 1e3 for k in results[-1].scatter_s
        },
        "sent_ms_per_rank": {k: statistics.median(r.sent_s[k] for r in results) * 1e3 for k in results[-1].sent_s},
        "sent_mb_per_rank": {k: results[-1].sent_bytes[k] / 2**20 for k in results[-1].sent_bytes},
        "first_token": results[-1].first_token,
        "assignment_counts": [results[-1].assignment.count(w) for w in range(max(results[-1].assignment) + 1)],
    }


def nccl_bandwidth(rank, nbytes=1 << 30, repeats=5):
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if torch.cuda.is_available() else "cpu")
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        if rank == 1:
            dist.send(t, dst=0)
        elif rank == 0:
            dist.recv(t, src=1)
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def qps_at_slo(service_s, slo_s=1.0, n_arrivals=4000, seed=0):
    """Largest Poisson arrival rate whose p50 TTFT (wait + service) stays within the SLO, for a FIFO
    single server whose service times cycle through the measured ones."""

    def p50(rate):
        rng = random.Random(seed)
        t = free = 0.0
        ttft = []
        for i in range(n_arrivals):
            t += rng.expovariate(rate)
            start = max(t, free)
            free = start + service_s[i % len(service_s)]
            ttft.append(free - t)
        return statistics.median(ttft)

    lo, hi = 0.0, 10.0 / statistics.median(service_s)
    for _ in range(40):
        mid = (lo + hi) / 2
        if p50(mid) <= slo_s:
            lo = mid
        else:
            hi = mid
    return lo


def trace_requests(seed, n_req, pool, lo=4, hi=32, zipf_s=1.1):
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** zipf_s for i in range(len(pool))]
    reqs = []
    for _ in range(n_req):
        k = rng.randint(lo, hi)
        chosen = []
        while len(chosen) < k:
            d = rng.choices(range(len(pool)), weights)[0]
            if d not in chosen:
                chosen.append(d)
        reqs.append({"segments": [pool[d] for d in chosen], "suffix": rand_ids(rng, QUESTION),
                     "sampling_params": {"max_new_tokens": 1}})
    return reqs


def service_times(engine, reqs):
    out = []
    for r in reqs:
        req = engine.parse_request(r)
        sync()
        t0 = time.perf_counter()
        pre = engine.prefill(req)
        int(torch.argmax(pre.logits))
        sync()
        out.append(time.perf_counter() - t0)
    return out


def grpc_loopback_gbps(total=512 << 20, chunk=4 << 20, repeats=3):
    """Python gRPC server streaming of raw byte chunks over loopback (no protobuf), GB/s."""
    from concurrent import futures

    import grpc

    payload = os.urandom(chunk)

    def stream(request, context):
        for _ in range(total // chunk):
            yield payload

    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    server = grpc.server(futures.ThreadPoolExecutor(4), options=opts)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Bulk", {"Get": grpc.unary_stream_rpc_method_handler(stream)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            call = ch.unary_stream("/bench.Bulk/Get")
            rates = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                n = sum(len(m) for m in call(b""))
                rates.append(n / (time.perf_counter() - t0) / 1e9)
    finally:
        server.stop(None)
    return statistics.median(rates)


def qps_figures(args, seg, figures, detail):
    """pic vs prefix service times over a Zipf RAG trace on this GPU, then the queue simulation.

    Each engine first serves a request on documents outside the pool (kernel compilation and
    autotuning are not service time). The trace runs in order from empty caches; the sustainable
    rate uses the service times of its second half, once the caches have warmed on the first
    (the whole trace's times are in the detail)."""
    pool_rng = random.Random(2)
    pool = [rand_ids(pool_rng, seg) for _ in range(64)]
    n_req = 12 if args.quick else args.trace_requests
    trace = trace_requests(3, n_req, pool, hi=8 if args.quick else 32)
    warm = trace_requests(4, 1, [rand_ids(pool_rng, seg) for _ in range(8)], lo=8, hi=8)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    st = {}
    # The prefix baseline is what engines do today (dense checkpoints every 4 pages); a request
    # that misses costs at least a plain prefill, so the faster of `prefix` and `full` is the peer.
    for mode, kw in (("pic", {}), ("prefix", {"prefix_policy": "checkpoint"}), ("full", {})):
        eng = build_engine(args.preset, mode, entry_cache_bytes=40 << 30, prefix_cache_bytes=16 << 30, **kw)
        service_times(eng, warm)
        st[mode] = service_times(eng, trace)
        del eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    steady = {m: v[len(v) // 2 :] for m, v in st.items()}
    q = {m: qps_at_slo(v) for m, v in steady.items()}
    figures["qps_at_slo_pic"] = q["pic"]
    figures["qps_at_slo_prefix"] = q["prefix"]
    figures["qps_at_slo_full"] = q["full"]
    peer = max(q["prefix"], q["full"])
    figures["qps_at_slo_pic_vs_prefix"] = q["pic"] / peer if peer else float("inf")
    detail["qps"] = {
        "service_ms": {m: [round(x * 1e3, 2) for x in v] for m, v in st.items()},
        "service_ms_median_steady": {m: statistics.median(v) * 1e3 for m, v in steady.items()},
        "service_ms_median_all": {m: statistics.median(v) * 1e3 for m, v in st.items()},
        "requests": len(trace),
        "steady_requests": len(trace) - len(trace) // 2,
        "documents_per_request": [len(r["segments"]) for r in trace],
        "pool_documents": len(pool),
        "segment_tokens": seg,
        "slo_p50_s": 1.0,
        "method": "after one warm-up request per engine (documents outside the pool), service times "
        "measured on one GPU over the trace in order from empty caches; the second half's times, cycled, "
        "are replayed as Poisson arrivals through a FIFO single-server queue; qps_at_slo_pic_vs_prefix "
        "divides by the faster of prefix (checkpoint policy) and full",
    }


def worker(rank, world, port, args, queue):
    from hybridcache.services.parallel.segment_parallel import measured_speeds

    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    figures, detail = {}, {}
    try:
        engine = build_engine(args.preset)
        rng = random.Random(1)
        n_seg = 8 if args.quick else 32
        seg = args.segment_tokens
        segs = [rand_ids(rng, seg) for _ in range(n_seg)]
        req = engine.parse_request({"segments": segs, "suffix": rand_ids(rng, QUESTION)})
        runs1 = cold_runs(engine, req, 1, "lpt", args.repeats)
        cold = {1: summarize(runs1)}
        if rank == 0 and runs1:
            # the same combine again on its finished entries: what assembling costs once the builds'
            # allocations and launches are behind it (the in-run combine_ms includes their tail)
            cold[1]["combine_rerun_ms"] = rerun_ms(engine, runs1[-1].layout, args.repeats)
        # rank 0 also combines: its share of the builds is cut by the combine's cost relative to
        # building everything, measured in the 1-worker run just made (unless given)
        share = [args.combine_share]
        if share[0] is None and rank == 0:
            share[0] = cold[1]["combine_ms"] / cold[1]["scatter_rank0_ms"]
        dist.broadcast_object_list(share, src=0)
        costs = [float(len(x)) for x in req.segment_ids]
        for m in range(2, world + 1):
            first = cold_runs(engine, req, m, "lpt", args.repeats, share[0])
            # the assignment again with each rank's build rate measured on those requests (a rank
            # that sends builds slower than rank 0): what a router with live rates would do
            speeds = [None]
            if rank == 0:
                speeds[0] = measured_speeds(first[-1], costs)
            dist.broadcast_object_list(speeds, src=0)
            cold[m] = summarize(cold_runs(engine, req, m, "lpt", args.repeats, share[0], speeds[0]))
            if rank == 0:
                cold[m]["speeds"] = speeds[0]
                cold[m]["equal_speeds"] = summarize(first)
        # heavy-tailed lengths, same total
        lens = pareto_lengths(0, n_seg, n_seg * seg, lo=min(128, seg), hi=8 * seg)
        skew = engine.parse_request({"segments": [rand_ids(rng, n) for n in lens], "suffix": rand_ids(rng, QUESTION)})
        pol = {p: summarize(cold_runs(engine, skew, world, p, args.repeats)) for p in ("lpt", "round_robin")}
        gbps = nccl_bandwidth(rank)
        if rank == 0:
            detail["cold"] = cold
            detail["combine_share"] = share[0]
            detail["skewed"] = {"lengths": lens, **pol}
            tag = "32k" if (n_seg, seg) == (32, 1024) else f"{n_seg}x{seg}"
            for m in range(2, world + 1):
                figures[f"cold_ttft_speedup_{m}_workers_{tag}"] = cold[1]["ttft_ms"] / cold[m]["ttft_ms"]
            figures[f"cold_ttft_ms_1_worker_{tag}"] = cold[1]["ttft_ms"]
            figures[f"cold_ttft_ms_{world}_workers_{tag}"] = cold[world]["ttft_ms"]
            figures["cold_first_token_equal_across_worker_counts"] = float(
                len({c["first_token"] for c in cold.values()}) == 1)
            lpt_gain = pol["round_robin"]["ttft_ms"] / pol["lpt"]["ttft_ms"]
            sfx = "" if world == 2 else f"_{world}_workers"
            figures["lpt_vs_round_robin_speedup" + sfx] = lpt_gain
            # the same ratio in tokens for this draw, and its mean over draws of the distribution
            figures["lpt_vs_round_robin_token_bound" + sfx] = token_balance_bound(lens, world)
            detail["skewed"]["token_bound_over_draws"] = token_balance_bounds(
                n_seg, n_seg * seg, min(128, seg), 8 * seg, world
            )
            figures["nccl_transfer_GBps"] = gbps
            from hybridcache.services.runtime.cache import expected_entry_nbytes

            entry_bytes = expected_entry_nbytes(engine.cfg, seg - SEAM, engine.model.dtype)
            figures[f"entry_bytes_{seg}_token_segment"] = entry_bytes
        dist.barrier()
        if rank == 0 and not args.no_qps:
            del engine
            qps_figures(args, seg, figures, detail)
        dist.barrier()
        if rank == 0:
            queue.put({"figures": figures, "detail": detail})
    finally:
        dist.destroy_process_group()


def run_ranks(args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.gpus, port, args, q)) for r in range(args.gpus)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 1800
    while True:
        try:
            res = q.get(timeout=5)
            break
        except queue_mod.Empty:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                # a rank that died leaves the others blocked in a collective: stop them all
                for p in procs:
                    p.terminate()
                why = f"rank(s) {failed} exited with an error" if failed else "no result within 30 min"
                raise RuntimeError(f"segment_parallel: {why}; see the traceback above") from None
    for p in procs:
        p.join()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count(), help="ranks (CPU processes without CUDA)")
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8 segments, short trace")
    ap.add_argument("--segment-tokens", type=int, default=SEG)
    ap.add_argument("--no-qps", action="store_true")
    ap.add_argument(
        "--combine-share",
        type=float,
        default=None,
        help="rank 0's head start in the assignment, as a fraction of all build work (default: the "
        "1-worker run's combine / build time)",
    )
    ap.add_argument("--qps-only", action="store_true", help="only the pic-vs-prefix QPS figures (one GPU)")
    ap.add_argument(
        "--trace-requests", type=int, default=48, help="requests in the QPS trace (the second half is timed)"
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    grpc_gbps = grpc_loopback_gbps()
    if args.qps_only:
        res = {"figures": {}, "detail": {}}
        qps_figures(args, args.segment_tokens, res["figures"], res["detail"])
    elif args.gpus < 2:
        print(json.dumps({"error": "needs at least 2 GPUs (or --qps-only on one)"}))
        return 2
    else:
        res = run_ranks(args)
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        commit = os.environ.get("HYBRIDCACHE_COMMIT", "unknown")
    out = {
        "benchmark": "segment_parallel",
        "gpu": (f"{1 if args.qps_only else args.gpus}x {torch.cuda.get_device_name(0)}"
                if torch.cuda.is_available() else "none (CPU smoke)"),
        "commit": os.environ.get("HYBRIDCACHE_COMMIT", commit),
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/segment_parallel.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "preset": args.preset,
        **res,
    }
    out["figures"]["grpc_transfer_GBps"] = grpc_gbps
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
