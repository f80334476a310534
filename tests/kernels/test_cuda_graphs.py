"""CUDA graphs of the live pass (services/runtime/graphs.py, a ModelRunner's) on a GPU: every replay
against the eager forward on the same request, for requests of one shape with other tokens and
entries."""

import contextlib

import pytest
import torch
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime.cache import SegmentEntry
from hybridcache.services.runtime.cache.host_tier import stage, to_host
from hybridcache.services.runtime.config import ModelConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.modelzoo import hf_config, random_init_
from hybridcache.services.runtime.runner import ModelRunner
from hybridcache.services.runtime.sequence import CachedSpan, LiveRun

pytestmark = pytest.mark.gpu
SEAM = 8


def cuda_model(dtype):
    cfg = ModelConfig.from_dict(hf_config("qwen3_5_text", "tiny"))
    model = HybridLM(cfg).eval()
    random_init_(model, seed=1, std=0.08)
    model = model.to("cuda", dtype)
    model.merge_projections()
    return model


def request(model, seed, lengths=(150, 203, 97, 150), question=16):
    gen = torch.Generator().manual_seed(seed)
    segs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in lengths]
    q = torch.randint(0, model.cfg.vocab_size, (question,), generator=gen)
    datas = []
    for seg in segs:
        _, rec = model.forward_layout(
            model.empty_state(), [LiveRun(seg[:SEAM], 0), LiveRun(seg[SEAM:], SEAM, record="entry")], "none"
        )
        datas.append(rec.entries[1])
    return segs, datas, q


def pic_layout(segs, datas, question):
    layout, pos = [], 0
    for seg, data in zip(segs, datas):
        layout += [LiveRun(seg[:SEAM], pos), CachedSpan(data, pos + SEAM)]
        pos += seg.numel()
    return layout + [LiveRun(question, pos)]


def run(runner, layout, graphs: bool, **kw):
    state = runner.empty_state()
    with contextlib.nullcontext() if graphs else runner.eager():
        logits, rec = runner.forward(state, layout, "last", **kw)
    torch.cuda.synchronize()
    return logits, state, rec


def gap(a, b):
    return (a.float() - b.float()).abs().max().item()


def assert_close_states(a, b, tol):
    for i in b.linear:
        assert gap(a.linear[i].ssm, b.linear[i].ssm) <= tol * (1 + b.linear[i].ssm.abs().max().item()), i
        assert gap(a.linear[i].conv, b.linear[i].conv) <= tol * (1 + b.linear[i].conv.abs().max().item()), i
    for i in b.attn:
        assert a.attn[i].k.shape == b.attn[i].k.shape
        assert gap(a.attn[i].k, b.attn[i].k) <= tol * (1 + b.attn[i].k.abs().max().item()), i
        assert gap(a.attn[i].v, b.attn[i].v) <= tol * (1 + b.attn[i].v.abs().max().item()), i


def test_replays_of_a_shape_match_the_eager_forward():
    """bf16, the served dtype (fp32 adds minutes of fla compilation; the CPU tests cover the logic)."""
    model = cuda_model(torch.bfloat16)
    runner = ModelRunner(model, RuntimeConfig())
    graphs = runner.layout_graphs
    assert graphs is not None
    kept = []
    for seed in (1, 2, 3, 4):  # eager, capture (answered eagerly), replay, replay
        segs, datas, q = request(model, seed)
        ref_logits, ref_state, _ = run(runner, pic_layout(segs, datas, q), graphs=False)
        logits, state, _ = run(runner, pic_layout(segs, datas, q), graphs=True)
        # the same kernels on the same inputs
        assert gap(logits, ref_logits) <= 1e-3 * (1 + ref_logits.abs().max().item())
        assert_close_states(state, ref_state, 1e-3)
        kept.append((logits.clone(), logits, state.linear[0].ssm.clone(), state.linear[0].ssm))
    assert graphs.stats["captures"] == 1 and graphs.stats["replays"] == 2, (graphs.stats, graphs.failed)
    assert not graphs.failed
    # span T and S reach the fold through its address tables: bound by rewriting them, not copied
    assert all(static.patched for static in graphs._graphs.values())
    # a request's logits and state are its own: later replays do not write them
    for copy, live, ssm_copy, ssm_live in kept:
        assert torch.equal(copy, live) and torch.equal(ssm_copy, ssm_live)


def test_replays_with_host_staged_entries_snapshots_and_hidden_states():
    model = cuda_model(torch.bfloat16)
    runner = ModelRunner(model, RuntimeConfig())
    graphs = runner.layout_graphs
    snaps, hidden = {1, 5}, (0, 3)
    for seed in (1, 2, 3):
        segs, datas, q = request(model, seed)
        ref_logits, ref_state, ref_rec = run(
            runner, pic_layout(segs, datas, q), graphs=False, snapshot_after=snaps, capture_hidden=hidden
        )
        hosted = stage([to_host(SegmentEntry(f"s{seed}-{i}", 1, d, 0.0)) for i, d in enumerate(datas)], "cuda")
        logits, state, rec = run(
            runner, pic_layout(segs, hosted, q), graphs=True, snapshot_after=snaps, capture_hidden=hidden
        )
        assert gap(logits, ref_logits) <= 1e-3 * (1 + ref_logits.abs().max().item())
        assert_close_states(state, ref_state, 1e-3)
        assert set(rec.snapshots) == snaps
        for idx in snaps:
            for lay, s in ref_rec.snapshots[idx].items():
                assert gap(rec.snapshots[idx][lay].ssm, s.ssm) <= 1e-3 * (1 + s.ssm.abs().max().item())
        for i in hidden:
            assert gap(rec.hidden[i], ref_rec.hidden[i]) <= 1e-3 * (1 + ref_rec.hidden[i].abs().max().item())
    assert graphs.stats["replays"] == 1 and not graphs.failed, (graphs.stats, graphs.failed)


def test_engine_answers_alike_with_and_without_graphs(tmp_path):
    """Two engines on one model, each with its runner, get the same RAG requests of one shape (new
    documents each time, then the same documents after another system prompt): the same tokens with
    graphs on or off, on the engine's whole path (entries built cold, part-chain snapshots, prefix
    pages, decode)."""
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.modelzoo import init_model_dir

    path = init_model_dir("qwen3_5_text", "tiny", tmp_path / "m", seed=1, std=0.08)
    graphed = Engine.from_dir(path, device="cuda", dtype=torch.bfloat16, config=EngineConfig(mode="pic"))
    eager = EngineConfig(mode="pic", cuda_graphs=False, decode_cuda_graphs=False)
    plain = Engine(graphed.model, graphed.tokenizer, eager)
    assert plain.runner.layout_graphs is None and graphed.runner.layout_graphs is not None
    gen = torch.Generator().manual_seed(0)
    # one scheduler each (its pool's pages are what the assembly graphs of its requests read)
    with LLM(plain) as plain_llm, LLM(graphed) as graphed_llm:
        for n in range(3):
            docs = [torch.randint(0, 200, (120,), generator=gen).tolist() for _ in range(3)]
            cold = {
                "system": [1, 2, 3],
                "segments": docs,
                "suffix": [7, 8, 9, 10],
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
            }
            for req in (cold, dict(cold, system=[4, 5, 6], segments=docs[::-1])):
                want = plain_llm.generate(dict(req)).output_ids
                got = graphed_llm.generate(dict(req)).output_ids
                assert got == want and len(want) == 6, n
    # the scheduler's assemblies run in their pages, planned: from the assembly graphs of their buckets
    stats = graphed.runner.graph_stats
    assert stats["replays"] >= 2 and not stats["failures"], (stats, graphed.runner.assembly_graphs.failed)
