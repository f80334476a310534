"""MiniMax-Text-01 (model_type minimax): lightning-attention linear layers interleaved with softmax
attention, a softmax top-k MoE in every block; tensor names of transformers' modeling_minimax.py.

Lightning attention is linear attention with a fixed decay per head and no query scale:
S_t = exp(-s_h) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t, with q, k, v = silu(qkv_proj(x)) split per
head. transformers computes it block-wise (intra-block decayed Q K^T, inter-block Q S with
exp(-s (i + 1)) query decays and exp(-s B) block decays); that is this recurrence regrouped. The
rate of head h in layer l is s = b^(h + 1) (1 - l / (L - 1 + 1e-5) + 1e-5), b = 2^(-8 / H): the
ALiBi base for every H (not interleaved as kernels/ops/simple_gla.lightning_slopes is for
non-powers of two) times a per-layer factor that takes the decay to ~1 in the last layer. So a
segment's T is a scalar per head, exp(-s n) (docs/concepts.md, "The math"), and there is no short conv: the conv
tail of an entry is empty.

The output is RMSNorm over all heads (eps 1e-6), gated by sigmoid(output_gate(x)). Blocks are
post-norm-like: the residual is the *normalized* input, scaled by alpha, the mixer's output by
beta (separate factors for lightning, softmax attention and the MoE). Softmax attention is GQA
with RoPE over the whole head, so cached K is re-rotated on reuse; transformers' minimax ignores
partial_rotary_factor / rotary_dim, so configs asking for partial RoPE are refused.

Checkpoints carry transformers' per-layer decay buffers (slope_rate, query/key/diagonal_decay), as
save_pretrained writes them; the experts' hub names (block_sparse_moe.experts.E.w1 / w2 / w3) are
mapped by runtime/hub_names.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.models.bamba import RopeAttention
from hybridcache.services.runtime.models.common import (
    Backbone,
    BlockLayer,
    LayerTypes,
    LayoutLM,
    RMSNorm,
    eos_ids,
    need,
    softmax_top_k,
)
from hybridcache.services.runtime.models.mixer import LinearMixer
from hybridcache.services.runtime.models.qwen3_hybrid import Experts, Router
from hybridcache.services.runtime.sequence import LinearState
from torch import nn


@dataclass(frozen=True)
class MiniMaxConfig(LayerTypes):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int  # lightning and softmax attention alike
    num_key_value_heads: int  # softmax attention only
    head_dim: int
    intermediate_size: int  # per expert
    num_experts: int
    num_experts_per_tok: int
    block_size: int = 256  # transformers' lightning block; only the shapes of the decay buffers
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    full_attn_alpha_factor: float = 1.0
    full_attn_beta_factor: float = 1.0
    linear_attn_alpha_factor: float = 1.0
    linear_attn_beta_factor: float = 1.0
    mlp_alpha_factor: float = 1.0
    mlp_beta_factor: float = 1.0
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    attention_bias: bool = False  # read by the shared RoPE attention

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelConfigError("layer_types must have num_hidden_layers entries")
        if not set(self.layer_types) <= {"linear_attention", "full_attention"}:
            raise ModelConfigError(f"unsupported minimax layer type(s) in {sorted(set(self.layer_types))}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError("minimax needs num_local_experts >= num_experts_per_tok > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim {self.head_dim} must be even (RoPE)")
        if self.block_size < 1:
            raise ModelConfigError(f"block_size must be positive, got {self.block_size}")

    @property
    def moe_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def linear_conv_kernel_dim(self) -> int:
        """No short conv: an entry's body needs no conv tail (engine.cacheable reads this)."""
        return 1

    def slopes(self, layer_idx: int, device=None) -> torch.Tensor:
        """Decay rates s [H] of a lightning layer, computed as transformers computes them (fp32)."""
        heads = self.num_attention_heads
        base = 1 / (2 ** (8 / heads))
        rate = base ** (torch.arange(heads, device=device) + 1)
        return rate * (1 - layer_idx / (self.num_hidden_layers - 1 + 1e-5) + 1e-5)

    def entry_nbytes(self, body_tokens: int, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
        """Scalar T [H] and S [H, d, d] (state_dtype) per lightning layer, no conv tail; K/V per attention layer."""
        esz = torch.tensor([], dtype=dtype).element_size()
        ssz = torch.tensor([], dtype=state_dtype).element_size()
        h, d = self.num_attention_heads, self.head_dim
        per_linear = ssz * h * (1 + d * d)
        per_attn = 2 * esz * self.num_key_value_heads * d * body_tokens
        return len(self.linear_layers) * per_linear + len(self.attention_layers) * per_attn

    @classmethod
    def from_dict(cls, cfg: dict) -> MiniMaxConfig:
        n_layers = int(need(cfg, "num_hidden_layers"))
        hidden, heads = int(need(cfg, "hidden_size")), int(need(cfg, "num_attention_heads"))
        types = cfg.get("layer_types")
        if types is None and cfg.get("attn_type_list") is not None:
            # the original MiniMax-Text-01 config: 0 = lightning, 1 = softmax attention
            types = ["full_attention" if int(t) else "linear_attention" for t in cfg["attn_type_list"]]
        if types is None:
            # transformers' default: softmax attention in even layers
            types = ["linear_attention" if i % 2 else "full_attention" for i in range(n_layers)]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
        if cfg.get("sliding_window") is not None:
            raise ModelConfigError("minimax with a sliding_window is not supported")
        if not cfg.get("postnorm", True):
            raise ModelConfigError("minimax with postnorm false is not supported (transformers' minimax is postnorm)")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ModelConfigError(f"unsupported rope_type {rope.get('rope_type')!r} (only 'default')")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        rotary = cfg.get("rotary_dim") or head_dim * float(rope.get("partial_rotary_factor", 1.0))
        if int(rotary) != head_dim:
            # transformers' minimax rotates the whole head whatever the config says: refuse, not guess
            raise ModelConfigError(f"partial RoPE (rotary dim {rotary} of head_dim {head_dim}) is not supported")
        # transformers' names, else the remote-code checkpoint's (layernorm_full_attention_alpha, ...)
        factors = {
            f"{part}_{ab}_factor": float(cfg.get(f"{part}_{ab}_factor", cfg.get(f"layernorm_{old}_{ab}", 1.0)))
            for part, old in (("full_attn", "full_attention"), ("linear_attn", "linear_attention"), ("mlp", "mlp"))
            for ab in ("alpha", "beta")
        }
        return cls(
            model_type="minimax",
            vocab_size=int(need(cfg, "vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=tuple(types),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(need(cfg, "intermediate_size")),
            num_experts=int(cfg.get("num_local_experts", cfg.get("num_experts", 8))),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
            block_size=int(cfg.get("block_size", 256)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e6))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            **factors,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )


class LightningAttention(LinearMixer):
    """Lightning attention on the mixer contract (mixer.py), without a short conv (conv_width 1):
    rec = (q, k, v, g) with g None (the layer's fixed decays) or a per-step log decay [B, n, H]
    once identity_steps has made padding steps g = 0, k = 0 (no decay, no update). T_t =
    exp(sum g) is a scalar per head; u_t = T_t q_t (backends.simple_gla_pieces)."""

    conv_width = 1

    def __init__(self, cfg: MiniMaxConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.nh, self.d = cfg.num_attention_heads, cfg.head_dim
        self.head_start = 0  # the first of this module's heads (tensor parallelism keeps a block of them)
        inner = self.nh * self.d
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * inner, bias=False)
        self.output_gate = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.norm = RMSNorm(inner, 1e-6)
        self.out_proj = nn.Linear(inner, cfg.hidden_size, bias=False)
        # transformers' save_pretrained writes its block-decay buffers: held (and written) only so
        # that such directories load and transformers reads ours; the scan recomputes the rates in fp32
        s = cfg.slopes(layer_idx)[:, None, None]  # [H, 1, 1]
        pos = torch.arange(cfg.block_size) + 1
        diag = s * (pos[:, None] - pos[None, :])
        self.register_buffer("slope_rate", s)
        self.register_buffer("query_decay", torch.exp(-s * pos[:, None]))  # [H, B, 1]
        self.register_buffer("key_decay", torch.exp(-s * (cfg.block_size - pos[:, None])))
        self.register_buffer("diagonal_decay", torch.exp(torch.where(diag >= 0, -diag, float("-inf")))[None])

    def empty_state(self, device) -> LinearState:
        dt = self.out_proj.weight.dtype
        return LinearState(
            ssm=torch.zeros(1, self.nh, self.d, self.d, dtype=torch.float32, device=device),
            conv=torch.zeros(1, 0, 0, dtype=dt, device=device),
        )

    def slopes(self, device):
        """This module's heads' decay rates [H] (fp32)."""
        return self.cfg.slopes(self.layer_idx, device)[self.head_start : self.head_start + self.nh]

    def project(self, x):
        """x [B, n, h] -> ((silu(qkv) [B, n, 3 H d],), x (the output gate's input))."""
        return (F.silu(self.qkv_proj(x)),), x

    def recurrence_inputs(self, qkv, rest):
        q, k, v = qkv.reshape(*qkv.shape[:2], self.nh, 3 * self.d).split(self.d, dim=-1)  # [B, n, H, d] each
        return q, k, v, None

    def log_decays(self, rec):
        """The per-step log decay [B, n, H] of rec: its g, or the layer's -slopes at every step."""
        q, _, _, g = rec
        return g if g is not None else (-self.slopes(q.device))[None, None, :].expand(*q.shape[:3])

    def identity_steps(self, rec, pad):
        q, k, v, _ = rec
        g = self.log_decays(rec).masked_fill(pad[..., None], 0.0)
        return q, k.masked_fill(pad[..., None, None], 0.0), v, g

    def recurrence(self, rec, initial_state, output_transition):
        q, k, v, g = rec
        if g is None:
            res = backends.lightning_attention(q, k, v, self.slopes(q.device), 1.0, initial_state, output_transition)
        else:
            res = backends.simple_gla(q, k, v, g, 1.0, initial_state, output_transition)
        return res[0], res[1], (res[2] if output_transition else None)

    def pieces(self, rec):
        q, k, v, _ = rec
        return backends.simple_gla_pieces(q, k, v, self.log_decays(rec), 1.0)

    def recurrence_step(self, qkv, rest, pool, slots):
        """The plain recurrence's step (kernels/ops/recurrent_step) with the layer's fixed decays."""
        q, k, v, _ = self.recurrence_inputs(qkv[:, None], rest)  # [B, 1, H, d] each
        g = -self.slopes(q.device)[None, :].expand(q.shape[0], self.nh)
        return backends.recurrent_step(q[:, 0], k[:, 0], v[:, 0], g, None, pool, slots, scale=1.0)

    def finish(self, o, x):
        B, n = o.shape[:2]
        o = self.norm(o.reshape(B, n, self.nh * self.d))
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * o)


class MiniMaxMoE(nn.Module):
    """Softmax router, top-k renormalized, SwiGLU experts (fused 3-D weights); no shared expert."""

    def __init__(self, cfg: MiniMaxConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        path = self.experts.path(flat, self.top_k)
        top_w, top_i = softmax_top_k(backends.linear(flat, self.gate.weight), self.top_k, True, torch.float,
                                     fused=path == "pairs")
        out = self.experts(flat, top_i, top_w, path=path)
        return out.view(shape)


class MiniMaxDecoderLayer(BlockLayer):
    def __init__(self, cfg: MiniMaxConfig, i: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        if self.kind == "linear_attention":
            self.self_attn = LightningAttention(cfg, i)
            self.attn_alpha, self.attn_beta = cfg.linear_attn_alpha_factor, cfg.linear_attn_beta_factor
        else:
            self.self_attn = RopeAttention(cfg)
            self.attn_alpha, self.attn_beta = cfg.full_attn_alpha_factor, cfg.full_attn_beta_factor
        self.mlp_alpha, self.mlp_beta = cfg.mlp_alpha_factor, cfg.mlp_beta_factor
        self.mlp = MiniMaxMoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def empty_state(self, device):
        return self.self_attn.empty_state(device)

    def block(self, x, mix):
        """x [B, n, h] -> [B, n, h]; mix(h) runs the mixer. The residual is the normalized input
        (transformers' MiniMaxDecoderLayer)."""
        h = self.input_layernorm(x)
        h = self.post_attention_layernorm(h * self.attn_alpha + mix(h) * self.attn_beta)
        return h * self.mlp_alpha + self.mlp(h) * self.mlp_beta



class MiniMaxLM(LayoutLM):
    def __init__(self, cfg):
        super().__init__(
            cfg,
            Backbone(
                cfg,
                [MiniMaxDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)],
                RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            ),
        )
