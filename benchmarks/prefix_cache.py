"""Prefix page tree: linear-state bytes per token of each policy against a dense checkpoint per
page, restore time against re-prefill, and fidelity (linear-state error, next-token agreement).

Random weights on a real shape, built directly on the device (no checkpoint is written):

    python benchmarks/prefix_cache.py --preset qwen3.5-9b --device cuda --dtype bfloat16 \
        --lengths 8192 32768 --out benchmarks/results/prefix_cache_h200.json
    python benchmarks/prefix_cache.py --preset tiny --lengths 512 1024       # CPU smoke run
    python benchmarks/prefix_cache.py --preset qwen3.5-9b --dtype bfloat16 --anchor-dtype float8_e4m3fn \
        --bytes-only                                                        # bytes only, no GPU

--anchor-dtype float8_e4m3fn stores suffix_replay's anchors in fp8 with a per-anchor fp32 scale.
--bytes-only computes each policy's linear-state bytes per token from the shape alone (the model
is built on the meta device, so a 9B shape needs no memory), against (a) a dense checkpoint every
64-token page and (b) SGLang's default grid (a dense state every --sglang-interval tokens: its
mamba radix cache, with the default no_buffer strategy, keeps a state where chunked prefill
ends a chunk, chunked_prefill_size 8,192 on H100/H200 — besides one at the end of every finished
request, which no grid models), and as the checkpoint policy at that interval; then checks each
figure against what an engine on the tiny preset (CPU, same dtype) keeps in its page tree.

Each prompt of L tokens is prefilled once per policy (pages inserted); then the state after
H = L - 64 tokens (one page before a checkpoint-grid position) is rebuilt from the tree and
compared, in time and values, with a re-prefill of those H tokens.

Prints one JSON object (gpu, commit, date, command, config, per-length rows and a flat
`figures` object) and writes it to --out when given.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.cache import POLICIES, PrefixPolicy, linear_state_bytes_per_token, restore_state
from hybridcache.services.runtime.cache.policies import ANCHOR_DTYPES
from hybridcache.services.runtime.config import ModelConfig
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.modelzoo import hf_config
from hybridcache.services.runtime.sequence import LiveRun
from hybridcache.services.runtime.tokenizer import Tokenizer, build_byte_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.no_grad()
def init_on_device_(model: HybridLM, seed: int, std: float = 0.02) -> None:
    """modelzoo.random_init_'s distributions, drawn on the model's device (fast for big shapes)."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.uniform_(math.log(1e-3), math.log(4.0))
        elif name.endswith("dt_bias"):
            p.uniform_(-1.0, 1.0)
        elif name.endswith("linear_attn.norm.weight"):
            p.normal_(1.0, 0.1)
        elif "norm" in name.split(".")[-2]:
            p.normal_(0.0, 0.1)
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
        else:
            p.normal_(0.0, std)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int):
    """Median wall time in ms of fn() (after one warm-up call) and its last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), out


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def dense_state_bytes(model: HybridLM) -> int:
    st = model.empty_state()
    return sum(t.numel() * t.element_size() for s in st.linear.values() for t in (s.ssm, s.conv))


def build_model(cfg: ModelConfig, dtype, device) -> HybridLM:
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return HybridLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)


def analytic_bytes_per_token(model: HybridLM, policies: dict[str, PrefixPolicy], page: int,
                             sglang_interval: int = 8192) -> dict:
    """Linear-state bytes per cached token of each policy, of a dense checkpoint after every page
    and of one every `sglang_interval` tokens, from the model's state shapes alone (works on a
    meta-device model)."""
    dense = dense_state_bytes(model)
    groups = len(model.linear_groups())
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    hidden = model.cfg.hidden_size
    out = {"dense_checkpoint_every_page": dense / page, "dense_checkpoint_sglang_grid": dense / sglang_interval}
    # every policy also keeps the attention layers' K and V of each cached token
    cfg = model.cfg
    out["attention_kv"] = (sum(t == "full_attention" for t in cfg.layer_types) * 2 * cfg.num_key_value_heads
                           * cfg.head_dim * itemsize)
    for name, pol in policies.items():
        out[name] = linear_state_bytes_per_token(pol, dense, groups * pol.anchor_row_bytes(hidden, itemsize))
    return out


def measured_bytes_per_token(model, tokenizer, policy: PrefixPolicy, length: int) -> tuple[float, float, float]:
    """(page tree linear bytes, a warm request's linear_state_bytes stat, page tree bytes with the
    attention K/V) per token after one prompt of `length` tokens (a multiple of the checkpoint
    grid) went through an engine."""
    eng = Engine(model, tokenizer, EngineConfig(
        mode="prefix", prefix_policy=policy.name, checkpoint_every=policy.checkpoint_every,
        anchors_per_page=policy.anchors_per_page, replay_anchors=policy.replay_anchors,
        anchor_dtype=policy.anchor_dtype, prefix_cache_bytes=1 << 40))
    ids = torch.randint(0, min(model.cfg.vocab_size, 256), (length,), generator=torch.Generator().manual_seed(0))
    req = {"suffix": ids.tolist() + [1], "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}
    with LLM(eng) as llm:
        llm.generate(req)
        stat = llm.generate(req).stats.linear_state_bytes
    return eng.pages.linear_bytes / length, stat / length, eng.pages.used_bytes / length


def continuation_agreement(model, ref_state, got_state, cont_ids) -> tuple[float, float]:
    """Greedy next-token agreement and max relative logit error over a teacher-forced continuation."""
    run = [LiveRun(cont_ids, ref_state.length)]
    ref_logits, _ = model.forward_layout(ref_state.clone(), run, "all")
    got_logits, _ = model.forward_layout(got_state.clone(), run, "all")
    agree = (ref_logits.argmax(-1) == got_logits.argmax(-1)).float().mean().item()
    return agree, rel(got_logits, ref_logits)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip()
    except OSError:
        return "unknown"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_5_text")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES),
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512])
    ap.add_argument("--checkpoint-every", type=int, default=4)
    ap.add_argument("--anchors-per-page", type=int, default=4)
    ap.add_argument("--replay-anchors", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--anchor-dtype", default="model", choices=["model", *ANCHOR_DTYPES],
                    help="suffix_replay anchor storage (model: the model's dtype)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--sglang-interval", type=int, default=8192,
                    help="tokens between SGLang's default dense states (its chunked_prefill_size on H100/H200)")
    ap.add_argument("--bytes-only", action="store_true",
                    help="analytic bytes per token for --preset, checked against an engine on the tiny preset (CPU)")
    ap.add_argument("--continuation", type=int, default=32, help="tokens teacher-forced after the prefix")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = ap.parse_args(argv)
    if args.bytes_only:
        args.device = "cpu"
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    anchor_dtype = None if args.anchor_dtype == "model" else args.anchor_dtype

    cfg = ModelConfig.from_dict(hf_config(args.arch, args.preset))
    model = build_model(cfg, dtype, "meta" if args.bytes_only else device)
    tokenizer = Tokenizer(build_byte_tokenizer())
    P = 64
    groups = model.linear_groups()
    all_policies = {
        "checkpoint": PrefixPolicy("checkpoint", checkpoint_every=args.checkpoint_every),
        "suffix_replay": PrefixPolicy("suffix_replay", anchors_per_page=args.anchors_per_page,
                                      replay_anchors=args.replay_anchors[0], anchor_dtype=anchor_dtype),
        "exact_replay": PrefixPolicy("exact_replay", checkpoint_every=args.checkpoint_every),
    }
    policies = {n: p for n, p in all_policies.items() if n in args.policies}
    if args.bytes_only and anchor_dtype and "suffix_replay" in policies:
        # The same policy with anchors in the model's dtype, for comparison.
        policies["suffix_replay_model_anchors"] = dataclasses.replace(policies["suffix_replay"], anchor_dtype=None)
    if args.bytes_only and "checkpoint" in policies:
        if args.sglang_interval % P:
            raise SystemExit(f"--sglang-interval must be a multiple of {P}")
        # the checkpoint policy on SGLang's grid: what the engine keeps for it
        policies["checkpoint_sglang_grid"] = PrefixPolicy("checkpoint", checkpoint_every=args.sglang_interval // P)
    analytic = analytic_bytes_per_token(model, policies, P, args.sglang_interval)
    dense_per_page = analytic["dense_checkpoint_every_page"]
    result = {
        "benchmark": "prefix_cache",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (cpu)",
        "commit": args.commit or git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "config": {
            "arch": args.arch, "preset": args.preset, "dtype": str(dtype).removeprefix("torch."),
            "linear_layers": sum(map(len, groups)), "linear_groups": len(groups), "hidden": cfg.hidden_size,
            "page_tokens": P, "checkpoint_every": args.checkpoint_every,
            "anchors_per_page": args.anchors_per_page,
            "replay_anchors": args.replay_anchors,
            "anchor_dtype": args.anchor_dtype,
            "sglang_interval": args.sglang_interval,
            "fla_kernels": device.type == "cuda" and backends.fla_available(),
        },
        "analytic_bytes_per_token": analytic,
        "rows": [],
    }
    if args.bytes_only:
        return _bytes_only(args, result, policies, dtype, tokenizer)
    init_on_device_(model, args.seed)
    model.eval()
    gen = torch.Generator().manual_seed(args.seed)
    for L in args.lengths:
        if L % (P * args.checkpoint_every):
            grid = P * args.checkpoint_every
            raise SystemExit(f"--lengths must be multiples of {grid} (the checkpoint grid): {L}")
        # The hit lands one page before a checkpoint-grid position: the case where the policies
        # differ (checkpoint falls back N - 1 pages and recomputes them; exact_replay replays them).
        H = L - P
        ids = torch.randint(0, min(cfg.vocab_size, 256), (L + args.continuation,), generator=gen)
        cont = ids[H : H + args.continuation].to(device)
        prefill_ms, ref = timed(lambda ids=ids, H=H: _prefill(model, ids[:H]), device, args.repeats)
        row = {"prompt_tokens": L, "hit_point_tokens": H, "reprefill_ms": prefill_ms, "policies": {}}
        for name, policy in policies.items():
            eng = Engine(model, tokenizer, EngineConfig(
                mode="prefix", prefix_policy=name, checkpoint_every=policy.checkpoint_every,
                anchors_per_page=policy.anchors_per_page, replay_anchors=policy.replay_anchors,
                anchor_dtype=policy.anchor_dtype, prefix_cache_bytes=1 << 40))
            prompt = ids[:L].tolist() + [1]
            req = eng.parse_request({"suffix": prompt, "sampling_params": {"max_new_tokens": 1}})
            sync(device)
            t0 = time.perf_counter()
            pre = eng.prefill(req)
            sync(device)
            insert_ms = (time.perf_counter() - t0) * 1000
            eng.finish_prefix(pre)
            bytes_per_token = eng.pages.linear_bytes / L
            path = eng.pages.match(ids[:H].tolist(), policy.usable)
            hit = len(path) * P
            r = args.anchors_per_page
            variants = [policy] if name != "suffix_replay" else [
                PrefixPolicy(name, anchors_per_page=r, replay_anchors=k, anchor_dtype=anchor_dtype)
                for k in args.replay_anchors
            ]
            for pol in variants:
                def state_at_hit(pol=pol, path=path, ids=ids, H=H):
                    return _state_at(model, pol, path, ids, H)

                restore_ms, got = timed(state_at_hit, device, args.repeats)
                errs = [rel(got.linear[i].ssm, ref.linear[i].ssm) for i in ref.linear]
                agree, logit_err = continuation_agreement(model, ref, got, cont)
                key = name if name != "suffix_replay" else f"{name}{_dtype_tag(pol)}_k{pol.replay_anchors}"
                row["policies"][key] = {
                    "linear_bytes_per_token": bytes_per_token,
                    "vs_dense_checkpoint_per_page": bytes_per_token / dense_per_page,
                    "hit_tokens": hit,
                    "recomputed_tokens": H - hit,
                    "state_ms": restore_ms,
                    "state_vs_reprefill": restore_ms / prefill_ms,
                    "prefill_with_insert_ms": insert_ms,
                    "linear_state_rel_err_max": max(errs),
                    "linear_state_rel_err_mean": sum(errs) / len(errs),
                    "next_token_agreement": agree,
                    "continuation_logits_rel_err": logit_err,
                }
            del eng, pre
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["rows"].append(row)
        if args.out:  # a run cut short still leaves the lengths it finished
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    figures = _analytic_figures(result, policies)
    for row in result["rows"]:
        L = row["prompt_tokens"]
        figures[f"reprefill_ms_{row['hit_point_tokens']}"] = row["reprefill_ms"]
        for key, r in row["policies"].items():
            for f in ("linear_bytes_per_token", "vs_dense_checkpoint_per_page", "state_ms",
                      "state_vs_reprefill", "linear_state_rel_err_max", "next_token_agreement",
                      "recomputed_tokens"):
                figures[f"{key}_{f}_{L}"] = r[f]
    return _finish(args, result, figures)


def _finish(args, result: dict, figures: dict) -> dict:
    result["figures"] = figures
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


def _dtype_tag(policy: PrefixPolicy) -> str:
    return {"float8_e4m3fn": "_fp8", "bfloat16": "_bf16"}.get(policy.anchor_dtype, "")


def _analytic_figures(result: dict, policies: dict[str, PrefixPolicy]) -> dict:
    """Flat figures: each policy's analytic bytes per token and its fraction of a dense
    checkpoint per page (also as 1 / x) and of SGLang's default grid; the named
    `suffix_replay_bytes_vs_sglang_grid` (suffix_replay as configured, anchors at the end of every
    64-token page: 8192 / 64 = 128x finer hits than the grid)."""
    analytic = result["analytic_bytes_per_token"]
    dense = analytic["dense_checkpoint_every_page"]
    grid = analytic["dense_checkpoint_sglang_grid"]
    figures = {"analytic_dense_checkpoint_every_page_bytes_per_token": dense,
               "analytic_sglang_grid_bytes_per_token": grid,
               "analytic_attention_kv_bytes_per_token": analytic["attention_kv"]}
    for name, pol in policies.items():
        key = f"analytic_{name}{_dtype_tag(pol)}"
        figures[f"{key}_bytes_per_token"] = analytic[name]
        figures[f"{key}_vs_dense_checkpoint_per_page"] = analytic[name] / dense
        figures[f"{key}_dense_checkpoint_per_page_over_it"] = dense / analytic[name]
        figures[f"{key}_vs_sglang_grid"] = analytic[name] / grid
    if "suffix_replay" in analytic:
        figures["suffix_replay_bytes_vs_sglang_grid"] = analytic["suffix_replay"] / grid
        figures["suffix_replay_granularity_vs_sglang_grid"] = result["config"]["sglang_interval"] / 64
    return figures


def _bytes_only(args, result: dict, policies: dict[str, PrefixPolicy], dtype, tokenizer) -> dict:
    """Analytic figures for --preset, and the same formula checked against the bytes an engine on
    the tiny preset keeps (CPU, --dtype, prompts of one checkpoint grid per length)."""
    result["benchmark"] = "prefix_cache_bytes"
    figures = _analytic_figures(result, policies)
    # room for a prompt of SGLang's grid (the tiny preset's context is 4k)
    tiny_dict = hf_config(args.arch, "tiny")
    tiny_dict["max_position_embeddings"] = max(tiny_dict.get("max_position_embeddings", 0), 2 * args.sglang_interval)
    tiny_cfg = ModelConfig.from_dict(tiny_dict)
    tiny = build_model(tiny_cfg, dtype, "cpu")
    init_on_device_(tiny, args.seed)
    tiny.eval()
    tiny_analytic = analytic_bytes_per_token(tiny, policies, 64, args.sglang_interval)
    check = {"preset": "tiny", "rows": []}
    for L in args.lengths:
        grid = 64 * args.checkpoint_every
        if L % grid:
            raise SystemExit(f"--lengths must be multiples of {grid} (the checkpoint grid): {L}")
        for name, pol in policies.items():
            if pol.stores_checkpoints and L % pol.checkpoint_tokens:
                continue  # a coarser grid (SGLang's) is checked at its own length below
            tree, stat, total = measured_bytes_per_token(tiny, tokenizer, pol, L)
            key = f"tiny_{name}{_dtype_tag(pol)}"
            equal = tree == stat == tiny_analytic[name] and total == tree + tiny_analytic["attention_kv"]
            check["rows"].append({"policy": name, "anchor_dtype": pol.anchor_dtype, "prompt_tokens": L,
                                  "analytic": tiny_analytic[name], "page_tree": tree,
                                  "linear_state_bytes_stat": stat, "page_tree_with_attention": total,
                                  "analytic_with_attention": tiny_analytic[name] + tiny_analytic["attention_kv"],
                                  "equal": equal})
            figures[f"{key}_measured_bytes_per_token_{L}"] = stat
            figures[f"{key}_analytic_bytes_per_token"] = tiny_analytic[name]
            figures[f"{key}_measured_equals_analytic_{L}"] = equal
    coarse = {n: p for n, p in policies.items() if p.stores_checkpoints
              and not any(L % p.checkpoint_tokens == 0 for L in args.lengths)}
    for name, pol in coarse.items():
        L = pol.checkpoint_tokens
        tree, stat, total = measured_bytes_per_token(tiny, tokenizer, pol, L)
        equal = tree == stat == tiny_analytic[name] and total == tree + tiny_analytic["attention_kv"]
        check["rows"].append({"policy": name, "anchor_dtype": None, "prompt_tokens": L,
                              "analytic": tiny_analytic[name], "page_tree": tree,
                              "linear_state_bytes_stat": stat, "page_tree_with_attention": total,
                              "analytic_with_attention": tiny_analytic[name] + tiny_analytic["attention_kv"],
                              "equal": equal})
        figures[f"tiny_{name}_measured_bytes_per_token_{L}"] = stat
        figures[f"tiny_{name}_analytic_bytes_per_token"] = tiny_analytic[name]
        figures[f"tiny_{name}_measured_equals_analytic_{L}"] = equal
    result["engine_check"] = check
    result["figures"] = figures
    if not all(r["equal"] for r in check["rows"]):
        _finish(args, result, figures)
        raise SystemExit("measured linear-state bytes differ from the analytic figure (see engine_check)")
    return _finish(args, result, figures)


@torch.no_grad()
def _state_at(model, policy, path, ids, H):
    """The state after H tokens from a hit on `path`: restore, then run what the hit misses live."""
    state = restore_state(model, policy, path) if path else model.empty_state()
    if state.length < H:
        model.forward_layout(state, [LiveRun(ids[state.length : H], state.length)], "none")
    return state


@torch.no_grad()
def _prefill(model, ids):
    state = model.empty_state()
    model.forward_layout(state, [LiveRun(ids, 0)], "none")
    return state


if __name__ == "__main__":
    main()
