"""Where the time of a batched decode step goes on the GPU (services/runtime/paged.py decode_step):
Qwen3.5-9B shape (or --preset qwen3.5-35b-a3b, the MoE shape, --layers of it: 0 all, fewer when
they do not fit), random bf16 weights, B requests of --prompt-tokens tokens each in a StatePool,
stepped eagerly and from decode CUDA graphs; per batch size the wall time of a step (median of
--steps), its kernels' device time and launches, the top ops by host and device time under
torch.profiler, and the host-device synchronizations of one step with their call sites. A step
whose wall time is far above its kernels' device time is host-bound (launches, Python, syncs).

    python tools/profile_decode.py [--batches 1,32] [--steps 20] [--top 20]
    python tools/profile_decode.py --preset qwen3.5-35b-a3b --layers 16 --batches 1,32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32", help="comma list of decode batch sizes")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--no-graphs", action="store_true", help="eager steps only")
    ap.add_argument("--preset", default="qwen3.5-9b", choices=["qwen3.5-9b", "qwen3.5-35b-a3b"],
                    help="the dense shape (qwen3_5_text) or the MoE shape (qwen3_5_moe_text)")
    ap.add_argument("--layers", type=int, default=0, help="MoE shape: layers to build (0: all that fit)")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        print(f"profile_decode: error: --batches {args.batches!r}: expected a comma list of integers", file=sys.stderr)
        return 2
    if not batches or min(batches) < 1 or args.steps < 1 or args.prompt_tokens < 1:
        print("profile_decode: error: batch sizes, --steps and --prompt-tokens must be >= 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("profile_decode: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    from gpu_bench import build_models
    from hybridcache.services.config import RuntimeConfig
    from hybridcache.services.runtime.runner import ModelRunner
    from hybridcache.services.runtime.sequence import LiveRun
    from profile_forward import sync_sites, table

    if args.preset == "qwen3.5-9b":
        cfg, model, _, _ = build_models(args.preset, False)
    else:
        from moe_bench import build_ours, layers_that_fit

        layers = layers_that_fit(args.preset, args.layers, "cuda", torch.bfloat16, reserve_gib=12)
        cfg, model = build_ours(args.preset, layers, "cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    slots_max = max(batches)
    kv_tokens = slots_max * (args.prompt_tokens + 4 * args.steps + 64)
    import datetime
    import os

    out = {"benchmark": "profile_decode", "gpu": torch.cuda.get_device_name(0),
           "commit": os.environ.get("HYBRIDCACHE_COMMIT", ""),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "python tools/profile_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "preset": args.preset, "prompt_tokens": args.prompt_tokens, "steps": args.steps,
           "layers": cfg.num_hidden_layers}
    modes = (False,) if args.no_graphs else (False, True)
    for graphs in modes:
        # the decode step's CUDA graphs are its runner's (services/runtime/runner.py)
        runner = ModelRunner(model, RuntimeConfig(decode_cuda_graphs=graphs,
                                                  max_model_len=args.prompt_tokens + 8 * args.steps + 64))
        for B in batches:
            pool = runner.new_state_pool(slots_max, kv_tokens)
            slots = []
            for _ in range(B):
                s = model.empty_state()
                ids = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=gen)
                model.forward_layout(s, [LiveRun(ids, 0)], logits_for="none")
                slots.append(pool.assign(s))
            toks = [5] * B

            def step(pool=pool, slots=slots, toks=toks, runner=runner):
                logits, _ = runner.decode(pool, slots, toks)
                return logits

            for _ in range(3):  # warm: kernels compiled, the graph of this size captured
                step()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            key = f"{'graphs' if graphs else 'eager'}_b{B}"
            out[key] = {
                "step_ms_p50": round(statistics.median(times), 3),
                "step_ms_min": round(min(times), 3),
                "gpu_kernel_ms": round(sum(e.self_device_time_total for e in kernels) / 1e3, 3),
                "kernel_launches": sum(e.count for e in kernels),
                "syncs": sync_sites(step),
                "by_host_time": table(prof, "self_cpu_time_total", args.top),
                "by_device_time": table(prof, "self_device_time_total", args.top),
            }
            experts = next((m for m in model.modules() if hasattr(m, "gate_up_proj")), None)
            if experts is not None:  # the MoE path the step takes (backends.moe_path: "pairs" up to 64 pairs)
                probe = torch.zeros(B, cfg.hidden_size, device="cuda", dtype=experts.down_proj.dtype)
                out[key]["moe_path"] = experts.path(probe, cfg.num_experts_per_tok)
            if graphs:
                g = runner.decode_graphs(pool)
                out[key]["graph_stats"] = dict(g.stats) if g is not None else None
                out[key]["graph_failures"] = {str(k): v for k, v in g.failed.items()} if g is not None else None
            print(f"profile_decode: {key}: {out[key]['step_ms_p50']} ms a step, "
                  f"kernels {out[key]['gpu_kernel_ms']} ms", file=sys.stderr, flush=True)
            del pool, step
            torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
