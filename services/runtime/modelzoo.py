"""Presets and random-weight model directories in Hugging Face format (`hybridcache model init`).

Tiny presets exist for every supported architecture (tests); `qwen3.5-9b` and `qwen3.5-35b-a3b`
are the real shapes, with random weights, for GPU benchmarks (compute does not depend on weight
values).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from hybridcache.services.runtime.hub_names import hub_tensors
from hybridcache.services.runtime.models.families import FAMILY_PRESETS
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.models.registry import build_model, config_from_dict, supported_model_types
from hybridcache.services.runtime.tokenizer import build_byte_tokenizer
from safetensors.torch import save_file

_TINY_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=256,
    pad_token_id=256,
)
_TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=64)

_QWEN35_9B = dict(
    vocab_size=248320,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
    eos_token_id=248046,
    pad_token_id=248044,
)
_QWEN35_35B_A3B = dict(
    _QWEN35_9B,
    hidden_size=2048,
    num_hidden_layers=40,
    num_key_value_heads=2,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
)
_QWEN35_35B_A3B.pop("intermediate_size")

# Qwen3-Next-80B-A3B's released shape (~80 B parameters, ~160 GB in bf16: tensor parallelism >= 2 on H200s)
_QWEN3_NEXT_80B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5120,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    num_experts=512,
    num_experts_per_tok=10,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
    eos_token_id=151645,
    pad_token_id=151643,
)

# (arch, preset) -> text config (model_type added on write)
PRESETS: dict[tuple[str, str], dict] = {
    ("qwen3_next", "tiny"): dict(_TINY_COMMON, **_TINY_MOE, decoder_sparse_step=1, mlp_only_layers=[1]),
    ("qwen3_5_text", "tiny"): dict(_TINY_COMMON),
    ("qwen3_5", "tiny"): dict(_TINY_COMMON),
    ("qwen3_5_moe_text", "tiny"): dict(_TINY_COMMON, **_TINY_MOE),
    ("qwen3_5_moe", "tiny"): dict(_TINY_COMMON, **_TINY_MOE),
    ("qwen3_next", "qwen3-next-80b-a3b"): _QWEN3_NEXT_80B_A3B,
    ("qwen3_5_text", "qwen3.5-9b"): _QWEN35_9B,
    ("qwen3_5", "qwen3.5-9b"): _QWEN35_9B,
    ("qwen3_5_moe_text", "qwen3.5-35b-a3b"): _QWEN35_35B_A3B,
    ("qwen3_5_moe", "qwen3.5-35b-a3b"): _QWEN35_35B_A3B,
    **FAMILY_PRESETS,
}


def preset_names(arch: str) -> list[str]:
    return sorted(p for a, p in PRESETS if a == arch)


def hf_config(arch: str, preset: str, overrides: dict | None = None) -> dict:
    """The config.json dict for (arch, preset); nested text_config for the multimodal model_types."""
    if arch not in supported_model_types():
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(supported_model_types())}")
    if (arch, preset) not in PRESETS:
        raise ValueError(f"no preset {preset!r} for arch {arch!r}; presets: {', '.join(preset_names(arch))}")
    text = dict(PRESETS[(arch, preset)], **(overrides or {}))
    if arch in ("qwen3_5", "qwen3_5_moe"):
        text["model_type"] = arch + "_text"
        top = {
            "model_type": arch,
            "architectures": [
                "Qwen3_5ForConditionalGeneration" if arch == "qwen3_5" else "Qwen3_5MoeForConditionalGeneration"
            ],
            "text_config": text,
            "tie_word_embeddings": text.get("tie_word_embeddings", False),
        }
        return top
    text["model_type"] = arch
    return text


@torch.no_grad()
def random_init_(model: HybridLM, seed: int, std: float = 0.02) -> None:
    """Initialise every parameter from a seeded generator on the model's device, in the spirit of
    the HF init.

    Norm weights get small noise around their neutral value so tests see a wrong norm formula.
    """
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    # plain RMSNorm (weight * x) is neutral at 1, Qwen's zero-centered one (1 + weight) at 0
    norm_offset = getattr(model, "norm_offset", 0.0)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            # log-uniform A in [1e-3, 4]: slow heads keep state across segments, fast ones forget
            vals = torch.empty(p.shape, device=dev).uniform_(math.log(1e-3), math.log(4.0), generator=gen)
        elif name.endswith("dt_bias"):
            vals = torch.rand(p.shape, device=dev, generator=gen) * 2 - 1
        elif name.endswith("linear_attn.norm.weight"):
            vals = 1.0 + 0.1 * torch.randn(p.shape, device=dev, generator=gen)
        elif "norm" in name.split(".")[-2]:
            vals = norm_offset + 0.1 * torch.randn(p.shape, device=dev, generator=gen)
        elif name.endswith("conv1d.weight"):
            vals = torch.randn(p.shape, device=dev, generator=gen) / math.sqrt(p.shape[-1])
        else:
            vals = torch.randn(p.shape, device=dev, generator=gen) * std
        p.copy_(vals.to(p.dtype))


def checkpoint_tensors(model: HybridLM, multimodal: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights under the names the hub's checkpoints use (hub_names.hub_tensors)."""
    return hub_tensors(model.cfg, model.state_dict(), multimodal=multimodal)


def init_model_dir(
    arch: str,
    preset: str,
    out: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    std: float = 0.02,
    overrides: dict | None = None,
    device: str = "cpu",
) -> Path:
    """Write config.json, model.safetensors and tokenizer.json of a random-weight model.

    On a device other than the CPU the model is built and initialised there in `dtype` (a 9B
    model's weights made on the GPU in seconds, without a host copy in fp32)."""
    out = Path(out)
    cfg_dict = hf_config(arch, preset, overrides)
    cfg = config_from_dict(cfg_dict)
    tok = build_byte_tokenizer()
    if tok.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
        raise ValueError(f"vocab_size {cfg.vocab_size} is smaller than the tokenizer's")
    out.mkdir(parents=True, exist_ok=True)
    if device == "cpu":
        model = build_model(cfg)
        random_init_(model, seed, std)
        model = model.to(dtype)
    else:
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = build_model(cfg).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        random_init_(model, seed, std)
    save_file(
        {k: v.contiguous().cpu() for k, v in checkpoint_tensors(model, multimodal="text_config" in cfg_dict).items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": cfg_dict.get("eos_token_id", cfg.eos_token_ids[0] if cfg.eos_token_ids else None)})
        + "\n"
    )
    return out


class NoModelError(FileNotFoundError):
    """No model directory given and none shipped with this installation (one line at the CLI)."""


def shipped_model_dir() -> Path:
    """models/default as installed: the package data of `hybridcache.models` (inside a wheel's
    site-packages, or the source tree through an editable install), else the source tree beside
    this file (an editable install made before models/ was a package)."""
    from importlib.resources import files

    try:
        return Path(str(files("hybridcache.models") / "default"))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "models" / "default"


SHIPPED_MODEL = shipped_model_dir()


def default_model_dir() -> Path:
    """The model served when no --model is given: $HYBRIDCACHE_MODEL, else the trained QA model
    shipped with the package (models/default). NoModelError when neither exists: a random model
    in its place would answer garbage without a word."""
    import os

    env = os.environ.get("HYBRIDCACHE_MODEL")
    if env:
        return Path(env)
    if (SHIPPED_MODEL / "config.json").is_file():
        return SHIPPED_MODEL
    raise NoModelError(f"no --model given and this installation has no shipped model ({SHIPPED_MODEL} is "
                       f"missing): pass --model DIR or set HYBRIDCACHE_MODEL")
