"""Served multi-turn trace: prefix hit tokens and TTFT of each prefix policy at one page-tree byte
budget, through `hybridcache up --mode prefix`; prints one JSON object.

The trace (seeded, the same for every policy): conversations arrive as a Poisson process
(--rate a second); each starts with one of --systems shared system prompts of --system-tokens
tokens and has 4-16 turns (--turns); a turn's prompt is the history it continues (its parent
turn's prompt and that turn's answer, as the server wrote it) and a new user message; with
probability --branch-prob a turn continues an earlier turn than the last (a user editing or
regenerating: the conversation branches); a turn is sent --think-s (mean, exponential) after the
answer it continues. Answers are --output-tokens long (EOS ignored, greedy).

Policies (--policies), each on its own server with the same --prefix-cache-bytes (the page tree's
budget: attention K/V and linear state together):

    checkpoint      a dense linear state every --checkpoint-every pages (256 tokens)
    exact_replay    anchors for every token and that checkpoint grid (exact)
    suffix_replay   --anchors-per-page anchors per page, replay of --replay-anchors, --anchor-dtype
    sglang_peer     SGLang's mamba radix cache under its default (no_buffer) strategy, as the
                    checkpoint policy keeps it: a dense state every --sglang-interval tokens (8,192:
                    its chunked-prefill chunk on H100/H200, where it keeps a chunk's state) and the
                    state where every finished request (prompt and output) ended
                    (--checkpoint-request-ends), at its last 64-token page boundary (SGLang's tree is
                    token-granular there: it resumes up to 63 tokens later than SGLang would)
    sglang_grid     the grid alone, without the request-end states

The JSON also gives, from the trace alone (no budget, no eviction), the prompt tokens that the grid
plus token-exact request-end states would have served
(`sglang_request_end_states_hit_fraction_upper_bound`).

Per policy: prefix hit tokens (the server's prefix_reused_tokens) and their share of prompt
tokens, client TTFT percentiles (all requests, and follow-up turns alone), the server's restore
time. Figures: `multiturn_ttft_p50_suffix_replay_vs_sglang_grid_checkpoint`, against sglang_peer
(also named `multiturn_ttft_p50_suffix_replay_vs_sglang_peer`), `..._vs_sglang_bare_grid` against
sglang_grid, against the others, and `multiturn_hit_fraction_<policy>`.

    python benchmarks/multiturn.py                                   # CPU, the shipped model
    python benchmarks/multiturn.py --device cuda --dtype bfloat16 --model /tmp/served-q9b \\
        --prefix-cache-bytes 8589934592 --out multiturn_h100.json    # write the model first
"""

from __future__ import annotations

import argparse
import datetime
import http.client as httplib
import importlib.util
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from hybridcache.services.runtime.qa_data import common_prefix_len

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("checkpoint", "exact_replay", "suffix_replay", "sglang_peer", "sglang_grid")


def _served_load():
    """benchmarks/served_load.py (its stack launcher, model writer and percentiles)."""
    spec = importlib.util.spec_from_file_location("served_load", Path(__file__).with_name("served_load.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("served_load", mod)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules["served_load"])
    return sys.modules["served_load"]


@dataclass(frozen=True)
class TraceTurn:
    parent: int | None  # the turn whose prompt and answer this one continues; None: the system prompt
    user: tuple[int, ...]  # the new user message's token ids
    think_s: float  # wait after the answer it follows (the conversation's previous request)


@dataclass(frozen=True)
class TraceConversation:
    start_s: float  # arrival, from the trace's start
    system: int  # index of its shared system prompt
    turns: tuple[TraceTurn, ...]


@dataclass(frozen=True)
class Trace:
    systems: tuple[tuple[int, ...], ...]
    conversations: tuple[TraceConversation, ...]

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def make_trace(args, seed: int | None = None) -> Trace:
    """The trace of `args` (see the module docstring); the same for a seed whatever the policy."""
    rng = random.Random(args.seed if seed is None else seed)
    lo_v, hi_v = 5, args.vocab

    def ids(n):
        return tuple(rng.randrange(lo_v, hi_v) for _ in range(n))

    systems = tuple(ids(args.system_tokens) for _ in range(args.systems))
    convs, t = [], 0.0
    for _ in range(args.conversations):
        t += rng.expovariate(args.rate)
        n = rng.randint(*args.turns)
        turns = []
        for i in range(n):
            parent = None if i == 0 else i - 1
            if i >= 2 and rng.random() < args.branch_prob:
                parent = rng.randrange(0, i - 1)  # an earlier turn than the last: a branch
            turns.append(TraceTurn(parent, ids(rng.randint(*args.user_tokens)), rng.expovariate(1 / args.think_s)
                                   if args.think_s > 0 else 0.0))
        convs.append(TraceConversation(t, rng.randrange(args.systems), tuple(turns)))
    return Trace(systems, tuple(convs))


@dataclass
class Sent:
    """One request as the client saw it."""

    conversation: int
    turn: int
    prompt: list[int]
    sent: float = 0.0
    first: float | None = None
    done: float = 0.0
    status: int = 0
    output_ids: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.first is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


def send(host: str, port: int, sent: Sent, max_tokens: int, timeout_s: float) -> None:
    """POST a streamed /generate of sent.prompt; fills in its times, output and the server's stats."""
    body = {"input_ids": sent.prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}}
    sent.sent = time.perf_counter()
    conn = httplib.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        sent.status = resp.status
        if resp.status != 200:
            sent.error = resp.read().decode()[:300]
            return
        for line in resp:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                sent.error = json.dumps(ev["error"])[:300]
                break
            if ev.get("output_ids") and sent.first is None:
                sent.first = time.perf_counter()
            sent.output_ids = ev.get("output_ids") or sent.output_ids
            if isinstance(ev.get("hybridcache"), dict):
                sent.stats = {k: v for k, v in ev["hybridcache"].items() if k != "segments"}
    except OSError as e:
        sent.error = f"{type(e).__name__}: {e}"
    finally:
        sent.done = time.perf_counter()
        conn.close()


def run_trace(host: str, port: int, trace: Trace, args) -> tuple[list[Sent], float]:
    """Every conversation on its own thread from its arrival; its turns one after another."""
    out: list[Sent] = []
    lock = threading.Lock()

    def conversation(c: int, conv: TraceConversation):
        prompts: list[list[int]] = []
        answers: list[list[int]] = []
        for i, turn in enumerate(conv.turns):
            if i:
                time.sleep(turn.think_s)
            history = list(trace.systems[conv.system]) if turn.parent is None else \
                prompts[turn.parent] + answers[turn.parent]
            s = Sent(c, i, history + list(turn.user))
            send(host, port, s, args.output_tokens, args.timeout_s)
            prompts.append(s.prompt)
            answers.append(s.output_ids)
            with lock:
                out.append(s)

    threads = []
    t0 = time.perf_counter()
    for c, conv in enumerate(trace.conversations):
        delay = t0 + conv.start_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=conversation, args=(c, conv))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return sorted(out, key=lambda s: s.sent), time.perf_counter() - t0


def summarize(sent: list[Sent], wall_s: float, percentiles) -> dict:
    ok = [s for s in sent if s.ok]
    follow = [s for s in ok if s.turn > 0]
    prompt = sum(len(s.prompt) for s in ok)
    hit = sum(s.stats.get("prefix_reused_tokens", 0) for s in ok)
    hit_follow = sum(s.stats.get("prefix_reused_tokens", 0) for s in follow)
    return {
        "requests": len(sent), "completed": len(ok), "failed": len(sent) - len(ok),
        "errors": sorted({s.error for s in sent if s.error})[:3], "wall_s": round(wall_s, 2),
        "prompt_tokens": prompt, "prefix_hit_tokens": hit,
        "prefix_hit_fraction": round(hit / prompt, 4) if prompt else 0.0,
        "follow_up_hit_fraction": round(hit_follow / max(1, sum(len(s.prompt) for s in follow)), 4),
        "requests_with_a_hit": sum(s.stats.get("prefix_reused_tokens", 0) > 0 for s in ok),
        "ttft_ms": percentiles([s.ttft for s in ok]),
        "ttft_follow_up_ms": percentiles([s.ttft for s in follow]),
        "ttft_first_turn_ms": percentiles([s.ttft for s in ok if s.turn == 0]),
        "server_engine_ttft_ms": percentiles([s.stats["engine_ttft_ms"] for s in ok if "engine_ttft_ms" in s.stats],
                                             scale=1.0),
        "prefix_restore_ms": percentiles([s.stats["prefix_restore_ms"] for s in ok
                                          if s.stats.get("prefix_reused_tokens")], scale=1.0),
    }


def sglang_request_end_hits(sent: list[Sent], interval: int) -> dict:
    """Prompt tokens SGLang's default mamba cache could serve from the trace alone, an upper bound
    (no budget, no eviction): for each request, the longest of (a) an earlier finished request's
    tokens (prompt and answer but its last token, where it keeps the request's final state) that
    begin this prompt, and (b) a multiple of `interval` within the prefix this prompt shares with
    an earlier request (its chunked-prefill states)."""
    done: list[tuple[float, list[int], list[int]]] = []  # (finish time, prompt, tokens whose state is kept)
    hit = prompt_tokens = 0
    order = sorted(sent, key=lambda s: s.sent)
    for s in order:
        if not s.ok:
            continue
        target = s.prompt[:-1]
        best = 0
        for finished, prompt, seq in done:
            if finished > s.sent:
                continue
            if len(seq) > best and seq == target[: len(seq)]:
                best = len(seq)
            shared = common_prefix_len(target, prompt + seq[len(prompt):])
            best = max(best, shared // interval * interval)
        hit += best
        prompt_tokens += len(s.prompt)
        done.append((s.done, s.prompt, s.prompt + s.output_ids[:-1]))
    return {"hit_tokens": hit, "prompt_tokens": prompt_tokens,
            "hit_fraction": round(hit / prompt_tokens, 4) if prompt_tokens else 0.0}


def prefix_policy(name: str, args):
    """The PrefixPolicy a policy name of the trace runs."""
    from hybridcache.services.runtime.cache import PrefixPolicy

    if name in ("checkpoint", "exact_replay"):
        return PrefixPolicy(name, checkpoint_every=args.checkpoint_every)
    if name == "suffix_replay":
        return PrefixPolicy(name, anchors_per_page=args.anchors_per_page, replay_anchors=args.replay_anchors,
                            anchor_dtype=None if args.anchor_dtype == "model" else args.anchor_dtype)
    if name in ("sglang_peer", "sglang_grid"):
        return PrefixPolicy("checkpoint", checkpoint_every=args.sglang_interval // 64,
                            request_end_checkpoints=name == "sglang_peer")
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


def policy_flags(policy) -> list[str]:
    """`hybridcache up` flags of a PrefixPolicy (the byte budget is added by the caller)."""
    return ["--prefix-policy", policy.name, "--checkpoint-every", str(policy.checkpoint_every),
            "--anchors-per-page", str(policy.anchors_per_page), "--replay-anchors", str(policy.replay_anchors),
            "--anchor-dtype", policy.anchor_dtype or "model",
            "--checkpoint-request-ends", "on" if policy.request_end_checkpoints else "off"]


def bytes_per_token(model_dir: Path, dtype: str, policies: dict) -> dict:
    """Each policy's page-tree bytes per cached token (attention K/V and linear state) from the
    model's shape (built on the meta device: no memory), and one dense state's bytes
    (`dense_state`: what a request-end state adds, per finished request, to a policy that keeps
    them; its per-token figures leave those out)."""
    import torch
    from hybridcache.services.runtime.cache import linear_state_bytes_per_token
    from hybridcache.services.runtime.config import ModelConfig
    from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM

    cfg = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    torch_dtype = getattr(torch, dtype)
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device("meta"):
            model = HybridLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    state = model.empty_state()
    dense = sum(t.numel() * t.element_size() for s in state.linear.values() for t in (s.ssm, s.conv))
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    kv = sum(t == "full_attention" for t in cfg.layer_types) * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    groups = len(model.linear_groups())
    out: dict = {"attention_kv": kv, "dense_state": dense}
    for name, pol in policies.items():
        linear = linear_state_bytes_per_token(pol, dense, groups * pol.anchor_row_bytes(cfg.hidden_size, itemsize))
        out[name] = {"linear": linear, "total": linear + kv}
    return out


def figures_of(results: dict, sglang_end: dict | None) -> dict:
    figures: dict = {}
    # a policy whose server did not start, or whose requests did not all complete, gives no figure
    # (its TTFT percentiles would be of the requests that happened to succeed)
    results = {p: r for p, r in results.items() if "error" not in r and not r.get("failed")}
    p50 = {p: r["ttft_ms"].get("p50") for p, r in results.items()}
    for p, r in results.items():
        figures[f"multiturn_ttft_p50_ms_{p}"] = p50[p]
        figures[f"multiturn_hit_fraction_{p}"] = r["prefix_hit_fraction"]
    if "suffix_replay" in p50 and p50["suffix_replay"]:
        # the figure is against SGLang's peer (grid and request-end states); the bare grid apart
        for other, name in (("sglang_peer", "sglang_grid_checkpoint"), ("sglang_peer", "sglang_peer"),
                            ("sglang_grid", "sglang_bare_grid"), ("checkpoint", "checkpoint"),
                            ("exact_replay", "exact_replay")):
            if p50.get(other):
                figures[f"multiturn_ttft_p50_suffix_replay_vs_{name}"] = round(p50["suffix_replay"] / p50[other], 3)
    if sglang_end is not None:
        figures["sglang_request_end_states_hit_fraction_upper_bound"] = sglang_end["hit_fraction"]
    return figures


def gpu_name() -> str:
    """The GPU's name from nvidia-smi (no CUDA context in this client process), else "cuda"."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    return out[0] if out else "cuda"


def pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 < LO <= HI, got {text!r}")
    return lo, hi


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model directory (default: the shipped model)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--up-args", default="--scatter-workers 0", help="more `hybridcache up` flags, one string")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {','.join(POLICIES)}")
    ap.add_argument("--prefix-cache-bytes", type=int, default=None,
                    help="the page tree's budget, the same for every policy (default: a quarter of what the "
                    "trace's prompt tokens take under exact_replay)")
    ap.add_argument("--checkpoint-every", type=int, default=4)
    ap.add_argument("--anchors-per-page", type=int, default=4)
    ap.add_argument("--replay-anchors", type=int, default=64)
    ap.add_argument("--anchor-dtype", default="float8_e4m3fn", choices=["model", "bfloat16", "float8_e4m3fn"])
    ap.add_argument("--sglang-interval", type=int, default=8192)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--rate", type=float, default=1.0, help="conversation arrivals a second (Poisson)")
    ap.add_argument("--systems", type=int, default=4, help="shared system prompts")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--turns", type=pair, default=(4, 16), help="LO,HI turns of a conversation")
    ap.add_argument("--user-tokens", type=pair, default=(32, 128), help="LO,HI tokens of a user message")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--branch-prob", type=float, default=0.2, help="a turn continues an earlier turn than the last")
    ap.add_argument("--think-s", type=float, default=0.5, help="mean wait before a follow-up turn (exponential)")
    ap.add_argument("--vocab", type=int, default=1000, help="token ids are drawn from [5, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--machine", default="", help="the result's machine field (default: cpu, or the GPU's name)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in args.policies if p not in POLICIES]
    if bad or not args.policies:
        ap.error(f"--policies: unknown {', '.join(bad) or args.policies!r}; known: {', '.join(POLICIES)}")
    if args.sglang_interval % 64 or args.sglang_interval <= 0:
        ap.error("--sglang-interval must be a positive multiple of 64 (the page)")
    if args.rate <= 0 or args.conversations <= 0 or args.systems <= 0:
        ap.error("--rate, --conversations and --systems must be positive")
    sl = _served_load()
    if args.model is None:
        from hybridcache.services.runtime.modelzoo import default_model_dir

        args.model = default_model_dir()
    trace = make_trace(args)
    policies = {p: prefix_policy(p, args) for p in args.policies}
    exact = prefix_policy("exact_replay", args)
    per_token = bytes_per_token(args.model, args.dtype, dict(policies, exact_replay=exact))
    unique = sum(len(s) for s in trace.systems) + sum(
        len(t.user) + args.output_tokens for c in trace.conversations for t in c.turns)
    budget = args.prefix_cache_bytes or int(unique * per_token["exact_replay"]["total"] / 4)
    from hybridcache.services.launcher import free_port

    machine = args.machine or ("cpu" if args.device == "cpu" else gpu_name())
    commit = os.environ.get("HYBRIDCACHE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    results, sent_of = {}, {}

    def record() -> dict:
        # the SGLang bound from the trace as SGLang's peer (else the grid, else the first run) sent it
        ref = sent_of.get("sglang_peer") or sent_of.get("sglang_grid") or next(iter(sent_of.values()), [])
        sglang_end = sglang_request_end_hits(ref, args.sglang_interval)
        return {
            "benchmark": "multiturn", "machine": machine, "gpu": machine if args.device == "cuda" else "none (CPU)",
            "commit": commit or "unknown",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": platform.node(), "cpus": os.cpu_count(),
            "command": "python benchmarks/" + shlex.join([Path(__file__).name,
                                                          *(argv if argv is not None else sys.argv[1:])]),
            "model": str(args.model), "device": args.device, "dtype": args.dtype, "up_args": args.up_args,
            "trace": {"conversations": len(trace.conversations), "requests": trace.requests, "rate": args.rate,
                      "systems": args.systems, "system_tokens": args.system_tokens, "turns": list(args.turns),
                      "user_tokens": list(args.user_tokens), "output_tokens": args.output_tokens,
                      "branch_prob": args.branch_prob, "think_s": args.think_s, "seed": args.seed,
                      "branched_turns": sum(t.parent is not None and t.parent != i - 1
                                            for c in trace.conversations for i, t in enumerate(c.turns)),
                      "unique_tokens": unique},
            "prefix_cache_bytes": budget,
            "bytes_per_token": {p: per_token[p] for p in ("attention_kv", "dense_state", *args.policies)},
            "policies": {p: policy_flags(pol) for p, pol in policies.items()},
            "sglang_interval": args.sglang_interval,
            "sglang_request_end_states_upper_bound": sglang_end,
            "results": results,
            "figures": figures_of(results, sglang_end),
            "note": "client TTFT from sending a streamed /generate to its first token; prefix hit tokens are the "
                    "server's prefix_reused_tokens (where the page tree resumed the request); every policy ran the "
                    "same trace (same arrivals, prompts built from each server's own answers) on its own server "
                    "with the same page-tree budget; capacity_tokens is the budget over a policy's bytes per token, "
                    "which for sglang_peer leaves out its request-end states (dense_state bytes each)",
        }

    for policy in args.policies:
        up = f"{args.up_args} --mode prefix --prefix-cache-bytes {budget} {shlex.join(policy_flags(policies[policy]))}"
        try:
            stack = sl.Stack(SimpleNamespace(port=free_port(), model=args.model, device=args.device,
                                             dtype=args.dtype, up_args=up), None)
        except SystemExit as e:  # a server that did not start: the other policies still run
            results[policy] = {"error": str(e)}
            print(f"multiturn: {policy}: {e}", file=sys.stderr, flush=True)
            continue
        try:
            host, port = stack.url.removeprefix("http://").rstrip("/").split(":")
            # a short conversation of other tokens first (a cold turn, a continuation, a branch), one
            # request at a time: compilation and first-use costs stay out of the measured trace
            warm = make_trace(SimpleNamespace(**dict(vars(args), conversations=1, turns=(3, 3), branch_prob=1.0,
                                                     think_s=0.0, systems=1)), seed=args.seed + 10_000)
            run_trace(host, int(port), warm, args)
            sent, wall = run_trace(host, int(port), trace, args)
        finally:
            stack.stop()
        results[policy] = summarize(sent, wall, sl.percentiles)
        results[policy]["capacity_tokens"] = int(budget // per_token[policy]["total"])
        sent_of[policy] = sent
        print(f"multiturn: {policy}: p50 TTFT {results[policy]['ttft_ms'].get('p50')} ms, hit fraction "
              f"{results[policy]['prefix_hit_fraction']}, {results[policy]['failed']} failed",
              file=sys.stderr, flush=True)
        if args.out:  # a run cut short still leaves the policies it finished
            args.out.write_text(json.dumps(record(), indent=2) + "\n")
    out = record()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
