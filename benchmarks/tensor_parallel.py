"""Tensor parallelism: prefill and batched decode of one model at TP 1 and TP 2; prints one JSON object.

A preset's shape (default Qwen3.5-9B) with random weights made on each rank's device, split as a
served worker splits a checkpoint (tensor_parallel/shard.py), run by a ModelRunner on each rank
through the same broadcast calls (tensor_parallel/ranks.py). Figures per TP size: `full` prefill
of --prefill-tokens tokens (seconds, tokens/s) and decode tokens/s of --streams requests stepping together (each after a
--prompt-tokens prompt); then tp2_prefill_speedup and tp2_decode_speedup when both sizes ran.

    python benchmarks/tensor_parallel.py --device cuda [--tp 1] [--tp 1,2] [--out results.json]
    python benchmarks/tensor_parallel.py --device cpu --preset tiny --prefill-tokens 256 --streams 4
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime import modelzoo
from hybridcache.services.runtime.models.registry import build_model, config_from_dict
from hybridcache.services.runtime.runner import ModelRunner
from hybridcache.services.runtime.sequence import LiveRun
from hybridcache.services.runtime.tensor_parallel import ranks
from hybridcache.services.runtime.tensor_parallel.shard import shard_model

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def random_model(arch: str, preset: str, dtype: str, device: str, rank: int, size: int):
    """Rank `rank` of `size`'s shard of a random-weight model, made on its device (no checkpoint:
    the shard's shapes are cut on the meta device, then filled; weight values do not change the
    compute)."""
    cfg = config_from_dict(modelzoo.hf_config(arch, preset))
    with torch.device("meta"):
        model = shard_model(build_model(cfg), rank, size)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    model = model.to(getattr(torch, dtype)).to_empty(device=dev)
    gen = torch.Generator(device=dev).manual_seed(rank)
    offset = getattr(model, "norm_offset", 0.0)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if not p.is_floating_point():
            continue
        if name.endswith("A_log"):
            p.uniform_(math.log(1e-3), math.log(4.0), generator=gen)
        elif name.endswith("dt_bias"):
            p.uniform_(-1.0, 1.0, generator=gen)
        elif "norm" in name.split(".")[-2]:
            p.normal_(offset if not name.endswith("linear_attn.norm.weight") else 1.0, 0.1, generator=gen)
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    model.eval().merge_projections()
    return model


def random_runner(arch: str, preset: str, dtype: str, device: str, max_len: int, rank: int, size: int) -> ModelRunner:
    """The ModelRunner of rank `rank`'s shard (random_model), its pools' tables `max_len` tokens wide."""
    return ModelRunner(random_model(arch, preset, dtype, device, rank, size), RuntimeConfig(max_model_len=max_len))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(runner, args) -> dict:
    """Prefill and decode figures of one model through its runner (a ModelRunner, or rank 0's
    RankedRunner, whose calls run on every rank)."""
    vocab = config_from_dict(modelzoo.hf_config(args.arch, args.preset)).vocab_size
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=gen)

    prompt = ids(args.prefill_tokens)
    times = []
    for rep in range(args.repeat + 1):
        sync(args.device)
        t0 = time.perf_counter()
        runner.forward(runner.empty_state(), [LiveRun(prompt, 0)], logits_for="last")
        sync(args.device)
        if rep:  # the first run warms the kernels up
            times.append(time.perf_counter() - t0)
    prefill_s = statistics.median(times)
    states = []
    for _ in range(args.streams):
        st = runner.empty_state()
        runner.forward(st, [LiveRun(ids(args.prompt_tokens), 0)], logits_for="none")
        states.append(st)
    toks = ids(args.streams).tolist()
    # the streams held as the scheduler holds its running requests: linear states in slots, K/V in pages
    room = args.streams * (args.prompt_tokens + args.decode_steps + 2)
    pool = runner.new_state_pool(args.streams, room)
    slots = [runner.assign(pool, st) for st in states]
    runner.decode(pool, slots, toks)  # warm-up step
    sync(args.device)
    t0 = time.perf_counter()
    for _ in range(args.decode_steps):
        logits, _ = runner.decode(pool, slots, toks)
        toks = logits.argmax(-1).tolist()
    sync(args.device)
    decode_s = time.perf_counter() - t0
    return {
        "prefill_tokens": args.prefill_tokens,
        "prefill_s": round(prefill_s, 4),
        "prefill_tokens_per_s": round(args.prefill_tokens / prefill_s, 1),
        "streams": args.streams,
        "prompt_tokens": args.prompt_tokens,
        "decode_steps": args.decode_steps,
        "decode_tokens_per_s": round(args.streams * args.decode_steps / decode_s, 1),
        "decode_step_ms": round(1000 * decode_s / args.decode_steps, 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--arch", default="qwen3_5_text")
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tp", default="1,2", help="comma list of tensor-parallel sizes to run")
    ap.add_argument("--prefill-tokens", type=int, default=32768)
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="prompt of each decoding stream")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    try:
        sizes = [int(t) for t in args.tp.split(",")]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        print(f"tensor_parallel.py: error: --tp must be a comma list of sizes >= 1, got {args.tp!r}", file=sys.stderr)
        return 2
    if (args.arch, args.preset) not in modelzoo.PRESETS:
        print(f"tensor_parallel.py: error: no preset {args.preset!r} of {args.arch!r}", file=sys.stderr)
        return 2
    if args.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < max(sizes)):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"tensor_parallel.py: error: --tp {max(sizes)} needs that many GPUs, {n} visible", file=sys.stderr)
        return 2
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    commit = os.environ.get("HYBRIDCACHE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    out = {"benchmark": "tensor_parallel", "gpu": device_name, "commit": commit or "unknown",
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": shlex.join(["python", "benchmarks/tensor_parallel.py",
                                  *(argv if argv is not None else sys.argv[1:])]),
           "device": device_name, "arch": args.arch, "preset": args.preset, "dtype": args.dtype, "tp": {}}
    for size in sizes:
        build = functools.partial(random_runner, args.arch, args.preset, args.dtype, args.device,
                                  args.prompt_tokens + args.decode_steps + 2)
        if size == 1:
            runner = build(0, 1)
            out["tp"]["1"] = measure(runner, args)
            del runner
            if args.device == "cuda":
                torch.cuda.empty_cache()
            continue
        group = ranks.start(size, build, args.device)
        try:
            out["tp"][str(size)] = measure(group.runner(), args)
        finally:
            group.shutdown()
    if "1" in out["tp"] and "2" in out["tp"]:
        one, two = out["tp"]["1"], out["tp"]["2"]
        out["tp2_prefill_speedup"] = round(one["prefill_s"] / two["prefill_s"], 3)
        out["tp2_decode_speedup"] = round(two["decode_tokens_per_s"] / one["decode_tokens_per_s"], 3)
    figures = {}
    if "1" in out["tp"]:
        figures["tp1_prefill_s_32k"] = out["tp"]["1"]["prefill_s"]
        figures["tp1_decode_tokens_per_s_32_streams"] = out["tp"]["1"]["decode_tokens_per_s"]
    if "tp2_prefill_speedup" in out:
        figures["tp2_prefill_speedup_32k"] = out["tp2_prefill_speedup"]
        figures["tp2_decode_tokens_per_s_vs_tp1"] = out["tp2_decode_speedup"]
    out["figures"] = figures
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
