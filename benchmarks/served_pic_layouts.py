"""Warm PIC requests of unseen layouts against repeated ones, and against their floor, through the
HTTP API; prints one JSON object.

One pic stack (`hybridcache up`, or a running server given by --url) first caches a pool of
--docs documents of random lengths (--doc-tokens MIN,MAX, seeded) and --floor-docs documents of
--floor-doc-tokens each (cold requests, not timed). Then, every request greedy with one new token
and a new --system-tokens system prompt (so no part-chain snapshot of an earlier request applies
and every segment is folded in from its entry), each timed from sending to the first streamed token:

- repeated: --requests requests of the same --docs-per-request pool documents in the same order
  (one layout, repeated);
- unseen: --requests requests of --docs-per-request pool documents drawn anew each time, in a new
  order (every request a layout not seen before: its documents' lengths in another sequence);
- floor: --requests requests of the --floor-docs documents of --floor-doc-tokens tokens.

Figures: `warm_pic_ttft_unseen_layouts_vs_repeated` (p50 TTFT of unseen over repeated; target
<= 1.2) and `warm_pic_ttft_fraction_of_floor_32x1k` (the floor request's floor over its p50
TTFT; target >= 0.25). The floor of a warm request is the larger of two times: the bytes it must
read at the device-to-device copy bandwidth measured in this run (every weight once, but of the
token embedding only the live tokens' rows; each entry's linear-layer T, S and conv tail and
attention K/V as the server stores them), and its FLOPs at the bf16 matmul rate measured in this
run (2 x the weights' parameters x the live tokens, the live queries' attention over the context,
the fold's T S products). The response's statistics give the graph counts of each request
(`graph_captures`: a capture on a request whose layout is new would show there).

    python benchmarks/served_pic_layouts.py --device cuda --init-model qwen3_5_text:qwen3.5-9b \\
        --model /tmp/q9b --out r.json

On a GPU the model is written by a process of its own first, and the bandwidth and matmul rate
are measured by another, before the server starts.
"""

from __future__ import annotations

import argparse
import http.client as httplib
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_load import Stack, emit, init_model_apart, percentiles, rand_ids, run_facts  # noqa: E402

# measured in a child process on the GPU before the server starts (nothing of it stays allocated)
DEVICE_PROBE = r"""
import json, time, torch
n = 1 << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    b.copy_(a)
torch.cuda.synchronize()
copy_bw = 2 * n * 20 / (time.perf_counter() - t0)  # bytes read + written per second
del a, b
m = 8192
x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    x @ y
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(10):
    x @ y
torch.cuda.synchronize()
flops = 2 * m ** 3 * 10 / (time.perf_counter() - t0)
print(json.dumps({"gpu": torch.cuda.get_device_name(0), "copy_bytes_per_s": copy_bw, "bf16_flops_per_s": flops}))
"""


def probe_device() -> dict:
    res = subprocess.run([sys.executable, "-P", "-c", DEVICE_PROBE], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise SystemExit(f"served_pic_layouts: the device probe failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def stream(host: str, port: int, body: dict, timeout_s: float) -> dict:
    """POST a native request ({"system", "segments", "suffix", "sampling_params"}, token ids) as a
    streamed SGLang /generate (the suffix as input_ids): {"ttft_ms", "stats" (the last event's
    hybridcache statistics)} or {"error"}. The body is encoded before the clock starts."""
    wire = {k: v for k, v in body.items() if k != "suffix"}
    wire.update(input_ids=body["suffix"], stream=True)
    data = json.dumps(wire).encode()
    conn = httplib.HTTPConnection(host, port, timeout=timeout_s)
    ttft, last = None, None
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/generate", data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read().decode()[:300]}"}
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return {"error": json.dumps(ev["error"])[:300]}
            if ttft is None and ev.get("output_ids"):
                ttft = (time.perf_counter() - t0) * 1000
            last = ev
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()
    if ttft is None:
        return {"error": "no token streamed"}
    return {"ttft_ms": round(ttft, 2), "stats": (last or {}).get("hybridcache") or {}}


STATS = ("engine_ttft_ms", "prompt_tokens", "cached_tokens", "live_tokens", "built_tokens", "graph_captures",
         "graph_replays", "graph_eager", "graph_failures")


def timed(host, port, bodies: list[dict], timeout_s: float) -> dict:
    """Requests one after another; their TTFT percentiles, graph counts and anything that failed."""
    runs = [stream(host, port, b, timeout_s) for b in bodies]
    ok = [r for r in runs if "ttft_ms" in r]
    errors = sorted({r["error"] for r in runs if "error" in r})[:3]
    out = {"requests": len(bodies), "completed": len(ok), "errors": errors,
           "ttft_ms": percentiles([r["ttft_ms"] for r in ok], scale=1.0),
           "ttft_ms_each": [r["ttft_ms"] for r in ok]}
    for k in STATS:
        vals = [r["stats"][k] for r in ok if isinstance(r["stats"].get(k), (int, float))]
        if vals:
            out[k] = sum(vals) if k.startswith("graph_") or k == "built_tokens" else statistics.median(vals)
    return out


def model_shape(model_dir: Path, dtype: str) -> dict:
    """Bytes and FLOPs of the model from its config (built on the meta device: shapes only)."""
    from hybridcache.services.runtime.models.registry import config_from_dir, shape_model

    model = shape_model(config_from_dir(model_dir), dtype)
    cfg = model.cfg
    embed = getattr(model.model, model.model.embed_name).weight
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = embed is model.lm_head.weight
    if not tied:
        weights -= embed.numel() * embed.element_size()
        params -= embed.numel()
    return {"weights_read": weights, "matmul_params": params, "embedding_row": embed.shape[1] * embed.element_size(),
            "linear_layers": len(cfg.linear_layers), "attention_layers": len(cfg.attention_layers),
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "linear_heads": cfg.linear_num_value_heads, "linear_key_dim": cfg.linear_key_head_dim,
            "linear_value_dim": cfg.linear_value_head_dim,
            "conv_dim": 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim,
            "conv_width": cfg.linear_conv_kernel_dim, "itemsize": embed.element_size()}


def warm_floor(shape: dict, docs: int, doc_tokens: int, live: int, seam: int, state_bytes: int,
               copy_bytes_per_s: float, flops_per_s: float) -> dict:
    """The floor of a warm request of `docs` cached documents of `doc_tokens` tokens and `live` live
    tokens (module docstring): bytes read, FLOPs, and the time of each at the measured rates."""
    body = doc_tokens - seam
    K, V, H = shape["linear_key_dim"], shape["linear_value_dim"], shape["linear_heads"]
    per_entry_linear = shape["linear_layers"] * (H * (K * K + K * V) * state_bytes
                                                 + shape["conv_dim"] * (shape["conv_width"] - 1) * shape["itemsize"])
    kv_token = shape["attention_layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * shape["itemsize"]
    entries = docs * (per_entry_linear + body * kv_token)
    moved = shape["weights_read"] + live * shape["embedding_row"] + entries
    context = docs * doc_tokens + live
    flops = (2 * shape["matmul_params"] * live
             + shape["attention_layers"] * 4 * shape["heads"] * shape["head_dim"] * live * context
             + docs * shape["linear_layers"] * H * 2 * K * K * V)
    bytes_ms, flops_ms = moved / copy_bytes_per_s * 1000, flops / flops_per_s * 1000
    return {"bytes_read": int(moved), "entry_bytes": int(entries), "flops": int(flops),
            "bytes_ms": round(bytes_ms, 3), "flops_ms": round(flops_ms, 3),
            "floor_ms": round(max(bytes_ms, flops_ms), 3)}


def figures_of(results: dict, floor: dict) -> tuple[dict, list[str]]:
    """The run's figures and the phases whose requests did not all complete: such a phase gives no
    figure (its p50 would be of the requests that happened to succeed), and a failed cache fill
    none at all (the warm requests would have built what it missed)."""
    failed = [k for k, r in results.items() if r.get("completed") != r.get("requests")]
    figures = {}
    rep, new, fl = (results[k].get("ttft_ms", {}).get("p50") if k not in failed and "cache_fill" not in failed
                    else None for k in ("repeated", "unseen", "floor_request"))
    if rep and new:
        figures["warm_pic_ttft_unseen_layouts_vs_repeated"] = round(new / rep, 3)
    if fl:
        figures["warm_pic_ttft_fraction_of_floor_32x1k"] = round(floor["floor_ms"] / fl, 3)
    figures["warm_pic_unseen_layouts_graph_captures"] = results["unseen"].get("graph_captures")
    return figures, failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running pic server (http://HOST:PORT); default: start `hybridcache up`")
    ap.add_argument("--model", type=Path, required=True, help="model directory")
    ap.add_argument("--init-model", metavar="ARCH:PRESET", help="first write a random-weight model to --model")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--up-args", default="--scatter-workers 0 --max-num-seqs 4", help="more `hybridcache up` flags")
    ap.add_argument("--docs", type=int, default=40, help="documents of the pool the unseen layouts draw from")
    ap.add_argument("--doc-tokens", default="200,4000", help="MIN,MAX tokens of a pool document")
    ap.add_argument("--docs-per-request", type=int, default=32)
    ap.add_argument("--floor-docs", type=int, default=32)
    ap.add_argument("--floor-doc-tokens", type=int, default=1024)
    ap.add_argument("--system-tokens", type=int, default=16)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=12, help="timed requests of each kind")
    ap.add_argument("--seam-window", type=int, default=8, help="the server's --seam-window (the floor's live tokens)")
    ap.add_argument("--entry-state-bytes", type=int, default=4, help="bytes of an entry's T and S values (fp32: 4)")
    ap.add_argument("--vocab", type=int, default=250, help="prompt ids are drawn from [5, vocab)")
    ap.add_argument("--copy-bandwidth", type=float, help="bytes/s (read + written) instead of measuring it (CPU)")
    ap.add_argument("--peak-flops", type=float, help="FLOP/s instead of measuring a bf16 matmul (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.init_model:
        init_model_apart(args.init_model, args.model, args.device, args.dtype)
    shape = model_shape(args.model, args.dtype)
    probe = probe_device() if args.device == "cuda" else {"gpu": "none (CPU)", "copy_bytes_per_s": 10e9,
                                                          "bf16_flops_per_s": 1e12}
    if args.copy_bandwidth:
        probe["copy_bytes_per_s"] = args.copy_bandwidth
    if args.peak_flops:
        probe["bf16_flops_per_s"] = args.peak_flops
    print(f"served_pic_layouts: {probe}", file=sys.stderr, flush=True)
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.doc_tokens.split(","))
    pool = [rand_ids(rng, rng.randint(lo, hi), args.vocab) for _ in range(args.docs)]
    floor_docs = [rand_ids(rng, args.floor_doc_tokens, args.vocab) for _ in range(args.floor_docs)]
    question = rand_ids(rng, args.question_tokens, args.vocab)
    n = args.docs_per_request
    sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}

    def body(docs):
        return {"system": rand_ids(rng, args.system_tokens, args.vocab), "segments": docs, "suffix": question,
                "sampling_params": sp}

    fixed = pool[:n]
    unseen, orders = [], set()
    while len(unseen) < args.requests:
        docs = rng.sample(pool, n)
        order = tuple(len(d) for d in docs)
        if order in orders or docs == fixed:
            continue
        orders.add(order)
        unseen.append(body(docs))
    repeated = [body(list(fixed)) for _ in range(args.requests + 1)]  # the first is not timed
    floor_reqs = [body(floor_docs[::-1] if k % 2 else list(floor_docs)) for k in range(args.requests + 1)]
    if not args.port and not args.url:
        from hybridcache.services.launcher import free_port

        args.port = free_port()
    warm_shape = f"{args.system_tokens}+{args.floor_docs}x{args.floor_doc_tokens}+{args.question_tokens}"
    up_args = f"{args.up_args} --mode pic --seam-window {args.seam_window} --warmup-shape {warm_shape}"
    stack = None
    if not args.url:
        stack = Stack(argparse.Namespace(port=args.port, model=args.model, device=args.device, dtype=args.dtype,
                                         up_args=up_args), None)
    url = args.url or stack.url
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    port = int(port)
    results: dict = {}
    try:
        # the documents cached, a few a request (cold builds; not timed)
        fill = [docs[i : i + 8] for docs in (pool, floor_docs) for i in range(0, len(docs), 8)]
        results["cache_fill"] = timed(host, port, [body(d) for d in fill], args.timeout_s)
        results["repeated"] = timed(host, port, repeated, args.timeout_s)
        results["repeated"]["first_ttft_ms"] = results["repeated"]["ttft_ms_each"].pop(0) if \
            results["repeated"]["ttft_ms_each"] else None
        results["repeated"]["ttft_ms"] = percentiles(results["repeated"]["ttft_ms_each"], scale=1.0)
        results["unseen"] = timed(host, port, unseen, args.timeout_s)
        results["floor_request"] = timed(host, port, floor_reqs, args.timeout_s)
        each = results["floor_request"]["ttft_ms_each"]
        results["floor_request"]["first_ttft_ms"] = each.pop(0) if each else None
        results["floor_request"]["ttft_ms"] = percentiles(each, scale=1.0)
    finally:
        if stack is not None:
            stack.stop()
    live = args.system_tokens + args.floor_docs * args.seam_window + args.question_tokens
    floor = warm_floor(shape, args.floor_docs, args.floor_doc_tokens, live, args.seam_window, args.entry_state_bytes,
                       probe["copy_bytes_per_s"], probe["bf16_flops_per_s"])
    figures, failed = figures_of(results, floor)
    for k in failed:
        print(f"served_pic_layouts: error: {k}: {results[k]['completed']} of {results[k]['requests']} completed: "
              f"{results[k].get('errors')}", file=sys.stderr)
    targets = {"warm_pic_ttft_unseen_layouts_vs_repeated": "<= 1.2", "warm_pic_ttft_fraction_of_floor_32x1k": ">= 0.25"}
    out = {"benchmark": "served_pic_layouts", "figures": figures, "targets": targets,
           "results": results, "floor_32x1k": floor, "model_shape": shape,
           "gpu": probe["gpu"], "copy_bandwidth_tb_per_s": round(probe["copy_bytes_per_s"] / 1e12, 3),
           "bf16_tflops": round(probe["bf16_flops_per_s"] / 1e12, 1),
           **run_facts(__file__, argv), "seconds": round(time.perf_counter() - t_start, 1),
           "model": str(args.model), "dtype": args.dtype, "up_args": up_args,
           "note": "TTFT from sending the request to its first streamed token, one request at a time, each with "
                   "a new system prompt; unseen: every request a new document order and lengths; floor: max of the "
                   "bytes a warm request reads at the measured copy bandwidth and its FLOPs at the measured bf16 "
                   "matmul rate"}
    if failed:
        out["failures"] = failed
    return emit(out, args.out) or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
