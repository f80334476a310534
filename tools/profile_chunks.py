"""Where a long prompt's chunked prefill spends its time: a plain prompt run a budget of live tokens
at a time (Engine.start_prefill / prefill_chunk, its K/V in a pool slot's pages, as the scheduler
runs it) in each of --modes (pic and prefix record its pages into the prefix cache as they go, full
does not); prints JSON: each chunk's ms and context, the whole prefill's ms, the end of each chunk
alone (`finish_ms`: Engine._finish_chunk, its recording and page-tree insert, timed between
synchronisations, in the timed run), and one chunk deep in the prompt profiled (its top ops by host
and device time; with layer parts `--profile-part` picks its first call or the one that ends it, a
call of its own after its last run of layers). --sync-check runs the deep chunk after that one
under CUDA sync debugging and reports each host-device synchronisation of its calls by call site.

    python tools/profile_chunks.py [--preset qwen3.5-9b] [--tokens 32768] [--budget 512] [--modes full,pic]
        [--layer-parts 1] [--profile-part first] [--sync-check]

On a machine without a GPU it runs the same code on the CPU (use --preset tiny --tokens 3000).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--layers", type=int, default=0, help="layers kept of the preset (0: all)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=512, help="the scheduler's budget (live tokens at zero context)")
    ap.add_argument("--modes", default="full,pic")
    ap.add_argument("--layer-parts", type=int, default=1,
                    help="chunks of this many times the budget's tokens, each run over as many calls (a run of "
                         "layers a call: the scheduler's --chunk-layer-parts); each call is timed")
    ap.add_argument("--profile-part", choices=["first", "last"], default="first",
                    help="with --layer-parts > 1, the profiled chunk's call: its first run of layers, or the call "
                         "that ends it (its kept states and pages: a call of its own after its last run of layers)")
    ap.add_argument("--sync-check", action="store_true",
                    help="run the deep chunk after the profiled one under CUDA sync debugging: each host-device "
                         "synchronisation of its calls with its call site")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    from dataclasses import replace

    from hybridcache.services.runtime.engine import Engine
    from hybridcache.services.runtime.scheduler import attention_cost_per_position, chunk_tokens
    from profile_engine import sync
    from profile_forward import sync_sites, table
    from qps import build_engine

    rng = random.Random(0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    last = args.profile_part == "last" and args.layer_parts > 1  # profile the call that ends a chunk
    out = {"preset": args.preset, "tokens": args.tokens, "budget": args.budget, "layer_parts": args.layer_parts,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    base = None
    for mode in args.modes.split(","):
        if base is None:
            eng = base = build_engine(args.preset, mode, layers=args.layers)
        else:
            eng = Engine(base.model, base.tokenizer, replace(base.config, mode=mode))
        config = eng.config
        slope = attention_cost_per_position(eng.model)
        pool = eng.runner.new_state_pool(1, args.tokens + 64)
        res = {"prefix_policy": getattr(config, "prefix_policy", None) if config.uses_prefix_cache else None}
        for run in ("warm-up", "timed"):  # a new prompt each: the prefix cache holds none of it
            prompt = [rng.randrange(5, 250) for _ in range(args.tokens)]
            req = eng.parse_request({"suffix": prompt, "sampling_params": {"max_new_tokens": 1}})
            job = eng.start_prefill(req)
            slot = eng.runner.assign(pool, job.state)
            chunks, profiled, finish_ms, syncs = [], None, [], None
            finish = eng._finish_chunk
            if run == "timed":
                def timed_finish(*a, finish=finish, finish_ms=finish_ms, **kw):
                    sync()
                    t = time.perf_counter()
                    r = finish(*a, **kw)
                    sync()
                    finish_ms.append(round((time.perf_counter() - t) * 1e3, 2))
                    return r

                eng._finish_chunk = timed_finish
            sync()
            t_all = time.perf_counter()
            while job.next < len(job.layout):
                context = job.layout[job.next].start + job.offset
                n = chunk_tokens(args.budget, context, slope) * args.layer_parts
                deep = run == "timed" and profiled is None and context >= args.tokens * 3 // 4
                checked = (run == "timed" and args.sync_check and profiled is not None and syncs is None
                           and torch.cuda.is_available())
                if checked:  # every call of this chunk under sync debugging, untimed (its end too)
                    syncs, got = {}, []
                    eng._finish_chunk = finish
                    for k in range(args.layer_parts + 1):
                        def call(eng=eng, job=job, n=n if k == 0 else None, got=got):
                            got.append(eng.prefill_chunk(job, n, layer_parts=args.layer_parts))

                        syncs[f"call {k + 1}"] = sync_sites(call)
                        if not job.part_way:
                            break
                    pre = got[-1]
                    eng._finish_chunk = timed_finish
                    sync()
                    continue
                t0 = time.perf_counter()
                if deep and not last:
                    with profile(activities=activities) as prof:
                        pre = eng.prefill_chunk(job, n, layer_parts=args.layer_parts)
                        sync()
                    profiled = prof
                else:
                    pre = eng.prefill_chunk(job, n, layer_parts=args.layer_parts)
                    sync()
                chunks.append((context, round((time.perf_counter() - t0) * 1e3, 2)))
                part = 1
                while job.part_way:  # the chunk's other runs of layers, a call each
                    part += 1
                    t0 = time.perf_counter()
                    # the call that ends the chunk: its end apart, or the last chunk's last run of layers
                    ends = job.running.ran is not None or (job.next >= len(job.layout) and part == args.layer_parts)
                    if deep and last and ends:
                        with profile(activities=activities) as prof:
                            pre = eng.prefill_chunk(job)
                            sync()
                        profiled = prof
                    else:
                        pre = eng.prefill_chunk(job)
                        sync()
                    chunks.append((context, round((time.perf_counter() - t0) * 1e3, 2)))
            total = (time.perf_counter() - t_all) * 1e3
            eng._finish_chunk = finish
            eng.finish_prefix(pre)
            pool.release(slot)
        res.update(prefill_ms=round(total, 1), chunks=len(chunks), chunk_ms=chunks,
                   chunk_ms_mean=round(sum(ms for _, ms in chunks) / len(chunks), 2), finish_ms=finish_ms,
                   finish_ms_mean=round(sum(finish_ms) / max(1, len(finish_ms)), 2))
        if syncs is not None:
            res["sync_sites"] = syncs
        if profiled is not None:
            kernels = [e for e in profiled.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            res["profiled_chunk"] = {
                "gpu_kernel_ms": round(sum(e.self_device_time_total for e in kernels) / 1e3, 3),
                "kernel_launches": sum(e.count for e in kernels),
                "by_host_time": table(profiled, "self_cpu_time_total", args.top),
                "by_device_time": table(profiled, "self_device_time_total", args.top),
            }
        out[mode] = res
        del eng, pool
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
