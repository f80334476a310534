"""Served decode against its memory-bandwidth floor, through the HTTP API; prints one JSON object.

One `hybridcache up` stack (or a running server, --url) serves closed batches of N streamed
`/generate` requests sent at once, for each N of --streams (greedy), and --sampled-streams of them
again sampled (temperature 0.8, top-p 0.95). A batch's decode rate is measured where all N
streams are decoding: the output tokens that arrived between the last stream's first token and
the first stream's last token, over that window.

Each batch also says where its time went: the server's own split of the time to first token
(`server_ttft_ms`: the router's parse and plan, the combine worker's receipt to the first token,
the wait in the scheduler's queue) and the CPU seconds each process spent over the batch
(`cpu_s`: router, combine worker, the client's processes; a process of Python near one CPU second
a second is saturated; `cpu_us_per_token`: the same over the tokens streamed). The client
spreads its streams over processes of --client-streams-per-process streams each (one thread a
stream), so that parsing 128 streams' events in one interpreter does not delay the token times it
records.

The floor of a decode step of N requests is the bytes it must move at the GPU's device-to-device
copy bandwidth, measured in the same run (a copy reads and writes, and so does a step): every
weight but the token embedding's rows not looked up (read once), the running requests' linear
states (read and written back in place), and their attention K/V up to each one's mean context in
the window (read). `served_decode_fraction_of_floor_{N}_streams` is the measured tokens/s over the
floor's N / step time; `served_sampled_vs_greedy_tokens_per_s_{N}_streams` compares sampled and
greedy batches of the same size. The sampler's own cost on the device at that batch size (one
`sampling.sample` of N rows of the vocabulary) is measured beside the copy bandwidth.

    python benchmarks/served_decode.py --device cuda --init-model qwen3_5_text:qwen3.5-9b --model /tmp/q9b \\
        --streams 1,32,128 --sampled-streams 32 --max-tokens 256 --out r.json

On a GPU the model is written by a process of its own first (what it cached is freed before the
server loads the model), and the bandwidth is measured by another, before the server starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_load import SERVER_STATS, Result, Stack, emit, init_model_apart, percentiles, rand_ids, run_facts, send  # noqa: E402

SAMPLED = {"temperature": 0.8, "top_p": 0.95}

# measured in a child process on the GPU before the server starts (nothing of it stays allocated)
_DEVICE_PROBE = r"""
import json, sys, time, torch
from hybridcache.services.runtime.sampling import SamplingParams, sample
n = 1 << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
torch.cuda.synchronize()
reps = 20
t0 = time.perf_counter()
for _ in range(reps):
    b.copy_(a)
torch.cuda.synchronize()
copy_bw = 2 * n * reps / (time.perf_counter() - t0)  # bytes read + written per second
del a, b
vocab, sizes = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")]
out = {"gpu": torch.cuda.get_device_name(0), "copy_bytes_per_s": copy_bw, "sampler_ms": {}, "argmax_ms": {}}
for size in sizes:
    logits = torch.randn(size, vocab, device="cuda")
    params = [SamplingParams(**json.loads(sys.argv[3]))] * size
    for name, fn in (("sampler_ms", lambda: sample(logits, params, [None] * size)),
                     ("argmax_ms", lambda: logits.argmax(-1))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        out[name][str(size)] = round((time.perf_counter() - t0) / 20 * 1000, 3)
print(json.dumps(out))
"""


def model_bytes(model_dir: Path, dtype: str) -> dict:
    """What a decode step of the model reads besides K/V, from its config (built on the meta
    device: shapes only): weights (all but the token embedding when the head does not share it),
    one request's linear states (ssm and conv, as the pool holds them) and K/V bytes a token."""
    from hybridcache.services.runtime.models.registry import config_from_dir, shape_model
    from hybridcache.services.runtime.scheduler import kv_bytes_per_token

    model = shape_model(config_from_dir(model_dir), dtype)
    embed = getattr(model.model, model.model.embed_name).weight
    tied = embed is model.lm_head.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:
        weights -= embed.numel() * embed.element_size()
    empty = model.empty_state()
    states = sum(t.numel() * t.element_size() for s in empty.linear.values() for t in (s.ssm, s.conv))
    return {"weights_read": weights, "embedding_row": embed.shape[1] * embed.element_size(),
            "linear_state_per_request": states, "kv_per_token": kv_bytes_per_token(model),
            "vocab": model.cfg.vocab_size}


def step_floor(shape: dict, n: int, mean_context: float, copy_bytes_per_s: float) -> dict:
    """Bytes a decode step of n requests moves at the least, and the tokens/s that allows:
    the weights read once, n embedding rows, the linear states read and written in place, each
    request's K/V read over its context (the new token's K/V written)."""
    moved = (shape["weights_read"] + n * shape["embedding_row"] + 2 * n * shape["linear_state_per_request"]
             + n * (mean_context + 1) * shape["kv_per_token"])
    step_s = moved / copy_bytes_per_s
    return {"bytes_per_step": int(moved), "step_ms": round(step_s * 1000, 3), "tokens_per_s": round(n / step_s, 2)}


def send_all(host: str, port: int, bodies: list[dict], timeout_s: float, start_at: float | None = None
             ) -> list[Result]:
    """Every body sent at once (at time.perf_counter() `start_at` when given), one thread each."""
    results: list[Result] = [Result() for _ in bodies]

    def one(i):
        results[i] = send(host, port, bodies[i], timeout_s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    if start_at is not None and start_at > time.perf_counter():
        time.sleep(start_at - time.perf_counter())
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def client_main() -> int:
    """A client process (--client-worker): the job on stdin ({host, port, bodies, timeout_s,
    start_at}), its Results on stdout. time.perf_counter is CLOCK_MONOTONIC on Linux, one clock for
    every process of the machine: the processes' times compare."""
    job = json.loads(sys.stdin.read())
    results = send_all(job["host"], job["port"], job["bodies"], job["timeout_s"], job["start_at"])
    print(json.dumps([dataclasses.asdict(r) for r in results]))
    return 0


def client_processes(host: str, port: int, bodies: list[dict], timeout_s: float, procs: int) -> list[Result]:
    """The bodies sent at once from `procs` processes (client_main), each a share of them."""
    start_at = time.perf_counter() + 1.0 + 0.1 * procs  # time for every process to start
    shares = [list(range(k, len(bodies), procs)) for k in range(procs)]
    children = []
    for share in shares:
        child = subprocess.Popen([sys.executable, "-P", str(Path(__file__).resolve()), "--client-worker"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        child.stdin.write(json.dumps({"host": host, "port": port, "bodies": [bodies[i] for i in share],
                                      "timeout_s": timeout_s, "start_at": start_at}))
        child.stdin.close()
        children.append(child)
    results: list[Result] = [Result(error="client process failed") for _ in bodies]
    for share, child in zip(shares, children):
        text = child.stdout.read()
        if child.wait() == 0:
            for i, r in zip(share, json.loads(text)):
                results[i] = Result(**r)
    return results


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc; None where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def batch(host: str, port: int, args, n: int, sampling: dict, seed: int, pids: dict | None = None) -> dict:
    """N requests sent at once, one thread each (over client processes of
    --client-streams-per-process streams); their decode rate where all N are decoding. `pids`:
    role -> process id of the server's processes whose CPU seconds over the batch are reported."""
    import resource

    rng = random.Random(seed)
    sp = dict({"max_new_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0}, **sampling)
    bodies = [{"input_ids": rand_ids(rng, args.prompt_tokens, args.vocab), "sampling_params": sp} for _ in range(n)]
    procs = max(1, math.ceil(n / args.client_streams_per_process)) if args.client_streams_per_process else 1
    pids = dict(pids or {})
    cpu0 = {role: cpu_seconds(pid) for role, pid in pids.items()}
    own0 = resource.getrusage(resource.RUSAGE_SELF if procs == 1 else resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    if procs == 1:
        results = send_all(host, port, bodies, args.timeout_s)
    else:
        results = client_processes(host, port, bodies, args.timeout_s, procs)
        t0 = min(r.sent for r in results if r.sent) if any(r.sent for r in results) else t0
    wall = time.perf_counter() - t0
    own = resource.getrusage(resource.RUSAGE_SELF if procs == 1 else resource.RUSAGE_CHILDREN)
    cpu = {role: round(cpu_seconds(pid) - cpu0[role], 2) for role, pid in pids.items()
           if cpu0[role] is not None and cpu_seconds(pid) is not None}
    cpu["client"] = round(own.ru_utime + own.ru_stime - own0.ru_utime - own0.ru_stime, 2)
    ok = [r for r in results if r.status == 200 and not r.error and len(r.token_times) == args.max_tokens]
    streamed = sum(len(r.token_times) for r in results)
    out = {"requests": n, "completed": len(ok), "errors": sorted({r.error for r in results if r.error})[:3],
           "wall_s": round(wall, 3), "client_processes": procs, "cpu_s": cpu,
           "cpu_us_per_token": {role: round(s * 1e6 / streamed, 1) for role, s in cpu.items()} if streamed else {},
           "server_ttft_ms": {k: percentiles([r.server[k] for r in ok if k in r.server], scale=1.0)
                              for k in SERVER_STATS}}
    if len(ok) < n:
        return out
    start = max(r.token_times[0] for r in ok)
    end = min(r.token_times[-1] for r in ok)
    inside = [[t for t in r.token_times if start < t <= end] for r in ok]
    tokens = sum(len(x) for x in inside)
    out["window"] = "all streams decoding"
    if end <= start or tokens < n:
        # no such window (streams that finish before others start: short outputs, a fast model):
        # every token after each stream's first, over the batch's whole decode
        start, end = min(r.token_times[0] for r in ok), max(r.token_times[-1] for r in ok)
        inside = [r.token_times[1:] for r in ok]
        tokens = sum(len(x) for x in inside)
        out["window"] = "whole batch"
        if end <= start:
            out["error"] = "no decode time measured: raise --max-tokens"
            return out
    # each request's context over the window: its prompt and the tokens it had by then, on average
    done = [sum(1 for t in r.token_times if t <= start) for r in ok]
    mean_context = args.prompt_tokens + sum(d + len(x) / 2 for d, x in zip(done, inside)) / n
    out.update(window_s=round(end - start, 3), window_tokens=tokens,
               decode_tokens_per_s=round(tokens / (end - start), 2), mean_context=round(mean_context, 1),
               itl_ms=percentiles([b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]),
               ttft_ms=percentiles([r.ttft for r in ok]))
    return out


def probe_device(args, vocab: int) -> dict:
    sizes = sorted(set(args.sampled_streams) | set(args.streams))
    cmd = [sys.executable, "-P", "-c", _DEVICE_PROBE, str(vocab), ",".join(map(str, sizes)), json.dumps(SAMPLED)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise SystemExit(f"served_decode: the device probe failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def get_json(address: str, path: str, timeout_s: float) -> tuple[int, dict]:
    import http.client as httplib

    host, port = address.split(":")
    conn = httplib.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}
    finally:
        conn.close()


def figures_of(results: dict) -> dict:
    out = {}
    for n, r in results["greedy"].items():
        if "decode_tokens_per_s" in r:
            out[f"served_decode_fraction_of_floor_{n}_streams"] = round(
                r["decode_tokens_per_s"] / r["floor"]["tokens_per_s"], 3)
    for n, r in results["sampled"].items():
        g = results["greedy"].get(n, {})
        if "decode_tokens_per_s" in r and "decode_tokens_per_s" in g:
            out[f"served_sampled_vs_greedy_tokens_per_s_{n}_streams"] = round(
                r["decode_tokens_per_s"] / g["decode_tokens_per_s"], 3)
    return out


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (http://HOST:PORT); default: start `hybridcache up`")
    ap.add_argument("--model", type=Path, required=True, help="model directory")
    ap.add_argument("--init-model", metavar="ARCH:PRESET", help="first write a random-weight model to --model")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--up-args", default="--scatter-workers 0 --warmup-shape 16+4x256+16",
                    help="more `hybridcache up` flags, one string (--max-num-seqs is the largest of --streams)")
    ap.add_argument("--streams", type=ints, default=[1, 32, 128], help="greedy batch sizes (comma list)")
    ap.add_argument("--sampled-streams", type=ints, default=[32], help="sampled batch sizes (temperature 0.8, "
                    "top-p 0.95)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every batch (a sampled batch right after the "
                    "greedy one of its size); the fastest of each counts")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=250, help="prompt ids are drawn from [5, vocab)")
    ap.add_argument("--copy-bandwidth", type=float, help="bytes/s (read + written) instead of measuring it (CPU)")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--client-streams-per-process", type=int, default=32,
                    help="streams a client process sends (one thread each); 0: every stream from this process")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.client_streams_per_process < 0:
        ap.error("--client-streams-per-process must be >= 0")
    t_start = time.perf_counter()
    if args.init_model:
        init_model_apart(args.init_model, args.model, args.device, args.dtype)
    shape = model_bytes(args.model, args.dtype)
    if args.device == "cuda":
        probe = probe_device(args, shape["vocab"])
    else:
        probe = {"gpu": "none (CPU)", "copy_bytes_per_s": args.copy_bandwidth or 10e9}
    if args.copy_bandwidth:
        probe["copy_bytes_per_s"] = args.copy_bandwidth
    print(f"served_decode: {probe}", file=sys.stderr, flush=True)
    most = max(args.streams + args.sampled_streams)
    if not args.port and not args.url:
        from hybridcache.services.launcher import free_port

        args.port = free_port()
    stack = None
    if not args.url:
        up = argparse.Namespace(port=args.port, model=args.model, device=args.device, dtype=args.dtype,
                                up_args=f"{args.up_args} --max-num-seqs {most}")
        stack = Stack(up, None)
    url = args.url or stack.url
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    results: dict = {"greedy": {}, "sampled": {}}
    health = {}
    try:
        pids = {s["role"]: s["pid"] for s in (stack.services if stack else []) if s.get("pid")
                and s["role"] in ("router", "combine")}
        combine = next((s for s in (stack.services if stack else []) if s["role"] == "combine"), None)
        if combine is not None:  # its warm-up and memory plan (decode graphs captured, budgets)
            code, body = get_json(combine["http"], "/health", args.timeout_s)
            if code == 200:
                health = {k: body.get(k) for k in ("warmup", "memory")}
        send(host, int(port), {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}, args.timeout_s)
        # every repeat runs each batch once, a sampled batch right after the greedy one of its size:
        # the sampled/greedy ratio compares runs minutes apart at most, not a whole sweep apart
        jobs = sorted([("greedy", n, {}) for n in args.streams] + [("sampled", n, SAMPLED)
                                                                   for n in args.sampled_streams],
                      key=lambda j: (j[1], j[0] == "sampled"))
        runs_of: dict = {(kind, n): [] for kind, n, _ in jobs}
        for rep in range(args.repeats):
            for kind, n, sampling in jobs:
                r = batch(host, int(port), args, n, sampling, seed=100 * rep + n, pids=pids)
                print(f"served_decode: {kind} {n}: {json.dumps(r)}", file=sys.stderr, flush=True)
                runs_of[kind, n].append(r)
        for (kind, n), runs in runs_of.items():
            good = [r for r in runs if "decode_tokens_per_s" in r]
            best = max(good, key=lambda r: r["decode_tokens_per_s"]) if good else runs[-1]
            best["runs_tokens_per_s"] = [r.get("decode_tokens_per_s") for r in runs]
            if good:
                best["floor"] = step_floor(shape, n, best["mean_context"], probe["copy_bytes_per_s"])
            results[kind][str(n)] = best
    finally:
        if stack is not None:
            stack.stop()
    out = {"benchmark": "served_decode", "figures": figures_of(results), "results": results,
           "gpu": probe["gpu"], "copy_bandwidth_tb_per_s": round(probe["copy_bytes_per_s"] / 1e12, 3),
           "sampler_ms": probe.get("sampler_ms"), "argmax_ms": probe.get("argmax_ms"), "model_bytes": shape,
           "combine_health": health,
           **run_facts(__file__, argv), "seconds": round(time.perf_counter() - t_start, 1),
           "model": str(args.model), "dtype": args.dtype, "up_args": f"{args.up_args} --max-num-seqs {most}",
           "note": "decode rate where all N streams decode (client-side token arrival times); floor: weights, "
                   "linear states (read + written) and the batch's K/V at the copy bandwidth measured in this run"}
    return emit(out, args.out)


if __name__ == "__main__":
    sys.exit(client_main() if sys.argv[1:] == ["--client-worker"] else main())
