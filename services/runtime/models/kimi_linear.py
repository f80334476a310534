"""Kimi-Linear (model_type kimi_linear): KDA linear layers + MLA attention, MLP / MoE blocks,
with the checkpoint's tensor names (transformers' modeling_kimi_linear.py).

KDA is a delta rule with a per-channel forget gate, so a segment's transition T is a dense
K x K matrix per head (docs/concepts.md, "The math"; kernels/ops/kda). The gate is g = -exp(A_log) softplus(f_b(f_a(x))
+ dt_bias) per channel, beta = sigmoid(b_proj(x)); q and k are L2-normalised after a silu short
conv; the output goes through an RMSNorm gated by sigmoid(g_b(g_a(x))).

MLA attention has no positional encoding (NoPE: its "rope" part of the key is shared across
heads but never rotated), so cached keys are used as stored whatever the shift. The attention
state and a segment entry hold the compressed latents only — c = kv_a_layernorm(kv_a(x)) [r] and
the shared key part k_r [d_rope] per token, not per-head K/V — and attention runs on them with the
up-projection absorbed into the query and the output: score_h = (W_uk,h^T q_nope,h) . c +
q_rope,h . k_r, o_h = W_uv,h (sum softmax * c). That is multi-query attention over [c, k_r].
Blocks are pre-norm; the MLP of a block is dense (SwiGLU) or a DeepSeek-V3 MoE (sigmoid router
with a score-correction bias, group-limited top-k, routed scaling, one shared expert).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.models.common import (
    Backbone,
    BlockLayer,
    DecodeBatch,
    LayerTypes,
    LayoutLM,
    RMSNorm,
    eos_ids,
    first_live_start,
    merge_weights,
    merged_linear,
    need,
)
from hybridcache.services.runtime.models.mixer import LinearMixer, attention_spans
from hybridcache.services.runtime.models.qwen3_hybrid import MLP, Experts
from hybridcache.services.runtime.sequence import AttnSpan, AttnState, CachedSpan, LinearState
from torch import nn


def _first(cfg: dict, *keys, default=None):
    """The value of the first of `keys` present in cfg (config.json spells MoE fields two ways)."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


@dataclass(frozen=True)
class KimiLinearConfig(LayerTypes):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per block
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    # MLA
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers or len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ModelConfigError("layer_types and mlp_layer_types must have num_hidden_layers entries")
        if not set(self.layer_types) <= {"linear_attention", "full_attention"}:
            raise ModelConfigError(f"unsupported kimi_linear layer type(s) in {sorted(set(self.layer_types))}")
        if not set(self.mlp_layer_types) <= {"dense", "sparse"}:
            raise ModelConfigError(f"unsupported kimi_linear mlp layer type(s) in {sorted(set(self.mlp_layer_types))}")
        if "sparse" in self.mlp_layer_types:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ModelConfigError(
                    "sparse blocks need num_experts >= num_experts_per_tok > 0 and moe_intermediate_size > 0"
                )
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ModelConfigError("num_experts must be a multiple of n_group and 0 < topk_group <= n_group")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.linear_num_heads * self.linear_head_dim

    def entry_nbytes(self, body_tokens: int, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
        """Dense T and S (state_dtype) and the conv tail per KDA layer; MLA latents [c, k_r] per attention layer."""
        esz = torch.tensor([], dtype=dtype).element_size()
        ssz = torch.tensor([], dtype=state_dtype).element_size()
        h, d = self.linear_num_heads, self.linear_head_dim
        per_linear = ssz * h * d * (d + d) + esz * self.conv_dim * (self.linear_conv_kernel_dim - 1)
        per_attn = esz * (self.kv_lora_rank + self.qk_rope_head_dim) * body_tokens
        return len(self.linear_layers) * per_linear + len(self.attention_layers) * per_attn

    @classmethod
    def from_dict(cls, cfg: dict) -> KimiLinearConfig:
        n_layers = int(need(cfg, "num_hidden_layers"))
        heads = int(need(cfg, "num_attention_heads"))
        # num_key_value_heads is not read: MLA expands its latents to every head (transformers needs it equal
        # to num_attention_heads, the runtime does not)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
        lin = cfg.get("linear_attn_config") or {}
        layer_types = cfg.get("layer_types")
        if layer_types is None and "full_attn_layers" in lin and "kda_layers" in lin:
            # the checkpoint's lists are 1-indexed
            full = {int(i) - 1 for i in lin["full_attn_layers"]}
            layer_types = ["full_attention" if i in full else "linear_attention" for i in range(n_layers)]
        if layer_types is None:
            layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            k_dense = int(cfg.get("first_k_dense_replace", 1))
            mlp_types = ["dense" if i < k_dense else "sparse" for i in range(n_layers)]
        q_lora = cfg.get("q_lora_rank")
        return cls(
            model_type="kimi_linear",
            vocab_size=int(need(cfg, "vocab_size")),
            hidden_size=int(need(cfg, "hidden_size")),
            num_hidden_layers=n_layers,
            intermediate_size=int(need(cfg, "intermediate_size")),
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_types),
            linear_num_heads=int(lin.get("num_heads", cfg.get("linear_num_heads", 32))),
            linear_head_dim=int(lin.get("head_dim", cfg.get("linear_head_dim", 128))),
            linear_conv_kernel_dim=int(lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4))),
            num_attention_heads=heads,
            kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
            q_lora_rank=None if q_lora is None else int(q_lora),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
            v_head_dim=int(cfg.get("v_head_dim") or 128),
            attention_bias=bool(cfg.get("attention_bias", False)),
            num_experts=int(_first(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=256)),
            num_experts_per_tok=int(_first(cfg, "num_experts_per_token", "num_experts_per_tok", default=8)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1024)),
            num_shared_experts=int(_first(cfg, "num_shared_experts", "n_shared_experts", default=1)),
            n_group=int(_first(cfg, "num_expert_group", "n_group", default=1)),
            topk_group=int(cfg.get("topk_group") or 1),
            norm_topk_prob=bool(_first(cfg, "moe_renormalize", "norm_topk_prob", default=True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.446)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(_first(cfg, "model_max_length", "max_position_embeddings", default=1048576)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )


class SigmoidGatedRMSNorm(nn.Module):
    """weight * x / rms(x) * sigmoid(gate) over the head dim, all in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        xf = x.float()
        xf = self.weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * torch.sigmoid(gate.float())).to(x.dtype)


class ForgetGate(nn.Module):
    """Per-channel log forget gate g [.., H, K] = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)."""

    def __init__(self, cfg: KimiLinearConfig):
        super().__init__()
        self.h, self.d = cfg.linear_num_heads, cfg.linear_head_dim
        self.f_a_proj = nn.Linear(cfg.hidden_size, self.d, bias=False)
        self.f_b_proj = nn.Linear(self.d, self.h * self.d, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.h * self.d))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.h, 1))

    def forward(self, x):
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(*x.shape[:2], self.h, self.d)
        return -self.A_log.float().exp() * F.softplus(g, threshold=20.0)


class KimiDeltaAttention(LinearMixer):
    """KDA on the mixer contract (mixer.py): the conv reads q|k|v; rec = (q, k, v, g, beta) with a
    per-channel log gate g [B, n, H, K]. g = 0 and beta = 0 is the identity step (A_t = I, no
    update); the query transition u_t = scale T_t^T q_t comes from the kernels (backends.kda_pieces)."""

    def __init__(self, cfg: KimiLinearConfig):
        super().__init__()
        h = cfg.hidden_size
        self.nh, self.d = cfg.linear_num_heads, cfg.linear_head_dim
        self.qkv_dim = self.nh * self.d
        self.conv_dim, self.conv_width = cfg.conv_dim, cfg.linear_conv_kernel_dim
        self.q_proj = nn.Linear(h, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(h, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(h, self.qkv_dim, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False)
        self.forget_gate = ForgetGate(cfg)
        self.b_proj = nn.Linear(h, self.nh, bias=False)
        self.g_a_proj = nn.Linear(h, self.d, bias=False)
        self.g_b_proj = nn.Linear(self.d, self.qkv_dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.d, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, h, bias=False)

    def empty_state(self, device) -> LinearState:
        return LinearState(
            ssm=torch.zeros(1, self.nh, self.d, self.d, dtype=torch.float32, device=device),
            conv=torch.zeros(1, self.conv_dim, self.conv_width - 1, dtype=self.o_proj.weight.dtype, device=device),
        )

    def project(self, x):
        """x [B, n, h] -> ((q|k|v [B, n, conv_dim] (pre-conv), g [B, n, H, K], beta [B, n, H]), g_a)."""
        lins = (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.g_a_proj)
        mixed, b, g_a = merged_linear(x, getattr(self, "_in_proj", None), lins, [3, 1, 1])
        return (mixed, self.forget_gate(x), torch.sigmoid(b.float())), g_a

    def recurrence_inputs(self, conv_out, rest):
        g, beta = rest
        B, n = conv_out.shape[:2]
        q, k, v = (t.reshape(B, n, self.nh, self.d) for t in torch.split(conv_out, self.qkv_dim, dim=-1))
        return backends.l2norm_fp32(q), backends.l2norm_fp32(k), v, g, beta

    def identity_steps(self, rec, pad):
        q, k, v, g, beta = rec
        return q, k, v, g.masked_fill(pad[..., None, None], 0.0), beta.masked_fill(pad[..., None], 0.0)

    def recurrence(self, rec, initial_state, output_transition):
        res = backends.kda(*rec, initial_state, output_transition)
        return res[0], res[1], (res[2] if output_transition else None)

    def pieces(self, rec):
        return backends.kda_pieces(*rec)

    def recurrence_step(self, conv_out, rest, pool, slots):
        """One launch on CUDA: q and k (views of the conv output) L2-normalized inside the kernel,
        the per-key gate g [B, H, K] and beta [B, H] as project made them."""
        g, beta = rest
        B = conv_out.shape[0]
        q, k, v = (t.view(B, self.nh, self.d) for t in torch.split(conv_out, self.qkv_dim, dim=-1))
        return backends.recurrent_step(q, k, v, g, beta, pool, slots, l2norm_qk=True)

    def merge_projections(self) -> int:
        self._in_proj = merge_weights(self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.g_a_proj)
        return int(self._in_proj is not None)

    def finish(self, o, g_a):
        B, n = o.shape[:2]
        gate = self.g_b_proj(g_a).view(B, n, self.nh, self.d)
        return self.o_proj(self.o_norm(o, gate).reshape(B, n, self.qkv_dim))


class MLAttention(nn.Module):
    """Multi-head latent attention without positions, run on the compressed latents (module docstring)."""

    def __init__(self, cfg: KimiLinearConfig):
        super().__init__()
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.nh, self.r = cfg.num_attention_heads, cfg.kv_lora_rank
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.scale = cfg.qk_head_dim**-0.5
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.nh * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.r + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = nn.Linear(self.r, self.nh * (self.dn + self.dv), bias=False)
        self.kv_b_proj.keeps_row_major = True  # absorbed into the attention as a view of its weight
        self.o_proj = nn.Linear(self.nh * self.dv, h, bias=bias)

    def empty_state(self, device) -> AttnState:
        """k holds the latents c [1, 1, N, r], v the shared key part k_r [1, 1, N, d_rope]."""
        dt = self.o_proj.weight.dtype
        return AttnState(
            k=torch.zeros(1, 1, 0, self.r, dtype=dt, device=device),
            v=torch.zeros(1, 1, 0, self.dr, dtype=dt, device=device),
        )

    def query(self, x):
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def gather_latents(self, c, k_r, layout, state: AttnState, rec, layer_idx):
        """Latents of everything before and in this layout, in position order; records entries."""
        cs, rs, off = [state.k], [state.v], 0
        for idx, piece in enumerate(layout):
            if isinstance(piece, CachedSpan):
                # NoPE: a cached span's keys are valid at any position, piece.shift is ignored
                span = piece.data.attn[layer_idx]
                cs.append(span.k.to(c.dtype))
                rs.append(span.v.to(c.dtype))
                continue
            m = piece.token_ids.numel()
            cs.append(c[:, :, off : off + m])
            rs.append(k_r[:, :, off : off + m])
            if rec is not None and piece.record == "entry":
                rec.entries[idx].attn[layer_idx] = AttnSpan(k=cs[-1].clone(), v=rs[-1].clone())
            off += m
        state.k, state.v = torch.cat(cs, dim=2), torch.cat(rs, dim=2)
        return state.k, state.v

    def latents(self, x):
        """x [B, n, h] -> the absorbed queries q_lat [B, H, n, r + dr], latents c [B, 1, n, r],
        shared key parts k_r [B, n, dr] and the value up-projection w_uv [H, dv, r]."""
        B, n = x.shape[:2]
        q = self.query(x).view(B, n, self.nh, self.dn + self.dr).transpose(1, 2)  # [B, H, n, dn + dr]
        q_nope, q_rope = q.split([self.dn, self.dr], dim=-1)
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.r, self.dr], dim=-1)
        c = self.kv_a_layernorm(c)[:, None]  # [B, 1, n, r]
        w = self.kv_b_proj.weight.view(self.nh, self.dn + self.dv, self.r)
        w_uk, w_uv = w[:, : self.dn], w[:, self.dn :]  # [H, dn, r], [H, dv, r]
        q_lat = torch.cat([torch.einsum("bhnd,hdr->bhnr", q_nope, w_uk), q_rope], dim=-1)
        return q_lat, c, k_r, w_uv

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        """Standalone prefill of B padded segments: causal attention over each one's latents,
        the body latents [c, k_r] into datas[j] (NoPE: no positions to record)."""
        B, L = x.shape[:2]
        q_lat, c, k_r, w_uv = self.latents(x)
        k_r = k_r[:, None]  # [B, 1, L, dr]
        o_lat = backends.sdpa(q_lat, torch.cat([c, k_r], dim=-1), c, is_causal=True, scale=self.scale, enable_gqa=True)
        attention_spans(c, k_r, lengths, seam, datas, layer_idx)
        out = torch.einsum("bhnr,hvr->bnhv", o_lat, w_uv).reshape(B, L, self.nh * self.dv)
        return self.o_proj(out)

    def forward_layout(self, x, layout, state, rec, layer_idx, live_pos):
        n = x.shape[1]
        q_lat, c, k_r, w_uv = self.latents(x)
        if isinstance(layout, DecodeBatch):
            # one token of each of n requests: latents and key parts written into their pages, then
            # gathered for the batch under a key mask
            layout.write(layout.kv.k[layer_idx], c[0].transpose(0, 1))  # [n, 1, r]
            layout.write(layout.kv.v[layer_idx], k_r.transpose(0, 1))  # [n, 1, dr]
            C, K_r, mask = layout.gather(layer_idx)  # [n, 1, N, r], [n, 1, N, dr], [n, 1, 1, N]
            qb = q_lat[0].transpose(0, 1)[:, :, None]  # [n, H, 1, r + dr]
            o_lat = backends.sdpa(qb, torch.cat([C, K_r], dim=-1), C, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out = torch.einsum("nhr,hvr->nhv", o_lat[:, :, 0], w_uv).reshape(1, n, self.nh * self.dv)
            return self.o_proj(out)
        C, K_r = self.gather_latents(c, k_r[:, None], layout, state, rec, layer_idx)
        k_lat = torch.cat([C, K_r], dim=-1)  # [1, 1, N, r + dr]
        N = C.shape[2]
        mask = None
        if not (n == 1 and first_live_start(layout) == N - 1):
            mask = torch.arange(N, device=x.device)[None, :] <= live_pos[:, None]  # [n, N]
        o_lat = backends.sdpa(q_lat, k_lat, C, attn_mask=mask, scale=self.scale, enable_gqa=True)  # [1, H, n, r]
        out = torch.einsum("bhnr,hvr->bnhv", o_lat, w_uv).reshape(1, n, self.nh * self.dv)
        return self.o_proj(out)


class TopkRouter(nn.Module):
    """DeepSeek-V3 router: sigmoid scores, top-k among the best groups chosen with a bias, scaled weights."""

    def __init__(self, cfg: KimiLinearConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def forward(self, x):
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [n, E]
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)  # [n, G]
        top_groups = group_scores.topk(cfg.topk_group, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(cfg.num_experts // cfg.n_group, dim=1), float("-inf"))
        top_i = choice.topk(cfg.num_experts_per_tok, dim=-1)[1]
        top_w = scores.gather(1, top_i)
        if cfg.norm_topk_prob:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_w * cfg.routed_scaling_factor, top_i


class MoE(nn.Module):
    """Routed experts (fused 3-D weights, Qwen's layout) plus always-on shared experts."""

    def __init__(self, cfg: KimiLinearConfig):
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)
        # the pair-major MoE kernels read these weights themselves, row-major (backends.column_major_linears)
        for lin in self.shared_experts.children():
            lin.keeps_row_major = True

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        top_w, top_i = self.gate(flat)
        path = self.experts.path(flat, top_w.shape[1])
        if path == "pairs":
            # the (ungated) shared experts run inside the routed experts' two launches
            return self.experts(flat, top_i, top_w, self.shared_experts.as_shared(), path).view(shape)
        out = self.experts(flat, top_i, top_w, path=path)
        return out.view(shape) + self.shared_experts(x)


class KimiDecoderLayer(BlockLayer):
    def __init__(self, cfg: KimiLinearConfig, i: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.self_attn = KimiDeltaAttention(cfg) if self.kind == "linear_attention" else MLAttention(cfg)
        dense = cfg.mlp_layer_types[i] == "dense"
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if dense else MoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def empty_state(self, device):
        return self.self_attn.empty_state(device)

    def block(self, x, mix):
        """x [B, n, h] -> [B, n, h]: pre-norm mixer and MLP halves; mix(h) runs the mixer."""
        x = x + mix(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))



class KimiLinearLM(LayoutLM):
    # its MLA layers gather their latents themselves (gather_latents): a prefill keeps them contiguous
    paged_prefill = False

    def __init__(self, cfg):
        super().__init__(
            cfg,
            Backbone(
                cfg,
                [KimiDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)],
                RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            ),
        )
