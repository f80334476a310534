"""Two tiny Qwen3.5-MoE models alike but for their routers, and decode inputs for both: the tests
that a decode step's ops do not depend on the routing (tests/runtime/test_moe.py for the grouped
and loop paths, tests/kernels/test_moe_pairs.py for the pair path)."""

import torch
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.models import qwen3_hybrid
from hybridcache.services.runtime.modelzoo import init_model_dir
from hybridcache.services.runtime.sequence import LiveRun


def routing_twins(tmp_path, prompt_lengths):
    """(spread, narrow, prompts, tokens): `narrow`'s routers are zero (every token goes to the same
    two experts: all scores tie), `spread`'s send tokens over most of its 16 experts; prompts of
    the given lengths and one next token each."""
    path_dir = init_model_dir("qwen3_5_moe_text", "tiny", tmp_path / "m", seed=1, std=0.3,
                              overrides={"num_experts": 16, "num_experts_per_tok": 2})
    spread, narrow = load_model(path_dir), load_model(path_dir)
    for m in narrow.modules():
        if isinstance(m, qwen3_hybrid.SparseMoE):
            m.gate.weight.data.zero_()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (n,), generator=gen) for n in prompt_lengths]
    tokens = torch.randint(0, 250, (len(prompts),), generator=gen).tolist()
    return spread, narrow, prompts, tokens


def prefilled_pool(runner, model, prompts):
    """A pool of `runner` holding each prompt prefilled from an empty state (on the model's own
    path, as a scheduler's prefill leaves it), and their slots."""
    pool = runner.new_state_pool(len(prompts), 64 * len(prompts))
    slots = []
    for p in prompts:
        s = model.empty_state()
        model.forward_layout(s, [LiveRun(p, 0)], logits_for="none")
        slots.append(pool.assign(s))
    return pool, slots
