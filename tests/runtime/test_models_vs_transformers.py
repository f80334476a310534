"""`full` mode equals Hugging Face transformers' own implementation (fp32, tiny random configs)."""

import pytest
import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.sequence import LiveRun
from transformers import AutoModelForCausalLM

ARCHS = ["qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"]


def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_logits_equal_transformers(arch, model_dirs):
    ids = torch.randint(0, 256, (1, 97), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = reference(model_dirs[arch])(ids).logits[0]
    model = load_model(model_dirs[arch])
    ours, _ = model.forward_layout(model.empty_state(), [LiveRun(ids[0], 0)], logits_for="all")
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe"])
def test_greedy_generation_equals_transformers(arch, model_dirs):
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = reference(model_dirs[arch]).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, eos_token_id=None
        )[0, 40:].tolist()
    engine = Engine.from_dir(model_dirs[arch], config=EngineConfig(mode="full"))
    res = LLM(engine).generate(
        {"suffix": ids[0].tolist(), "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}
    )
    assert len(ref) == 32
    assert res.output_ids == ref
