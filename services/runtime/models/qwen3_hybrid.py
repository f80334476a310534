"""Qwen3-Next and Qwen3.5 (dense and MoE) text models: Gated DeltaNet + gated full attention.

The modules mirror the Hugging Face checkpoints' tensor names, so a checkpoint loads by name.
`HybridLM.forward_layout` runs only the live tokens of a layout (sequence.py), layer by layer:
linear layers scan live runs from the running state and fold cached spans in with one T S + S;
attention layers let live tokens attend to all K/V before them, cached spans' K re-rotated.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.moe import SharedExpert
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.config import ModelConfig
from hybridcache.services.runtime.models.common import (
    Backbone,
    DecodeBatch,
    LayoutLM,
    attention_layout,
    merge_weights,
    merged_linear,
    route,
)
from hybridcache.services.runtime.models.mixer import DeltaRuleMixer, build_attention
from hybridcache.services.runtime.sequence import AttnState, LinearState, Recording
from torch import nn


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        if backends.use_fast_kernels(x):
            fused = backends.fused_rms_norm(x, self._scale(), self.eps)
            if fused is not None:
                return fused
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def _scale(self):
        """1 + weight in fp32, kept until the weight changes (the fused kernel's multiplier)."""
        w = self.weight
        key = (backends.tensor_version(w), w.data_ptr(), w.device, w.dtype)
        if getattr(self, "_scale_key", None) != key:
            self._scale_cache = 1.0 + w.detach().float()
            self._scale_key = key
        return self._scale_cache


class GatedRMSNorm(nn.Module):
    """RMSNorm over the value head dim, then times silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        """x [..., D] and gate of x's elements with the same last dim (any shape: a strided
        [B, n, H, D] view of a projection is read in place on CUDA)."""
        if backends.use_fast_kernels(x):
            fused = backends.fused_rms_norm_gated(x, gate, self.weight, self.eps)
            if fused is not None:
                return fused
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        xf = self.weight * xf.to(dtype)
        return (xf * F.silu(gate.float()).reshape(xf.shape)).to(dtype)


@functools.lru_cache(maxsize=16)
def _inv_freq(rotary_dim: int, theta: float, device) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype):
    """cos, sin [n, rotary_dim] for integer positions [n].

    Every attention layer of a forward rotates its queries and keys at the same positions tensor
    (and the cached keys at one shift table): the result is kept with the positions tensor
    (backends.kept_for) instead of about ten launches per rotation again (16 rotations a forward
    at the Qwen3.5-9B shape, a decode step included)."""

    def build():
        freqs = positions.float()[:, None] * _inv_freq(rotary_dim, float(theta), positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    return backends.kept_for(("rope", rotary_dim, float(theta), dtype, positions.device), positions, None, build)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [1, H, n, d] by cos/sin [n, rotary_dim]."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


class GatedDeltaNet(DeltaRuleMixer):
    """Gated DeltaNet on the mixer contract (mixer.py): the conv reads q|k|v, the output is
    normed and gated by z."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = cfg.linear_conv_kernel_dim
        # Qwen3-Next packs q, k, v, z (and b, a) per key-head group; Qwen3.5 keeps them apart.
        self.fused_projections = cfg.family == "qwen3_next"
        h = cfg.hidden_size
        if self.fused_projections:
            self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, self.hv, bias=False)
            self.in_proj_a = nn.Linear(h, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def projections(self, x):
        """x [B, n, h] -> mixed_qkv [B, n, conv_dim] (pre-conv), z [B, n, Hv, dv], b, a [B, n, Hv]."""
        B, n = x.shape[:2]
        if self.fused_projections:
            qkvz, ba = merged_linear(x, getattr(self, "_in_proj", None), (self.in_proj_qkvz, self.in_proj_ba))
            qkvz, ba = qkvz.reshape(B, n, self.hk, -1), ba.reshape(B, n, self.hk, -1)
            r = self.hv // self.hk
            q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
            b, a = torch.split(ba, [r, r], dim=-1)
            mixed = torch.cat([q.reshape(B, n, -1), k.reshape(B, n, -1), v.reshape(B, n, -1)], dim=-1)
            return mixed, z.reshape(B, n, self.hv, self.dv), b.reshape(B, n, self.hv), a.reshape(B, n, self.hv)
        mixed, z, b, a = merged_linear(
            x, getattr(self, "_in_proj", None), (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        )
        return mixed, z.reshape(B, n, self.hv, self.dv), b, a

    def merge_projections(self) -> int:
        if self.fused_projections:
            self._in_proj = merge_weights(self.in_proj_qkvz, self.in_proj_ba)
        else:
            self._in_proj = merge_weights(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        return int(self._in_proj is not None)

    def empty_state(self, device) -> LinearState:
        return LinearState(
            ssm=torch.zeros(1, self.hv, self.dk, self.dv, dtype=torch.float32, device=device),
            conv=torch.zeros(1, self.conv_dim, self.conv_width - 1, dtype=self.out_proj.weight.dtype, device=device),
        )

    def project(self, x):
        """x [B, n, h] -> ((mixed_qkv [B, n, conv_dim] (pre-conv), b, a [B, n, Hv]), z [B, n, Hv, dv])."""
        mixed, z, b, a = self.projections(x)
        return (mixed, b, a), z

    def recurrence_inputs(self, conv_out, rest):
        return self.qkv_gates(conv_out, *rest)

    def qkv_gates(self, conv_out, b, a):
        """conv outputs [B, n, conv_dim], b, a [B, n, Hv] -> q, k [B, n, Hv, dk] (L2-normed; fp32, or
        v's dtype on CUDA with fla, whose kernels take that), v [B, n, Hv, dv], g, beta [B, n, Hv] fp32."""
        B, n = conv_out.shape[:2]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, n, self.hk, self.dk)
        k = k.reshape(B, n, self.hk, self.dk)
        v = v.reshape(B, n, self.hv, self.dv)
        rep = self.hv // self.hk  # grouped value heads share a key head
        q, k = backends.l2norm_qk(q, v.dtype, rep), backends.l2norm_qk(k, v.dtype, rep)
        g, beta = backends.gdn_gates(a, b, self.A_log, self.dt_bias)
        return q, k, v, g, beta

    def finish(self, o, z):
        """Gated RMSNorm of the outputs o [B, n, Hv, dv] by z, then the output projection."""
        B, n = o.shape[:2]
        # z [B, n, Hv, dv] is a strided slice of the projection: the norm's kernel reads it in place
        o = self.norm(o.reshape(-1, self.dv), z).view(B, n, self.value_dim)
        return self.out_proj(o)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.hq * self.d * 2, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.hq * self.d, h, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.d, cfg.rms_norm_eps)

    def merge_projections(self) -> int:
        self._qkv = merge_weights(self.q_proj, self.k_proj, self.v_proj)
        return int(self._qkv is not None)

    def rope(self, positions, dtype):
        return rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta, dtype)

    def rotate(self, x, positions):
        """x [1, H, N, d] rotated by per-position angles positions [N]."""
        if backends.use_fast_kernels(x):
            return backends.rope_heads(x, *self.rope(positions, torch.float32))
        cos, sin = self.rope(positions, x.dtype)
        return apply_rope(x, cos, sin)

    def empty_state(self, device) -> AttnState:
        dt = self.o_proj.weight.dtype
        z = torch.zeros(1, self.hkv, 0, self.d, dtype=dt, device=device)
        return AttnState(k=z, v=z.clone())

    def projections(self, x):
        """x [B, n, h] -> q [B, n, Hq, d], k, v [B, n, Hkv, d], gate [B, n, Hq, d]: token-major
        views of the merged projection (nothing normalized or rotated)."""
        B, n = x.shape[:2]
        qg, k, v = merged_linear(x, getattr(self, "_qkv", None), (self.q_proj, self.k_proj, self.v_proj))
        q, gate = torch.chunk(qg.reshape(B, n, self.hq, 2 * self.d), 2, dim=-1)
        return q, k.reshape(B, n, self.hkv, self.d), v.reshape(B, n, self.hkv, self.d), gate

    def qkv(self, x, positions):
        """x [B, n, h] -> q [B, Hq, n, d], k, v [B, Hkv, n, d] (q, k rotated at `positions`), gate [B, n, Hq, d]."""
        q, k, v, gate = self.projections(x)
        v = v.transpose(1, 2)
        if backends.use_fast_kernels(x):
            # head norm and rotation in one launch each for q and k (kernels/ops/rope)
            cos, sin = self.rope(positions, torch.float32)
            q = backends.norm_rope(q, self.q_norm._scale(), self.q_norm.eps, cos, sin)
            k = backends.norm_rope(k, self.k_norm._scale(), self.k_norm.eps, cos, sin)
            return q, k, v, gate
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)
        return self.rotate(q, positions), self.rotate(k, positions), v, gate

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        """Standalone prefill of B segments at once (mixer.build_attention), body K/V at local
        positions into datas[j]."""
        q, k, v, gate = self.qkv(x, torch.arange(x.shape[1], device=x.device))
        out = build_attention(q, k, v, lengths, seam, datas, layer_idx, self.d**-0.5)  # [B, Hq, L, d]
        return self.o_proj(backends.gated_heads(out, gate))

    def decode_step(self, x, batch: DecodeBatch, layer_idx: int, positions):
        """A decode step on CUDA, x [1, B, h]: the keys normalized, rotated and written into the
        pages with the values in one launch (backends.norm_rope_into_pages), then attention over
        the pages that normalizes and rotates the raw queries itself and gates its own output;
        None where that launch does not apply (forward_layout's path then)."""
        q, k, v, gate = self.projections(x)
        cos, sin = self.rope(positions, torch.float32)
        kv = batch.kv
        kp, vp = kv.k[layer_idx], kv.v[layer_idx]
        if not backends.norm_rope_into_pages(k[0], v[0], self.k_norm._scale(), self.k_norm.eps, cos, sin, kp, vp,
                                             batch.kv_rows):
            return None
        # the queries' norm and rotation in the attention kernel's prologue, the output gate in its
        # store: [B, Hq, d], token-major as the output projection reads it
        o = backends.paged_decode_attention(q[0], kp, vp, kv.table, batch.rows, batch.lengths, self.d**-0.5,
                                            batch.max_pages, gate[0], (self.q_norm._scale(), self.q_norm.eps, cos, sin))
        return self.o_proj(o.reshape(1, o.shape[0], -1))

    def forward_layout(self, x, layout, state: AttnState, rec: Recording | None, layer_idx: int, live_pos):
        """x [1, n_live, h]; live_pos [n_live] absolute positions of the live tokens."""
        if isinstance(layout, DecodeBatch) and backends.use_fast_kernels(x):
            out = self.decode_step(x, layout, layer_idx, live_pos)
            if out is not None:
                return out
        q, k, v, gate = self.qkv(x, live_pos)
        out = attention_layout(
            q, k, v, layout, state, rec, layer_idx, live_pos, self.d**-0.5, self.rotate, head_major=True
        )
        return self.o_proj(backends.gated_heads(out, gate))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def merge_projections(self) -> int:
        self._gate_up = merge_weights(self.gate_proj, self.up_proj)
        return int(self._gate_up is not None)

    def as_shared(self, gate_logit: torch.Tensor | None = None) -> SharedExpert:
        """This MLP as a MoE block's shared expert (its output scaled by sigmoid(x @ gate_logit^T))."""
        return SharedExpert(self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, gate_logit)

    def forward(self, x):
        gate, up = merged_linear(x, getattr(self, "_gate_up", None), (self.gate_proj, self.up_proj))
        act = backends.fused_silu_mul(gate, up)
        return self.down_proj(act if act is not None else F.silu(gate) * up)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights this module multiplies through backends.linear (backends.gemv_weights)."""
        return [self.weight]


class Experts(nn.Module):
    """Expert weights fused as 3-D tensors; the loader also accepts per-expert checkpoints. The
    forward is backends.moe_experts: one grouped GEMM pair over the tokens sorted by expert (or a
    fused Triton kernel) with no host synchronisation, the per-expert loop as the reference."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))

    def path(self, x, top_k: int) -> str:
        """backends.moe_path for x [n, h] routed to top_k experts each."""
        return backends.moe_path(x, self.gate_up_proj, self.down_proj, top_k)

    def forward(self, x, top_i, top_w, shared: SharedExpert | None = None, path: str | None = None):
        """x [n, h]; top_i, top_w [n, k]: sum over each token's k experts of w * expert(x), plus the
        shared expert where given (backends.moe_experts)."""
        return backends.moe_experts(x, self.gate_up_proj, self.down_proj, top_i, top_w, shared, path)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # the pair-major MoE kernels read these weights themselves, row-major (backends.column_major_linears)
        for lin in (*self.shared_expert.children(), self.shared_expert_gate):
            lin.keeps_row_major = True

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        k = self.cfg.num_experts_per_tok
        path = self.experts.path(x, k)
        # Qwen3.5-MoE always renormalises the top-k weights (its config has no norm_topk_prob)
        renormalize = self.cfg.norm_topk_prob or self.cfg.family == "qwen3_5_moe"
        top_w, top_i = route(x, self.gate.weight, k, renormalize, x.dtype, path)
        if path == "pairs":
            # the shared expert and its sigmoid gate run inside the routed experts' two launches
            shared = self.shared_expert.as_shared(self.shared_expert_gate.weight)
            return self.experts(x, top_i, top_w, shared, path).view(shape)
        out = self.experts(x, top_i, top_w, path=path)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def empty_state(self, device):
        return self.mixer().empty_state(device)

    def mixer(self):
        return self.linear_attn if self.kind == "linear_attention" else self.self_attn

    # LayoutLM.forward_decode hands a decode step's stream to this layer as x + r, the previous
    # layer's MLP output r not yet added, and takes this layer's back the same way: the add goes
    # into the input norm's launch (add_norm) instead of a launch of its own
    defers_residual = True

    def block(self, x, mix, r=None, defer: bool = False):
        """The block around its mixer: x [B, n, h] -> [B, n, h], residuals included; mix(h) runs
        the mixer on the normed stream. `r`: the stream entering is x + r (added with the input
        norm); `defer`: returns (x, the MLP's output) for the next layer to add."""
        if r is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.add_norm(x, r, self.input_layernorm)
        x, h = self.add_norm(x, mix(h))
        m = self.mlp(h)
        return (x, m) if defer else x + m

    def forward_layout(self, x, layout, state, rec, layer_idx, positions, r=None, defer: bool = False):
        """x [1, n_live, h] -> [1, n_live, h], residuals included (`r`, `defer`: block's)."""
        if self.kind == "linear_attention":
            return self.block(x, lambda h: self.linear_attn.forward_layout(h, layout, state, rec, layer_idx), r, defer)
        return self.block(x, lambda h: self.self_attn.forward_layout(h, layout, state, rec, layer_idx, positions),
                          r, defer)

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        """The block over B padded segments from position 0 (LayoutLM.build_span_data)."""
        return self.block(x, lambda h: self.mixer().build_spans(h, lengths, seam, datas, layer_idx))

    def add_norm(self, x, h, ln=None):
        """The residual sum x + h and its norm by `ln` (default the post-attention norm), in one
        launch on CUDA."""
        ln = ln if ln is not None else self.post_attention_layernorm
        fused = backends.fused_add_rms_norm(x, h, ln._scale(), ln.eps)
        if fused is not None:
            return fused
        x = x + h
        return x, ln(x)


class HybridLM(LayoutLM):
    """Qwen3-Next / Qwen3.5: runs layouts of live runs and cached spans (LayoutLM.forward_layout)."""

    norm_offset = 0.0  # modelzoo.random_init_: zero-centred RMSNorm, scale (1 + weight)

    # dense and MoE alike: the MoE block routes and runs its experts on the device (backends.moe_experts)
    cuda_graphs = True
    planned_assemblies = True

    def span_rotation(self, layer: int):
        return self.layers[layer].self_attn.rotate

    def span_rope(self, layer: int):
        attn = self.layers[layer].self_attn
        return lambda shifts: attn.rope(shifts, torch.float32)

    @property
    def conv_width(self) -> int:
        """The short conv's width of the linear layers (planned assemblies: their tails' length)."""
        return next(layer.linear_attn.conv_width for layer in self.layers if layer.kind == "linear_attention")

    def __init__(self, cfg: ModelConfig):
        super().__init__(
            cfg,
            Backbone(
                cfg,
                [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)],
                ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            ),
        )
