"""model_type -> (config class, model class), imported lazily.

Every config class is a frozen dataclass with `from_dict(hf_config_dict)` and the fields the
engine, the router's request plan (plan.py) and `hybridcache up` read (model_type, vocab_size,
hidden_size, num_hidden_layers, eos_token_ids, max_position_embeddings, layer_types, raw); the
configs of families whose entries differ from the Qwen layout (olmo_hybrid, nemotron_h, bamba,
kimi_linear, minimax) also have `entry_nbytes(body_tokens, dtype, state_dtype)`, which the plan
uses to size entries before they exist (plan.expected_entry_nbytes). Every model class is a
models.common.LayoutLM: a backbone whose layers have a `kind` ("linear_attention",
"full_attention" or a stateless kind such as "mlp"), `empty_state(device)` and
`forward_layout(x, layout, state, rec, layer_idx, positions)`; its linear layers follow the mixer
contract of models/mixer.py.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from hybridcache.services.runtime.config import SUPPORTED_MODEL_TYPES, ModelConfigError, read_config_json

_PKG = "hybridcache.services.runtime"
_QWEN = (f"{_PKG}.config:ModelConfig", f"{_PKG}.models.qwen3_hybrid:HybridLM")

ARCHITECTURES: dict[str, tuple[str, str]] = {
    **{t: _QWEN for t in SUPPORTED_MODEL_TYPES},
    "olmo_hybrid": (f"{_PKG}.models.olmo_hybrid:OlmoHybridConfig", f"{_PKG}.models.olmo_hybrid:OlmoHybridLM"),
    "nemotron_h": (f"{_PKG}.models.nemotron_h:NemotronHConfig", f"{_PKG}.models.nemotron_h:NemotronHLM"),
    "kimi_linear": (f"{_PKG}.models.kimi_linear:KimiLinearConfig", f"{_PKG}.models.kimi_linear:KimiLinearLM"),
    "bamba": (f"{_PKG}.models.bamba:BambaConfig", f"{_PKG}.models.bamba:BambaLM"),
    "minimax": (f"{_PKG}.models.minimax:MiniMaxConfig", f"{_PKG}.models.minimax:MiniMaxLM"),
}


def _load(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def config_from_dict(cfg: dict):
    """Parse a HF config.json dict with its architecture's config class (ModelConfigError if unknown)."""
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type not in ARCHITECTURES:
        raise ModelConfigError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    return _load(ARCHITECTURES[model_type][0]).from_dict(cfg)


def config_from_dir(path: str | Path):
    return config_from_dict(read_config_json(path))


def model_class(cfg):
    """The model class serving a parsed config."""
    return _load(ARCHITECTURES[cfg.model_type][1])


def build_model(cfg):
    return model_class(cfg)(cfg)


def shape_model(cfg, dtype: str):
    """build_model(cfg) on the meta device with `dtype` ("bfloat16", ...) parameters: shapes and byte
    counts without memory (benchmarks' floors and fits)."""
    import torch

    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device("meta"):
            return build_model(cfg)
    finally:
        torch.set_default_dtype(prev)
