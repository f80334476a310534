"""Count the torch ops that launch work (views and metadata left out) in a pic assembly and a
decode step, through the engine on the CPU. On a GPU each of them is at least one kernel launch,
and the warm pic TTFT is host-bound (tools/profile_forward.py), so this is the CPU-side
measure of launch overhead; the linear layers' recurrences run their reference ops on the CPU,
so families' GPU kernels are not counted as on the GPU.

    python tools/op_count.py [--preset tiny] [--segments 4 8 16] [--segment-tokens 64]
        [--cold-segment-tokens 448]

Also counts a cold prompt of 8 segments (nothing cached) in `full`, `prefix` and `pic` mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# aten ops that only make views or read metadata: no kernel of their own on a GPU
NO_LAUNCH = {
    "aten::" + n
    for n in (
        "as_strided view reshape transpose unsqueeze permute _unsafe_view t select slice alias narrow squeeze "
        "expand resolve_conj resolve_neg result_type detach split chunk empty empty_strided empty_like to linear "
        "matmul contiguous lift_fresh split_with_sizes unbind dim size stride is_nonzero item _local_scalar_dense "
        "broadcast_tensors flatten unflatten movedim numpy_T type_as _reshape_alias view_as"
    ).split()
}


FAST_PATH = False  # set by --fast-path


def launching_ops(fn) -> dict[str, int]:
    if FAST_PATH:
        return launching_ops_fast_path(fn)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::") and e.key not in NO_LAUNCH}


def launching_ops_fast_path(fn) -> dict[str, int]:
    """Torch ops (seen by a dispatch mode, below autograd) and Triton launches of fn, by name. The
    interpreter runs each Triton kernel with torch ops of its own: those are not counted, the
    launch is (once)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    counts: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = "aten::" + func.overloadpacket.__name__
            if name not in NO_LAUNCH:
                counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    real = InterpretedFunction.run

    def run(self, *a, **k):
        name = "triton::" + getattr(getattr(self, "fn", None), "__name__", "kernel")
        counts[name] = counts.get(name, 0) + 1
        with _disable_current_modes():
            return real(self, *a, **k)

    InterpretedFunction.run = run
    try:
        with Count():
            fn()
    finally:
        InterpretedFunction.run = real
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--segments", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--segment-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cold-segment-tokens", type=int, default=448, help="8 of these make the cold prompt")
    ap.add_argument(
        "--fast-path",
        action="store_true",
        help="take the CUDA code path (fused Triton kernels, run by Triton's interpreter on the CPU) and "
        "count each Triton launch with the torch ops; fla's kernels are absent on the CPU, so the linear "
        "layers' scans still run their reference ops",
    )
    args = ap.parse_args(argv)
    if args.fast_path:
        global FAST_PATH
        FAST_PATH = True
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        from hybridcache.services.runtime import backends

        backends.use_fast_kernels = lambda t: True
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    from hybridcache.services.runtime.sequence import LiveRun
    from qps import build_engine

    eng = build_engine(args.preset, "pic")
    gen = torch.Generator().manual_seed(0)
    figures, detail = {}, {}
    for n in args.segments:
        segs = [torch.randint(0, 250, (args.segment_tokens,), generator=gen).tolist() for _ in range(n)]
        eng.prefill(eng.parse_request({"segments": segs, "suffix": [1, 2, 3]}))  # builds the entries
        # warm segments in an order not seen before, after no cached prefix: a full assembly
        req = eng.parse_request({"segments": segs[1:] + segs[:1], "suffix": list(range(20))})
        ops = launching_ops(lambda req=req: eng.prefill(req))
        figures[f"pic_ops_{n}_segments"] = sum(ops.values())
        detail[f"pic_{n}"] = dict(sorted(ops.items(), key=lambda kv: -kv[1])[: args.top])
    state = eng.model.empty_state()
    eng.model.forward_layout(state, [LiveRun(torch.arange(200) % 250, 0)], "none")
    ops = launching_ops(lambda: eng.model.forward_layout(state.clone(), [LiveRun(torch.tensor([5]), 200)], "last"))
    figures["decode_step_ops"] = sum(ops.values())
    detail["decode"] = dict(sorted(ops.items(), key=lambda kv: -kv[1])[: args.top])
    # a cold prompt (nothing cached) in each mode: prefix mode splits it where it keeps checkpoints
    gen = torch.Generator().manual_seed(1)
    cold = [torch.randint(0, 250, (args.cold_segment_tokens,), generator=gen).tolist() for _ in range(8)]
    for mode in ("full", "prefix", "pic"):
        eng_m = build_engine(args.preset, mode)
        req = eng_m.parse_request({"segments": cold, "suffix": [1, 2, 3]})
        ops = launching_ops(lambda eng_m=eng_m, req=req: eng_m.finish_prefix(eng_m.prefill(req)))
        figures[f"cold_prompt_ops_{mode}"] = sum(ops.values())
    figures["cold_prompt_tokens"] = 8 * args.cold_segment_tokens + 3
    if len(args.segments) > 1:
        a, b = args.segments[0], args.segments[-1]
        figures["pic_ops_per_extra_segment"] = round(
            (figures[f"pic_ops_{b}_segments"] - figures[f"pic_ops_{a}_segments"]) / (b - a), 1
        )
    commit = os.environ.get("HYBRIDCACHE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        json.dumps(
            {
                "benchmark": "op_count",
                "device": "cpu",
                "commit": commit,
                "date": datetime.date.today().isoformat(),
                "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                "preset": args.preset,
                "path": "CUDA code path under Triton's interpreter (fla absent)" if args.fast_path else "CPU reference",
                "layers": eng.model.cfg.num_hidden_layers,
                "figures": figures,
                "detail": detail,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
