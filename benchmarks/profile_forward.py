"""Where the time of one forward goes on the GPU: torch.profiler over a decode step and a pic
assembly (Qwen3.5-9B shape, random bf16 weights); prints JSON with the top ops by host and device time.

    python benchmarks/profile_forward.py [--segments 8] [--top 25]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))


def table(prof, key, top):
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [
        {
            "op": e.key[:80],
            "calls": e.count,
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
            "device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 3),
        }
        for e in rows
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    from gpu_bench import SEAM, SEG, build_entries, build_models, pic_layout
    from hybridcache.services.runtime.sequence import LiveRun

    cfg, model, _, _ = build_models("qwen3.5-9b", False)
    gen = torch.Generator().manual_seed(0)
    segs = [torch.randint(0, cfg.vocab_size, (SEG,), generator=gen) for _ in range(args.segments)]
    question = torch.randint(0, cfg.vocab_size, (64,), generator=gen)
    entries = build_entries(model, segs)
    out = {"segments": args.segments, "seam": SEAM}

    def pic():
        model.forward_layout(model.empty_state(), pic_layout(segs, entries, question), "last")

    state = model.empty_state()
    model.forward_layout(state, [LiveRun(torch.cat(segs), 0)], "none")

    def decode():
        s = state.clone()
        model.forward_layout(s, [LiveRun(torch.tensor([5]), s.length)], "last")

    for name, fn in (("decode", decode), ("pic", pic)):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        out[name] = {
            "wall_ms": round(wall, 2),
            "by_host_time": table(prof, "self_cpu_time_total", args.top),
            "by_device_time": table(prof, "self_device_time_total", args.top),
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
