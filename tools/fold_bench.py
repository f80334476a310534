"""The live scan's fold of one linear layer, alone: cached spans' entries and the layer's seam
runs folded from the running state with every intermediate state out, as
`LinearMixer.batched_scan` (models/mixer.py) does for a pic assembly (Qwen3.5-9B's linear layer: 32 heads,
128 x 128 state, bf16 entries; 32 spans and 33 runs, the 32 x 1k + question request).

Variants, same inputs, timed in the same run:
- `stack`: the path before 531ce67: a slice per run, torch.cat of the 65 T and the 65 S blocks,
  then compose_states_fwd over the stack;
- `blocks`: compose_states_blocks (the entries read in place through an address table), each
  step's addresses loaded in its own iteration (the default);
- `blocks_prefetch`: the same with the next step's addresses loaded a step ahead;
- `blocks_prefetch_w4`: as blocks_prefetch with 4 warps a program instead of 8;
- `table`: compose_states_table over device address tables (the planned assembly's fold, as its
  CUDA graphs run it: no host table a call); `table_<option>` the same with other launch options
  (column blocks, warps, stages, addresses a step ahead);
- `table_runs_fp32_in_place`: the runs' pairs fp32 (as a pass leaves them) read beside the bf16
  entries through one table (runs=); `table_runs_fp32_copied`: the same pairs copied to bf16
  first, then the table (the copies timed with the fold);
- `table_fp32`: fp32 entries (the default entry_state_dtype), every pair fp32 and the dots in
  tf32x3; `table_fp32_<option>` with other launch options, `table_fp32_tf32` in one TF32 pass.

Per variant: GPU time of one fold (CUDA events around `--iters` folds, divided), host time of one
fold's calls (the host returning from the call, without waiting for the GPU), and the largest
difference of its states from `stack`'s. Prints one JSON object; `--out FILE` also writes it.

    python tools/fold_bench.py [--spans 32] [--iters 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--spans", type=int, default=32, help="cached spans; the runs are one more (default 32)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128, help="key and value head dim (default 128)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.spans < 1 or args.heads < 1 or args.dim < 1 or args.iters < 1:
        print("fold_bench: error: --spans, --heads, --dim and --iters must be positive", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("fold_bench: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from hybridcache.kernels.ops.transition.compose_triton import (
        compose_states_blocks,
        compose_states_fwd,
        compose_states_table,
    )

    torch.manual_seed(0)
    H, K, n = args.heads, args.dim, args.spans
    dev, bf = "cuda", torch.bfloat16

    def transitions(m):
        u = torch.nn.functional.normalize(torch.randn(m, H, K, 2, device=dev), dim=-2)
        return (0.9 * (torch.eye(K, device=dev) - 0.5 * u @ u.transpose(-1, -2))).to(bf)

    spans = [(transitions(1), torch.randn(1, H, K, K, device=dev).to(bf)) for _ in range(n)]
    runs_T, runs_S = transitions(n + 1), torch.randn(n + 1, H, K, K, device=dev).to(bf)
    h0 = torch.randn(1, H, K, K, device=dev)
    # run, span, run, span, ..., run: the order of a pic request's pieces after its first segment
    blocks = []
    for j in range(n + 1):
        blocks.append(((runs_T, j), (runs_S, j)))
        if j < n:
            blocks.append(spans[j])
    Ts = [b[0] for b in blocks]
    Ss = [b[1] for b in blocks]

    def stack():
        t = [b[0][b[1] : b[1] + 1] if isinstance(b, tuple) else b for b in Ts]
        s = [b[0][b[1] : b[1] + 1] if isinstance(b, tuple) else b for b in Ss]
        return compose_states_fwd(torch.cat(t), torch.cat(s), h0[0], output_all=True)[1]

    def address(b):
        base, i = b if isinstance(b, tuple) else (b, 0)
        return base.data_ptr() + i * base[0].numel() * base.element_size()

    t_tab = torch.tensor([address(b) for b in Ts], device=dev)
    s_tab = torch.tensor([address(b) for b in Ss], device=dev)
    variants = {
        "stack": stack,
        "blocks": lambda: compose_states_blocks(Ts, Ss, h0[0], output_all=True)[1],
        "blocks_prefetch": lambda: compose_states_blocks(Ts, Ss, h0[0], output_all=True, prefetch_addresses=True)[1],
        "blocks_prefetch_w4": lambda: compose_states_blocks(
            Ts, Ss, h0[0], output_all=True, prefetch_addresses=True, num_warps=4
        )[1],
        "table": lambda: compose_states_table(t_tab, s_tab, runs_T, runs_S, h0[0], output_all=True)[1],
    }
    # the table's launch options: column blocks of 16 and 64 (the default takes 32 at 32 heads:
    # 128 programs), 4 warps, 3 stages, addresses a step ahead
    for name, kw in (("bv16", dict(block_v=16)), ("bv64", dict(block_v=64)), ("w4", dict(num_warps=4)),
                     ("s3", dict(num_stages=3)), ("prefetch", dict(prefetch_addresses=True)),
                     ("bv16_w4", dict(block_v=16, num_warps=4))):
        variants[f"table_{name}"] = functools.partial(
            lambda kw: compose_states_table(t_tab, s_tab, runs_T, runs_S, h0[0], output_all=True, **kw)[1], kw)
    # the planned assembly's runs as a pass leaves them, fp32 beside the bf16 entries: read in place
    # (runs=, each T rounded to bf16 as read) against copied to bf16 first and then folded
    runs_T32, runs_S32 = runs_T.float(), runs_S.float()
    run_of = torch.tensor([j // 2 if j % 2 == 0 else -1 for j in range(len(Ts))], device=dev)

    def tables_of(rt, rs):
        def addr(b, base):
            if isinstance(b, tuple):
                return base.data_ptr() + b[1] * base[0].numel() * base.element_size()
            return b.data_ptr()

        return (torch.tensor([addr(b, rt) for b in Ts], device=dev),
                torch.tensor([addr(b, rs) for b in Ss], device=dev))

    t32, s32 = tables_of(runs_T32, runs_S32)
    variants["table_runs_fp32_in_place"] = lambda: compose_states_table(
        t32, s32, spans[0][0], spans[0][1], h0[0], output_all=True, runs=(run_of, runs_T32, runs_S32))[1]

    def converted():
        rt, rs = runs_T32.to(bf), runs_S32.to(bf)
        tt, ss = tables_of(rt, rs)
        return compose_states_table(tt, ss, rt, rs, h0[0], output_all=True)[1]

    variants["table_runs_fp32_copied"] = converted
    # fp32 entries (entry_state_dtype float32, the default): every pair fp32, the fold's dots in
    # tf32x3 by default; with its launch options, and one TF32 pass for what the other two cost
    as32 = {id(t): t.float() for pair in spans for t in pair}  # each span's T and S in fp32
    Ts32 = [(runs_T32, b[1]) if isinstance(b, tuple) else as32[id(b)] for b in Ts]
    Ss32 = [(runs_S32, b[1]) if isinstance(b, tuple) else as32[id(b)] for b in Ss]
    t_all32 = torch.tensor([address(b) for b in Ts32], device=dev)
    s_all32 = torch.tensor([address(b) for b in Ss32], device=dev)
    for name, kw in (("", {}), ("_s2", dict(num_stages=2)), ("_s3", dict(num_stages=3)), ("_w4", dict(num_warps=4)),
                     ("_bv64", dict(block_v=64)), ("_tf32", dict(dot_precision="tf32"))):
        variants[f"table_fp32{name}"] = functools.partial(
            lambda kw: compose_states_table(t_all32, s_all32, runs_T32, runs_S32, h0[0], output_all=True, **kw)[1],
            kw)
    ref = stack()
    figures, detail = {}, {}
    for name, fn in variants.items():
        got = fn()
        diff = (got - ref).abs().max().item()
        rel = ((got - ref).norm() / ref.norm()).item()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = 0.0
        start.record()
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            host += time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        gpu_us = 1000 * start.elapsed_time(end) / args.iters
        figures[f"fold_us_{name}"] = round(gpu_us, 2)
        figures[f"fold_host_us_{name}"] = round(1e6 * host / args.iters, 2)
        detail[name] = {"max_abs_diff_vs_stack": diff, "rel_err_vs_stack": rel}
    commit = (
        os.environ.get("HYBRIDCACHE_COMMIT")
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    out = {
        "gpu": torch.cuda.get_device_name(),
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python tools/fold_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": {"heads": H, "dim": K, "spans": n, "runs": n + 1, "blocks": len(Ts), "entry_dtype": "bfloat16"},
        "detail": detail,
        "figures": figures,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
