"""Where the time of one forward goes on the GPU: torch.profiler over a decode step and a pic
assembly (Qwen3.5-9B shape, random bf16 weights) run eagerly, from its CUDA graphs, planned over
its request's pages (as served) from its bucket's graphs and eagerly, and from its graphs with the
entries staged from the host tier; prints JSON with the top ops by host and
device time.

    python tools/profile_forward.py [--segments 8] [--top 25] [--sync-check]

--sync-check also runs each forward once under torch.cuda.set_sync_debug_mode("warn") and reports
every host-device synchronization with its call site in the project or in fla: one sync in a
host-bound forward stalls the host until the GPU drains, so the launches after it no longer
overlap the GPU's work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


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


def timeline(prof, buckets: int = 20, names=("stage", "forward")) -> dict:
    """When the copy engine and the SMs were busy in one profiled run, on the profiler's clock (ms
    from the first host range): host-to-device copies and kernels as unions of their intervals,
    their overlap, the copies' idle gaps between the first and the last one, the host ranges
    named by record_function (`names`: `stage`, `forward`), and per time bucket the busy fraction of both
    and the device-to-device memcpys started (a memcpy runs on a copy engine, behind its queue).
    A transfer that overlaps the compute shows as overlap_ms near the smaller of the two."""

    def merged(iv):
        out = []
        for a, b in sorted(iv):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    def total(iv):
        return sum(b - a for a, b in iv)

    def intersect(x, y):
        i = j = 0
        acc = 0.0
        while i < len(x) and j < len(y):
            lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
            acc += max(0.0, hi - lo)
            if x[i][1] < y[j][1]:
                i += 1
            else:
                j += 1
        return acc

    cuda = torch.autograd.DeviceType.CUDA
    events = list(prof.events())
    dev = [e for e in events if e.device_type == cuda]
    host = {
        e.name: (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type != cuda and e.name in names
    }
    h2d = merged([(e.time_range.start, e.time_range.end) for e in dev if "HtoD" in e.name])
    ker = merged(
        [
            (e.time_range.start, e.time_range.end)
            for e in dev
            if not e.name.startswith("Memcpy") and not e.name.startswith("Memset")
        ]
    )
    d2d = [e.time_range.start for e in dev if "DtoD" in e.name]
    t0 = min([a for a, _ in host.values()] + [iv[0][0] for iv in (h2d, ker) if iv])
    ms = lambda t: round((t - t0) / 1e3, 3)  # noqa: E731
    out = {name: [ms(a), ms(b)] for name, (a, b) in host.items()}
    out.update(kernels=[ms(ker[0][0]), ms(ker[-1][1])] if ker else None, kernel_busy_ms=round(total(ker) / 1e3, 3))
    if h2d:
        gaps = [(h2d[k + 1][0] - h2d[k][1], h2d[k][1]) for k in range(len(h2d) - 1)]
        big = sorted(gaps, reverse=True)[:5]
        out.update(
            h2d=[ms(h2d[0][0]), ms(h2d[-1][1])],
            h2d_busy_ms=round(total(h2d) / 1e3, 3),
            h2d_idle_between_ms=round(sum(g for g, _ in gaps) / 1e3, 3),
            h2d_largest_gaps=[{"ms": round(g / 1e3, 3), "at_ms": ms(at)} for g, at in big],
            overlap_ms=round(intersect(h2d, ker) / 1e3, 3),
        )
    end = max([iv[-1][1] for iv in (h2d, ker) if iv] + [b for _, b in host.values()])
    width = (end - t0) / buckets
    if width > 0:
        rows = []
        for k in range(buckets):
            win = [[t0 + k * width, t0 + (k + 1) * width]]
            lo, hi = win[0]
            rows.append(
                [
                    round(intersect(h2d, win) / width, 2),
                    round(intersect(ker, win) / width, 2),
                    sum(lo <= a < hi for a in d2d),
                ]
            )
        out["busy_by_bucket_h2d_kernels_d2d"] = {"bucket_ms": round(width / 1e3, 3), "rows": rows}
    return out


def sync_sites(fn, depth: int = 4) -> dict[str, int]:
    """Runs fn with CUDA sync debugging on; counts each synchronizing call by the innermost
    `depth` frames of its stack that lie in hybridcache or fla (file:line, innermost first)."""
    import collections
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()
    old_show = warnings.showwarning

    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return old_show(message, category, filename, lineno, file, line)
        frames = [
            f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}"
            for f in reversed(traceback.extract_stack()[:-1])
            if ("hybridcache" in f.filename or "/fla/" in f.filename) and "profile_forward" not in f.filename
        ]
        sites[" <- ".join(frames[:depth]) or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old_show
    return dict(sites.most_common())


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sync-check", action="store_true", help="report host-device syncs and their call sites")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    from gpu_bench import SEAM, SEG, build_entries, build_models, pic_layout, runner_of
    from hybridcache.services.runtime.sequence import LiveRun

    cfg, model, _, _ = build_models("qwen3.5-9b", False)
    gen = torch.Generator().manual_seed(0)
    segs = [torch.randint(0, cfg.vocab_size, (SEG,), generator=gen) for _ in range(args.segments)]
    question = torch.randint(0, cfg.vocab_size, (64,), generator=gen)
    entries = build_entries(model, segs)
    out = {"segments": args.segments, "seam": SEAM}
    runner = runner_of(model)  # the assemblies' CUDA graphs are its (services/runtime/runner.py)
    eager = runner.eager

    def pic():
        runner.forward(model.empty_state(), pic_layout(segs, entries, question), "last")

    state = model.empty_state()
    model.forward_layout(state, [LiveRun(torch.cat(segs), 0)], "none")

    def decode():
        s = state.clone()
        model.forward_layout(s, [LiveRun(torch.tensor([5]), s.length)], "last")

    def graphs(on: bool):
        """The eager live pass, or its CUDA graphs (services/runtime/graphs.py; captured at the
        shape's second sighting, so after the warm-up runs below every run is a replay)."""

        def fn():
            with contextlib.nullcontext() if on else eager(), record_function("forward"):
                pic()

        return fn

    # the same assembly with its entries in the host tier (staged layer by layer while the graphs
    # replay): where the transfer and the compute fail to overlap shows in its timeline
    from hybridcache.services.runtime.cache import SegmentEntry
    from hybridcache.services.runtime.cache.host_tier import stage, to_host

    hosted = [to_host(SegmentEntry(f"profile-{i}", SEG, e, 0.0)) for i, e in enumerate(entries)]

    def pic_host(graphs_on: bool = True):
        """Stage the host entries (every layer queued at once) and run the assembly from its graphs
        or eagerly."""

        def fn():
            with contextlib.nullcontext() if graphs_on else eager():
                with record_function("stage"):
                    staged = stage(hosted, "cuda")
                with record_function("forward"):
                    runner.forward(model.empty_state(), pic_layout(segs, staged, question), "last")

        return fn

    # the served form: the request's K/V in a slot's pages, so the assembly runs planned
    # (models/assembly.py) from its bucket's graphs, or eagerly over its plan
    from hybridcache.services.runtime.models.assembly import plan_assembly
    from hybridcache.services.runtime.paged import extend_pages

    pool = runner.new_state_pool(2, args.segments * SEG + 1024)
    layout = pic_layout(segs, entries, question)

    def planned(graphs_on: bool):
        def fn():
            state = runner.empty_state()
            slot = pool.assign(state)
            extend_pages(state, layout[-1].end)
            if graphs_on:
                with record_function("forward"):
                    runner.forward(state, layout, "last")
            else:
                with record_function("plan"):
                    plan = plan_assembly(model, state, layout, (), (), "last", runner.run_tokens)
                with record_function("forward"):
                    model.forward_planned(state, plan)
            pool.release(slot)

        return fn

    cases = (
        ("decode", decode),
        ("pic", graphs(False)),
        ("pic_graphs", graphs(True)),
        ("planned_graphs", planned(True)),
        ("planned_eager", planned(False)),
        ("pic_host_graphs", pic_host()),
        ("pic_host_eager", pic_host(False)),
    )
    for name, fn in cases:
        for _ in range(3):
            fn()
        walls = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        wall = sorted(walls)[2]  # the median of five
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        out[name] = {
            "wall_ms": round(wall, 2),
            "gpu_kernel_ms": round(sum(e.self_device_time_total for e in kernels) / 1e3, 3),
            "kernel_launches": sum(e.count for e in kernels),
            "by_host_time": table(prof, "self_cpu_time_total", args.top),
            "by_device_time": table(prof, "self_device_time_total", args.top),
        }
        if name.startswith(("pic", "planned")):
            out[name]["timeline"] = timeline(prof)
        if args.sync_check:
            sites = sync_sites(fn)
            out[name]["syncs"] = sum(sites.values())
            out[name]["sync_sites"] = sites

    # gpu_bench times pic as a median of five while the previous run's (logits, state) is alive;
    # time the same assembly both ways (its 32 x 1k figure has been 50 ms above this script's wall)
    def pic_kept():
        state = model.empty_state()
        return runner.forward(state, pic_layout(segs, entries, question), "last"), state

    runner.layout_graphs = None  # the eager pass from here, as before graphs (their memory goes)
    for keep in (False, True):
        prev, times = pic_kept(), []
        torch.cuda.synchronize()
        for _ in range(5):
            t0 = time.perf_counter()
            cur = pic_kept()
            torch.cuda.synchronize()
            times.append(round((time.perf_counter() - t0) * 1e3, 2))
            prev = cur if keep else None
            del cur
        del prev
        out["pic"]["wall_ms_x5_keep_previous" if keep else "wall_ms_x5_drop_previous"] = times
    stats = torch.cuda.memory_stats()
    out["cuda_memory"] = {
        "num_alloc_retries": stats.get("num_alloc_retries"),
        "num_device_alloc": stats.get("num_device_alloc"),
        "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
        "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
