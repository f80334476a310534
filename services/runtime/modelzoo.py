"""Presets and random-weight model directories in Hugging Face format (`hybridcache model init`).

Tiny presets exist for every supported architecture (tests); `qwen3.5-9b` and `qwen3.5-35b-a3b`
are the real shapes, with random weights, for GPU benchmarks (compute does not depend on weight
values).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from hybridcache.services.runtime.hub_names import hub_tensors
from hybridcache.services.runtime.models.families import FAMILY_PRESETS
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.models.registry import build_model, config_from_dict, supported_model_types
from hybridcache.services.runtime.tokenizer import build_byte_tokenizer
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

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


def _random_value(name: str, shape, gen: torch.Generator, dev, std: float, norm_offset: float) -> torch.Tensor:
    """The fp32 initial value of parameter `name`, drawn from `gen` (random_init_'s rule); scaled in
    place, so that drawing a parameter holds one copy of it."""
    if name.endswith("A_log"):
        # log-uniform A in [1e-3, 4]: slow heads keep state across segments, fast ones forget
        return torch.empty(shape, device=dev).uniform_(math.log(1e-3), math.log(4.0), generator=gen)
    if name.endswith("dt_bias"):
        return torch.rand(shape, device=dev, generator=gen).mul_(2).sub_(1)
    if name.endswith("linear_attn.norm.weight"):
        return torch.randn(shape, device=dev, generator=gen).mul_(0.1).add_(1.0)
    if "norm" in name.split(".")[-2]:
        return torch.randn(shape, device=dev, generator=gen).mul_(0.1).add_(norm_offset)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, device=dev, generator=gen).div_(math.sqrt(shape[-1]))
    return torch.randn(shape, device=dev, generator=gen).mul_(std)


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
        p.copy_(_random_value(name, p.shape, gen, dev, std, norm_offset).to(p.dtype))


def checkpoint_tensors(model: HybridLM, multimodal: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights under the names the hub's checkpoints use (hub_names.hub_tensors)."""
    return hub_tensors(model.cfg, model.state_dict(), multimodal=multimodal)


@contextmanager
def _parameters_on_meta():
    """Build modules with their parameters on the meta device (no memory, no initialisation: a
    parameter is moved there as it is registered, before its module initialises it) and their
    buffers as the constructors compute them (some are persistent: minimax's decays)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


DEFAULT_SHARD_BYTES = 5 * 10**9  # `save_pretrained`'s max_shard_size="5GB"


def parse_size(text: str) -> int:
    """"5GB" -> 5e9, "500MB", "64KiB", "1000" (bytes); ValueError (one line) on anything else."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    unit = m.group(2).upper().removesuffix("B") if m else ""
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30,
             "TI": 2**40}.get(unit)
    if m is None or scale is None or float(m.group(1)) * scale < 1:
        raise ValueError(f"expected a size such as 5GB, 500MB or 64KiB, got {text!r}")
    return int(float(m.group(1)) * scale)


def init_model_dir(
    arch: str,
    preset: str,
    out: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    std: float = 0.02,
    overrides: dict | None = None,
    device: str = "cpu",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = False,
) -> Path:
    """Write config.json, the weights and tokenizer.json of a random-weight model, as the hub holds
    them: model.safetensors when they fit one shard of `max_shard_bytes`, else
    model-0000K-of-0000N.safetensors and model.safetensors.index.json.

    The model is never held whole: its structure is built on the meta device, then each parameter
    is drawn (on `device`: a 9B model's values come from the GPU in seconds), cast to `dtype` and
    added to the shard being filled, which is written once full. Host memory peaks at about one
    shard and one parameter's copies. The values equal random_init_'s of the whole model (the same
    generator, drawn parameter by parameter in the same order). `progress`: a tqdm bar of the bytes
    written, on stderr."""
    out = Path(out)
    cfg_dict = hf_config(arch, preset, overrides)
    cfg = config_from_dict(cfg_dict)
    tok = build_byte_tokenizer()
    if tok.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
        raise ValueError(f"vocab_size {cfg.vocab_size} is smaller than the tokenizer's")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out.mkdir(parents=True, exist_ok=True)
    with _parameters_on_meta():
        model = build_model(cfg)
    multimodal = "text_config" in cfg_dict
    state = model.state_dict(keep_vars=True)  # parameters on meta, buffers with their values
    params = {id(p) for p in model.parameters()}
    names_of = Counter(id(t) for t in state.values())  # a tied parameter has several names

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    # the shards, planned from the shapes: hub names in order, a new shard when the next would overflow
    plan: list[list[str]] = [[]]
    filled = total = 0
    for name, t in state.items():
        for hub_name, part in hub_tensors(cfg, {name: cast(t.detach())}, multimodal=multimodal).items():
            nbytes = part.numel() * part.element_size()
            if plan[-1] and filled + nbytes > max_shard_bytes:
                plan.append([])
                filled = 0
            plan[-1].append(hub_name)
            filled += nbytes
            total += nbytes
    files = (["model.safetensors"] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    shard_of = {hub_name: i for i, names in enumerate(plan) for hub_name in names}

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    norm_offset = getattr(model, "norm_offset", 0.0)
    drawn: dict[int, torch.Tensor] = {}  # tied parameters are drawn once
    shard: dict[str, torch.Tensor] = {}
    current = 0
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}", disable=not progress)

    def write(i: int) -> None:
        save_file(shard, str(out / files[i]), metadata={"format": "pt"})
        bar.update(sum(v.numel() * v.element_size() for v in shard.values()))
        shard.clear()

    with torch.no_grad(), bar:
        for name, t in state.items():
            if id(t) in params:
                value = drawn.get(id(t))
                if value is None:
                    value = cast(_random_value(name, t.shape, gen, dev, std, norm_offset)).cpu()
                    if names_of[id(t)] > 1:
                        drawn[id(t)] = value
            else:
                value = cast(t.detach()).cpu()
            for hub_name, part in hub_tensors(cfg, {name: value}, multimodal=multimodal).items():
                if shard_of[hub_name] != current:
                    write(current)
                    current = shard_of[hub_name]
                shard[hub_name] = part.contiguous()
            del value
        write(current)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {n: files[shard_of[n]] for n in sorted(shard_of)}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
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
