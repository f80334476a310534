"""Where a warm pic request's time to first token goes in the engine, as a combine worker runs it:
the request through the scheduler (its state in a pool slot's pages, so the assembly runs planned
from its bucket's CUDA graphs), timed to its first token, then once under torch.profiler with the
engine's stages marked (start_prefill, the forward, the part chains kept); the profiled request's
scheduler steps run in the calling thread (the profiler records the thread that starts it). Prints JSON:
the TTFT median, each stage's host time, the GPU's kernel time and launches, the top kernels.

    python tools/profile_engine.py [--preset qwen3.5-9b] [--segments 32] [--segment-tokens 1024]
    python tools/profile_engine.py --arch qwen3_5_moe_text --preset qwen3.5-35b-a3b --layers 8

On a machine without a GPU it runs the same code on the CPU (use --preset tiny).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_probe import HostWatch  # noqa: E402

# engine and runner methods whose time is reported (object attribute, label)
STAGES = (
    ("engine", "start_prefill"),
    ("engine", "prefill_chunk"),
    ("engine", "_keep_chains"),
    ("runner", "forward"),
    ("runner", "extend_pages"),
    ("runner", "snapshots"),
    ("scheduler", "_prefill_step"),
    ("scheduler", "_decode_step"),
    ("scheduler", "_handle"),
)


def marked(obj, name: str, label: str):
    """Wrap obj.name (an instance attribute from here on) in a profiler range `label`."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    setattr(obj, name, wrapper)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--arch", default="qwen3_5_text", help="qwen3_5_moe_text for the MoE presets")
    ap.add_argument("--layers", type=int, default=0, help="layers kept of the preset (0: all)")
    ap.add_argument("--segments", type=int, default=32)
    ap.add_argument("--segment-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=5, help="warm requests timed after the warm-up")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    from hybridcache.services.runtime.llm import LLM
    from profile_forward import table, timeline
    from qps import build_engine

    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(5, 250) for _ in range(n)]

    docs = [ids(args.segment_tokens) for _ in range(args.segments)]
    question = ids(args.question_tokens)
    sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}

    def warm():
        order = list(range(args.segments))
        rng.shuffle(order)
        return {"system": ids(16), "segments": [docs[i] for i in order], "suffix": question, "sampling_params": sp}

    llm = LLM(build_engine(args.preset, "pic", args.arch, args.layers))
    eng, sched = llm.engine, llm.scheduler

    def ttft(native) -> float:
        req = llm.parse_request(native)
        sync()
        t0 = time.perf_counter()
        first = None
        for _ in sched.add_request(req):  # to the end: the request releases what it holds
            if first is None:
                sync()
                first = time.perf_counter()
        return (first - t0) * 1e3

    out = {"preset": args.preset, "arch": args.arch, "layers": len(eng.model.layers), "segments": args.segments,
           "segment_tokens": args.segment_tokens,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    out["cold_ms"] = round(ttft({"system": ids(16), "segments": docs, "suffix": question, "sampling_params": sp}), 2)
    out["warmup_ms"] = [round(ttft(warm()), 2) for _ in range(3)]  # eager, capture, replay
    watch = HostWatch()  # the host's speed and contention over the timed requests
    out["ttft_ms"] = [round(ttft(warm()), 2) for _ in range(args.requests)]
    out["host"] = watch.report()
    out["ttft_ms_p50"] = round(statistics.median(out["ttft_ms"]), 2)
    owners = {"engine": eng, "runner": eng.runner, "scheduler": sched}
    for owner, name in STAGES:
        if hasattr(owners[owner], name):
            marked(owners[owner], name, f"{owner}.{name}")
    # the profiler sees the ops of the thread that starts it: from here the scheduler's steps run
    # in this one (its own thread stopped)
    sched.stop()
    sched._stop = False  # add_request takes requests again; step() is called from here

    def stepped(native) -> float:
        handle = sched.add_request(llm.parse_request(native))
        sync()
        t0, first = time.perf_counter(), None
        while not handle.done.is_set():
            sched.step()
            if first is None and handle.output_ids:
                sync()
                first = time.perf_counter()
        if handle.error is not None:
            raise handle.error
        return (first - t0) * 1e3

    out["stepped_ttft_ms"] = [round(stepped(warm()), 2) for _ in range(2)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    req = warm()
    with profile(activities=activities) as prof:
        ms = stepped(req)
    out["profiled_ttft_ms"] = round(ms, 2)
    events = prof.key_averages()
    out["stages_ms"] = {e.key: {"calls": e.count, "cpu_total_ms": round(e.cpu_time_total / 1e3, 3)}
                        for e in events if e.key.split(".")[0] in owners}
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    out["gpu_kernel_ms"] = round(sum(e.self_device_time_total for e in kernels) / 1e3, 3)
    out["kernel_launches"] = sum(e.count for e in kernels)
    out["by_host_time"] = table(prof, "self_cpu_time_total", args.top)
    out["by_device_time"] = table(prof, "self_device_time_total", args.top)
    if kernels:
        out["timeline"] = timeline(prof, names={f"{o}.{n}" for o, n in STAGES})
    out["graph_stats"] = eng.runner.graph_stats
    llm.close()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
