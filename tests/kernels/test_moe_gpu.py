"""MoE models in CUDA graphs on a GPU (bf16, tiny Qwen3.5-MoE and Qwen3-Next with 16 experts, top-4):
a decode step and a warm pic request replay their graphs with the host never synchronised
(torch.cuda.set_sync_debug_mode("error") around the replayed calls) and give the eager pass's
logits; an engine answers alike with graphs on and off."""

import pytest
import torch
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.config import ModelConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.modelzoo import hf_config, init_model_dir, random_init_
from hybridcache.services.runtime.runner import ModelRunner
from hybridcache.services.runtime.sequence import CachedSpan, LiveRun

pytestmark = pytest.mark.gpu
ARCHS = ["qwen3_5_moe_text", "qwen3_next"]
MOE = {"num_experts": 16, "num_experts_per_tok": 4}
SEAM = 8


def cuda_model(arch):
    model = HybridLM(ModelConfig.from_dict(hf_config(arch, "tiny", MOE))).eval()
    random_init_(model, seed=1, std=0.08)
    model = model.to("cuda", torch.bfloat16)
    model.merge_projections()
    return model


class NoHostSync:
    """Inside the block a host synchronisation raises (torch's sync debug mode)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def gap(a, b):
    return (a.float() - b.float()).abs().max().item()


def prefilled(model, ids):
    s = model.empty_state()
    model.forward_layout(s, [LiveRun(ids, 0)], logits_for="none")
    return s


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_step_replays_without_host_sync(arch):
    model = cuda_model(arch)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    x = torch.zeros(3, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    # three requests, top-4: 12 token-expert pairs, the pair-major kernels (routing included)
    assert backends.moe_path(x, experts.gate_up_proj, experts.down_proj, MOE["num_experts_per_tok"]) == "pairs"
    gen = torch.Generator().manual_seed(0)
    # an eager runner and a graphed one over the model (the decode graphs are a runner's)
    runners = {g: ModelRunner(model, RuntimeConfig(decode_cuda_graphs=g, max_model_len=1024)) for g in (False, True)}
    pools = {g: runners[g].new_state_pool(8, 4096) for g in (False, True)}
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in (7, 30, 100)]
    slots = {g: [pools[g].assign(prefilled(model, p)) for p in prompts] for g in pools}
    toks = [int(p[-1]) for p in prompts]
    for step in range(6):
        out = {}
        for g in (False, True):
            if g and step > 0:  # the first graphed step captures; the later ones replay
                with NoHostSync():
                    out[g], _ = runners[g].decode(pools[g], slots[g], toks)
            else:
                out[g], _ = runners[g].decode(pools[g], slots[g], toks)
        assert gap(out[True], out[False]) <= 3e-2, step
        assert out[True].argmax(-1).tolist() == out[False].argmax(-1).tolist(), step
        toks = out[False].argmax(-1).tolist()
    graphs = runners[True].decode_graphs(pools[True])
    assert graphs.stats["captures"] == 1 and graphs.stats["replays"] == 5 and not graphs.failed, graphs.stats


def pic_request(model, seed, lengths=(150, 203, 97), question=16):
    """A pic layout of segments whose entries were built standalone, and a question."""
    gen = torch.Generator().manual_seed(seed)
    layout, pos = [], 0
    for n in lengths:
        seg = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen)
        _, rec = model.forward_layout(
            model.empty_state(), [LiveRun(seg[:SEAM], 0), LiveRun(seg[SEAM:], SEAM, record="entry")], "none"
        )
        layout += [LiveRun(seg[:SEAM], pos), CachedSpan(rec.entries[1], pos + SEAM)]
        pos += n
    return layout + [LiveRun(torch.randint(0, model.cfg.vocab_size, (question,), generator=gen), pos)]


@pytest.mark.parametrize("arch", ARCHS)
def test_warm_request_replays_without_host_sync(arch):
    model = cuda_model(arch)
    runner = ModelRunner(model, RuntimeConfig())
    graphs = runner.layout_graphs
    assert graphs is not None
    for seed in (1, 2, 3, 4):  # eager, capture (answered eagerly), replay, replay
        layout = pic_request(model, seed)
        with runner.eager():
            ref, _ = runner.forward(model.empty_state(), layout, "last")
        state = model.empty_state()
        if seed >= 3:
            with NoHostSync():
                logits, _ = runner.forward(state, layout, "last")
        else:
            logits, _ = runner.forward(state, layout, "last")
        assert gap(logits, ref) <= 1e-3 * (1 + ref.abs().max().item()), seed
    assert graphs.stats["captures"] == 1 and graphs.stats["replays"] == 2 and not graphs.failed, graphs.stats


def test_engine_answers_alike_with_and_without_graphs(tmp_path):
    from hybridcache.services.runtime.engine import Engine, EngineConfig

    path = init_model_dir("qwen3_5_moe_text", "tiny", tmp_path / "m", seed=1, std=0.08, overrides=MOE)
    graphed = Engine.from_dir(path, device="cuda", dtype=torch.bfloat16, config=EngineConfig(mode="pic"))
    # graphs off: the same passes run eagerly (the assemblies planned, as the graphs run them, their
    # buckets never captured), the decode steps eager. An engine with no graphs at all runs
    # assemblies unplanned, whose other order of sums may flip a routed expert and then a token.
    plain = Engine(graphed.model, graphed.tokenizer, EngineConfig(mode="pic", decode_cuda_graphs=False))
    for graphs in (plain.runner.assembly_graphs, plain.runner.layout_graphs):
        graphs.capture_after = 10**9
    gen = torch.Generator().manual_seed(0)
    # one scheduler each (its pool's pages are what the assembly graphs of its requests read)
    with LLM(plain) as plain_llm, LLM(graphed) as graphed_llm:
        for n in range(3):
            docs = [torch.randint(0, 200, (120,), generator=gen).tolist() for _ in range(3)]
            cold = {"system": [1, 2, 3], "segments": docs, "suffix": [7, 8, 9, 10],
                    "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
            for req in (cold, dict(cold, system=[4, 5, 6], segments=docs[::-1])):
                want = plain_llm.generate(dict(req)).output_ids
                got = graphed_llm.generate(dict(req)).output_ids
                assert got == want and len(want) == 6, n
    # the scheduler's assemblies run in their pages, planned: from the assembly graphs of their buckets
    stats = graphed.runner.graph_stats
    assert stats["replays"] >= 2 and not stats["failures"], (stats, graphed.runner.assembly_graphs.failed)
    assert plain.runner.graph_stats["captures"] == 0 and plain.runner.graph_stats["eager"] >= 2
