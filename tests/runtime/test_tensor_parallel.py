"""Tensor parallelism on the CPU: two ranks as two processes (gloo), one group for the module.

TP = 2 `full` logits equal TP = 1 for every family (tiny random models), and the handles that name
per-rank objects across the ranks refuse what would carry rank 0's slice to the others.
"""

import functools

import pytest
import torch
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.modelzoo import init_model_dir
from hybridcache.services.runtime.sequence import LiveRun
from hybridcache.services.runtime.tensor_parallel import ranks
from hybridcache.services.runtime.tensor_parallel.shard import shard_model

# every family: GDN (Qwen3.5 apart, Qwen3-Next packed; dense and MoE), OLMo's GDN with cross-head
# q/k norms, Mamba2 (Nemotron-H, Bamba), KDA with MLA and a DeepSeek MoE, lightning with a softmax MoE
ARCHS = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "olmo_hybrid", "nemotron_h", "kimi_linear", "bamba",
         "minimax"]
SIZE = 2


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the logits' scale (fp32 sums over ranks add in another order)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    return {a: str(init_model_dir(a, "tiny", root / a, seed=1, std=0.08)) for a in ARCHS}


@pytest.fixture(scope="module")
def group(dirs):
    """One group of two ranks holding a `full` engine per family."""
    named = {a: (p, RuntimeConfig(mode="full")) for a, p in dirs.items()}
    surface = ranks.Surface(frozenset(), children=tuple((a, ranks.ENGINE_SURFACE) for a in named))
    g = ranks.start(SIZE, functools.partial(ranks.build_engines, named), surface)
    yield g
    g.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_logits_equal_tp1(arch, dirs, group):
    ids = torch.randint(0, 256, (61,), generator=torch.Generator().manual_seed(3))
    ref_model = load_model(dirs[arch])
    ref_state = ref_model.empty_state()
    ref, _ = ref_model.forward_layout(ref_state, [LiveRun(ids[:-1], 0)], logits_for="all")
    ref_next, _ = ref_model.forward_layout(ref_state, [LiveRun(ids[-1:], 60)])
    model = getattr(group.target, arch).model
    state = model.empty_state()
    out, _ = model.forward_layout(state, [LiveRun(ids[:-1], 0)], logits_for="all")
    # the state left behind is rank 0's share: half the linear heads, half the key/value heads
    lin = next(iter(state.linear.values())).ssm
    assert lin.shape[1] * SIZE == next(iter(ref_state.linear.values())).ssm.shape[1]
    nxt, _ = model.forward_layout(state, [LiveRun(ids[-1:], 60)])
    assert ref.abs().max().item() > 1e-2
    assert _close(out, ref) <= 1e-5
    assert _close(nxt, ref_next) <= 1e-5
    # batched decode of two requests continues both
    s1, s2 = model.empty_state(), model.empty_state()
    model.forward_layout(s1, [LiveRun(ids[:30], 0)], logits_for="none")
    model.forward_layout(s2, [LiveRun(ids[:-1], 0)], logits_for="none")
    both, _ = model.decode_batch([s1, s2], [int(ids[30]), int(ids[-1])])
    assert _close(both[0], ref[30]) <= 1e-5
    assert _close(both[1], ref_next) <= 1e-5


def test_engine_generate_equals_tp1(dirs, group):
    req = {"segments": ["the first part of a prompt", " and a second one"], "suffix": " then",
           "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
    from hybridcache.services.runtime.engine import Engine

    ref = Engine.from_dir(dirs["qwen3_5_text"], config=RuntimeConfig(mode="full")).generate(req)
    out = group.target.qwen3_5_text.generate(req)
    assert out.output_ids == ref.output_ids and len(out.output_ids) == 6


def test_unnamed_float_tensor_is_refused(group):
    """A tensor rank 0 made on its own holds its slice only: passing it to a broadcast call fails."""
    model = group.target.qwen3_5_text.model
    state = model.empty_state()
    mine = state.linear[0].ssm.clone()  # made outside a broadcast call
    with pytest.raises(ranks.TPError, match="outside the broadcast calls"):
        model.replay_linear_group((0, 1), mine.new_zeros(3, 64), state)
    with pytest.raises(ranks.TPError, match="module of rank 0 only"):
        group.target.qwen3_5_text.model.model  # noqa: B018 - reading it is what fails


def test_split_must_divide_heads(dirs):
    model = load_model(dirs["qwen3_5_text"])
    with pytest.raises(ModelConfigError, match="tensor-parallel size 3 must divide"):
        shard_model(model, 0, 3)


def test_split_shapes(dirs):
    """Each rank keeps its block of heads: rank 1's q/k/v rows are the second half of each section."""
    full = load_model(dirs["qwen3_5_text"])
    part = shard_model(load_model(dirs["qwen3_5_text"]), 1, 2)
    a, b = full.layers[0].linear_attn, part.layers[0].linear_attn
    kd, vd = a.key_dim, a.value_dim
    w = a.in_proj_qkv.weight
    want = torch.cat([w[kd // 2 : kd], w[kd + kd // 2 : 2 * kd], w[2 * kd + vd // 2 :]])
    assert torch.equal(b.in_proj_qkv.weight, want)
    assert (b.hk, b.hv, b.conv_dim) == (a.hk // 2, a.hv // 2, a.conv_dim // 2)
    assert torch.equal(b.out_proj.weight, a.out_proj.weight[:, vd // 2 :])
