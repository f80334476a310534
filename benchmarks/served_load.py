"""Load through the served HTTP API (`/generate`, streamed), with real arrivals; prints one JSON object.

Two scenarios, either or both (`--scenario streams,rag`):
- streams: closed loop, N client streams each sending its next request when the last one ended,
  for each N of --streams (1 = one request at a time). Per N: output tokens/s, requests/s, TTFT
  and inter-token latency percentiles. Figures, for the largest N against 1:
  `decode_tokens_per_s_{N}_streams_vs_1`, `itl_p50_{N}_streams_vs_1`, `requests_per_s_{N}_streams_vs_1`.
- rag: open loop, Poisson arrivals at each rate of --rates (requests/s), requests from a RAG
  trace: Zipf over --docs documents of --doc-tokens tokens, 4-32 (--docs-per-request) a request, a
  --question-tokens question. Run once per --modes (the server's --mode: pic, prefix, full; the
  stack is restarted for each when this script starts it), after warm-up requests that show every
  document once. The rates run ascending; a rate meets the SLO when every request completed and
  the p50 TTFT is within --slo-ttft-s, and the QPS at the SLO is the highest rate met before the
  first one missed (the sweep stops there; 0 when the lowest misses). Figures: `served_qps_at_slo_pic_vs_prefix`,
  `served_qps_at_slo_pic_vs_full` (and `served_qps_at_slo_<mode>`).

The stack is `hybridcache up --model M --port P` with --up-args added (the script waits for its
ready line and stops it with SIGTERM), or a running server given by --url. A random-weight
model of a preset is written first with --init-model ARCH:PRESET --model DIR (on the GPU when
--device cuda, in --dtype). Requests a full queue refuses (HTTP 429) are counted apart.

    python benchmarks/served_load.py --scenario streams --streams 1,16 --requests-per-stream 4 --max-tokens 32
    python benchmarks/served_load.py --device cuda --dtype bfloat16 --init-model qwen3_5_text:qwen3.5-9b \\
        --model /tmp/q9b --scenario streams,rag --streams 1,32 --max-tokens 256 ...
    python benchmarks/served_load.py --combine streams.json rag_pic.json rag_prefix.json --out FILE

On the device machine `bash scripts/device_suite.sh COMMIT served` runs it (stage `served`).
"""

from __future__ import annotations

import argparse
import datetime
import http.client as httplib
import json
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_probe import probe  # noqa: E402


@dataclass
class Result:
    """One request as the client saw it."""

    status: int = 0
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each output token
    server: dict = field(default_factory=dict)  # SERVER_STATS of the last event's "hybridcache" stats
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


# The server's own split of a request's time to its first token (router.py, combine/worker.py):
# ttft_ms from the router's receipt, router_ms its parse and plan, combine_ttft_ms from the combine
# worker's receipt, engine_ttft_ms from the scheduler's queue (waiting included) to the first token,
# queue_ms its wait in that queue for a seat.
SERVER_STATS = ("ttft_ms", "router_ms", "combine_ttft_ms", "engine_ttft_ms", "queue_ms")


def send(host: str, port: int, body: dict, timeout_s: float) -> Result:
    """POST a streamed /generate and time every token's arrival."""
    res = Result(sent=time.perf_counter())
    conn = httplib.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", "/generate", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            res.error = resp.read().decode()[:300]
            return res
        n = 0
        for line in resp:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.perf_counter()  # the event's arrival, before this thread parses it
            ev = json.loads(line[6:])
            if "error" in ev:
                res.error = json.dumps(ev["error"])[:300]
                break
            ids = ev.get("output_ids") or []
            if isinstance(ev.get("hybridcache"), dict):
                res.server = {k: ev["hybridcache"][k] for k in SERVER_STATS if k in ev["hybridcache"]}
            res.token_times += [now] * (len(ids) - n)
            n = len(ids)
    except OSError as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return res


def percentiles(xs: list[float], scale: float = 1000.0) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)

    def q(p):
        return round(xs[min(len(xs) - 1, int(p * len(xs)))] * scale, 2)

    return {"p50": round(statistics.median(xs) * scale, 2), "p90": q(0.9), "p99": q(0.99), "mean":
            round(statistics.fmean(xs) * scale, 2)}


def summarize(results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.status == 200 and not r.error and r.token_times]
    tokens = sum(len(r.token_times) for r in ok)
    return {"requests": len(results), "completed": len(ok), "rejected_429": sum(r.status == 429 for r in results),
            "failed": sum(1 for r in results if r not in ok and r.status != 429),
            "errors": sorted({r.error for r in results if r.error})[:3],
            "wall_s": round(wall_s, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
            "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
            "ttft_ms": percentiles([r.ttft for r in ok]),
            "itl_ms": percentiles([x for r in ok for x in r.itls]),
            "e2e_ms": percentiles([r.token_times[-1] - r.sent for r in ok]),
            # where the client's TTFT went, as the server saw it (percentiles of each, ms)
            "server_ttft_ms": {k: percentiles([r.server[k] for r in ok if k in r.server], scale=1.0)
                               for k in SERVER_STATS}}


def rand_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]


def stream_requests(args, n_streams: int, rng: random.Random) -> list[list[dict]]:
    """Per stream, its requests: a --prompt-tokens prompt and --max-tokens output (EOS ignored)."""
    sp = {"max_new_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0}
    return [[{"input_ids": rand_ids(rng, args.prompt_tokens, args.vocab), "sampling_params": sp}
             for _ in range(args.requests_per_stream)] for _ in range(n_streams)]


def closed_loop(host, port, reqs: list[list[dict]], timeout_s: float) -> dict:
    """One client thread per stream, each sending its requests back to back."""
    results: list[Result] = []
    lock = threading.Lock()

    def client(mine):
        for body in mine:
            r = send(host, port, body, timeout_s)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(mine,)) for mine in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize(results, time.perf_counter() - t0)


def run_streams(host, port, args) -> dict:
    """Each stream count of --streams, --repeats times, the counts interleaved (so that a change
    of the machine's load hits all alike); per count, the run of median requests/s."""
    for body in stream_requests(args, 1, random.Random(1))[0][:1]:  # nothing of the first run is start-up
        send(host, port, body, args.timeout_s)
    runs: dict[int, list[dict]] = {n: [] for n in args.streams}
    for rep in range(args.repeats):
        for n in args.streams:
            # requests of the same shapes, none seen before (no cache hits across runs)
            s = closed_loop(host, port, stream_requests(args, n, random.Random(1000 * rep + n)), args.timeout_s)
            runs[n].append(s)
            print(f"served_load: {n} streams: {json.dumps(s)}", file=sys.stderr, flush=True)
    out = {}
    for n, rs in runs.items():
        ranked = sorted(rs, key=lambda s: s["requests_per_s"])
        out[str(n)] = dict(ranked[len(ranked) // 2], requests_per_s_runs=[s["requests_per_s"] for s in rs])
    return out


def doc_pool(args) -> list[list[int]]:
    """The trace's documents, the same in every run and mode."""
    return [rand_ids(random.Random(10_000 + d), args.doc_tokens, args.vocab) for d in range(args.docs)]


def rag_trace(args, n: int, seed: int) -> list[dict]:
    """n requests over one pool of documents: Zipf popularity, 4-32 documents each, own question."""
    rng = random.Random(seed)
    docs = doc_pool(args)
    weights = [1.0 / (d + 1) ** args.zipf for d in range(args.docs)]
    lo, hi = args.docs_per_request
    out = []
    for _ in range(n):
        k = min(rng.randint(lo, hi), args.docs)
        chosen: list[int] = []
        while len(chosen) < k:
            d = rng.choices(range(args.docs), weights)[0]
            if d not in chosen:
                chosen.append(d)
        out.append({"segments": [docs[d] for d in chosen], "suffix": rand_ids(rng, args.question_tokens, args.vocab),
                    "sampling_params": {"max_new_tokens": args.rag_max_tokens, "ignore_eos": True,
                                        "temperature": 0.0}})
    return out


def open_loop(host, port, bodies: list[dict], rate: float, seed: int, timeout_s: float) -> dict:
    """Send `bodies` at Poisson arrivals of `rate` per second, each on its own thread (open loop:
    an arrival does not wait for earlier requests)."""
    rng = random.Random(seed)
    results: list[Result] = []
    lock = threading.Lock()

    def one(body):
        r = send(host, port, body, timeout_s)
        with lock:
            results.append(r)

    threads = []
    t0 = time.perf_counter()
    at = 0.0
    for body in bodies:
        at += rng.expovariate(rate)
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(body,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    out = summarize(results, time.perf_counter() - t0)
    out["offered_rate"] = rate
    return out


def warmup_requests(args) -> list[dict]:
    """Requests that show every document of the pool once (--warmup-requests more of the trace
    after them): the sweep measures a server in its steady state, not its first sight of the pool."""
    trace = rag_trace(args, 1 + args.docs // args.docs_per_request[0] + args.warmup_requests, seed=7)
    pool, hi = doc_pool(args), args.docs_per_request[1]
    out = [dict(trace[0], segments=pool[i:i + hi]) for i in range(0, args.docs, hi)]
    return out + trace[len(out):len(out) + args.warmup_requests]


def run_rag(host, port, args, mode: str) -> dict:
    """The sweep, rates ascending, until a rate misses the SLO (the rates above would miss it
    too); the QPS at the SLO is the highest rate met before that, 0 when the lowest misses."""
    for body in warmup_requests(args):  # one at a time
        send(host, port, body, args.timeout_s)
    sweep, qps = {}, 0.0
    for i, rate in enumerate(sorted(args.rates)):
        bodies = rag_trace(args, args.rag_requests, seed=100 + i)
        s = sweep[str(rate)] = open_loop(host, port, bodies, rate, seed=200 + i, timeout_s=args.timeout_s)
        met = s["completed"] == s["requests"] and s["ttft_ms"].get("p50", 1e18) <= args.slo_ttft_s * 1000
        s["meets_slo"] = met
        print(f"served_load: rag {mode} at {rate}/s: p50 TTFT {s['ttft_ms'].get('p50')} ms, "
              f"{s['requests_per_s']} req/s, {s['rejected_429']} refused", file=sys.stderr, flush=True)
        if not met:
            break
        qps = rate
    return {"sweep": sweep, "qps_at_slo": qps}


class Stack:
    """`hybridcache up` as a child process; stop() sends SIGTERM."""

    def __init__(self, args, mode: str | None):
        port = args.port
        cmd = [sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(args.model), "--port", str(port),
               "--device", args.device, "--dtype", args.dtype, *shlex.split(args.up_args)]
        if mode is not None:
            cmd += ["--mode", mode]
        self.cmd = cmd
        env = dict(os.environ, PYTHONSAFEPATH="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith('{"ready"'):
            self.stop()
            raise SystemExit(f"served_load: `hybridcache up` did not become ready ({shlex.join(cmd)})")
        ready = json.loads(line)
        self.url = ready["http"]
        self.services = ready.get("services", [])  # role, grpc and http address of each process

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def init_model(spec: str, out: Path, device: str, dtype: str) -> None:
    """A random-weight model directory of ARCH:PRESET, as `hybridcache model init` writes it, but
    built and initialised on `device` (a 9B model's weights made on the GPU in seconds)."""
    import torch
    from hybridcache.services.runtime.modelzoo import init_model_dir

    if (out / "config.json").is_file():
        return
    arch, preset = spec.split(":")
    init_model_dir(arch, preset, out, seed=0, dtype=getattr(torch, dtype), device=device)


def init_model_apart(spec: str, out: Path, device: str, dtype: str) -> None:
    """A random-weight model directory of ARCH:PRESET written by a process of its own (what it
    cached on the GPU is freed before a server loads the model); nothing when `out` holds one."""
    if (out / "config.json").is_file():
        return
    arch, preset = spec.split(":")
    code = ("import torch; from hybridcache.services.runtime.modelzoo import init_model_dir; "
            f"init_model_dir({arch!r}, {preset!r}, {str(out)!r}, dtype=torch.{dtype}, device={device!r})")
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=900)


def figures_of(results: dict) -> dict:
    """The named figures of a run's results: the largest stream count against 1, pic's QPS at the
    SLO against the other modes'."""
    figures: dict = {}
    streams = results.get("streams", {})
    n = max((int(k) for k in streams), default=1)
    if "1" in streams and n > 1:
        one, many = streams["1"], streams[str(n)]
        figures[f"decode_tokens_per_s_{n}_streams_vs_1"] = round(many["output_tokens_per_s"]
                                                                / one["output_tokens_per_s"], 3)
        figures[f"requests_per_s_{n}_streams_vs_1"] = round(many["requests_per_s"] / one["requests_per_s"], 3)
        if one["itl_ms"] and many["itl_ms"]:
            figures[f"itl_p50_{n}_streams_vs_1"] = round(many["itl_ms"]["p50"] / one["itl_ms"]["p50"], 3)
    q = {mode: r["qps_at_slo"] for mode, r in results.get("rag", {}).items()}
    for mode, v in q.items():
        figures[f"served_qps_at_slo_{mode}"] = v
    for other in ("prefix", "full"):
        if "pic" in q and other in q:
            # None: the other mode met the SLO at no rate swept (sweep lower rates)
            figures[f"served_qps_at_slo_pic_vs_{other}"] = round(q["pic"] / q[other], 3) if q[other] else None
    return figures


def combine(paths: list[Path], out_path: Path | None) -> int:
    """One result of several runs' files (a device call each: the streams, then one RAG mode a
    call), its figures computed again over the merged results."""
    runs = [json.loads(p.read_text()) for p in paths]
    merged = dict(runs[-1], results={}, commands=[r["command"] for r in runs], sources=[p.name for p in paths])
    for r in runs:
        for scenario, res in r["results"].items():
            if scenario == "rag":
                merged["results"].setdefault("rag", {}).update(res)
            else:
                merged["results"][scenario] = res
    commits = sorted({r["commit"] for r in runs})
    merged.update(commit=commits[0] if len(commits) == 1 else ",".join(commits),
                  date=max(r["date"] for r in runs), figures=figures_of(merged["results"]),
                  command=" && ".join(merged["commands"]))
    return emit(merged, out_path)


def run_facts(script: str, argv=None) -> dict:
    """The commit (the device machine's copy of the tree has no git: scripts/device_suite.sh names
    it in HYBRIDCACHE_COMMIT), UTC date, host (its name, and a probe of its speed and load at the
    run's end: host_probe.py) and command line of a run of benchmarks/`script`."""
    commit = os.environ.get("HYBRIDCACHE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": platform.node(), "host_probe": {k: v for k, v in probe().items() if k != "cpu"},
            "command": "python benchmarks/" + shlex.join([Path(script).name, *(argv or sys.argv[1:])])}


def emit(out: dict, path: Path | None) -> int:
    """Print a result as JSON, and write it to `path` when given."""
    text = json.dumps(out, indent=2)
    print(text)
    if path:
        path.write_text(text + "\n")
    return 0


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (http://HOST:PORT); default: start `hybridcache up`")
    ap.add_argument("--model", type=Path, help="model directory (default: the shipped model)")
    ap.add_argument("--init-model", metavar="ARCH:PRESET", help="first write a random-weight model to --model")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--port", type=int, default=0, help="port of the stack this script starts (default: a free one)")
    ap.add_argument("--up-args", default="--scatter-workers 0", help="more `hybridcache up` flags, one string")
    ap.add_argument("--scenario", default="streams", help="streams, rag or streams,rag")
    ap.add_argument("--streams", type=ints, default=[1, 16], help="closed-loop stream counts (comma list)")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1, help="streams: runs of each count, interleaved")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens of a streams request")
    ap.add_argument("--modes", default="pic,prefix,full", help="rag: the server modes compared")
    ap.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")], default=[0.5, 1.0, 2.0, 4.0],
                    help="rag: Poisson arrival rates swept (requests/s)")
    ap.add_argument("--rag-requests", type=int, default=24, help="rag: requests per rate")
    ap.add_argument("--warmup-requests", type=int, default=4,
                    help="rag: requests of the trace sent one at a time before the sweep, after requests that "
                    "show every document once")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--docs-per-request", type=ints, default=[4, 32], help="rag: LO,HI documents a request")
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--rag-max-tokens", type=int, default=16)
    ap.add_argument("--zipf", type=float, default=1.0, help="rag: Zipf exponent of document popularity")
    ap.add_argument("--slo-ttft-s", type=float, default=1.0)
    ap.add_argument("--vocab", type=int, default=250, help="token ids are drawn from [5, vocab)")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--machine", default="", help="the result's machine field (default: cpu, or the GPU's name)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--combine", type=Path, nargs="+", metavar="FILE",
                    help="run nothing: merge these result files (e.g. one RAG mode each) into one")
    args = ap.parse_args(argv)
    scenarios = set(args.scenario.split(","))
    if not scenarios <= {"streams", "rag"}:
        ap.error(f"--scenario: expected streams and/or rag, got {args.scenario!r}")
    if args.combine:
        return combine(args.combine, args.out)
    if args.model is None:
        from hybridcache.services.runtime.modelzoo import default_model_dir

        args.model = default_model_dir()
    if args.init_model:
        init_model(args.init_model, args.model, args.device, args.dtype)
    if not args.url and not args.port:
        from hybridcache.services.launcher import free_port

        args.port = free_port()

    def target(mode):
        stack = None if args.url else Stack(args, mode)
        url = args.url or stack.url
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        return stack, host, int(port)

    out: dict = {"benchmark": "served_load", "figures": {}, "results": {}}
    if "streams" in scenarios:
        stack, host, port = target(None)
        try:
            out["results"]["streams"] = run_streams(host, port, args)
        finally:
            if stack is not None:
                stack.stop()
    if "rag" in scenarios:
        modes = args.modes.split(",") if not args.url else ["as served"]
        out["results"]["rag"] = {}
        for mode in modes:
            stack, host, port = target(None if args.url else mode)
            try:
                out["results"]["rag"][mode] = run_rag(host, port, args, mode)
            finally:
                if stack is not None:
                    stack.stop()
    out["figures"] = figures_of(out["results"])
    machine = args.machine or "cpu"
    if args.device == "cuda" and not args.machine:
        import torch

        machine = torch.cuda.get_device_name(0)
    facts = run_facts(__file__, argv)
    out.update(machine=machine, gpu=machine if args.device == "cuda" else "none (CPU)", commit=facts["commit"],
               date=facts["date"], host=facts["host"], host_probe=facts["host_probe"], cpus=os.cpu_count(),
               command=facts["command"],
               model=str(args.model), device=args.device, dtype=args.dtype, up_args=args.up_args,
               note="client-side times of streamed /generate requests: TTFT from sending to the first token's "
                    "event, inter-token latency between token events; closed-loop streams send back to back, the "
                    "RAG sweep sends Poisson arrivals open loop; a rate meets the SLO when every request completed "
                    "and the p50 TTFT is within it")
    return emit(out, args.out)


if __name__ == "__main__":
    sys.exit(main())
