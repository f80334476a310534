"""Where the steps go while a long prompt prefills under running streams, in one process: the
combine worker's scheduler (its decode graphs captured, its chunked prefill in layer parts) stepped
here with --streams requests decoding, then one --long-tokens cold prompt added; each step timed
and told apart by what it ran of the long prompt's chunk: its first run of layers (the chunk's
start: its pieces, pages and forward set up), a later run, the chunk's end in a call of its own
(kept states, pages recorded and inserted), the prompt's last call (its first token), or none
(decode only). Prints JSON: the steps' wall ms by kind and by the chunk's depth into the prompt,
the slowest steps with what they ran, the interpreter's collections during the prefill (the
warm-up's objects frozen first, as a served worker freezes them) and the objects it tracks at the
prompt's first token, the streams' inter-token gaps (steady and during, as served_long_prompt's
itl phase reports them from the client: here without the router, the RPC and HTTP between).

    python tools/profile_mixed.py [--preset qwen3.5-9b] [--streams 32] [--long-tokens 131072]
        [--budget 128] [--layer-parts 16]

On a machine without a GPU it runs the same code on the CPU (use --preset tiny --long-tokens 3000).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybridcache.services.observability.metrics import GcPauses  # noqa: E402
from served_load import percentiles  # noqa: E402


def stats(xs: list[float]) -> dict:
    """served_load's percentiles of ms values, with their count and maximum."""
    if not xs:
        return {"n": 0}
    return dict(percentiles(xs, scale=1.0), n=len(xs), max=round(max(xs), 2))


class Collections(GcPauses):
    """GcPauses keeping each collection as (generation, ms)."""

    def __init__(self):
        super().__init__()
        self.pauses: list[tuple[int, float]] = []

    def __call__(self, phase, info):
        before = self.seconds
        super().__call__(phase, info)
        if phase == "stop":
            self.pauses.append((info["generation"], (self.seconds - before) * 1e3))


def chunk_phase(seq) -> tuple[str, int, int]:
    """What the next step runs of `seq`'s prefill: (kind, the chunk's context, run index); "start"
    before the prompt's first chunk (the step admits it and starts its prefill)."""
    job = None if seq is None else seq.job
    if job is None:
        return "start", 0, 0
    run = job.running
    if run is None:
        piece = job.layout[job.next]
        return "first", piece.start + job.offset, 0
    if run.ran is not None:
        return "end", run.start, run.calls + 1
    return "part", run.start, run.calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--layers", type=int, default=0, help="layers kept of the preset (0: all)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-prompt-tokens", type=int, default=64)
    ap.add_argument("--steady-steps", type=int, default=200, help="decode-only steps timed before the long prompt")
    ap.add_argument("--long-tokens", type=int, default=131072)
    ap.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens")
    ap.add_argument("--layer-parts", type=int, default=16, help="chunk_layer_parts")
    ap.add_argument("--max-position-embeddings", type=int, default=0,
                    help="the model's context limit (0: the preset's)")
    ap.add_argument("--mode", default="pic")
    ap.add_argument("--slowest", type=int, default=20)
    args = ap.parse_args(argv)
    if min(args.streams, args.long_tokens, args.budget, args.layer_parts) < 1:
        ap.error("--streams, --long-tokens, --budget and --layer-parts must be >= 1")
    torch.set_grad_enabled(False)
    from hybridcache.services.runtime.llm import LLM
    from hybridcache.services.runtime.scheduler import scheduler_config
    from qps import build_engine

    cuda = torch.cuda.is_available()
    rng = random.Random(0)
    positions = {"max_position_embeddings": args.max_position_embeddings} if args.max_position_embeddings else None
    eng = build_engine(args.preset, args.mode, layers=args.layers, model_overrides=positions)
    vocab = min(eng.cfg.vocab_size, 250)

    def ids(n):
        return [rng.randrange(5, vocab) for _ in range(n)]

    limit = eng.config.max_model_len or eng.cfg.max_position_embeddings
    if args.long_tokens + 2 > limit:
        ap.error(f"--long-tokens {args.long_tokens} does not fit the model's context limit of {limit} "
                 "(--max-position-embeddings sets it)")
    stream_tokens = max(1, limit - args.stream_prompt_tokens - 1)  # as many as fit: cancelled at the end
    sched_cfg = scheduler_config(eng.config, eng.model.device)
    sched_cfg = dataclasses.replace(sched_cfg, max_num_seqs=args.streams + 1, max_num_batched_tokens=args.budget,
                                    chunk_layer_parts=args.layer_parts)
    llm = LLM(eng, sched_cfg)
    sched = llm.scheduler
    t0 = time.perf_counter()
    warm = llm.warmup()
    graphs = sched.warm_decode_graphs()
    out = {"preset": args.preset, "layers": len(eng.model.layers), "mode": args.mode, "streams": args.streams,
           "long_tokens": args.long_tokens, "budget": args.budget, "layer_parts": args.layer_parts,
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "warmup_s": round(time.perf_counter() - t0, 2), "decode_graphs_captured": graphs,
           "warmup_requests": warm.get("requests")}
    # as a served worker does once warm: what exists now is frozen out of the collector's sight
    gc.collect()
    gc.freeze()
    # the steps run in this thread from here (the scheduler's own thread stopped)
    sched.stop()
    sched._stop = False

    sp = {"max_new_tokens": stream_tokens, "temperature": 0.0, "ignore_eos": True}
    handles = [sched.add_request(llm.parse_request({"suffix": ids(args.stream_prompt_tokens), "sampling_params": sp}))
               for _ in range(args.streams)]
    emitted: list[list[float]] = [[] for _ in handles]

    def step() -> float:
        s0 = time.perf_counter()
        sched.step()
        now = time.perf_counter()
        for h, times in zip(handles, emitted):
            times += [now] * (len(h.output_ids) - len(times))
        return (now - s0) * 1e3

    deadline = time.perf_counter() + 600
    while not all(h.output_ids for h in handles) and time.perf_counter() < deadline:
        step()
    if not all(h.output_ids for h in handles):
        raise SystemExit("profile_mixed: the streams did not all start decoding in 600 s")
    for _ in range(20):  # past the first steps of the full batch
        step()
    steady_from = time.perf_counter()
    steady = [step() for _ in range(args.steady_steps)]
    long = sched.add_request(llm.parse_request({"suffix": ids(args.long_tokens),
                                                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0,
                                                                    "ignore_eos": True}}))
    collections = Collections()
    gc.callbacks.append(collections)
    steps = []
    long_sent = time.perf_counter()
    try:
        while not long.output_ids and not long.done.is_set():
            seq = next((s for s in sched._admitted if s.handle is long), None)
            kind, context, run = chunk_phase(seq)
            n_gc = len(collections.pauses)
            ms = step()
            if long.output_ids:
                kind = "last"  # the prompt's last call: its first token
            gc_ms = sum(p for _, p in collections.pauses[n_gc:])
            steps.append({"ms": round(ms, 3), "kind": kind, "context": context, "run": run,
                          "tokens": sched.step_log[-1][1] if sched.step_log else 0, "gc_ms": round(gc_ms, 3)})
    finally:
        gc.callbacks.remove(collections)
    long_first = time.perf_counter()
    tracked = len(gc.get_objects())  # with the streams still running
    if long.error is not None:
        raise SystemExit(f"profile_mixed: the long prompt failed: {long.error}")
    for h in handles:
        h.cancel()
    for _ in range(3):
        sched.step()

    def gaps(lo, hi):
        return [(b - a) * 1e3 for t in emitted for a, b in zip(t, t[1:]) if lo <= a and b <= hi]

    steady_gaps, during_gaps = stats(gaps(steady_from, long_sent)), stats(gaps(long_sent, long_first))
    depth = max(1, args.long_tokens // 4)
    out.update({
        "long_prefill_s": round(long_first - long_sent, 3),
        "steady_step_ms": stats(steady),
        "during_step_ms": stats([s["ms"] for s in steps]),
        "steady_gap_ms": steady_gaps,
        "during_gap_ms": during_gaps,
        "itl_p99_during_vs_steady_p50": (round(during_gaps["p99"] / steady_gaps["p50"], 3)
                                         if during_gaps["n"] and steady_gaps["n"] else None),
        "step_ms_by_kind": {k: stats([s["ms"] for s in steps if s["kind"] == k])
                            for k in sorted({s["kind"] for s in steps})},
        "step_ms_by_run": {str(r): stats([s["ms"] for s in steps if s["kind"] in ("first", "part")
                                                and s["run"] == r])
                           for r in sorted({s["run"] for s in steps if s["kind"] in ("first", "part")})},
        "step_ms_by_depth": {f"{q * depth}-{(q + 1) * depth}": stats(
            [s["ms"] for s in steps if q * depth <= s["context"] < (q + 1) * depth]) for q in range(4)},
        "gc_during": {"collections": len(collections.pauses), "ms": round(sum(p for _, p in collections.pauses), 2),
                      "max_ms": round(max((p for _, p in collections.pauses), default=0.0), 2),
                      "by_generation": {str(g): sum(1 for gg, _ in collections.pauses if gg == g) for g in range(3)}},
        "tracked_objects_at_first_token": tracked,
        "slowest_steps": sorted(steps, key=lambda s: -s["ms"])[:args.slowest],
        "steps": len(steps),
        "graph_stats": eng.runner.graph_stats,
    })
    llm.close()
    gc.unfreeze()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
