"""The served stack on one GPU, driven over HTTP by a streaming client; prints one JSON object.

Qwen3.5-9B shape (--preset; qwen3.5-35b-a3b for the MoE model, whose two served figures are also
given as moe_served_pic_ttft_speedup_vs_prefix_32x1k and moe_cold_pic_ttft_vs_full_32x1k) cut to
--layers layers (8: 6 Gated DeltaNet + 2 attention; `fit`: as many whole groups of the model's
layer mix as leave --reserve-gib of the GPU for the served stack), random bf16 weights
made on the GPU and written once to --model. A request is --segments documents of
--segment-tokens random tokens, a 16-token system prompt and a --question-tokens question
(32 x 1k + 64 by default). Phases (--phases, each optional):

- inproc: an Engine in this process, warmed up as a served worker is: the first cold pic request
  R (its TTFT), warm pic requests W_k (the same documents in another order after another system
  prompt), and `full` on R. The engine is then freed.
- pic: `hybridcache up --device cuda --scatter-workers 0`: R as the first request after start-up
  (all cold, built by the combine worker), then the W_k.
- scatter: the same with one scatter worker on the same GPU: R first, then a second cold request
  (new documents). The combine worker sees that the scatter worker's GPU is its own and builds
  the cold segments itself (stats: built_here_same_gpu).
- scatter_ipc: as scatter with `--scatter-same-gpu on`: the cold segments are built by the scatter
  worker all the same, and its entries move scatter -> combine over the transport the two pick
  (CUDA IPC, through the scatter worker's arena: the second request opens no IPC handle).
- prefix: the stack in mode prefix: R, then the W_k.

Every served TTFT is the client's: from sending the request to the first streamed token. Figures:
served_warm_ttft_vs_in_process (median W_k served / in-process), served_pic_ttft_speedup_vs_prefix_32x1k
(W_k, prefix stack / pic stack), cold_pic_ttft_vs_full_32x1k (the median of the pic stack's cold
requests, R, R2 and --cold-requests - 2 more, / the median of full on R in-process over
--repeats), cold_pic_first_request_ttft_vs_full_32x1k (R alone, the first request after
start-up, / that), cold_pic_ttft_vs_full_32x1k_with_scatter, cold_pic_ttft_with_scatter_vs_without (R
on each), cold_pic_ttft_with_scatter_vs_without_median (every cold request of the scatter stack
against every one of the pic stack, median against median: R, R2 and --cold-requests - 2 more
of new documents each; the pic stack serves R2 and those after its W_k),
scatter_to_combine_gb_per_s and scatter_to_combine_gb_per_s_host (the cold requests of the
scatter_ipc stack, else of the scatter stack; the median over them), the transport it took and the
IPC opens of each of those requests. The two rates:

- scatter_to_combine_gb_per_s, the link: bytes / scatter_copy_seconds, the time of the device
  copies themselves (cuda_ipc: the combine worker's copies of the scatter worker's arena slots and
  their checksums, timed by CUDA events on its side stream, EntryAssembler.copy_seconds); for a
  host transport (shm, grpc), which times no device copy, bytes / scatter_seconds as below.
- scatter_to_combine_gb_per_s_host: bytes / scatter_seconds, the host time the combine worker
  spent receiving them (EntryAssembler.transfer_seconds: for cuda_ipc the time spent in feeding
  device blocks, mapping, queuing copies, reading checksums back and packing entries; for a host
  transport from each entry's header to its last tensor).

    python benchmarks/served_gpu.py --out served_gpu.json
    python benchmarks/served_gpu.py --phases prefix --merge served_gpu.json --out served_gpu_2.json
    python benchmarks/served_gpu.py --device cpu --preset tiny --dtype float32 --layers 0 \\
        --segments 3 --segment-tokens 40 --question-tokens 8 --repeats 2   # CPU smoke
    python benchmarks/served_gpu.py --device cpu --preset tiny --dtype float32 --layers 0 \\
        --max-position-embeddings 65536 --phases pic --repeats 5   # the served overhead of 32 x 1k on CPU

The served_warm_*_ms figures split a warm request's time outside the engine: the router's
(router_ms), the combine worker's beyond its engine (combine_ms - engine_ttft_ms, to the request's
end; combine_ttft_ms - engine_ttft_ms, to its first token leaving the combine worker: the share of
the TTFT), the hops between them (router_to_combine_ms, combine_to_router_ms), from the router's
first token to the client's (router_to_client_ms) and all of it as the client sees it (client
TTFT - engine_ttft_ms). served_cold_prefill_steps, _build_ms and _assembly_ms (the cold requests'
median) and inproc_cold_* (R in-process) split a cold request's wait in the scheduler: the steps it
spent admitted, the host time of the batched builds of its segments, and its prefill's start to
its first token (RequestStats).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import http.client as httplib
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_probe import HostWatch  # noqa: E402

PHASES = ("inproc", "pic", "scatter", "scatter_ipc", "prefix")
SYSTEM_TOKENS = 16


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 250) for _ in range(n)]


class Workload:
    """R (the cold request), W_k (warm: R's documents reordered after another system prompt), and
    R2 (another cold request), as native request bodies of token ids."""

    def __init__(self, args):
        rng = random.Random(0)
        self.docs = [rand_ids(rng, args.segment_tokens) for _ in range(args.segments)]
        self.docs2 = [rand_ids(rng, args.segment_tokens) for _ in range(args.segments)]
        self.question = rand_ids(rng, args.question_tokens)
        sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        self.cold = {"system": rand_ids(rng, SYSTEM_TOKENS), "segments": self.docs, "suffix": self.question,
                     "sampling_params": sp}
        self.cold2 = dict(self.cold, segments=self.docs2)
        # more cold requests (new documents each) for the stacks' cold TTFT medians
        self.cold_more = [dict(self.cold, segments=[rand_ids(rng, args.segment_tokens) for _ in range(args.segments)])
                          for _ in range(max(0, args.cold_requests - 2))]
        self.warm = []
        for _ in range(args.repeats):
            order = list(range(args.segments))
            rng.shuffle(order)
            self.warm.append({"system": rand_ids(rng, SYSTEM_TOKENS), "segments": [self.docs[i] for i in order],
                              "suffix": self.question, "sampling_params": sp})


def http_body(native: dict) -> dict:
    """The native request as SGLang's streamed /generate takes it (token ids)."""
    return {"system": native["system"], "segments": native["segments"], "input_ids": native["suffix"],
            "sampling_params": native["sampling_params"], "stream": True}


def send(url: str, native: dict, timeout_s: float) -> dict:
    """POST a streamed /generate; {"ttft_ms" (client: send to first token), "stats" (the response's)}.
    The body is encoded before the clock starts: a client's JSON encoder is not the server's cost."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = httplib.HTTPConnection(host, int(port), timeout=timeout_s)
    body = json.dumps(http_body(native)).encode()
    t0 = time.perf_counter()
    ttft, last = None, None
    try:
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/generate answered {resp.status}: {resp.read().decode()[:300]}")
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"/generate streamed an error: {ev['error']}")
            if ttft is None and ev.get("output_ids"):
                ttft = (time.perf_counter() - t0) * 1000
            last = ev
    finally:
        conn.close()
    if ttft is None or last is None:
        raise RuntimeError("/generate streamed no token")
    return {"ttft_ms": round(ttft, 2), "stats": _stats(last.get("hybridcache") or {})}


def _stats(st: dict) -> dict:
    keep = ("ttft_ms", "engine_ttft_ms", "router_ms", "combine_ms", "combine_ttft_ms", "router_to_combine_ms",
            "combine_to_router_ms", "built_tokens",
            "reused_segments", "scatter_bytes", "scatter_seconds", "scatter_copy_seconds", "scatter_path",
            "scatter_blocks", "scatter_ipc_opens", "tier_bytes", "built_here_same_gpu", "prompt_tokens",
            "device_allocs", "alloc_retries", "entry_evictions", "entry_cache_bytes", "gc_collections", "gc_pause_ms",
            "graph_captures", "graph_replays", "graph_eager", "graph_failures", "prefill_steps", "build_ms",
            "assembly_ms")
    return {k: st[k] for k in keep if k in st}


def preset_arch(preset: str) -> str | None:
    """The model_type a preset belongs to: qwen3_5_text where several have it (tiny), else the
    text-only model_type (qwen3_5_moe_text for qwen3.5-35b-a3b), else the only one."""
    from hybridcache.services.runtime.modelzoo import PRESETS

    archs = [a for a, p in PRESETS if p == preset]
    for pick in ("qwen3_5_text", *[a for a in archs if a.endswith("_text")], *archs):
        if pick in archs:
            return pick
    return None


def is_moe(arch: str, preset: str) -> bool:
    from hybridcache.services.runtime.modelzoo import hf_config

    raw = hf_config(arch, preset)
    raw = raw.get("text_config", raw)
    return bool(raw.get("num_experts") or raw.get("num_local_experts"))


def layers_that_fit(arch: str, preset: str, dtype: str, free_bytes: float) -> int:
    """The most layers of the preset whose weights fit in free_bytes (a multiple of its
    full-attention interval, so the layer mix stays the model's; at least one interval), from its
    config alone (the model built on the meta device)."""
    from hybridcache.services.runtime.models.registry import config_from_dict, shape_model
    from hybridcache.services.runtime.modelzoo import hf_config

    raw = hf_config(arch, preset)
    model = shape_model(config_from_dict(raw), dtype)
    layers = model.model.layers
    per_layer = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    outside = sum(p.numel() * p.element_size() for p in model.parameters()) - sum(per_layer)
    text = raw.get("text_config", raw)
    step = int(text.get("full_attention_interval") or 1)
    n, used = 0, outside
    while n + step <= len(layers) and used + sum(per_layer[n:n + step]) <= free_bytes:
        used += sum(per_layer[n:n + step])
        n += step
    return max(n, min(step, len(layers)))


def model_dir(args) -> Path:
    positions = f"-{args.max_position_embeddings}pos" if args.max_position_embeddings else ""
    return args.model or Path(f"/tmp/hybridcache-served-{args.arch}-{args.preset}-{args.layers or 'all'}l-"
                              f"{args.dtype}{positions}")


def write_model(args, out: Path) -> None:
    """A random-weight model directory (made on the GPU with --device cuda), once."""
    import torch
    from hybridcache.services.runtime.modelzoo import init_model_dir

    if (out / "config.json").is_file():
        return
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    if args.max_position_embeddings:
        overrides["max_position_embeddings"] = args.max_position_embeddings
    # the CPU smoke run keeps the larger std of the project's tiny test models
    init_model_dir(args.arch, args.preset, out, seed=0, dtype=getattr(torch, args.dtype),
                   std=0.08 if args.device != "cuda" else 0.02, overrides=overrides or None, device=args.device)
    if args.device == "cuda":
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def inproc_phase(args, work: Workload, model: Path) -> dict:
    """The engine in this process, warmed up as a served worker is (serve --warmup): TTFT of the
    first cold pic request, the warm ones, and full on the cold request's prompt."""
    from dataclasses import replace

    import torch
    from hybridcache.services.config import RuntimeConfig
    from hybridcache.services.runtime.engine import Engine
    from hybridcache.services.runtime.llm import LLM

    config = RuntimeConfig(device=args.device, dtype=args.dtype)
    llm = LLM(Engine.from_dir(model, args.device, getattr(torch, args.dtype), config))
    out = {"warmup": llm.warmup()}

    seen = {}

    def ttft(llm, native) -> float:
        req = llm.parse_request(native)
        _sync(args.device)
        t0 = time.perf_counter()
        first = None
        handle = llm.scheduler.add_request(req)
        for _ in handle:  # to the end, so that the request releases what it holds
            if first is None:
                _sync(args.device)
                first = time.perf_counter()
        seen["stats"] = handle.prefill.stats
        return round((first - t0) * 1000, 2)

    out["cold_pic_ms"] = ttft(llm, work.cold)
    # where the cold request's wait went, as the scheduler splits it (the served stack's stats say the same)
    st = seen["stats"]
    out["cold_pic_stats"] = {"prefill_steps": st.prefill_steps, "build_ms": round(st.build_ms, 2),
                             "assembly_ms": round(st.assembly_ms, 2)}
    out["warm_pic_ms"] = [ttft(llm, w) for w in work.warm]
    engine = llm.engine
    llm.close()  # its pool of running requests' states goes before the next scheduler sizes its own
    del llm
    gc.collect()
    full = LLM(Engine(engine.model, engine.tokenizer, replace(engine.config, mode="full")))
    ttft(full, work.cold2)  # the plain prefill of that length once, as a warmed-up server has
    out["full_ms"] = [ttft(full, work.cold) for _ in range(max(1, args.repeats))]
    full.close()
    del engine, full
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


class Stack:
    """`hybridcache up` as a child process until stop() (SIGTERM)."""

    def __init__(self, args, model: Path, scatter: int, mode: str, extra: tuple[str, ...] = ()):
        cmd = [sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model),
               "--port", str(_free_port()), "--device", args.device, "--dtype", args.dtype,
               "--scatter-workers", str(scatter), "--mode", mode, "--ready-timeout-s", str(args.ready_timeout_s),
               *extra, *shlex.split(args.up_args)]
        self.cmd = cmd
        env = dict(os.environ, PYTHONSAFEPATH="1")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith('{"ready"'):
            self.stop()
            raise RuntimeError(f"`{shlex.join(cmd)}` did not become ready (exit {self.proc.returncode})")
        self.start_s = round(time.perf_counter() - t0, 1)
        ready = json.loads(line)
        self.url = ready["http"]
        self.services = ready.get("services", [])

    def gc_frozen_objects(self) -> int | None:
        """The objects the combine worker froze out of Python's collector once warm (its /health)."""
        combine = [s for s in self.services if s.get("role") == "combine"]
        if not combine:
            return None
        with urllib.request.urlopen(f"http://{combine[0]['http']}/health", timeout=10) as r:
            return json.loads(r.read()).get("gc_frozen_objects")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack_phase(args, work: Workload, model: Path, scatter: int, mode: str, extra: tuple[str, ...] = ()) -> dict:
    stack = Stack(args, model, scatter, mode, extra)
    try:
        out = {"start_s": stack.start_s, "combine_gc_frozen_objects": stack.gc_frozen_objects(),
               "cold": send(stack.url, work.cold, args.timeout_s)}
        if scatter:
            out["cold2"] = send(stack.url, work.cold2, args.timeout_s)
        else:
            out["warm"] = [send(stack.url, w, args.timeout_s) for w in work.warm]
            if args.cold_requests > 1:
                out["cold2"] = send(stack.url, work.cold2, args.timeout_s)
        out["cold_more"] = [send(stack.url, c, args.timeout_s) for c in work.cold_more]
        return out
    finally:
        stack.stop()


def _median(xs):
    return statistics.median(xs) if xs else None


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def figures(res: dict, moe: bool = False) -> dict:
    """The run's figures; for a MoE model the issue's two served figures also under moe_ names."""
    out = _figures(res)
    if moe:
        for name in ("served_pic_ttft_speedup_vs_prefix_32x1k", "cold_pic_ttft_vs_full_32x1k"):
            if name in out:  # a partial result (phases still to run) lacks some
                out["moe_" + name] = out[name]
    return out


def _figures(res: dict) -> dict:
    inproc, pic, sc, sc_ipc, prefix = (res.get(p) for p in PHASES)
    warm_served = _median([r["ttft_ms"] for r in pic["warm"]]) if pic else None
    warm_inproc = _median(inproc["warm_pic_ms"]) if inproc else None
    full = _median(inproc["full_ms"]) if inproc else None
    cold_pic = pic["cold"]["ttft_ms"] if pic else None
    cold_scatter = sc["cold"]["ttft_ms"] if sc else None
    # every cold request of a stack (R, the first after start-up, R2 and --cold-requests - 2 more
    # of new documents each); the pic stack's median against full's median over its repeats
    colds = {name: [r["ttft_ms"] for r in [ph["cold"], ph.get("cold2"), *ph.get("cold_more", ())] if r]
             for name, ph in (("pic", pic), ("scatter", sc)) if ph}
    out = {
        "served_warm_ttft_vs_in_process": _ratio(warm_served, warm_inproc),
        "served_pic_ttft_speedup_vs_prefix_32x1k":
            _ratio(_median([r["ttft_ms"] for r in prefix["warm"]]) if prefix else None, warm_served),
        "cold_pic_ttft_vs_full_32x1k": _ratio(_median(colds["pic"]) if colds.get("pic") else None, full),
        "cold_pic_first_request_ttft_vs_full_32x1k": _ratio(cold_pic, full),
        "cold_pic_ttft_vs_full_32x1k_with_scatter": _ratio(cold_scatter, full),
        "cold_pic_ttft_with_scatter_vs_without": _ratio(cold_scatter, cold_pic),
        "inproc_cold_pic_ttft_vs_full_32x1k": _ratio(inproc["cold_pic_ms"], full) if inproc else None,
        "served_warm_pic_ttft_ms": warm_served,
        "inproc_warm_pic_ttft_ms": warm_inproc,
        "served_cold_pic_ttft_ms": cold_pic,
        "served_cold_pic_ttft_ms_with_scatter": cold_scatter,
        "inproc_full_ttft_ms": full,
    }
    # the scatter worker on the combine worker's GPU against none, median against median
    if "pic" in colds and "scatter" in colds:
        out["cold_pic_ttft_ms_all"], out["cold_pic_ttft_ms_all_with_scatter"] = colds["pic"], colds["scatter"]
        out["cold_pic_ttft_with_scatter_vs_without_median"] = _ratio(_median(colds["scatter"]), _median(colds["pic"]))
    # what each of those cold requests paid on its own path besides the engine's work (their
    # stats): live-pass graphs captured, collector pauses, allocator retries
    for name, ph in (("pic", pic), ("scatter", sc)):
        reqs = [r for r in [ph["cold"], ph.get("cold2"), *ph.get("cold_more", ())] if r] if ph else []
        for key in ("graph_captures", "gc_pause_ms", "alloc_retries"):
            got = [r["stats"].get(key) for r in reqs]
            if any(v is not None for v in got):
                out[f"cold_{key}_all" + ("" if name == "pic" else "_with_scatter")] = got
    # where the cold requests' first-token wait went in the scheduler (served median; in-process R)
    pic_colds = [r for r in [pic["cold"], pic.get("cold2"), *pic.get("cold_more", ())] if r] if pic else []
    for key in ("prefill_steps", "build_ms", "assembly_ms"):
        got = [r["stats"][key] for r in pic_colds if key in r["stats"]]
        if got:
            out[f"served_cold_{key}"] = round(_median(got), 2)
        if inproc and key in inproc.get("cold_pic_stats", {}):
            out[f"inproc_cold_{key}"] = inproc["cold_pic_stats"][key]
    moving = sc_ipc or sc
    if moving:
        moves = [r["stats"] for r in (moving["cold"], moving["cold2"], *moving.get("cold_more", ()))
                 if r["stats"].get("scatter_seconds")]
        host = [m["scatter_bytes"] / m["scatter_seconds"] / 1e9 for m in moves]
        # the link: the device copies' own time where they were timed (cuda_ipc), else the host's
        link = [m["scatter_bytes"] / (m.get("scatter_copy_seconds") or m["scatter_seconds"]) / 1e9 for m in moves]
        out["scatter_to_combine_gb_per_s"] = float(f"{_median(link):.4g}") if link else None
        out["scatter_to_combine_gb_per_s_host"] = float(f"{_median(host):.4g}") if host else None
        out["scatter_to_combine_transport"] = moves[0].get("scatter_path", "") if moves else ""
        out["scatter_to_combine_ipc_opens"] = [m.get("scatter_ipc_opens") for m in moves] or None
    if sc_ipc:
        out["cold_pic_ttft_ms_with_scatter_moving_entries"] = sc_ipc["cold"]["ttft_ms"]
        out["cold_pic_ttft_with_scatter_moving_entries_vs_without"] = _ratio(sc_ipc["cold"]["ttft_ms"], cold_pic)
    # where a warm request's time outside the engine goes, as its stats split it
    need = ("router_ms", "combine_ms", "engine_ttft_ms")
    st = [(r["ttft_ms"], r["stats"]) for r in (pic or {}).get("warm", ()) if all(k in r.get("stats", {}) for k in need)]
    if st:
        out["served_warm_router_ms"] = round(_median([s["router_ms"] for _, s in st]), 2)
        out["served_warm_combine_outside_engine_ms"] = round(
            _median([s["combine_ms"] - s["engine_ttft_ms"] for _, s in st]), 2)
        out["served_warm_client_minus_engine_ms"] = round(_median([t - s["engine_ttft_ms"] for t, s in st]), 2)
        first = [s["combine_ttft_ms"] - s["engine_ttft_ms"] for _, s in st if "combine_ttft_ms" in s]
        if first:
            out["served_warm_combine_ttft_minus_engine_ms"] = round(_median(first), 2)
        # the hops between the processes (the router's stats, one host's clock) and from the router's
        # first token to the client's
        for hop in ("router_to_combine_ms", "combine_to_router_ms"):
            got = [s[hop] for _, s in st if hop in s]
            if got:
                out[f"served_warm_{hop}"] = round(_median(got), 2)
        to_client = [t - s["ttft_ms"] for t, s in st if "ttft_ms" in s]
        if to_client:
            out["served_warm_router_to_client_ms"] = round(_median(to_client), 2)
    return {k: v for k, v in out.items() if v is not None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--arch", default=None, help="model_type (default: the one --preset belongs to, "
                    "qwen3_5_text for presets several have)")
    ap.add_argument("--preset", default="qwen3.5-9b", help="qwen3.5-9b, qwen3.5-35b-a3b (MoE), tiny, ...")
    ap.add_argument("--layers", default="8", help="layers kept of the preset (0: all; fit: as many as fit on the "
                    "GPU with --reserve-gib left for the served stack's caches, a multiple of the full-attention "
                    "interval; the result's shape says how many)")
    ap.add_argument("--reserve-gib", type=float, default=32.0, help="--layers fit: GPU memory left beside the weights")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--model", type=Path, help="model directory (written first when it holds no model)")
    ap.add_argument("--max-position-embeddings", type=int, default=0,
                    help="the written model's positions (0: the preset's; the tiny preset's 4,096 do not hold 32 x 1k)")
    ap.add_argument("--segments", type=int, default=32)
    ap.add_argument("--segment-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="warm requests (each its own order and system prompt)")
    ap.add_argument("--cold-requests", type=int, default=2,
                    help="cold requests a stack serves (the first after start-up, then new documents each)")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help=f"comma list of {', '.join(PHASES)}, run in the order given")
    ap.add_argument("--up-args", default="", help="more `hybridcache up` flags, one string")
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--merge", type=Path, help="a result file of this script: its phases not run now count too")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    problems = []
    if bad or not phases:
        problems.append(f"--phases: unknown {bad or 'empty list'}; choose from {', '.join(PHASES)}")
    for name in ("segments", "segment_tokens", "question_tokens", "repeats"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.layers != "fit" and not (args.layers.isdigit()):
        problems.append(f"--layers {args.layers}: a count >= 0 or fit")
    if args.layers == "fit" and args.device != "cuda":
        problems.append("--layers fit needs --device cuda (it sizes the model to the GPU)")
    if args.max_position_embeddings < 0:
        problems.append("--max-position-embeddings must be >= 0")
    args.arch = args.arch or preset_arch(args.preset)
    from hybridcache.services.runtime.modelzoo import PRESETS

    if (args.arch, args.preset) not in PRESETS:
        problems.append(f"--preset {args.preset}: no such preset" + (f" of --arch {args.arch}" if args.arch else ""))
    merged = {}
    if args.merge is not None:
        try:
            merged = json.loads(args.merge.read_text())["detail"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"--merge {args.merge}: not a result of this script ({type(e).__name__})")
    if problems:
        print(f"served_gpu: error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("served_gpu: error: --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.layers == "fit":
        total = torch.cuda.get_device_properties(0).total_memory
        args.layers = layers_that_fit(args.arch, args.preset, args.dtype, total - args.reserve_gib * 2**30)
        print(f"served_gpu: {args.layers} layers fit ({args.reserve_gib} GiB left)", file=sys.stderr, flush=True)
    else:
        args.layers = int(args.layers)
    model = model_dir(args)
    write_model(args, model)
    work = Workload(args)
    res = {p: v for p, v in merged.items() if p in PHASES and p not in phases}
    errors = {}
    runs = {"inproc": lambda: inproc_phase(args, work, model),
            "pic": lambda: stack_phase(args, work, model, 0, "pic"),
            "scatter": lambda: stack_phase(args, work, model, 1, "pic"),
            "scatter_ipc": lambda: stack_phase(args, work, model, 1, "pic", ("--scatter-same-gpu", "on")),
            "prefix": lambda: stack_phase(args, work, model, 0, "prefix")}

    def result():
        return {
            "benchmark": "served_gpu",
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "none (CPU)",
            "commit": os.environ.get("HYBRIDCACHE_COMMIT") or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/served_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "shape": {"arch": args.arch, "preset": args.preset, "layers": args.layers, "dtype": args.dtype,
                      "segments": args.segments, "segment_tokens": args.segment_tokens,
                      "question_tokens": args.question_tokens, "system_tokens": SYSTEM_TOKENS},
            "figures": figures(res, moe=is_moe(args.arch, args.preset)), "detail": res, "errors": errors,
            "merged_phases": sorted(p for p in res if p not in phases),
        }

    for phase in dict.fromkeys(phases):  # in the order asked: a call cut short keeps the first ones
        t0 = time.perf_counter()
        watch = HostWatch()  # the host's speed and contention over the phase (host_probe.py)
        try:
            res[phase] = runs[phase]()
            res[phase]["host"] = watch.report()
        except Exception as e:  # noqa: BLE001 - one failed phase must not cost the others' figures
            errors[phase] = f"{type(e).__name__}: {e}"[:500]
        print(f"served_gpu: {phase} done in {time.perf_counter() - t0:.1f} s"
              + (f" ({errors[phase]})" if phase in errors else ""), file=sys.stderr, flush=True)
        if args.out:
            args.out.write_text(json.dumps({**result(), "partial": True}, indent=2) + "\n")
    text = json.dumps(result(), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
