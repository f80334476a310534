"""What a receiver's slot copy costs while another process computes on the same GPU. A combine
worker's copy of a scatter worker's arena slot (checksum.copy_with_checksum: one pass, copy and
checksum) of --mb MB, --slots slots in one launch, timed two ways: by CUDA events around it on a
side stream (the GPU time of the copy) and by the host from queueing it to its end (what the
receiver waits). Measured alone, then with a neighbour process running bf16 matmuls on the same
GPU (a scatter worker building the next layers). Under the driver's default time-slicing the two
processes' kernels take turns; under MPS (run it with the MPS control daemon up) they share the
SMs at once. Prints one JSON object.

    python tools/copy_contention.py [--mb 135] [--slots 1,4] [--copies 24] [--label TEXT] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def neighbour(seconds: float) -> None:
    """bf16 matmuls on the GPU for `seconds`, synchronising every 20 (a builder's layers)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def measure(mb: int, slots: int, copies: int, gap_s: float) -> dict:
    from hybridcache.services.transport.checksum import copy_with_checksum, warm

    dev = torch.device("cuda")
    warm(dev)
    nbytes = (mb << 20) * slots
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream()
    gpu_ms, wait_ms = [], []
    for _ in range(copies):
        with torch.cuda.stream(stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dst = torch.empty_like(src)
            t0 = time.perf_counter()
            start.record()
            copy_with_checksum(src, dst)
            end.record()
        end.synchronize()
        wait_ms.append((time.perf_counter() - t0) * 1e3)
        gpu_ms.append(start.elapsed_time(end))
        time.sleep(gap_s)
    gpu, wait = statistics.median(gpu_ms), statistics.median(wait_ms)
    return {"slots": slots, "mb": mb * slots, "gpu_ms": round(gpu, 3), "host_wait_ms": round(wait, 3),
            "gb_per_s_gpu": round(nbytes / gpu / 1e6, 1), "gb_per_s_host_wait": round(nbytes / wait / 1e6, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=135, help="MB a slot (a 9B layer of 32 x 1k entries: 135)")
    ap.add_argument("--slots", default="1,4", help="slots a launch, comma-separated variants")
    ap.add_argument("--copies", type=int, default=24)
    ap.add_argument("--gap-s", type=float, default=0.02, help="pause between copies (a layer's build)")
    ap.add_argument("--neighbour-s", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--label", default="", help="recorded in the output (say: time-slicing, mps)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.neighbour_s:
        neighbour(args.neighbour_s)
        return 0
    if not torch.cuda.is_available():
        print("copy_contention: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        variants = [int(s) for s in args.slots.split(",")]
    except ValueError:
        print(f"copy_contention: --slots takes comma-separated integers, got {args.slots!r}", file=sys.stderr)
        return 2
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    res = {"tool": "copy_contention", "gpu": torch.cuda.get_device_name(), "commit": commit,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python tools/copy_contention.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "label": args.label,
           "alone": [measure(args.mb, k, args.copies, args.gap_s) for k in variants]}
    seconds = 4 + len(variants) * args.copies * (args.gap_s + 0.05) + 8
    proc = subprocess.Popen([sys.executable, __file__, "--neighbour-s", str(seconds)])
    try:
        time.sleep(4)  # the neighbour up and computing
        res["with_neighbour_computing"] = [measure(args.mb, k, args.copies, args.gap_s) for k in variants]
    finally:
        proc.kill()
        proc.wait()
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
