"""Sustainable QPS under a TTFT SLO on one GPU, pic vs prefix vs full; prints one JSON object.

Qwen3.5-9B shape, random bf16 weights made on the GPU. Per-request service times are measured on
the GPU over a Zipf RAG trace (32 x 1k documents at most, from a pool of 64, + a 64-token
question), then Poisson arrivals are replayed through a FIFO single-server queue (the simulation
is stated in the output). Also the gRPC loopback rate of raw byte chunks, the floor of the host
transports.

    python benchmarks/qps.py [--quick] [--trace-requests N] [--out FILE]
    python benchmarks/qps.py --preset tiny --quick --segment-tokens 256   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEG, QUESTION, SEAM = 1024, 64, 8


def build_engine(preset: str, mode: str = "pic", arch: str = "qwen3_5_text", layers: int = 0,
                 model_overrides: dict | None = None, **cfg_kw):
    """An Engine over a random-weight Qwen3.5 model of `preset` (arch qwen3_5_text, or
    qwen3_5_moe_text for the MoE presets; `layers`: that many of its layers, 0 all;
    `model_overrides`: config fields set besides, e.g. max_position_embeddings)."""
    from hybridcache.services.runtime.config import ModelConfig
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
    from hybridcache.services.runtime.modelzoo import hf_config, random_init_
    from hybridcache.services.runtime.tokenizer import Tokenizer, build_byte_tokenizer

    overrides = dict(model_overrides) if model_overrides else None
    if layers:
        base = hf_config(arch, preset)
        types = base.get("text_config", base).get("layer_types")
        overrides = dict(overrides or {}, num_hidden_layers=layers)
        if types:  # the preset's pattern of layer kinds, repeated
            overrides["layer_types"] = [types[i % len(types)] for i in range(layers)]
    cfg = ModelConfig.from_dict(hf_config(arch, preset, overrides))
    if not torch.cuda.is_available():  # CPU smoke run of the same code (tiny preset)
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


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--quick", action="store_true", help="short trace, at most 8 documents a request")
    ap.add_argument("--segment-tokens", type=int, default=SEG)
    ap.add_argument(
        "--trace-requests", type=int, default=48, help="requests in the QPS trace (the second half is timed)"
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.segment_tokens <= SEAM or args.trace_requests < 2:
        print(f"qps: error: --segment-tokens must exceed the seam ({SEAM}) and --trace-requests be >= 2",
              file=sys.stderr)
        return 2
    grpc_gbps = grpc_loopback_gbps()
    res = {"figures": {}, "detail": {}}
    qps_figures(args, args.segment_tokens, res["figures"], res["detail"])
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        commit = os.environ.get("HYBRIDCACHE_COMMIT", "unknown")
    out = {
        "benchmark": "qps",
        "gpu": f"1x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "none (CPU smoke)",
        "commit": os.environ.get("HYBRIDCACHE_COMMIT", commit),
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/qps.py " + " ".join(argv if argv is not None else sys.argv[1:]),
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
