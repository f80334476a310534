"""How each family's weights are split across tensor-parallel ranks, applied to a loaded model.

Every mixer is split by head, as vLLM splits it: the projections that make a head's inputs (q, k,
v, gates, decays, the short conv's channels) keep the rank's heads' rows (column-parallel), the
output projection keeps the matching input columns and sums the ranks' parts (row-parallel, one
all-reduce). MLPs split their intermediate channels the same way; MoE blocks split every expert's
intermediate channels and their shared expert's (the router stays whole, so every rank routes
alike) and sum once, at the block's output; the
embedding and the LM head split the vocabulary. Key/value heads fewer than the ranks are
replicated (rank r holds key head r // (ranks / heads)), as vLLM does for GQA.

A sharded module keeps its own math: only its head counts shrink, so its states, entries and K/V
hold the rank's heads. shard_model(model, rank, size) mutates the model in place (before
merge_projections, so the merged GEMMs are of the sharded weights). Its weights are tensors, or
checkpoint tensors not read yet (slices.Source, as the loader installs them): of those, each split
reads only the rank's rows or columns, and read_rest reads what no split took, whole.
"""

from __future__ import annotations

import torch
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.tensor_parallel.layers import (
    HeadShardedRMSNorm,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    reduce_output,
)
from hybridcache.services.runtime.tensor_parallel.slices import Source
from hybridcache.services.runtime.tensor_parallel.slices import cat as _cat
from torch import nn


class Split:
    """Which units (heads, groups, channels) of `total` this rank keeps: `count` from `start`."""

    __slots__ = ("total", "start", "count", "replicas")

    def __init__(self, total: int, rank: int, size: int, what: str, replicate: bool = False):
        if total % size == 0:
            self.count = total // size
            self.start, self.replicas = rank * self.count, 1
        elif replicate and size % total == 0:
            # fewer units than ranks: each unit is held whole by size // total ranks
            self.replicas = size // total
            self.start, self.count = rank // self.replicas, 1
        else:
            more = f" (or a divisor of it: {what} are replicated)" if replicate else ""
            raise ModelConfigError(f"tensor-parallel size {size} must divide the {total} {what}{more}")
        self.total = total


def take(t: torch.Tensor, sections: list[tuple[int, Split]], dim: int = 0) -> torch.Tensor:
    """Along `dim`, t is sections of (rows, split): `rows` rows made of split.total equal units;
    keep each section's units of this rank, in order (a new contiguous tensor; of a Source only
    those are read)."""
    if sum(rows for rows, _ in sections) != t.shape[dim]:
        raise ValueError(f"sections of {sum(r for r, _ in sections)} rows for a dim of {t.shape[dim]}")
    parts, off = [], 0
    for rows, sp in sections:
        unit = rows // sp.total
        parts.append(t.narrow(dim, off + sp.start * unit, sp.count * unit))
        off += rows
    if isinstance(t, Source):
        return _cat(parts, dim).read().contiguous()
    return torch.cat(parts, dim=dim).contiguous()


def whole(t):
    """t read whole (a Source), or t (a tensor)."""
    return t.read() if isinstance(t, Source) else t


def _param(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    is_param = isinstance(old, nn.Parameter)
    if isinstance(old, Source):
        delattr(module, name)
        is_param = old.is_param
    if is_param:
        setattr(module, name, nn.Parameter(value, requires_grad=False))
    else:
        module.register_buffer(name, value)


def column(linear: nn.Linear, sections: list[tuple[int, Split]]) -> None:
    """Keep the rank's output rows of `linear` (and of its bias)."""
    _param(linear, "weight", take(linear.weight.data, sections, 0))
    if linear.bias is not None:
        _param(linear, "bias", take(linear.bias.data, sections, 0))
    linear.out_features = linear.weight.shape[0]


def row(linear: nn.Linear, sections: list[tuple[int, Split]]) -> RowParallelLinear:
    """The row-parallel form of `linear`: the rank's input columns, summed over ranks."""
    bias = None if linear.bias is None else whole(linear.bias.data)
    return RowParallelLinear(take(linear.weight.data, sections, 1), bias)


def rows(module: nn.Module, name: str, sections: list[tuple[int, Split]], dim: int = 0) -> None:
    _param(module, name, take(getattr(module, name).data, sections, dim))


def conv(module: nn.Conv1d, sections: list[tuple[int, Split]]) -> None:
    """A depthwise conv keeps the rank's channels (weight [D, 1, W], bias [D])."""
    rows(module, "weight", sections)
    if module.bias is not None:
        rows(module, "bias", sections)
    module.in_channels = module.out_channels = module.groups = module.weight.shape[0]


def _attention(m, rank: int, size: int, q_rows_per_head: int) -> tuple[Split, Split]:
    """GQA projections q/k/v/o of an attention module with hq, hkv, d (q_rows_per_head rows per query
    head in q_proj: d, or 2 d with an output gate packed per head)."""
    sq = Split(m.hq, rank, size, "attention heads")
    skv = Split(m.hkv, rank, size, "key/value heads", replicate=True)
    column(m.q_proj, [(m.hq * q_rows_per_head, sq)])
    column(m.k_proj, [(m.hkv * m.d, skv)])
    column(m.v_proj, [(m.hkv * m.d, skv)])
    m.o_proj = row(m.o_proj, [(m.hq * m.d, sq)])
    return sq, skv


def shard_gated_attention(m, rank, size):
    """Qwen3-Next / Qwen3.5: q and its output gate packed per head; per-head q/k norms."""
    sq, skv = _attention(m, rank, size, 2 * m.d)
    m.hq, m.hkv = sq.count, skv.count


def shard_olmo_attention(m, rank, size):
    """OLMo-Hybrid: q/k RMSNorm over all heads at once, so over the ranks (HeadShardedRMSNorm)."""
    sq, skv = _attention(m, rank, size, m.d)
    m.q_norm = HeadShardedRMSNorm(take(m.q_norm.weight.data, [(m.hq * m.d, sq)]), m.hq * m.d, m.q_norm.eps)
    m.k_norm = HeadShardedRMSNorm(
        take(m.k_norm.weight.data, [(m.hkv * m.d, skv)]), m.hkv * m.d, m.k_norm.eps, skv.replicas
    )
    m.hq, m.hkv = sq.count, skv.count


def shard_plain_attention(m, rank, size):
    """Nemotron-H, Bamba, MiniMax softmax attention: GQA projections, nothing across heads."""
    sq, skv = _attention(m, rank, size, m.d)
    m.hq, m.hkv = sq.count, skv.count


def shard_gated_deltanet(m, rank, size):
    """Qwen3-Next packs q, k, v, z per key-head group (and b, a likewise); Qwen3.5 keeps them apart."""
    sk = Split(m.hk, rank, size, "linear key heads")
    sv = Split(m.hv, rank, size, "linear value heads")
    qkv = [(m.key_dim, sk), (m.key_dim, sk), (m.value_dim, sv)]
    if m.fused_projections:
        column(m.in_proj_qkvz, [(m.in_proj_qkvz.out_features, sk)])
        column(m.in_proj_ba, [(m.in_proj_ba.out_features, sk)])
    else:
        column(m.in_proj_qkv, qkv)
        column(m.in_proj_z, [(m.value_dim, sv)])
        column(m.in_proj_b, [(m.hv, sv)])
        column(m.in_proj_a, [(m.hv, sv)])
    conv(m.conv1d, qkv)
    rows(m, "dt_bias", [(m.hv, sv)])
    rows(m, "A_log", [(m.hv, sv)])
    m.out_proj = row(m.out_proj, [(m.value_dim, sv)])
    _gdn_counts(m, sk, sv)


def shard_olmo_deltanet(m, rank, size):
    sk = Split(m.hk, rank, size, "linear key heads")
    sv = Split(m.hv, rank, size, "linear value heads")
    column(m.q_proj, [(m.key_dim, sk)])
    column(m.k_proj, [(m.key_dim, sk)])
    column(m.v_proj, [(m.value_dim, sv)])
    column(m.g_proj, [(m.value_dim, sv)])
    column(m.a_proj, [(m.hv, sv)])
    column(m.b_proj, [(m.hv, sv)])
    conv(m.conv1d, [(m.key_dim, sk), (m.key_dim, sk), (m.value_dim, sv)])
    rows(m, "dt_bias", [(m.hv, sv)])
    rows(m, "A_log", [(m.hv, sv)])
    m.o_proj = row(m.o_proj, [(m.value_dim, sv)])
    _gdn_counts(m, sk, sv)


def _gdn_counts(m, sk: Split, sv: Split) -> None:
    m.hk, m.hv = sk.count, sv.count
    m.key_dim, m.value_dim = m.hk * m.dk, m.hv * m.dv
    m.conv_dim = 2 * m.key_dim + m.value_dim


def shard_mamba2(m, rank, size):
    """Nemotron-H / Bamba Mamba2: in_proj is [gate | x | B | C | dt]; heads split with their groups
    (each rank keeps whole groups, so the grouped output norm stays within a rank)."""
    sh = Split(m.h, rank, size, "mamba heads")
    sg = Split(m.g, rank, size, "mamba groups")
    gn = m.g * m.n
    xbc = [(m.inner, sh), (gn, sg), (gn, sg)]
    column(m.in_proj, [(m.inner, sh), *xbc, (m.h, sh)])
    conv(m.conv1d, xbc)
    for name in ("dt_bias", "A_log", "D"):
        rows(m, name, [(m.h, sh)])
    rows(m.norm, "weight", [(m.inner, sh)])
    m.out_proj = row(m.out_proj, [(m.inner, sh)])
    m.h, m.g = sh.count, sg.count
    m.inner = m.h * m.p
    m.conv_dim = m.inner + 2 * m.g * m.n


def shard_kda(m, rank, size):
    """Kimi Delta Attention: q/k/v, the per-channel forget gate's second projection and bias, beta
    and the output gate's second projection by head; the low-rank first projections stay whole."""
    sh = Split(m.nh, rank, size, "KDA heads")
    per = [(m.qkv_dim, sh)]
    for lin in (m.q_proj, m.k_proj, m.v_proj, m.g_b_proj):
        column(lin, per)
    column(m.b_proj, [(m.nh, sh)])
    conv(m.conv1d, per * 3)
    fg = m.forget_gate
    column(fg.f_b_proj, per)
    rows(fg, "dt_bias", per)
    rows(fg, "A_log", [(m.nh, sh)], dim=2)
    fg.h = sh.count
    m.o_proj = row(m.o_proj, per)
    m.nh = sh.count
    m.qkv_dim = m.nh * m.d
    m.conv_dim = 3 * m.qkv_dim


def shard_mla(m, rank, size):
    """Multi-head latent attention: the latents (kv_a) are shared by all heads and stay whole on
    every rank (so does their cache); q and the per-head up-projection kv_b split by head."""
    sh = Split(m.nh, rank, size, "attention heads")
    if hasattr(m, "q_proj"):
        column(m.q_proj, [(m.q_proj.out_features, sh)])
    else:
        column(m.q_b_proj, [(m.q_b_proj.out_features, sh)])
    column(m.kv_b_proj, [(m.nh * (m.dn + m.dv), sh)])
    m.o_proj = row(m.o_proj, [(m.nh * m.dv, sh)])
    m.nh = sh.count


def shard_lightning(m, rank, size):
    """MiniMax lightning attention: qkv packed per head, the output gate by head, the output norm
    over all heads (HeadShardedRMSNorm); each rank keeps its heads' decay rates."""
    sh = Split(m.nh, rank, size, "lightning heads")
    inner = m.nh * m.d
    column(m.qkv_proj, [(3 * inner, sh)])
    column(m.output_gate, [(inner, sh)])
    m.norm = HeadShardedRMSNorm(take(m.norm.weight.data, [(inner, sh)]), inner, m.norm.eps)
    for name in ("slope_rate", "query_decay", "key_decay"):
        rows(m, name, [(m.nh, sh)])
    rows(m, "diagonal_decay", [(m.nh, sh)], dim=1)
    m.out_proj = row(m.out_proj, [(inner, sh)])
    m.head_start, m.nh = sh.start, sh.count


def shard_mlp(m, rank, size):
    """SwiGLU MLP (gate_proj, up_proj, down_proj) by intermediate channel."""
    si = Split(m.gate_proj.out_features, rank, size, "MLP intermediate channels")
    column(m.gate_proj, [(si.total, si)])
    column(m.up_proj, [(si.total, si)])
    m.down_proj = row(m.down_proj, [(si.total, si)])


def shard_relu2_mlp(m, rank, size):
    si = Split(m.up_proj.out_features, rank, size, "MLP intermediate channels")
    column(m.up_proj, [(si.total, si)])
    m.down_proj = row(m.down_proj, [(si.total, si)])


def shard_experts(m, rank, size, reduce: bool = True):
    """Fused experts gate_up_proj [E, 2 I, h], down_proj [E, h, I]: every expert keeps the rank's
    intermediate channels; the routed sum is this rank's part, all-reduced (reduce_output) unless
    the MoE block around it reduces."""
    inter = m.down_proj.shape[2]
    si = Split(inter, rank, size, "expert intermediate channels")
    rows(m, "gate_up_proj", [(inter, si), (inter, si)], dim=1)
    rows(m, "down_proj", [(inter, si)], dim=2)
    if reduce:
        reduce_output(m)


def shard_moe(m, rank, size) -> list[nn.Module]:
    """An MoE block: routed experts and the shared expert(s) by intermediate channel, each left with
    this rank's partial sum, and ONE all-reduce of the block's output (the block adds them, the
    shared expert under a replicated gate: a sum of partial sums). Returns the modules it split."""
    shard_experts(m.experts, rank, size, reduce=False)
    done = [m.experts]
    shared = getattr(m, "shared_expert", None) or getattr(m, "shared_experts", None)
    if shared is not None:
        si = Split(shared.gate_proj.out_features, rank, size, "shared expert intermediate channels")
        column(shared.gate_proj, [(si.total, si)])
        column(shared.up_proj, [(si.total, si)])
        if shared.down_proj.bias is not None:
            raise ModelConfigError("a shared expert with a down_proj bias cannot leave partial sums")
        rows(shared.down_proj, "weight", [(si.total, si)], dim=1)
        shared.down_proj.in_features = si.count
        done.append(shared)
    reduce_output(m)
    return done


def shard_vocab(model, rank, size):
    """Embedding and LM head by vocabulary rows, padded to an equal share per rank."""
    vocab = model.cfg.vocab_size
    per = -(-vocab // size)
    lo, hi = min(rank * per, vocab), min((rank + 1) * per, vocab)
    emb_name = model.model.embed_name
    emb = getattr(model.model, emb_name)
    setattr(model.model, emb_name, VocabParallelEmbedding(emb.weight.data[lo:hi].clone(), lo, vocab))
    w = model.lm_head.weight.data
    head = w.new_zeros(per, w.shape[1])
    head[: hi - lo] = w[lo:hi]
    model.lm_head = ParallelLMHead(head, vocab)


def _rules() -> dict[type, callable]:
    """module class -> its shard function (imported here: the model modules import torch)."""
    from hybridcache.services.runtime.models import bamba, kimi_linear, minimax, nemotron_h, olmo_hybrid, qwen3_hybrid

    return {
        qwen3_hybrid.GatedAttention: shard_gated_attention,
        qwen3_hybrid.GatedDeltaNet: shard_gated_deltanet,
        qwen3_hybrid.MLP: shard_mlp,
        qwen3_hybrid.Experts: shard_experts,
        olmo_hybrid.OlmoAttention: shard_olmo_attention,
        olmo_hybrid.OlmoGatedDeltaNet: shard_olmo_deltanet,
        nemotron_h.Mamba2Mixer: shard_mamba2,
        nemotron_h.NemotronAttention: shard_plain_attention,
        bamba.RopeAttention: shard_plain_attention,
        nemotron_h.Relu2MLP: shard_relu2_mlp,
        kimi_linear.KimiDeltaAttention: shard_kda,
        kimi_linear.MLAttention: shard_mla,
        minimax.LightningAttention: shard_lightning,
    }


def _moe_blocks() -> set[type]:
    """MoE block classes (routed experts, a shared expert or not), split by shard_moe."""
    from hybridcache.services.runtime.models import kimi_linear, minimax, qwen3_hybrid

    return {qwen3_hybrid.SparseMoE, kimi_linear.MoE, minimax.MiniMaxMoE}


def shard_model(model: nn.Module, rank: int, size: int) -> nn.Module:
    """Split `model` (a loaded LayoutLM, weights whole) in place to rank `rank` of `size`; a
    ModelConfigError names a head count `size` does not divide. Returns the model."""
    if size == 1:
        return model
    rules, moes = _rules(), _moe_blocks()
    unknown = [type(m).__name__ for m in model.modules() if _is_mixer(m) and type(m) not in rules]
    if unknown:
        raise ModelConfigError(f"tensor parallelism has no split for {unknown[0]}")
    done = set()
    for m in [m for m in model.modules() if type(m) in moes]:
        done.update(id(x) for x in shard_moe(m, rank, size))
    for m in [m for m in model.modules() if type(m) in rules and id(m) not in done]:
        rules[type(m)](m, rank, size)
    shard_vocab(model, rank, size)
    model.tp_rank, model.tp_size = rank, size
    return model


def install_sources(model: nn.Module, sources: dict[str, Source]) -> None:
    """Put each checkpoint tensor not read yet in the place of the (meta) tensor it loads, as a
    plain attribute that remembers whether it is a parameter or a buffer."""
    for name, src in sources.items():
        path, _, attr = name.rpartition(".")
        module = model.get_submodule(path)
        src.is_param = attr in module._parameters
        (module._parameters if src.is_param else module._buffers).pop(attr, None)
        setattr(module, attr, src)


def read_rest(model: nn.Module) -> None:
    """Read whole every Source no split took (norms, routers, shared latents), as the parameter
    or buffer it stands for."""
    for module in model.modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, Source):
                _param(module, attr, value.read())


def _is_mixer(m: nn.Module) -> bool:
    """A module with an output projection that no rule knows would silently stay whole."""
    return any(isinstance(getattr(m, n, None), nn.Linear) for n in ("o_proj", "out_proj", "down_proj"))
