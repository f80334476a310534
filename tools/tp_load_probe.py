"""What a tensor-parallel rank reads of a checkpoint, against a whole load, on one device.

Writes a random-weight model of a preset (default the Qwen3.5-9B shape, bf16) once, then loads it
whole and as rank 0 (and 1) of --tp ranks (tensor_parallel/slices.py: only the rank's slices are
read), each load timed cold in its own process order, and prints one JSON line: checkpoint bytes,
bytes each load read, seconds, the rank's parameter bytes, whether the fingerprints agree.

    python tools/tp_load_probe.py --device cuda --out /tmp/q9b
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.modelzoo import init_model_dir


def _param_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen3_5_text")
    p.add_argument("--preset", default="qwen3.5-9b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", default="/tmp/tp-load-probe")
    args = p.parse_args()
    out = Path(args.out)
    t0 = time.perf_counter()
    if not (out / "config.json").is_file():
        init_model_dir(args.arch, args.preset, out, dtype=torch.bfloat16, device=args.device)
    write_s = time.perf_counter() - t0
    ckpt = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    loads = {}
    fingerprints = set()
    for name, rank, size in [("whole", 0, 1), *((f"rank{r}", r, args.tp) for r in range(min(args.tp, 2)))]:
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model = load_model(out, args.device, torch.bfloat16, tp_rank=rank, tp_size=size)
        if args.device == "cuda":
            torch.cuda.synchronize()
        loads[name] = {"seconds": round(time.perf_counter() - t0, 2), "bytes_read": model.checkpoint_bytes_read,
                       "param_bytes": _param_bytes(model)}
        fingerprints.add(model.fingerprint)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({"arch": args.arch, "preset": args.preset, "device": args.device, "tp": args.tp,
                      "checkpoint_bytes": ckpt, "write_seconds": round(write_s, 1), "loads": loads,
                      "fingerprints_agree": len(fingerprints) == 1}))


if __name__ == "__main__":
    main()
