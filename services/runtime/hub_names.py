"""Checkpoint tensor names as the Hugging Face hub holds them, mapped to and from the runtime's names.

The runtime's modules carry the names of transformers' own modules. For the Qwen families and
Bamba those are the hub's names; for the others transformers renames and fuses tensors when it
loads a checkpoint (its conversion_mapping.py) and undoes that when `save_pretrained` writes one:

- nemotron_h: `backbone.*` is `model.*`;
- olmo_hybrid: `attention_layer_norm` / `feedforward_layer_norm` are `input_layernorm` /
  `post_attention_layernorm`; `q_conv1d`, `k_conv1d`, `v_conv1d` are one `conv1d` (q|k|v rows);
- kimi_linear: `block_sparse_moe.*` is `mlp.*`; the KDA forget gate (`f_a_proj`, `f_b_proj`,
  `dt_bias`, `A_log`) sits under `self_attn.forget_gate`; q/k/v short convolutions are one `conv1d`;
- minimax: `block_sparse_moe.*` is `mlp.*`.

MoE experts are stored one by one on the hub (`experts.E.gate_proj/up_proj/down_proj` for Qwen,
`experts.E.w1/w3/w2` for the Mixtral-style families); the runtime holds them fused into 3-D
`experts.gate_up_proj` [E, 2I, H] (gate rows first) and `experts.down_proj` [E, H, I].
Multimodal wrappers keep the text model under `model.language_model.*`; their vision towers and
multi-token-prediction heads are not served.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

# tensors of a checkpoint the text model does not use (after the multimodal prefix is removed)
SKIPPED = re.compile(
    r"^(mtp\.|model\.mtp\.|model\.visual\.|visual\.|model\.vision_tower\.|vision_tower\.|"
    r"model\.multi_modal_projector\.|multi_modal_projector\.|.*rotary_emb\.inv_freq$)"
)
_MULTIMODAL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_CONV_PART = re.compile(r"^(.*)\.([qkv])_conv1d\.weight$")


@dataclass(frozen=True)
class HubLayout:
    """How one family's hub checkpoint names differ from the runtime's.

    renames: (hub, runtime) substrings, a leading "^" anchoring one at the start of the name;
    read replaces hub by runtime in order, write replaces runtime by hub in reverse order.
    experts: the hub's names of an expert's gate, up and down projections.
    split_conv: the module (e.g. "linear_attn") whose fused `conv1d.weight` the hub stores as
    q/k/v_conv1d, and `conv_sizes(cfg)` the rows of q, k and v.
    """

    renames: tuple[tuple[str, str], ...] = ()
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    split_conv: str | None = None
    conv_sizes: Callable | None = None


def _olmo_conv_sizes(cfg) -> list[int]:
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    return [key, key, cfg.linear_num_value_heads * cfg.linear_value_head_dim]


def _kimi_conv_sizes(cfg) -> list[int]:
    return [cfg.linear_num_heads * cfg.linear_head_dim] * 3


_MIXTRAL_EXPERTS = ("w1", "w3", "w2")
LAYOUTS: dict[str, HubLayout] = {
    "nemotron_h": HubLayout(renames=(("^backbone.", "model."),)),
    "olmo_hybrid": HubLayout(
        renames=(
            (".attention_layer_norm.", ".input_layernorm."),
            (".feedforward_layer_norm.", ".post_attention_layernorm."),
        ),
        split_conv="linear_attn",
        conv_sizes=_olmo_conv_sizes,
    ),
    "kimi_linear": HubLayout(
        renames=(
            (".block_sparse_moe.", ".mlp."),
            (".self_attn.f_a_proj.", ".self_attn.forget_gate.f_a_proj."),
            (".self_attn.f_b_proj.", ".self_attn.forget_gate.f_b_proj."),
            (".self_attn.dt_bias", ".self_attn.forget_gate.dt_bias"),
            (".self_attn.A_log", ".self_attn.forget_gate.A_log"),
        ),
        experts=_MIXTRAL_EXPERTS,
        split_conv="self_attn",
        conv_sizes=_kimi_conv_sizes,
    ),
    "minimax": HubLayout(renames=((".block_sparse_moe.", ".mlp."),), experts=_MIXTRAL_EXPERTS),
}
_DEFAULT = HubLayout()


def layout_of(model_type: str) -> HubLayout:
    return LAYOUTS.get(model_type, _DEFAULT)


def _renamed(name: str, old: str, new: str, anchored: bool) -> str:
    if anchored:
        return new + name[len(old) :] if name.startswith(old) else name
    return name.replace(old, new)


def _to_runtime(layout: HubLayout, name: str) -> str:
    for hub, runtime in layout.renames:
        name = _renamed(name, hub.lstrip("^"), runtime, hub.startswith("^"))
    return name


def _to_hub(layout: HubLayout, name: str) -> str:
    for hub, runtime in reversed(layout.renames):
        name = _renamed(name, runtime, hub.lstrip("^"), hub.startswith("^"))
    return name


def runtime_name(model_type: str, hub_name: str) -> str | None:
    """The runtime's name of one hub tensor (experts and conv parts still apart), None for a
    tensor the text model does not use."""
    name = hub_name
    for old, new in _MULTIMODAL_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    if SKIPPED.match(name):
        return None
    return _to_runtime(layout_of(model_type), name)


class Assembler:
    """Collects a checkpoint's tensors under the runtime's names: per-expert tensors are stacked
    into the fused expert tensors, q/k/v conv parts concatenated (by `finish`).

    `source[name]` is the hub name a runtime tensor came from (the first, for fused ones). `stack`
    and `cat` fuse them (torch's, or those of tensors not read yet: tensor_parallel/slices.py)."""

    def __init__(self, model_type: str, stack: Callable = torch.stack, cat: Callable = torch.cat):
        self.model_type = model_type
        self._stack, self._cat = stack, cat
        self.tensors: dict[str, torch.Tensor] = {}
        self.source: dict[str, str] = {}
        self._experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        self._conv: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, hub_name: str, load: Callable[[], torch.Tensor]) -> None:
        name = runtime_name(self.model_type, hub_name)
        if name is None:
            return
        m = _EXPERT.match(name)
        if m:
            prefix = m.group(1)
            self.source.setdefault(f"{prefix}.gate_up_proj", hub_name)
            self.source.setdefault(f"{prefix}.down_proj", hub_name)
            self._experts.setdefault(prefix, {}).setdefault(int(m.group(2)), {})[_EXPERT_ROLE[m.group(3)]] = load()
            return
        m = _CONV_PART.match(name)
        if m:
            self.source.setdefault(f"{m.group(1)}.conv1d.weight", hub_name)
            self._conv.setdefault(m.group(1), {})[m.group(2)] = load()
            return
        self.source[name] = hub_name
        self.tensors[name] = load()

    def finish(self) -> dict[str, torch.Tensor]:
        """The runtime's tensors; ValueError naming the first incomplete expert or conv group."""
        for prefix, per_expert in self._experts.items():
            n = max(per_expert) + 1
            incomplete = [e for e in range(n) if set(per_expert.get(e, {})) != {"gate", "up", "down"}]
            if incomplete:
                raise ValueError(f"checkpoint is missing tensors of expert(s) {incomplete[:5]} under {prefix}")
            self.tensors[f"{prefix}.gate_up_proj"] = self._stack(
                [self._cat([per_expert[e]["gate"], per_expert[e]["up"]], 0) for e in range(n)]
            )
            self.tensors[f"{prefix}.down_proj"] = self._stack([per_expert[e]["down"] for e in range(n)])
        for prefix, parts in self._conv.items():
            if set(parts) != {"q", "k", "v"}:
                lacking = sorted({"q", "k", "v"} - set(parts))
                raise ValueError(f"checkpoint is missing {prefix}.{lacking[0]}_conv1d.weight")
            self.tensors[f"{prefix}.conv1d.weight"] = self._cat([parts["q"], parts["k"], parts["v"]], 0)
        self._experts, self._conv = {}, {}
        return self.tensors


def hub_tensors(cfg, state: dict[str, torch.Tensor], multimodal: bool = False) -> dict[str, torch.Tensor]:
    """A runtime state dict under the hub's names, as `save_pretrained` writes it: experts one by
    one, q/k/v convolutions apart, the family's renames undone, and the text model under
    `model.language_model.` for a multimodal config."""
    layout = layout_of(cfg.model_type)
    gate, up, down = layout.experts
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        parts: dict[str, torch.Tensor]
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name[: -len(".gate_up_proj")], t.shape[1] // 2
            parts = {}
            for e in range(t.shape[0]):
                parts[f"{prefix}.{e}.{gate}.weight"] = t[e, :inter]
                parts[f"{prefix}.{e}.{up}.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            parts = {f"{prefix}.{e}.{down}.weight": t[e] for e in range(t.shape[0])}
        elif layout.split_conv and name.endswith(f".{layout.split_conv}.conv1d.weight"):
            prefix = name[: -len(".conv1d.weight")]
            q, k, v = t.split(layout.conv_sizes(cfg), 0)
            parts = {f"{prefix}.q_conv1d.weight": q, f"{prefix}.k_conv1d.weight": k, f"{prefix}.v_conv1d.weight": v}
        else:
            parts = {name: t}
        for key, value in parts.items():
            key = _to_hub(layout, key)
            if multimodal and key.startswith("model."):
                key = "model.language_model." + key[len("model.") :]
            out[key] = value.contiguous()
    return out
