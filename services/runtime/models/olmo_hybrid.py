"""OLMo-Hybrid (model_type olmo_hybrid): Gated DeltaNet + full attention, with the checkpoint's tensor names.

Differences from Qwen3-Next / Qwen3.5 (transformers' modeling_olmo_hybrid.py): separate q/k/v/a/b
projections and a dedicated g_proj output gate; beta scaled by 2 when linear_allow_neg_eigval
(eigenvalues of I - beta k k^T in [-1, 1]); the output norm's eps is 1e-5; attention layers are
post-norm (norm after attention and after the MLP, no input norm), q/k RMSNorm over all heads
at once, no output gate, and RoPE over the whole head dim or none at all (NoPE, rope_theta unset).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.models.common import (
    Backbone,
    LayerTypes,
    LayoutLM,
    RMSNorm,
    attention_layout,
    eos_ids,
    merge_weights,
    merged_linear,
    need,
)
from hybridcache.services.runtime.models.mixer import DeltaRuleMixer, build_attention
from hybridcache.services.runtime.models.qwen3_hybrid import (
    MLP,
    GatedRMSNorm,
    apply_rope,
    rope_cos_sin,
)
from hybridcache.services.runtime.sequence import AttnState, LinearState
from torch import nn


@dataclass(frozen=True)
class OlmoHybridConfig(LayerTypes):
    model_type: str
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
    linear_allow_neg_eigval: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None  # None: NoPE
    max_position_embeddings: int = 65536
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelConfigError("layer_types must have num_hidden_layers entries")
        if set(self.layer_types) != {"linear_attention", "full_attention"}:
            raise ModelConfigError("olmo_hybrid needs both linear_attention and full_attention layers")
        if self.num_attention_heads % self.num_key_value_heads or (
            self.linear_num_value_heads % self.linear_num_key_heads
        ):
            raise ModelConfigError("query/value head counts must be multiples of the key head counts")

    def entry_nbytes(self, body_tokens: int, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
        """Bytes of a segment entry: dense T and S in state_dtype, conv tail and K/V in the model dtype."""
        esz = torch.tensor([], dtype=dtype).element_size()
        ssz = torch.tensor([], dtype=state_dtype).element_size()
        hv, dk, dv = self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim
        conv_dim = 2 * self.linear_num_key_heads * dk + hv * dv
        per_linear = ssz * hv * dk * (dk + dv) + esz * conv_dim * (self.linear_conv_kernel_dim - 1)
        per_attn = 2 * esz * self.num_key_value_heads * self.head_dim * body_tokens
        return len(self.linear_layers) * per_linear + len(self.attention_layers) * per_attn

    @classmethod
    def from_dict(cls, cfg: dict) -> OlmoHybridConfig:
        n_layers = int(need(cfg, "num_hidden_layers"))
        heads = int(need(cfg, "num_attention_heads"))
        hidden = int(need(cfg, "hidden_size"))
        layer_types = cfg.get("layer_types") or [
            "full_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)
        ]
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ModelConfigError(f"unsupported rope_type {rope.get('rope_type')!r} (only 'default')")
        lk_heads = int(cfg.get("linear_num_key_heads") or heads)
        lk_dim = int(cfg.get("linear_key_head_dim") or int(0.75 * hidden / lk_heads))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
        return cls(
            model_type="olmo_hybrid",
            vocab_size=int(need(cfg, "vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(need(cfg, "intermediate_size")),
            layer_types=tuple(layer_types),
            linear_num_key_heads=lk_heads,
            linear_num_value_heads=int(cfg.get("linear_num_value_heads") or heads),
            linear_key_head_dim=lk_dim,
            linear_value_head_dim=int(cfg.get("linear_value_head_dim") or 2 * lk_dim),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
            linear_allow_neg_eigval=bool(cfg.get("linear_allow_neg_eigval", True)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=None if rope.get("rope_theta") is None else float(rope["rope_theta"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 65536)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )


class OlmoGatedDeltaNet(DeltaRuleMixer):
    """Gated DeltaNet on the mixer contract (mixer.py), beta scaled, output gated by g_proj."""

    def __init__(self, cfg: OlmoHybridConfig):
        super().__init__()
        h = cfg.hidden_size
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = cfg.linear_conv_kernel_dim
        self.beta_scale = 2.0 if cfg.linear_allow_neg_eigval else 1.0
        self.q_proj = nn.Linear(h, self.key_dim, bias=False)
        self.k_proj = nn.Linear(h, self.key_dim, bias=False)
        self.v_proj = nn.Linear(h, self.value_dim, bias=False)
        self.a_proj = nn.Linear(h, self.hv, bias=False)
        self.b_proj = nn.Linear(h, self.hv, bias=False)
        self.g_proj = nn.Linear(h, self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, h, bias=False)
        d, w = self.conv_dim, self.conv_width
        self.conv1d = nn.Conv1d(d, d, w, groups=d, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.o_norm = GatedRMSNorm(self.dv, 1e-5)

    def empty_state(self, device) -> LinearState:
        return LinearState(
            ssm=torch.zeros(1, self.hv, self.dk, self.dv, dtype=torch.float32, device=device),
            conv=torch.zeros(1, self.conv_dim, self.conv_width - 1, dtype=self.o_proj.weight.dtype, device=device),
        )

    def project(self, x):
        """x [B, n, h] -> ((q|k|v [B, n, conv_dim] (pre-conv), b, a [B, n, Hv]), output gate [B, n, value_dim])."""
        lins = (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.a_proj, self.g_proj)
        mixed, b, a, g = merged_linear(x, getattr(self, "_in_proj", None), lins, [3, 1, 1, 1])
        return (mixed, b, a), g

    def recurrence_inputs(self, conv_out, rest):
        b, a = rest
        B, n = conv_out.shape[:2]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(B, n, self.hk, self.dk), k.reshape(B, n, self.hk, self.dk)
        rep = self.hv // self.hk  # grouped value heads share a key head
        q, k = backends.l2norm_qk(q, v.dtype, rep), backends.l2norm_qk(k, v.dtype, rep)
        g, beta = backends.gdn_gates(a, b, self.A_log, self.dt_bias)
        return q, k, v.reshape(B, n, self.hv, self.dv), g, beta * self.beta_scale

    def merge_projections(self) -> int:
        lins = (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.a_proj, self.g_proj)
        self._in_proj = merge_weights(*lins)
        return int(self._in_proj is not None)

    def finish(self, o, g):
        B, n = o.shape[:2]
        o = self.o_norm(o.reshape(-1, self.dv), g.reshape(-1, self.dv))
        return self.o_proj(o.view(B, n, self.value_dim))


class OlmoAttention(nn.Module):
    def __init__(self, cfg: OlmoHybridConfig):
        super().__init__()
        self.cfg = cfg
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, self.hq * self.d, bias=bias)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=bias)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.hq * self.d, h, bias=bias)
        self.q_norm = RMSNorm(self.hq * self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hkv * self.d, cfg.rms_norm_eps)

    def empty_state(self, device) -> AttnState:
        z = torch.zeros(1, self.hkv, 0, self.d, dtype=self.o_proj.weight.dtype, device=device)
        return AttnState(k=z, v=z.clone())

    def rotate(self, x, positions):
        cos, sin = rope_cos_sin(positions, self.d, self.cfg.rope_theta, torch.float32)
        return apply_rope(x.float(), cos, sin).to(x.dtype)

    def qkv(self, x, positions):
        """x [B, n, h] -> q [B, Hq, n, d], k, v [B, Hkv, n, d] (q, k rotated at `positions` unless NoPE)."""
        B, n = x.shape[:2]
        q = self.q_norm(self.q_proj(x)).view(B, n, self.hq, self.d).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(B, n, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.hkv, self.d).transpose(1, 2)
        if self.cfg.rope_theta is not None:
            q, k = self.rotate(q, positions), self.rotate(k, positions)
        return q, k, v

    def forward_layout(self, x, layout, state, rec, layer_idx, live_pos):
        q, k, v = self.qkv(x, live_pos)
        rotate = self.rotate if self.cfg.rope_theta is not None else None
        out = attention_layout(q, k, v, layout, state, rec, layer_idx, live_pos, self.d**-0.5, rotate)
        return self.o_proj(out)

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        B, L = x.shape[:2]
        q, k, v = self.qkv(x, torch.arange(L, device=x.device))
        out = build_attention(q, k, v, lengths, seam, datas, layer_idx, self.d**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class OlmoDecoderLayer(nn.Module):
    def __init__(self, cfg: OlmoHybridConfig, i: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == "linear_attention":
            self.linear_attn = OlmoGatedDeltaNet(cfg)
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        else:
            self.self_attn = OlmoAttention(cfg)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def empty_state(self, device):
        mixer = self.linear_attn if self.kind == "linear_attention" else self.self_attn
        return mixer.empty_state(device)

    def block(self, x, mix):
        """x [B, n, h] -> [B, n, h] around mix (the mixer on its input): linear layers pre-norm,
        attention layers post-norm."""
        if self.kind == "linear_attention":
            x = x + mix(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(mix(x))
        return x + self.post_feedforward_layernorm(self.mlp(x))

    def forward_layout(self, x, layout, state, rec, layer_idx, positions):
        if self.kind == "linear_attention":
            return self.block(x, lambda h: self.linear_attn.forward_layout(h, layout, state, rec, layer_idx))
        return self.block(x, lambda h: self.self_attn.forward_layout(h, layout, state, rec, layer_idx, positions))

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        mixer = self.linear_attn if self.kind == "linear_attention" else self.self_attn
        return self.block(x, lambda h: mixer.build_spans(h, lengths, seam, datas, layer_idx))


class OlmoHybridLM(LayoutLM):
    def __init__(self, cfg):
        super().__init__(
            cfg,
            Backbone(
                cfg,
                [OlmoDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)],
                RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            ),
        )
