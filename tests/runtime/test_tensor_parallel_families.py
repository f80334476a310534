"""Tensor parallelism over two CPU ranks (gloo, two processes) for every model type, on checkpoints
transformers' `save_pretrained` wrote, of structures other than the tiny presets' that 2 divides
(tests/hf_models.py VARIED_TP2: uneven head ratios, one key/value head replicated on both ranks,
MLP-only layers among MoE ones, two SSM groups a rank; tied and untied embeddings): a prompt
through the one path (llm.LLM: the scheduler, the paged decode, every runner call on both ranks)
continues greedily for 32 tokens exactly as transformers' greedy `generate` does (batches of
requests over the ranks: test_tensor_parallel.py). VARIED's odd counts are refused before any rank
starts, naming the count.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hf_models import FAMILIES, VARIED, VARIED_TP2, greedy_generate, hf_model, reference_model, save_checkpoint
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.tensor_parallel import ranks

NEW_TOKENS = 32
SIZE = 2


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_families")
    return {a: str(save_checkpoint(hf_model(a, tied=i % 2 == 1, seed=24, overrides=VARIED_TP2[a]), root / a))
            for i, a in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def group(checkpoints):
    """One group of two ranks, each holding its shard of every checkpoint (the default mode, pic)."""
    g = ranks.start(SIZE, functools.partial(ranks.build_runners, {a: (p, RuntimeConfig()) for a, p in
                                                                    checkpoints.items()}))
    yield g
    g.shutdown()


@pytest.mark.parametrize("arch", FAMILIES)
def test_tp2_greedy_equals_transformers(arch, checkpoints, group):
    engine = ranks.engine_of(group, checkpoints[arch], arch)
    assert engine.tp_layout == f"0/{SIZE}"
    prompt = _ids(17, seed=1)
    expect = greedy_generate(reference_model(arch, checkpoints[arch]), prompt, NEW_TOKENS)
    llm = LLM(engine)
    try:
        greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        got = llm.generate({"suffix": prompt, "sampling_params": greedy})
    finally:
        llm.close()
    assert got.output_ids == expect


@pytest.mark.parametrize("arch", FAMILIES)
def test_odd_counts_are_refused_before_any_rank_starts(arch, tmp_path):
    """Every VARIED structure has a count 2 does not divide (3 key/value heads, 5 attention heads,
    3 KDA heads, 3 SSM groups): the split of its meta model names it."""
    path = save_checkpoint(hf_model(arch, tied=False, seed=24, overrides=VARIED[arch]), tmp_path / arch)
    with pytest.raises(ModelConfigError, match=f"tensor-parallel size {SIZE} must divide the [0-9]*[13579] "):
        ranks.check_split(str(path), SIZE)
