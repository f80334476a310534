"""Tiny checkpoints of every model type the runtime serves, built with transformers' own classes
and written by its `save_pretrained`, as the hub holds them (tests import this module by name:
pytest puts tests/ on sys.path through tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from hybridcache.services.runtime.modelzoo import hf_config
from hybridcache.services.runtime.tokenizer import build_byte_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

TEXT_FAMILIES = [
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "kimi_linear",
    "nemotron_h",
    "olmo_hybrid",
    "minimax",
    "bamba",
]
MULTIMODAL = ["qwen3_5", "qwen3_5_moe"]
FAMILIES = TEXT_FAMILIES + MULTIMODAL
# Structures other than the tiny presets' (which transformers' own configs accept): odd and
# uneven head counts, MLP-only layers among MoE ones, several SSM groups, more experts per token
VARIED = {
    "qwen3_next": dict(num_attention_heads=6, num_key_value_heads=3, linear_num_key_heads=3,
                       linear_num_value_heads=6, mlp_only_layers=[0, 2]),
    "qwen3_5_text": dict(num_attention_heads=6, num_key_value_heads=3, linear_num_key_heads=3,
                         linear_num_value_heads=3),
    "qwen3_5_moe_text": dict(num_attention_heads=5, num_key_value_heads=1, linear_num_key_heads=1,
                             linear_num_value_heads=3),
    "olmo_hybrid": dict(num_attention_heads=6, num_key_value_heads=3, linear_num_key_heads=3, linear_num_value_heads=3),
    "nemotron_h": dict(num_attention_heads=6, num_key_value_heads=3, mamba_num_heads=6, n_groups=3),
    "bamba": dict(num_attention_heads=6, num_key_value_heads=3, mamba_n_groups=4),
    "kimi_linear": dict(num_attention_heads=3, num_key_value_heads=3, linear_num_heads=3),
    "minimax": dict(num_attention_heads=6, num_key_value_heads=3, num_local_experts=5, num_experts_per_tok=3),
    "qwen3_5": dict(num_attention_heads=3, num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=2),
    "qwen3_5_moe": dict(num_attention_heads=6, num_key_value_heads=3, linear_num_key_heads=3,
                        linear_num_value_heads=6, num_experts=5, num_experts_per_tok=3),
}
# Structures as varied whose head, group and channel counts 2 divides, for tensor parallelism over two
# ranks (VARIED's odd counts cannot be split in two): uneven query/key-value and key/value linear head
# ratios, a single key/value head (replicated on both ranks), MLP-only layers among MoE ones, two SSM
# groups a rank, five experts
VARIED_TP2 = {
    "qwen3_next": dict(num_attention_heads=6, num_key_value_heads=2, linear_num_key_heads=2,
                       linear_num_value_heads=6, mlp_only_layers=[0, 2]),
    "qwen3_5_text": dict(num_attention_heads=6, num_key_value_heads=2, linear_num_key_heads=2,
                         linear_num_value_heads=6, intermediate_size=96),
    "qwen3_5_moe_text": dict(num_attention_heads=10, num_key_value_heads=1, linear_num_key_heads=2,
                             linear_num_value_heads=6),
    "olmo_hybrid": dict(num_attention_heads=6, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=6),
    "nemotron_h": dict(num_attention_heads=6, num_key_value_heads=2, mamba_num_heads=8, n_groups=4),
    "bamba": dict(num_attention_heads=6, num_key_value_heads=1, mamba_n_groups=4),
    "kimi_linear": dict(num_attention_heads=6, num_key_value_heads=6, linear_num_heads=6),
    "minimax": dict(num_attention_heads=6, num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=3),
    "qwen3_5": dict(num_attention_heads=6, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4),
    "qwen3_5_moe": dict(num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
                        linear_num_value_heads=2, num_experts=5, num_experts_per_tok=3),
}
TINY_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=16
)


def hf_model(arch: str, tied: bool, seed: int, overrides: dict | None = None):
    """A transformers model of the tiny preset (with `overrides` of its config), its weights drawn
    so that every tensor matters: matrices N(0, 0.08), time-step biases U(-1, 1), other vectors
    (norms, gates, biases) perturbed around their initial values."""
    cfg = hf_config(arch, "tiny", overrides)
    torch.manual_seed(seed)
    if arch in MULTIMODAL:
        text = {k: v for k, v in cfg["text_config"].items() if k != "tie_word_embeddings"}
        # tie_word_embeddings only at the top level, as the hub's multimodal configs set it
        config = AutoConfig.for_model(arch, text_config=text, vision_config=TINY_VISION, tie_word_embeddings=tied)
        model = AutoModelForImageTextToText.from_config(config)
    else:
        rest = {k: v for k, v in cfg.items() if k != "model_type"}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **dict(rest, tie_word_embeddings=tied)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                # softplus(dt_bias) of order 1, as modelzoo draws it: the Mamba-style init some
                # families use (dt in [0.001, 0.1]) leaves an SSM's state so small a part of the
                # output that a wrong head or group would go unseen
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
            else:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    if tied:
        model.tie_weights()
    return model.eval()


def save_checkpoint(model, out: Path, dtype: torch.dtype = torch.float32, sharded: bool = False) -> Path:
    """`save_pretrained` as the hub's checkpoints are written, with the project's byte tokenizer."""
    model.to(dtype).save_pretrained(out, max_shard_size="64KB" if sharded else "1GB")
    build_byte_tokenizer().save(str(out / "tokenizer.json"))
    return out


def reference_model(arch: str, path: Path):
    """transformers' model of a checkpoint, fp32, as the engine's reference."""
    if arch in MULTIMODAL:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # transformers' minimax computes with the decay buffers the checkpoint stores (rounded to
    # bf16 in a bf16 file), the runtime with exact rates: give the reference exact ones too
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "get_slope_rate"):
                rate = m.get_slope_rate()
                for name, value in zip(
                    ("slope_rate", "query_decay", "key_decay", "diagonal_decay"), (rate, *m.decay_factors(rate))
                ):
                    getattr(m, name).copy_(value)
    return model


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, n tokens, no end token: each step a full
    forward of the sequence so far (no cache, so nothing but the model's own math is compared)."""
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@torch.no_grad()
def greedy_generate(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy `generate` of `prompt` with its cache, n tokens whatever they are (no
    end token, as a request with ignore_eos): the decode path of transformers' recurrent and
    attention caches, a fraction of greedy_reference's cost (one full forward a token)."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    assert len(out) == n
    return out
