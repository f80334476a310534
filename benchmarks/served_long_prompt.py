"""128k-token prompts through the HTTP API: running streams' inter-token latency while a long prompt
prefills, and PIC's time to first token at 128k against the prefix and full peers; prints one JSON
object.

Phases (--phases, any of them; each starts its own `hybridcache up` stack):

- itl: a pic stack with --itl-budget as --max-num-batched-tokens (and --itl-layer-parts, when
  given, as --chunk-layer-parts: a chunk that many times the budget's tokens, over that many steps
  a run of layers each). --streams streamed requests
  (a --stream-prompt-tokens prompt, greedy, up to --stream-tokens new tokens) decode; their
  inter-token gaps over --steady-s seconds are the steady state; then one cold prompt of
  --long-tokens tokens (no segments: all live, prefilled a budget of tokens a step, in chunks) is
  sent and the streams' gaps between its sending and its first token are the gaps during the long
  prefill. `itl_p99_during_long_prefill_vs_steady` = their p99 over the steady p50 (target <= 3).
- pic: a pic stack serves a cold request of --docs documents of --doc-tokens tokens after a
  --system-tokens system prompt and a --question-tokens question (first another cold one of the
  same shape, not timed: kernels compile), then --repeats warm ones: the same documents in
  another order after a new system prompt (every document folded in from its entry).
- prefix: a prefix-mode stack serves the cold request (not timed), then the same warm ones: its
  prefix cache holds none of their prefix, so each prefills all its tokens.
- full: a full-mode stack serves the cold request twice (the first not timed).

`warm_pic_ttft_speedup_vs_prefix_128k` = prefix's p50 warm TTFT over pic's (target >= 30);
`cold_pic_ttft_vs_full_128k` = pic's cold TTFT over full's (target <= 1.0). Phases run in separate
invocations merge into --out when it holds an earlier run's results (--merge), so that each stays
within a device call's time:

    python benchmarks/served_long_prompt.py --device cuda --init-model qwen3_5_text:qwen3.5-9b \\
        --model /tmp/q9b --phases itl --out long.json
    python benchmarks/served_long_prompt.py --device cuda --model /tmp/q9b --phases pic,prefix,full \\
        --out long.json --merge

TTFT is the client's, from sending the request to its first streamed token. Each response's
statistics (engine TTFT, prompt, cached and built tokens) are kept beside it.
"""

from __future__ import annotations

import argparse
import http.client as httplib
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_probe import HostWatch  # noqa: E402
from hybridcache.services import contract  # noqa: E402
from hybridcache.services.config import default_of  # noqa: E402
from served_load import Result, Stack, emit, init_model_apart, percentiles, rand_ids, run_facts, send  # noqa: E402
from served_pic_layouts import stream  # noqa: E402

PHASES = ("itl", "pic", "prefix", "full")


def start(args, mode: str, extra: str) -> Stack:
    up = argparse.Namespace(port=args.port, model=args.model, device=args.device, dtype=args.dtype,
                            up_args=f"{args.up_args} {extra}")
    return Stack(up, mode)


def address(stack: Stack) -> tuple[str, int]:
    host, port = stack.url.removeprefix("http://").rstrip("/").split(":")
    return host, int(port)


def stream_until(host: str, port: int, body: dict, stop: threading.Event, res: Result, timeout_s: float) -> None:
    """A streamed /generate whose token arrival times go into `res`, read until its end or until
    `stop` is set (then the connection is closed, and the server cancels the request)."""
    conn = httplib.HTTPConnection(host, port, timeout=timeout_s)
    res.sent = time.perf_counter()
    try:
        conn.request("POST", "/generate", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            res.error = resp.read().decode()[:300]
            return
        n = 0
        for line in resp:
            if stop.is_set():
                break
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()  # the event's arrival, before this thread parses it
            ev = json.loads(line[6:])
            if "error" in ev:
                res.error = json.dumps(ev["error"])[:300]
                break
            ids = ev.get("output_ids") or []
            res.token_times += [now] * (len(ids) - n)
            n = len(ids)
    except OSError as e:
        if not stop.is_set():
            res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def run_itl(args, rng: random.Random) -> dict:
    """The itl phase (module docstring)."""
    parts = f" --chunk-layer-parts {args.itl_layer_parts}" if args.itl_layer_parts else ""
    stack = start(args, "pic", f"--max-num-batched-tokens {args.itl_budget} --max-num-seqs {args.streams + 1} "
                               f"--warmup-shape {args.itl_warmup_shape}{parts}")
    host, port = address(stack)
    results: list[Result] = [Result() for _ in range(args.streams)]
    stop = threading.Event()
    threads: list[threading.Thread] = []
    long: dict = {}
    server: dict = {}
    try:
        send(host, port, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}, args.timeout_s)
        sp = {"max_new_tokens": args.stream_tokens, "ignore_eos": True, "temperature": 0.0}
        bodies = [{"input_ids": rand_ids(rng, args.stream_prompt_tokens, args.vocab), "sampling_params": sp}
                  for _ in range(args.streams)]
        threads = [threading.Thread(target=stream_until, args=(host, port, bodies[i], stop, results[i], args.timeout_s),
                                    daemon=True) for i in range(args.streams)]
        for t in threads:
            t.start()
        # every stream decoding, then the steady window
        deadline = time.perf_counter() + args.timeout_s
        while time.perf_counter() < deadline and not all(r.token_times or r.error for r in results):
            time.sleep(0.05)
        steady_from = time.perf_counter()
        time.sleep(args.steady_s)
        long_body = {"suffix": rand_ids(rng, args.long_tokens, args.vocab),
                     "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}}
        before = {role: service_histograms(stack, role) for role in ("combine", "router")}
        long_sent = time.perf_counter()
        long = stream(host, port, long_body, args.timeout_s)
        long_first = long_sent + long["ttft_ms"] / 1000 if "ttft_ms" in long else time.perf_counter()
        server = {role: histogram_delta(before[role], service_histograms(stack, role)) for role in before}
        time.sleep(min(1.0, args.steady_s))  # the streams' next tokens after it
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        stack.stop()

    def gaps(lo, hi):
        out = []
        for r in results:
            t = r.token_times
            out += [b - a for a, b in zip(t, t[1:]) if lo <= a and b <= hi]
        return out

    steady = gaps(steady_from, long_sent)
    during = gaps(long_sent, long_first)
    # a gap across the long prompt's sending or its end counts as during too
    spanning = [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:])
                if (a < long_sent < b) or (a < long_first < b)]
    return {"streams": args.streams, "errors": sorted({r.error for r in results if r.error})[:3],
            "streams_decoding": sum(1 for r in results if r.token_times), "budget_tokens": args.itl_budget,
            "chunk_layer_parts": args.itl_layer_parts or default_of("chunk_layer_parts"),
            "long_tokens": args.long_tokens, "long": long,
            "long_prefill_s": round(long_first - long_sent, 3),
            "long_prefill_tokens_per_s": round(args.long_tokens / max(long_first - long_sent, 1e-9), 1),
            "steady_itl_ms": percentiles(steady), "during_itl_ms": percentiles(during + spanning),
            "steady_gaps": len(steady), "during_gaps": len(during) + len(spanning),
            # the servers' own view of the same window (bucket upper bound in ms -> count): the
            # combine worker's steps' wall times by what they ran and its collector's pauses by
            # generation; the router's gaps between a request's tokens and its collector's pauses
            "during_combine": server.get("combine", {}), "during_router": server.get("router", {})}


# per role, the histograms read and their label (None: the histogram has none)
HISTOGRAMS = {
    "combine": {contract.METRIC_SCHEDULER_STEP_SECONDS: "kind", contract.METRIC_GC_PAUSE_SECONDS: "generation"},
    "router": {contract.METRIC_INTER_TOKEN_SECONDS: None, contract.METRIC_GC_PAUSE_SECONDS: "generation"},
}


def service_histograms(stack, role: str) -> dict:
    """A role's histograms (HISTOGRAMS) from the first such process's /metrics: {name: {label
    value ("all" where none): {le: cumulative count}}} ({} where it cannot be read)."""
    import re
    import urllib.request

    if role == "router":  # its HTTP door is the stack's (the services list has the port asked for)
        where = stack.url.removeprefix("http://").rstrip("/")
    else:
        service = next((s for s in stack.services if s["role"] == role), None)
        if service is None:
            return {}
        where = service["http"]
    try:
        with urllib.request.urlopen(f"http://{where}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict = {}
    for name, label in HISTOGRAMS[role].items():
        if label is None:
            pat = re.compile(rf'^{name}_bucket{{()le="([^"]+)"}} ([0-9.e+]+)$', re.M)
        else:
            pat = re.compile(rf'^{name}_bucket{{{label}="([^"]*)",le="([^"]+)"}} ([0-9.e+]+)$', re.M)
        for value, le, count in pat.findall(text):
            out.setdefault(name, {}).setdefault(value or "all", {})[le] = float(count)
    return out


def histogram_delta(before: dict, after: dict) -> dict:
    """Per histogram and label, the observations between the two scrapes in each bucket (not
    cumulative), keyed by the bucket's upper bound in ms ("inf" for the last), with their count."""
    out: dict = {}
    for name, labels in after.items():
        short = name.removeprefix("hybridcache_").removesuffix("_seconds")
        for value, buckets in labels.items():
            prev, last, rows = before.get(name, {}).get(value, {}), 0.0, {}
            for le, cum in sorted(buckets.items(), key=lambda kv: float(kv[0])):
                n = cum - prev.get(le, 0.0)
                key = "inf" if le == "+Inf" else f"{float(le) * 1000:g}"
                if n - last:
                    rows[key] = int(n - last)
                last = n
            if rows:
                out.setdefault(short, {})[value] = {"count": int(last), "by_le_ms": rows}
    return out


def long_requests(args, rng: random.Random) -> dict:
    """The 128k requests of the pic, prefix and full phases (the same in each phase)."""
    sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    docs = [rand_ids(rng, args.doc_tokens, args.vocab) for _ in range(args.docs)]
    other = [rand_ids(rng, args.doc_tokens, args.vocab) for _ in range(args.docs)]
    question = rand_ids(rng, args.question_tokens, args.vocab)
    system = rand_ids(rng, args.system_tokens, args.vocab)
    cold = {"system": system, "segments": docs, "suffix": question, "sampling_params": sp}
    warm = []
    for _ in range(args.repeats):
        order = list(range(args.docs))
        rng.shuffle(order)
        warm.append({"system": rand_ids(rng, args.system_tokens, args.vocab), "segments": [docs[i] for i in order],
                     "suffix": question, "sampling_params": sp})
    return {"compile": dict(cold, segments=other, system=rand_ids(rng, args.system_tokens, args.vocab)), "cold": cold,
            "warm": warm}


def timed(host, port, bodies, timeout_s) -> dict:
    runs = [stream(host, port, b, timeout_s) for b in bodies]
    ok = [r for r in runs if "ttft_ms" in r]
    keep = ("engine_ttft_ms", "prompt_tokens", "cached_tokens", "built_tokens", "live_tokens", "entry_evictions")
    errors = sorted({r["error"] for r in runs if "error" in r})[:3]
    return {"requests": len(bodies), "completed": len(ok), "errors": errors,
            "ttft_ms_each": [r["ttft_ms"] for r in ok],
            "ttft_ms_p50": round(statistics.median([r["ttft_ms"] for r in ok]), 2) if ok else None,
            "stats": [{k: r["stats"][k] for k in keep if k in r["stats"]} for r in ok]}


def combine_memory(stack, timeout_s: float) -> dict:
    """The memory plan on the stack's combine worker's /health ({} where it has none)."""
    from served_decode import get_json

    combine = next((s for s in stack.services if s["role"] == "combine"), None)
    if combine is None:
        return {}
    code, body = get_json(combine["http"], "/health", timeout_s)
    return body.get("memory") or {} if code == 200 else {}


def run_long(args, mode: str, reqs: dict) -> dict:
    """The pic, prefix or full phase (module docstring)."""
    extra = f"--warmup-shape {args.warmup_shape}" if mode == "pic" else "--warmup-shape none"
    stack = start(args, mode, f"{extra} --max-num-batched-tokens {args.budget}")
    host, port = address(stack)
    out: dict = {"mode": mode}
    try:
        # the combine worker's memory plan (its budgets: whether 64 documents' entries fit)
        memory = combine_memory(stack, args.timeout_s)
        if memory:
            out["combine_memory"] = memory
        out["compile"] = timed(host, port, [reqs["compile"]], args.timeout_s)
        out["cold"] = timed(host, port, [reqs["cold"]], args.timeout_s)
        if mode != "full":
            out["warm"] = timed(host, port, reqs["warm"], args.timeout_s)
    finally:
        stack.stop()
    return out


def failures(results: dict) -> list[tuple[str, str]]:
    """(phase, what) for each failure in the phases' requests: a phase with one gives no figure (a
    long prompt refused at once would otherwise read as no stall at all)."""
    out = [(phase, f"its stack did not start: {r['stack_error']}") for phase, r in results.items()
           if isinstance(r, dict) and "stack_error" in r]
    itl = results.get("itl")
    if itl is not None and "stack_error" not in itl:
        if "ttft_ms" not in itl.get("long", {}):
            out.append(("itl", f"the long prompt: {itl.get('long', {}).get('error', 'no first token')}"))
        out += [("itl", f"a stream: {e}") for e in itl.get("errors", [])]
    for mode in ("pic", "prefix", "full"):
        for part, r in results.get(mode, {}).items():
            if isinstance(r, dict) and r.get("completed") != r.get("requests"):
                out.append((mode, f"{part}: {r.get('completed')} of {r.get('requests')} completed: {r.get('errors')}"))
    return out


def figures_of(results: dict) -> dict:
    out = {}
    failed = {phase for phase, _ in failures(results)}
    itl = results.get("itl", {}) if "itl" not in failed else {}
    steady, during = itl.get("steady_itl_ms", {}).get("p50"), itl.get("during_itl_ms", {}).get("p99")
    if steady and during:
        out["itl_p99_during_long_prefill_vs_steady"] = round(during / steady, 3)
    pic, prefix, full = (results.get(m, {}) if m not in failed else {} for m in ("pic", "prefix", "full"))
    warm_pic, warm_prefix = pic.get("warm", {}).get("ttft_ms_p50"), prefix.get("warm", {}).get("ttft_ms_p50")
    if warm_pic and warm_prefix:
        out["warm_pic_ttft_speedup_vs_prefix_128k"] = round(warm_prefix / warm_pic, 2)
    cold_pic, cold_full = pic.get("cold", {}).get("ttft_ms_p50"), full.get("cold", {}).get("ttft_ms_p50")
    if cold_pic and cold_full:
        out["cold_pic_ttft_vs_full_128k"] = round(cold_pic / cold_full, 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="model directory")
    ap.add_argument("--init-model", metavar="ARCH:PRESET", help="first write a random-weight model to --model")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--phases", default="itl,pic,prefix,full", help=f"comma list of {', '.join(PHASES)}")
    ap.add_argument("--up-args", default="--scatter-workers 0", help="more `hybridcache up` flags of every stack")
    # itl
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-prompt-tokens", type=int, default=64)
    ap.add_argument("--stream-tokens", type=int, default=4096, help="the streams' max_new_tokens (they outlast the "
                    "long prefill; closed when it is done)")
    ap.add_argument("--steady-s", type=float, default=3.0)
    ap.add_argument("--long-tokens", type=int, default=131072)
    ap.add_argument("--itl-budget", type=int, default=512, help="--max-num-batched-tokens of the itl stack")
    ap.add_argument("--itl-warmup-shape", default="16+4x256+16")
    ap.add_argument("--itl-layer-parts", type=int, default=0,
                    help="--chunk-layer-parts of the itl stack (0: the served default)")
    # pic, prefix, full
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--system-tokens", type=int, default=16)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=8192, help="--max-num-batched-tokens of the pic/prefix/full stacks")
    ap.add_argument("--warmup-shape", default="16+64x2048+64", help="the pic stack's --warmup-shape")
    ap.add_argument("--vocab", type=int, default=250, help="prompt ids are drawn from [5, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--merge", action="store_true", help="keep the phases of --out that this run does not redo")
    args = ap.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    bad = [p for p in phases if p not in PHASES]
    if bad:
        ap.error(f"unknown phase {bad[0]!r} (choose from {', '.join(PHASES)})")
    t_start = time.perf_counter()
    if args.init_model:
        init_model_apart(args.init_model, args.model, args.device, args.dtype)
    if not args.port:
        from hybridcache.services.launcher import free_port

        args.port = free_port()
    previous = {}
    if args.merge and args.out and args.out.is_file():
        previous = json.loads(args.out.read_text())
    results = dict(previous.get("results", {}))
    runs = dict(previous.get("runs", {}))
    reqs = long_requests(args, random.Random(args.seed))
    gpu = "none (CPU)"
    if args.device == "cuda":
        probe = subprocess.run([sys.executable, "-P", "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                               capture_output=True, text=True, timeout=120)
        gpu = probe.stdout.strip() or "unknown"
    facts = run_facts(__file__, argv)
    commit, date, command = facts["commit"], facts["date"], facts["command"]

    def result(final: bool) -> dict:
        failed = failures(results)
        if final:
            for phase, what in failed:
                print(f"served_long_prompt: error: {phase}: {what}", file=sys.stderr)
        return {"benchmark": "served_long_prompt", "figures": figures_of(results),
                "failures": [f"{phase}: {what}" for phase, what in failed],
                "targets": {"itl_p99_during_long_prefill_vs_steady": "<= 3",
                            "warm_pic_ttft_speedup_vs_prefix_128k": ">= 30", "cold_pic_ttft_vs_full_128k": "<= 1.0"},
                "results": results, "runs": runs, "gpu": gpu, "commit": commit, "date": date, "host": facts["host"],
                "seconds": round(time.perf_counter() - t_start, 1), "command": command, "model": str(args.model),
                "dtype": args.dtype, "up_args": args.up_args,
                "floors": "a prefill's floor is its FLOPs: pic's warm request runs its live tokens only (seams and the "
                          "question), the prefix and full peers all of the prompt; see "
                          "benchmarks/served_pic_layouts.py for a warm request against its byte and FLOP floor",
                "note": "TTFT from sending the request to its first streamed token; ITL from the streams' token "
                        "arrival times (steady: before the long prompt is sent; during: between its sending and its "
                        "first token)"}

    for i, phase in enumerate(phases):
        t0 = time.perf_counter()
        watch = HostWatch()  # the host's speed and contention over the phase (host_probe.py)
        try:
            if phase == "itl":
                results["itl"] = run_itl(args, random.Random(args.seed + 1))
            else:
                results[phase] = run_long(args, phase, reqs)
        except SystemExit as e:  # its `hybridcache up` did not become ready: the next phases still run
            results[phase] = {"stack_error": str(e)}
        print(f"served_long_prompt: {phase}: {json.dumps(results[phase])[:2000]}", file=sys.stderr, flush=True)
        runs[phase] = {"seconds": round(time.perf_counter() - t0, 1), "commit": commit, "date": date, "gpu": gpu,
                       "command": command, "host": watch.report()}
        if args.out and i < len(phases) - 1:
            # the phases so far, in case a later one is cut short (a device call's time limit)
            args.out.write_text(json.dumps(result(False), indent=1) + "\n")
    out = result(True)
    rc = emit(out, args.out)
    return rc or (1 if out["failures"] else 0)


if __name__ == "__main__":
    sys.exit(main())
