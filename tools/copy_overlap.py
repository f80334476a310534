"""Does compute overlap a bulk host-to-device transfer on this GPU, and what in the compute stream
breaks the overlap? The host tier's shape: a side stream copies `--layers` layers of `--mb` MB
each from pinned memory, one event a layer; the compute stream runs one CUDA graph a layer (bf16
matmuls of about `--layer-ms`) and waits for its layer's event first. Variants of the compute
graph: kernels only; kernels plus a small device-to-device copy_ (a memcpy node, run by a copy
engine); the same copy as a kernel (torch._foreach_copy_); kernels plus a small pinned
host-to-device copy on the compute stream outside the graph (as a replay's token ids). Reports,
per variant, the time of the transfer alone, of the compute alone and of both (median of
--repeats), and overlap_ms = transfer + compute - both (the transfer's time hidden under compute).

    python tools/copy_overlap.py [--layers 32] [--mb 128] [--layer-ms 1.4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--mb", type=int, default=128)
    ap.add_argument("--layer-ms", type=float, default=1.4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_overlap: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    n = args.mb * 2**20
    host = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(args.layers)]
    dst = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(args.layers)]
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    small_src = torch.randn(2**18, device=dev)  # 1 MB
    small_dst = torch.empty_like(small_src)
    ids_host = torch.arange(64, dtype=torch.int64).pin_memory()
    ids_dev = torch.empty(64, dtype=torch.int64, device=dev)

    # matmuls per layer for about --layer-ms
    for _ in range(10):  # cuBLAS' first calls set it up
        torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    per_mm = (time.perf_counter() - t0) / 50 * 1e3
    mms = max(1, round(args.layer_ms / per_mm))

    def body(kind):
        def fn():
            for _ in range(mms):
                torch.mm(a, b, out=c)
            if kind == "memcpy_node":
                small_dst.copy_(small_src)
            elif kind == "kernel_copy":
                torch._foreach_copy_([small_dst], [small_src])

        return fn

    figures = {"gpu": torch.cuda.get_device_name(), "matmuls_per_layer": mms, "layer_ms": round(mms * per_mm, 3)}
    for kind in ("kernels", "memcpy_node", "kernel_copy", "h2d_on_compute_stream"):
        fn = body("kernels" if kind == "h2d_on_compute_stream" else kind)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()

        def run(transfer: bool, compute: bool, kind=kind, g=g):
            events = []
            if transfer:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for d, h in zip(dst, host):
                        d.copy_(h, non_blocking=True)
                        e = torch.cuda.Event()
                        e.record(side)
                        events.append(e)
            if compute:
                for i in range(args.layers):
                    if kind == "h2d_on_compute_stream":
                        ids_dev.copy_(ids_host, non_blocking=True)
                    if transfer:
                        torch.cuda.current_stream().wait_event(events[i])
                    g.replay()
            if transfer:
                torch.cuda.current_stream().wait_stream(side)

        res = {}
        for name, tr, co in (("transfer", True, False), ("compute", False, True), ("both", True, True)):
            times = []
            for _ in range(args.repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run(tr, co)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            res[name] = round(statistics.median(times[1:]), 2)
        res["overlap_ms"] = round(res["transfer"] + res["compute"] - res["both"], 2)
        res["transfer_gb_per_s"] = round(args.layers * n / (res["transfer"] / 1e3) / 1e9, 1)
        figures[kind] = res
    out = {"command": "python tools/copy_overlap.py " + " ".join(argv or sys.argv[1:]), "figures": figures}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
