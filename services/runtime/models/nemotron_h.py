"""Nemotron-H (model_type nemotron_h): Mamba2 (SSD) mixers + attention + MLP blocks, checkpoint tensor names.

Every block is pre-norm with one mixer: Mamba2 ("linear_attention"), attention without positional
encoding (so cached K needs no re-rotation) or a squared-ReLU MLP. The Mamba2 state S [H, N, P]
has a scalar transition per head (docs/concepts.md, "The math"); the D skip and the gated RMSNorm act outside the
recurrence, on the live tokens only. MoE blocks are not supported yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.models.common import (
    Backbone,
    LayerTypes,
    LayoutLM,
    RMSNorm,
    attention_layout,
    eos_ids,
    need,
)
from hybridcache.services.runtime.models.mixer import LinearMixer, build_attention
from hybridcache.services.runtime.sequence import AttnState, LinearState
from torch import nn

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


@dataclass(frozen=True)
class NemotronHConfig(LayerTypes):
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    mlp_bias: bool = False
    attention_bias: bool = False
    # the lower clamp of dt: time_step_limit[0] (config.json's time_step_min is only an init range)
    time_step_min: float = 0.0
    layer_norm_epsilon: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention", "mlp"})
        if bad:
            raise ModelConfigError(f"unsupported nemotron_h block type(s) {bad} (MoE blocks are not supported)")
        if self.mamba_num_heads % self.n_groups or self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError("head counts must be multiples of n_groups / num_key_value_heads")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_conv_kernel_dim(self) -> int:
        return self.conv_kernel

    @property
    def conv_dim(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim + 2 * self.n_groups * self.ssm_state_size

    def entry_nbytes(self, body_tokens: int, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
        """Scalar T and S [H, N, P] in state_dtype, conv tail and K/V in the model dtype."""
        esz = torch.tensor([], dtype=dtype).element_size()
        ssz = torch.tensor([], dtype=state_dtype).element_size()
        h = self.mamba_num_heads
        conv_tail = esz * self.conv_dim * (self.conv_kernel - 1)
        per_linear = ssz * (h + h * self.ssm_state_size * self.mamba_head_dim) + conv_tail
        per_attn = 2 * esz * self.num_key_value_heads * self.head_dim * body_tokens
        return len(self.linear_layers) * per_linear + len(self.attention_layers) * per_attn

    @classmethod
    def from_dict(cls, cfg: dict) -> NemotronHConfig:
        types = cfg.get("layers_block_type") or cfg.get("layer_types")
        if types is None and cfg.get("hybrid_override_pattern"):
            pattern = cfg["hybrid_override_pattern"]
            if set(pattern) - set(_PATTERN):
                raise ModelConfigError(f"bad hybrid_override_pattern {pattern!r}")
            types = [_PATTERN[c] for c in pattern]
        if not types:
            raise ModelConfigError("nemotron_h config.json needs layers_block_type or hybrid_override_pattern")
        if cfg.get("mlp_hidden_act", "relu2") != "relu2" or cfg.get("mamba_hidden_act", "silu") != "silu":
            raise ModelConfigError("only mlp_hidden_act relu2 and mamba_hidden_act silu are supported")
        hidden, heads = int(need(cfg, "hidden_size")), int(need(cfg, "num_attention_heads"))
        lo, hi = cfg.get("time_step_limit") or cfg.get("mamba_dt_limit") or (0.0, float("inf"))
        if hi != float("inf"):
            raise ModelConfigError(f"a finite upper time_step_limit ({hi}) is not supported")
        return cls(
            model_type="nemotron_h",
            vocab_size=int(need(cfg, "vocab_size")),
            hidden_size=hidden,
            layer_types=tuple(_LEGACY.get(t, t) for t in types),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(need(cfg, "intermediate_size")),
            mamba_num_heads=int(need(cfg, "mamba_num_heads")),
            mamba_head_dim=int(need(cfg, "mamba_head_dim")),
            ssm_state_size=int(need(cfg, "ssm_state_size")),
            n_groups=int(cfg.get("n_groups", cfg.get("mamba_n_groups", 8))),
            conv_kernel=int(cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4))),
            use_conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
            use_bias=bool(cfg.get("use_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            time_step_min=float(lo),
            layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )


class GroupedGatedRMSNorm(nn.Module):
    """x * silu(gate), RMS-normalised per group of channels, times weight (fp32)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        xf = x.float() * F.silu(gate.float())
        xg = xf.view(*xf.shape[:-1], -1, self.group_size)
        xg = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xg.view_as(xf).to(x.dtype)


class Mamba2Mixer(LinearMixer):
    """Mamba2 (SSD) on the mixer contract (mixer.py): the conv (with bias) reads x|B|C; rec =
    (x, dt, B, C) with dt after softplus and clamp. dt = 0 is the identity step (decay exp(0) = 1,
    update dt B x^T = 0); T_t = exp(A sum dt) is a scalar per head, u_t = T_t C_t."""

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        self.cfg = cfg
        self.h, self.p, self.n, self.g = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
        self.inner = self.h * self.p
        self.conv_dim, self.conv_width = cfg.conv_dim, cfg.conv_kernel
        self.in_proj = nn.Linear(cfg.hidden_size, self.inner + self.conv_dim + self.h, bias=cfg.use_bias)
        d = self.conv_dim
        self.conv1d = nn.Conv1d(d, d, self.conv_width, groups=d, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.h))
        self.A_log = nn.Parameter(torch.zeros(self.h))
        self.D = nn.Parameter(torch.ones(self.h))
        self.norm = GroupedGatedRMSNorm(self.inner, self.inner // self.g, cfg.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.use_bias)

    def empty_state(self, device) -> LinearState:
        dt = self.out_proj.weight.dtype
        return LinearState(
            ssm=torch.zeros(1, self.h, self.n, self.p, dtype=torch.float32, device=device),
            conv=torch.zeros(1, self.conv_dim, self.conv_width - 1, dtype=dt, device=device),
        )

    def project(self, x):
        """x [B, n, h] -> ((x|B|C [B, n, conv_dim] (pre-conv), dt [B, n, H]), gate [B, n, inner])."""
        gate, xbc, dt = torch.split(self.in_proj(x), [self.inner, self.conv_dim, self.h], dim=-1)
        return (xbc, dt), gate

    def recurrence_inputs(self, conv_out, rest):
        (dt,) = rest
        b, n = conv_out.shape[:2]
        x, B, C = torch.split(conv_out, [self.inner, self.g * self.n, self.g * self.n], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp_min(self.cfg.time_step_min)
        return x.reshape(b, n, self.h, self.p), dt, B.reshape(b, n, self.g, self.n), C.reshape(b, n, self.g, self.n)

    def identity_steps(self, rec, pad):
        x, dt, B, C = rec
        return x, dt.masked_fill(pad[..., None], 0.0), B, C

    def recurrence(self, rec, initial_state, output_transition):
        x, dt, B, C = rec
        res = backends.ssd(x, dt, -self.A_log.float().exp(), B, C, self.D, initial_state, output_transition)
        return res[0], res[1], (res[2] if output_transition else None)

    def pieces(self, rec):
        x, dt, B, C = rec
        return backends.ssd_pieces(x, dt, -self.A_log.float().exp(), B, C, self.D)

    def recurrence_step(self, conv_out, rest, pool, slots):
        """SSD's step as the plain recurrence (kernels/ops/recurrent_step): q = C and k = dt B per
        head (the one token's, [b, H, N]), v = x, g = dt A, scale 1; y = o + D x."""
        x, dt, B, C = self.recurrence_inputs(conv_out[:, None], tuple(t[:, None] for t in rest))
        x, dt, B, C = x[:, 0], dt[:, 0], B[:, 0], C[:, 0]  # [b, H, P], [b, H], [b, G, N] x 2
        rep = self.h // self.g
        q = C.float().repeat_interleave(rep, dim=1)
        k = B.float().repeat_interleave(rep, dim=1) * dt[..., None]
        o = backends.recurrent_step(q, k, x.float(), dt * -self.A_log.float().exp(), None, pool, slots, scale=1.0)
        return o + self.D.float()[:, None] * x.float()

    def finish(self, y, gate):
        b, n = y.shape[:2]
        y = self.norm(y.reshape(b, n, self.inner), gate)
        return self.out_proj(y.to(gate.dtype))


class NemotronAttention(nn.Module):
    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, self.hq * self.d, bias=bias)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=bias)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.hq * self.d, h, bias=bias)

    def empty_state(self, device) -> AttnState:
        z = torch.zeros(1, self.hkv, 0, self.d, dtype=self.o_proj.weight.dtype, device=device)
        return AttnState(k=z, v=z.clone())

    def rotate(self, x, positions):
        """Keys as they are: no positional encoding, so cached K is used as stored."""
        return x

    rotates = False  # attention_layout re-rotates cached keys only when True

    def qkv(self, x, positions):
        """x [B, n, h] -> q [B, Hq, n, d], k, v [B, Hkv, n, d], q and k rotated at `positions`."""
        B, n = x.shape[:2]
        q = self.q_proj(x).view(B, n, self.hq, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, n, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.hkv, self.d).transpose(1, 2)
        return self.rotate(q, positions), self.rotate(k, positions), v

    def forward_layout(self, x, layout, state, rec, layer_idx, live_pos):
        q, k, v = self.qkv(x, live_pos)
        rotate = self.rotate if self.rotates else None
        return self.o_proj(attention_layout(q, k, v, layout, state, rec, layer_idx, live_pos, self.d**-0.5, rotate))

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        """Standalone prefill of B padded segments (mixer.build_attention)."""
        B, L = x.shape[:2]
        q, k, v = self.qkv(x, torch.arange(L, device=x.device))
        out = build_attention(q, k, v, lengths, seam, datas, layer_idx, self.d**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class Relu2MLP(nn.Module):
    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronBlock(nn.Module):
    def __init__(self, cfg: NemotronHConfig, i: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        mixers = {"linear_attention": Mamba2Mixer, "full_attention": NemotronAttention, "mlp": Relu2MLP}
        self.mixer = mixers[self.kind](cfg)

    def empty_state(self, device):
        return self.mixer.empty_state(device)

    def forward_layout(self, x, layout, state, rec, layer_idx, positions):
        h = self.norm(x)
        if self.kind == "linear_attention":
            return x + self.mixer.forward_layout(h, layout, state, rec, layer_idx)
        if self.kind == "full_attention":
            return x + self.mixer.forward_layout(h, layout, state, rec, layer_idx, positions)
        return x + self.mixer(h)

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        h = self.norm(x)
        if self.kind == "mlp":
            return x + self.mixer(h)
        return x + self.mixer.build_spans(h, lengths, seam, datas, layer_idx)


class NemotronHLM(LayoutLM):
    def __init__(self, cfg):
        super().__init__(
            cfg,
            Backbone(
                cfg,
                [NemotronBlock(cfg, i) for i in range(cfg.num_hidden_layers)],
                RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon),
                embed_name="embeddings",
                norm_name="norm_f",
            ),
        )
