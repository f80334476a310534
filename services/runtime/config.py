"""Model configuration: parsed once from a Hugging Face config.json into a frozen dataclass."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class ModelConfigError(ValueError):
    """A config.json the runtime cannot serve (unsupported model_type, missing or bad field)."""


# model_type -> (family, uses MoE by default). Nested multimodal configs carry the text model in
# `text_config`; only the text model is served.
SUPPORTED_MODEL_TYPES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    family: str  # qwen3_next | qwen3_5 | qwen3_5_moe
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
        if bad:
            raise ModelConfigError(f"unsupported layer type(s) {bad}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.hidden_act != "silu":
            raise ModelConfigError(f"unsupported hidden_act {self.hidden_act!r} (only silu)")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    def is_moe_layer(self, i: int) -> bool:
        if self.family == "qwen3_5":
            return False
        if self.family == "qwen3_5_moe":
            return True
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        text = cfg
        if "text_config" in cfg and isinstance(cfg["text_config"], dict):
            text = dict(cfg["text_config"])
            # token ids sometimes live only at the top level of multimodal configs
            for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
                if text.get(key) is None and cfg.get(key) is not None:
                    text[key] = cfg[key]
            # the wrapper model (ForConditionalGeneration) ties by its own config, whatever text_config says
            if cfg.get("tie_word_embeddings") is not None:
                text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        family = SUPPORTED_MODEL_TYPES[model_type]

        def need(key):
            if text.get(key) is None:
                raise ModelConfigError(f"config.json of model_type {model_type!r} is missing {key!r}")
            return text[key]

        rope = text.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ModelConfigError(f"unsupported rope_type {rope_type!r} (only 'default')")
        n_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
            ]
        eos = text.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        return cls(
            model_type=model_type,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate_size=int(text.get("intermediate_size") or 0),
            layer_types=tuple(layer_types),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(prf),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            attention_bias=bool(text.get("attention_bias", False)),
            hidden_act=str(text.get("hidden_act", "silu")),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            num_experts=int(text.get("num_experts") or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=int(text.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            eos_token_ids=eos_ids,
            pad_token_id=text.get("pad_token_id"),
            bos_token_id=text.get("bos_token_id"),
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(read_config_json(path))


_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_float(obj: dict):
    # transformers writes inf/nan as {"__float__": "Infinity"} (plain JSON has no such numbers)
    if len(obj) == 1 and obj.get("__float__") in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[obj["__float__"]]
    return obj


def read_config_json(path: str | Path) -> dict:
    """The config.json of a model directory as a dict (ModelConfigError if absent or not JSON)."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise ModelConfigError(f"no config.json in {path}")
    try:
        return json.loads(p.read_text(), object_hook=_special_float)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{p} is not valid JSON: {e}") from None
