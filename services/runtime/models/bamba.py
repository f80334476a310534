"""Bamba (model_type bamba): Mamba2 (SSD) or attention mixer + SwiGLU MLP in every block,
checkpoint tensor names of transformers' modeling_bamba.py.

The Mamba2 mixer is Nemotron-H's (scalar T per head; D skip and the grouped gated RMSNorm act
outside the recurrence, on the live tokens only). Unlike Nemotron-H, attention uses RoPE on the
first half of each head (partial_rotary_factor 0.5 unless rope_parameters says otherwise), so
cached K is re-rotated on reuse; every block is pre-norm with a mixer and a feed-forward half.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.models.common import (
    Backbone,
    BlockLayer,
    LayoutLM,
    RMSNorm,
    eos_ids,
    need,
)
from hybridcache.services.runtime.models.nemotron_h import (
    _LEGACY,
    Mamba2Mixer,
    NemotronAttention,
    NemotronHConfig,
)
from hybridcache.services.runtime.models.qwen3_hybrid import MLP, apply_rope, rope_cos_sin
from torch import nn


@dataclass(frozen=True)
class BambaConfig(NemotronHConfig):
    """Nemotron-H's fields (the Mamba2 mixer and the entry layout read them) plus RoPE."""

    rope_theta: float = 10000.0
    rotary_dim: int = 0

    def __post_init__(self):
        super().__post_init__()
        if "mlp" in self.layer_types:
            raise ModelConfigError("bamba blocks are linear_attention or full_attention")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ModelConfigError(f"rotary dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")

    @classmethod
    def from_dict(cls, cfg: dict) -> BambaConfig:
        n_layers = int(need(cfg, "num_hidden_layers"))
        hidden, heads = int(need(cfg, "hidden_size")), int(need(cfg, "num_attention_heads"))
        types = cfg.get("layers_block_type") or cfg.get("layer_types")
        if types is None:
            attn = set(cfg.get("attn_layer_indices") or [])
            types = ["full_attention" if i in attn else "linear_attention" for i in range(n_layers)]
        if len(types) != n_layers:
            raise ModelConfigError("the layer type list must have num_hidden_layers entries")
        if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias", False):
            raise ModelConfigError("only hidden_act silu without mlp_bias is supported")
        lo, hi = cfg.get("time_step_limit") or (0.0, float("inf"))
        if hi != float("inf"):
            raise ModelConfigError(f"a finite upper time_step_limit ({hi}) is not supported")
        m_heads = int(cfg.get("mamba_n_heads", 128))
        expand = int(cfg.get("mamba_expand", 2))
        m_head_dim = cfg.get("mamba_d_head", "auto")
        m_head_dim = expand * hidden // m_heads if m_head_dim in (None, "auto") else int(m_head_dim)
        if m_heads * m_head_dim != expand * hidden:
            raise ModelConfigError("mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ModelConfigError(f"unsupported rope_type {rope.get('rope_type')!r} (only 'default')")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        return cls(
            model_type="bamba",
            vocab_size=int(need(cfg, "vocab_size")),
            hidden_size=hidden,
            layer_types=tuple(_LEGACY.get(t, t) for t in types),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(need(cfg, "intermediate_size")),
            mamba_num_heads=m_heads,
            mamba_head_dim=m_head_dim,
            ssm_state_size=int(cfg.get("mamba_d_state", 256)),
            n_groups=int(cfg.get("mamba_n_groups", 1)),
            conv_kernel=int(cfg.get("mamba_d_conv", 4)),
            use_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            use_bias=bool(cfg.get("mamba_proj_bias", False)),
            mlp_bias=False,
            attention_bias=bool(cfg.get("attention_bias", False)),
            time_step_min=float(lo),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rotary_dim=int(head_dim * float(rope.get("partial_rotary_factor", 0.5))),
            layer_norm_epsilon=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )


class RopeAttention(NemotronAttention):
    """Nemotron-H's GQA projections with RoPE on the first rotary_dim channels of q and k."""

    def __init__(self, cfg: BambaConfig):
        super().__init__(cfg)
        self.rotary_dim, self.theta = cfg.rotary_dim, cfg.rope_theta

    rotates = True

    def rotate(self, x, positions):
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.theta, torch.float32)
        return apply_rope(x.float(), cos, sin).to(x.dtype)


class BambaDecoderLayer(BlockLayer):
    def __init__(self, cfg: BambaConfig, i: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        if self.kind == "linear_attention":
            self.mamba = Mamba2Mixer(cfg)
        else:
            self.self_attn = RopeAttention(cfg)
        self.feed_forward = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)

    def empty_state(self, device):
        return (self.mamba if self.kind == "linear_attention" else self.self_attn).empty_state(device)

    def block(self, x, mix):
        """x [B, n, h] -> [B, n, h]: pre-norm mixer and feed-forward halves; mix(h) runs the mixer."""
        x = x + mix(self.input_layernorm(x))
        return x + self.feed_forward(self.pre_ff_layernorm(x))

    def mixer_module(self) -> nn.Module:
        return self.mamba if self.kind == "linear_attention" else self.self_attn


class BambaLM(LayoutLM):
    def __init__(self, cfg):
        super().__init__(
            cfg,
            Backbone(
                cfg,
                [BambaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)],
                RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon),
                embed_name="embed_tokens",
                norm_name="final_layernorm",
            ),
        )
