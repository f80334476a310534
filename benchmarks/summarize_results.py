"""Regenerate benchmarks/results/SUMMARY.md and summary.json from the result files.

    python benchmarks/summarize_results.py           # rewrite both
    python benchmarks/summarize_results.py --check   # exit 1 when either is stale

Each named figure (FIGURES) reads one value from every result file that has it; the summary
gives the latest (by the file's date, same-day runs by the order of their commits) with its GPU,
commit, date, command and file, and the figure's earlier values as its history. Result files
are never edited: a new run is a new file, and this script picks it up.
tests/benchmarks/test_results_summary.py fails while the summary is stale.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# Commits that produced result files, oldest first (git log order). Only breaks ties between
# runs recorded with a date but no time; a commit not listed counts as newer than all of these.
COMMIT_ORDER = (
    "3394602 240c47c a038784 5f18ea0 7c8a14a 1dcd78c cbdb179 da9ac71 3390a34 69e5cf2 4e990a9 "
    "2a1bbf3 0b4d660 51b4324 2d28369 c4c3635 538c710 99d6573 d1ca92f eeb5dd2 5f1c62e ed44f23 "
    "98a17af dc47e28 531ce67 3a94072 637f190 c825280 eca2999 ce133e5 8ce3ed3 b4864fe 1a4fcbb "
    "b6b2555 edf4464 bc9355e"
).split()


@dataclass(frozen=True)
class Figure:
    """One published figure: where it is read from and how it is shown."""

    name: str
    files: str  # glob over the result file names
    path: str  # dotted path inside the JSON
    unit: str = ""
    digits: int = 1
    scale: float = 1.0  # shown value = stored value * scale (e.g. 100 for a fraction in %)
    machine: str = ""  # overrides the file's gpu field (e.g. an eval that ran on CPU)
    goal: str = ""


FIGURES = (
    Figure("warm pic TTFT, 32 x 1k + 64, GPU-resident entries", "gpu_bench_h200*.json",
           "figures.pic_ttft_ms_32x1k_gpu_resident", "ms", 1),
    Figure("warm prefix TTFT, 32 x 1k + 64 (the peer)", "gpu_bench_h200*.json",
           "figures.ttft_ms_prefix_32x1k", "ms", 0),
    Figure("warm pic TTFT speed-up vs prefix, GPU-resident", "gpu_bench_h200*.json",
           "figures.pic_ttft_speedup_vs_prefix_32x1k_gpu_resident", "x", 1, goal=">= 20x"),
    Figure("warm pic TTFT, 32 x 1k + 64, host-tier entries", "gpu_bench_h200*.json",
           "figures.pic_ttft_ms_32x1k_host", "ms", 1),
    Figure("warm pic TTFT speed-up vs prefix, host tier", "gpu_bench_h200*.json",
           "figures.pic_ttft_speedup_vs_prefix_32x1k_host", "x", 1, goal=">= 8x"),
    Figure("cold prefill, 32k tokens", "gpu_bench_h200*.json", "figures.cold_prefill_ms_32k", "ms", 0),
    Figure("cold prefill vs transformers + fla, 32k", "gpu_bench_h200*.json",
           "figures.cold_prefill_speedup_vs_transformers_32k", "x", 2, goal=">= 1.1x"),
    Figure("cold prefill vs transformers + fla, 8k", "gpu_bench_h200*.json",
           "figures.cold_prefill_speedup_vs_transformers_8k", "x", 2),
    Figure("entry-construction overhead, 32k", "gpu_bench_h200*.json",
           "figures.construction_overhead_pct_32k", "%", 2, goal="<= 3 %"),
    Figure("entry-construction overhead, 8k", "gpu_bench_h200*.json",
           "figures.construction_overhead_pct_8k", "%", 2, goal="<= 3 %"),
    Figure("composition per segment (24 x 32 x 128^2, bf16 entries)", "gpu_bench_h200*.json",
           "figures.compose_us_per_segment", "us", 1, goal="<= 20 us"),
    Figure("decode, batch 1", "gpu_bench_h200*.json", "figures.decode_tokens_per_s_batch1", "tokens/s", 1),
    Figure("decode, batch 32", "gpu_bench_h200*.json", "figures.decode_tokens_per_s_batch32", "tokens/s", 0),
    Figure("entry size, Qwen3.5-9B, 1k-token segment, bf16 states", "gpu_bench_h200*.json",
           "figures.entry_mb_per_segment_32x1k_bf16_states", "MB", 1),
    Figure("cold TTFT speed-up, 1 -> 2 scatter workers (32 x 1k)", "segment_parallel_2xh200*.json",
           "figures.cold_ttft_speedup_2_workers_32k", "x", 2, goal=">= 1.85x"),
    Figure("LPT vs round robin, heavy-tailed segment lengths", "segment_parallel_2xh200*.json",
           "figures.lpt_vs_round_robin_speedup", "x", 2, goal=">= 1.4x"),
    Figure("NCCL send/recv between two GPUs of one host", "segment_parallel_2xh200*.json",
           "figures.nccl_transfer_GBps", "GB/s", 0),
    Figure("QPS under a 1 s p50 TTFT SLO, pic", "*qps_h200*.json",
           "figures.qps_at_slo_pic", "req/s", 2),
    Figure("QPS under the SLO, pic vs the better of prefix and full", "*qps_h200*.json",
           "figures.qps_at_slo_pic_vs_prefix", "x", 2, goal=">= 2x"),
    Figure("prefix cache, linear-state bytes per token, exact_replay", "prefix_cache_h200*.json",
           "figures.analytic_exact_replay_bytes_per_token", "B", 0),
    Figure("prefix cache, linear-state bytes per token, suffix_replay (bf16)", "prefix_cache_h200*.json",
           "figures.analytic_suffix_replay_bytes_per_token", "B", 0),
    Figure("prefix cache, linear-state bytes per token, dense checkpoint per page", "prefix_cache_h200*.json",
           "figures.analytic_dense_checkpoint_every_page_bytes_per_token", "B", 0),
    Figure("prefix cache, state restore after 32k tokens, exact_replay", "prefix_cache_h200*.json",
           "figures.exact_replay_state_ms_32768", "ms", 0),
    Figure("prefix cache, re-prefill of the same 32k tokens", "prefix_cache_h200*.json",
           "figures.reprefill_ms_32704", "ms", 0),
    Figure("prefix cache, suffix_replay (r = 4, fp8) linear-state bytes vs SGLang's default grid (9B shape)",
           "prefix_cache_bytes_sglang_grid_cpu_*.json", "figures.suffix_replay_bytes_vs_sglang_grid", "x", 3,
           goal="<= 0.36"),
    Figure("multi-turn exact match, suffix_replay (k = 64, fp8) vs full recompute (shipped model)",
           "eval_multiturn_cpu_*.json", "figures.suffix_replay_em_vs_full_multiturn", "x", 3, goal=">= 0.99"),
    Figure("the same run: suffix_replay's restored linear state, relative error against the exact state",
           "eval_multiturn_cpu_*.json", "figures.suffix_replay_linear_state_rel_err_multiturn", "", 3),
    Figure("served multi-turn p50 TTFT at one page-tree budget, suffix_replay vs SGLang's peer (the checkpoint "
           "policy on its 8,192-token grid with every finished request's end state; CPU, shipped model)",
           "multiturn_cpu_*.json", "figures.multiturn_ttft_p50_suffix_replay_vs_sglang_peer", "x", 3, goal="<= 0.67"),
    Figure("the same run: suffix_replay vs that grid alone (no request-end states)", "multiturn_cpu_*.json",
           "figures.multiturn_ttft_p50_suffix_replay_vs_sglang_bare_grid", "x", 3),
    Figure("served multi-turn p50 TTFT, suffix_replay vs SGLang's peer, on a GPU (9B shape, bf16, CUDA graphs "
           "as served)", "multiturn_h100_*.json", "figures.multiturn_ttft_p50_suffix_replay_vs_sglang_peer", "x", 3,
           goal="<= 0.67"),
    Figure("the same GPU run: suffix_replay vs that grid alone", "multiturn_h100_*.json",
           "figures.multiturn_ttft_p50_suffix_replay_vs_sglang_bare_grid", "x", 3),
    Figure("QA 1-hop exact match (200 test questions), full", "train_qa_fla_h200_long_memory_*.json",
           "eval_1hop_200_call1.full.accuracy", "%", 1, 100.0, "CPU (eval of models/default)"),
    Figure("QA 1-hop exact match, pic (w = 8)", "train_qa_fla_h200_long_memory_*.json",
           "eval_1hop_200_call1.pic.accuracy", "%", 1, 100.0, "CPU (eval of models/default)"),
    Figure("QA 1-hop exact match, naive (T dropped)", "train_qa_fla_h200_long_memory_*.json",
           "eval_1hop_200_call1.naive.accuracy", "%", 1, 100.0, "CPU (eval of models/default)"),
    Figure("QA 2-hop exact match (200 test questions), full", "eval_2hop_cpu_*.json",
           "results.full.accuracy", "%", 1, 100.0),
    Figure("QA 2-hop exact match, pic", "eval_2hop_cpu_*.json", "results.pic.accuracy", "%", 1, 100.0),
    Figure("QA 2-hop exact match, naive", "eval_2hop_cpu_*.json", "results.naive.accuracy", "%", 1, 100.0),
    Figure("entry Get over gRPC on loopback (CPU, 56 MiB entry)", "transport_loopback_cpu_*.json",
           "figures.get_grpc_gb_s", "GB/s", 2),
    Figure("entry Get through shared memory (CPU, 56 MiB entry)", "transport_loopback_cpu_*.json",
           "figures.get_shm_gb_s", "GB/s", 2),
    Figure("prompt tokens cached when a LangChain stuff chain's 8 documents come back reordered (CPU, shipped model)",
           "rag_reuse_cpu_*.json", "reordered.cached_fraction", "%", 1, 100.0, "CPU", goal=">= 90 %"),
    Figure("served requests/s, 16 concurrent streams vs one at a time (CPU, shipped model)",
           "served_load_cpu_*.json", "figures.requests_per_s_16_streams_vs_1", "x", 2, goal=">= 4x"),
    Figure("router CPU per streamed token, multiplexed token streams (CPU, shipped model, 64 streams)",
           "token_stream_cpu_*.json", "figures.router_cpu_us_per_token_multiplexed", "µs", 1),
    Figure("the same, vs one stream per request (same machine, back to back)", "token_stream_cpu_*.json",
           "figures.router_cpu_per_token_multiplexed_vs_per_request", "x", 3),
    Figure("served tokens/s at 64 streams, multiplexed vs per-request token streams (CPU, shipped model)",
           "token_stream_cpu_*.json", "figures.decode_tokens_per_s_multiplexed_vs_per_request", "x", 3),
    Figure("served output tokens/s, 32 streams of 256 tokens vs 1 (Qwen3.5-9B shape, bf16)",
           "served_load_h200*.json", "figures.decode_tokens_per_s_32_streams_vs_1", "x", 1, goal=">= 15x"),
    Figure("served p50 inter-token latency, 32 streams vs 1", "served_load_h200*.json",
           "figures.itl_p50_32_streams_vs_1", "x", 2, goal="<= 2x"),
    Figure("served QPS at a 1 s p50 TTFT SLO, RAG trace (64 x 1k docs, 4-32 a request), pic",
           "served_load_rag_h200*.json", "figures.served_qps_at_slo_pic", "requests/s", 2),
    Figure("served QPS at the SLO, full (the peer)", "served_load_rag_h200*.json",
           "figures.served_qps_at_slo_full", "requests/s", 2),
    Figure("served QPS at the SLO, prefix (the peer; 0: met at no swept rate)", "served_load_rag_h200*.json",
           "figures.served_qps_at_slo_prefix", "requests/s", 2),
    Figure("served QPS at the SLO, pic vs full", "served_load_rag_h200*.json",
           "figures.served_qps_at_slo_pic_vs_full", "x", 1, goal=">= 2x"),
    Figure("served warm pic TTFT / in-process, 32 x 1k + 64 (9B shape; layers in the file)", "served_gpu_h200*.json",
           "figures.served_warm_ttft_vs_in_process", "x", 2, goal="<= 1.15"),
    Figure("served warm pic TTFT, 32 x 1k + 64 (client-measured)", "served_gpu_h200*.json",
           "figures.served_warm_pic_ttft_ms", "ms", 1),
    Figure("served warm pic TTFT speed-up vs a served prefix cache", "served_gpu_h200*.json",
           "figures.served_pic_ttft_speedup_vs_prefix_32x1k", "x", 1, goal=">= 15x"),
    Figure("served first cold pic TTFT / in-process full, same prompt", "served_gpu_h200*.json",
           "figures.cold_pic_ttft_vs_full_32x1k", "x", 2, goal="<= 1.2"),
    Figure("served cold pic TTFT with a scatter worker on the same GPU / without", "served_gpu_h200*.json",
           "figures.cold_pic_ttft_with_scatter_vs_without", "x", 2, goal="<= 1"),
    Figure("the same, median over every cold request of each stack (the first and new documents after)",
           "served_gpu_h200*.json", "figures.cold_pic_ttft_with_scatter_vs_without_median", "x", 2, goal="<= 1"),
    Figure("scatter -> combine entry bandwidth, two processes on one GPU (CUDA IPC)", "served_gpu_h200*.json",
           "figures.scatter_to_combine_gb_per_s", "GB/s", 2, goal=">= 50"),
    Figure("the same over the combine worker's host time receiving them", "served_gpu_h200*.json",
           "figures.scatter_to_combine_gb_per_s_host", "GB/s", 2),
    Figure("scatter -> combine through the CUDA IPC arena, two processes on one GPU (32 x 9B 8-layer entries)",
           "transport_loopback_cuda_ipc_h200*.json", "figures.scatter_to_combine_gb_per_s", "GB/s", 1, goal=">= 50"),
    Figure("the same on an H100, over the receiver's host time", "transport_loopback_cuda_ipc_h100*.json",
           "figures.scatter_to_combine_gb_per_s", "GB/s", 1, goal=">= 50"),
    Figure("the same on an H100, over the copies' GPU time", "transport_loopback_cuda_ipc_h100*.json",
           "figures.scatter_to_combine_link_gb_per_s", "GB/s", 1),
    Figure("receiver's host time a batched build over cuda_ipc, 32 entries x 32 layers (CPU, copies excluded)",
           "assembler_host_cpu_*.json", "figures.host_ms_per_request", "ms", 1),
    Figure("the same, the peer commit in the file / this (interleaved runs, same machine)", "assembler_host_cpu_*.json",
           "figures.host_time_peer_vs_this", "x", 2),
    Figure("TP 1 cold prefill, 32k tokens (Qwen3.5-9B shape, bf16; the TP 2 baseline)", "tensor_parallel_h200*.json",
           "figures.tp1_prefill_s_32k", "s", 2),
    Figure("TP 1 decode, 32 streams of 1k-token prompts", "tensor_parallel_h200*.json",
           "figures.tp1_decode_tokens_per_s_32_streams", "tokens/s", 0),
    Figure("MoE (Qwen3.5-35B-A3B shape, bf16) prefill vs transformers + fla, 8k", "moe_bench_*.json",
           "figures.moe_prefill_speedup_vs_peer_8k", "x", 2, goal=">= 1.1x"),
    Figure("MoE prefill vs transformers + fla, 32k", "moe_bench_*.json",
           "figures.moe_prefill_speedup_vs_peer_32k", "x", 2, goal=">= 1.1x"),
    Figure("MoE prefill, 32k tokens (ours)", "moe_bench_*.json", "figures.moe_prefill_ms_ours_32k", "ms", 0),
    Figure("MoE decode step at batch 1, fraction of the bandwidth floor", "moe_bench_*.json",
           "figures.moe_decode_fraction_of_floor_1", "", 3, goal=">= 0.6"),
    Figure("MoE decode step at batch 32, fraction of the bandwidth floor", "moe_bench_*.json",
           "figures.moe_decode_fraction_of_floor_32", "", 3, goal=">= 0.5"),
    Figure("MoE decode, batch 1 (graphed step)", "moe_bench_*.json", "figures.moe_decode_tokens_per_s_1",
           "tokens/s", 1),
    Figure("MoE decode, batch 32 (graphed step)", "moe_bench_*.json", "figures.moe_decode_tokens_per_s_32",
           "tokens/s", 0),
    Figure("one MoE block on 32 tokens, fastest expert path vs the per-expert loop", "moe_bench_*.json",
           "figures.moe_block_speedup_vs_loop_32", "x", 1),
    Figure("one MoE block at batch 1 (graphed, fastest path), fraction of its bandwidth floor", "moe_bench_*.json",
           "figures.moe_block_graph_fraction_of_floor_1", "", 3),
    Figure("MoE served warm pic TTFT speed-up vs a served prefix cache, 32 x 1k + 64 (35B-A3B shape, layers in the "
           "file)", "served_gpu_moe_*.json", "figures.moe_served_pic_ttft_speedup_vs_prefix_32x1k", "x", 1,
           goal=">= 15x"),
    Figure("MoE served cold pic TTFT / in-process full, same prompt (the median of the cold requests in the file)",
           "served_gpu_moe_*.json",
           "figures.moe_cold_pic_ttft_vs_full_32x1k", "x", 2, goal="<= 1"),
    Figure("served decode (HTTP, 9B shape, bf16), 1 stream, fraction of the bandwidth floor",
           "served_decode_h100_*.json",
           "figures.served_decode_fraction_of_floor_1_streams", "", 3, goal=">= 0.85"),
    Figure("served decode, 32 streams, fraction of the bandwidth floor", "served_decode_h100_*.json",
           "figures.served_decode_fraction_of_floor_32_streams", "", 3, goal=">= 0.75"),
    Figure("served decode, 128 streams, fraction of the bandwidth floor", "served_decode_h100_*.json",
           "figures.served_decode_fraction_of_floor_128_streams", "", 3, goal=">= 0.6"),
    Figure("served decode, 32 streams, sampled (T 0.8, top-p 0.95) / greedy tokens/s", "served_decode_h100_*.json",
           "figures.served_sampled_vs_greedy_tokens_per_s_32_streams", "", 3, goal=">= 0.95"),
    Figure("served decode on an H200, 1 stream, fraction of the bandwidth floor", "served_decode_h200_*.json",
           "figures.served_decode_fraction_of_floor_1_streams", "", 3, goal=">= 0.85"),
    Figure("served decode on an H200, 32 streams, fraction of the bandwidth floor", "served_decode_h200_*.json",
           "figures.served_decode_fraction_of_floor_32_streams", "", 3, goal=">= 0.75"),
    Figure("served decode on an H200, 128 streams, fraction of the bandwidth floor", "served_decode_h200_*.json",
           "figures.served_decode_fraction_of_floor_128_streams", "", 3, goal=">= 0.6"),
    Figure("warm pic TTFT, 32 documents of 200-4,000 tokens, unseen layouts / repeated layout",
           "served_pic_layouts_h*.json", "figures.warm_pic_ttft_unseen_layouts_vs_repeated", "", 3, goal="<= 1.2"),
    Figure("warm pic TTFT, 32 x 1k + 64, fraction of its floor", "served_pic_layouts_h*.json",
           "figures.warm_pic_ttft_fraction_of_floor_32x1k", "", 3, goal=">= 0.25"),
    Figure("32 streams' p99 inter-token gap during a 128k-token chunked prefill / their steady p50",
           "served_long_prompt_h*.json", "figures.itl_p99_during_long_prefill_vs_steady", "x", 1, goal="<= 3"),
    Figure("warm pic TTFT speed-up vs a served prefix cache, 64 x 2k + 64 (128k tokens, 9B shape)",
           "served_long_prompt_h*.json", "figures.warm_pic_ttft_speedup_vs_prefix_128k", "x", 1, goal=">= 30"),
    Figure("the same with whole chunks a step (--chunk-layer-parts 1)", "served_long_prompt_whole_chunks_h*.json",
           "figures.itl_p99_during_long_prefill_vs_steady", "x", 1),
    Figure("served decode, 128 streams, fraction of the floor, a gRPC token stream a request (the peer, same machine)",
           "served_decode_per_request_h100_*.json", "figures.served_decode_fraction_of_floor_128_streams", "", 3),
    Figure("served decode, 32 streams, fraction of the floor: this tree vs 0088f42 on the same machine (A/B)",
           "served_decode_ab_*.json", "figures.served_decode_fraction_of_floor_32_streams", "", 3),
    Figure("the same A/B, sampled / greedy tokens/s at 32 streams", "served_decode_ab_*.json",
           "figures.served_sampled_vs_greedy_tokens_per_s_32_streams", "", 3, goal=">= 0.95"),
)


@dataclass(frozen=True)
class Reading:
    value: float
    file: str
    gpu: str
    commit: str
    date: str
    command: str


def _lookup(data, path: str):
    for key in path.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data if isinstance(data, (int, float)) and not isinstance(data, bool) else None


def _commit(data: dict, file_name: str) -> str:
    """The short hash a run names first (its commit field, else its file name), or ''."""
    m = re.match(r"[0-9a-f]{7,40}", str(data.get("commit", "")))
    if m:
        return m.group()[:7]
    m = re.search(r"_([0-9a-f]{7})(?:_[a-z]+)?\.json$", file_name)
    return m.group(1) if m else ""


def _date(data: dict) -> str:
    """YYYY-MM-DD[ HH:MM] from the run's date field."""
    m = re.match(r"(\d{4}-\d{2}-\d{2})(?:[ T](\d{2}:\d{2}))?", str(data.get("date", "")))
    if not m:
        return ""
    return m.group(1) + (f" {m.group(2)}" if m.group(2) else "")


def _order(r: Reading) -> tuple:
    rank = COMMIT_ORDER.index(r.commit) if r.commit in COMMIT_ORDER else len(COMMIT_ORDER)
    day, _, time = r.date.partition(" ")
    return (day, rank, time, r.file)


def readings(fig: Figure, results: Path = RESULTS) -> list[Reading]:
    """Every recorded value of `fig`, oldest first."""
    out = []
    for p in sorted(results.glob("*.json")):
        if not fnmatch.fnmatch(p.name, fig.files):
            continue
        data = json.loads(p.read_text())
        if not isinstance(data, dict):
            continue
        value = _lookup(data, fig.path)
        if value is None:
            continue
        gpu = fig.machine or str(data.get("gpu") or data.get("machine") or data.get("device") or "")
        command = " ".join(str(data.get("command", "")).split())
        out.append(Reading(float(value), p.name, gpu, _commit(data, p.name), _date(data), command))
    return sorted(out, key=_order)


def _shown(fig: Figure, value: float) -> str:
    v = value * fig.scale
    text = f"{v:,.{fig.digits}f}"
    return f"{text} {fig.unit}" if fig.unit and fig.unit not in ("x", "%") else text + fig.unit.replace("%", " %")


def summary(results: Path = RESULTS) -> dict:
    figures = []
    for fig in FIGURES:
        rs = readings(fig, results)
        if not rs:
            raise SystemExit(f"summarize_results: no result file has {fig.name!r} ({fig.files}: {fig.path})")
        last = rs[-1]
        figures.append({
            "name": fig.name,
            "value": round(last.value * fig.scale, 6),
            "unit": fig.unit,
            "shown": _shown(fig, last.value),
            "goal": fig.goal,
            "gpu": last.gpu,
            "commit": last.commit,
            "date": last.date,
            "file": last.file,
            "command": last.command,
            "history": [{"shown": _shown(fig, r.value), "commit": r.commit, "date": r.date, "file": r.file}
                        for r in rs],
        })
    return {"generated_by": "python benchmarks/summarize_results.py", "figures": figures}


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def markdown(s: dict) -> str:
    lines = [
        "# Benchmark results: the latest value of each figure",
        "",
        "Generated by `python benchmarks/summarize_results.py` from the result files in this folder",
        "(do not edit; tests/benchmarks/test_results_summary.py fails while it is stale). How each figure",
        "is measured, and its caveats: docs/performance.md. Every run's full output is its result file.",
        "",
        "| figure | latest | goal | GPU | commit | date | result file |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in s["figures"]:
        lines.append(f"| {_cell(f['name'])} | **{f['shown']}** | {_cell(f['goal'])} | {_cell(f['gpu'])} | "
                     f"{f['commit']} | {f['date']} | [{f['file']}]({f['file']}) |")
    lines += ["", "## Commands", "", "| figure | command of its latest run |", "|---|---|"]
    for f in s["figures"]:
        lines.append(f"| {_cell(f['name'])} | `{_cell(f['command'])}` |")
    lines += ["", "## History", "", "Every recorded value, oldest first (value at commit, date).", ""]
    for f in s["figures"]:
        hist = "; ".join(f"{h['shown']} at {h['commit'] or '?'} ({h['date']})" for h in f["history"])
        lines.append(f"- {f['name']}: {hist}")
    return "\n".join(lines) + "\n"


def outputs(results: Path = RESULTS) -> dict[Path, str]:
    s = summary(results)
    return {results / "summary.json": json.dumps(s, indent=1) + "\n", results / "SUMMARY.md": markdown(s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when SUMMARY.md or summary.json is stale")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of result files")
    args = ap.parse_args(argv)
    files = outputs(args.results)
    if args.check:
        stale = [p.name for p, text in files.items() if not p.is_file() or p.read_text() != text]
        if stale:
            print(f"stale: {', '.join(stale)}; run python benchmarks/summarize_results.py")
            return 1
        return 0
    for p, text in files.items():
        p.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
