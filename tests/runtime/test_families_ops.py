"""Reference ops of the other linear families (GLA, scalar decay, Mamba2 SSD, KDA): fused T, composition."""

import sys

import pytest
import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.gla import naive_recurrent_gla
from hybridcache.kernels.ops.kda import naive_recurrent_kda
from hybridcache.kernels.ops.mamba2 import naive_ssd
from hybridcache.kernels.ops.simple_gla import (
    lightning_slopes,
    naive_lightning_attention,
    naive_recurrent_simple_gla,
)
from hybridcache.kernels.ops.transition import apply_segment, apply_transition, compose_many, transition_kind


def rel_rms(a, b):
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def family_inputs(family, B, T, H, K, V, seed=42):
    """(fn, positional args) for one family; every fn takes initial_state / output_transition."""
    torch.manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    if family == "gla":
        return naive_recurrent_gla, (q, k, v, F.logsigmoid(torch.randn(B, T, H, K)) * 0.2)
    if family == "simple_gla":
        return naive_recurrent_simple_gla, (q, k, v, F.logsigmoid(torch.randn(B, T, H)) * 0.3)
    if family == "lightning":
        return lambda *a, **kw: naive_lightning_attention(*a, lightning_slopes(H), **kw), (q, k, v)
    if family == "mamba2":
        G = 1 if H % 2 else 2
        dt = F.softplus(torch.randn(B, T, H) - 1)
        A = -torch.rand(H) * 2
        Bm, Cm = torch.randn(B, T, G, K) * 0.5, torch.randn(B, T, G, K) * 0.5
        D = torch.randn(H)
        return lambda *a, **kw: naive_ssd(*a, D=D, **kw), (v, dt, A, Bm, Cm)
    if family == "kda":
        g = F.logsigmoid(torch.randn(B, T, H, K) + 2) * 0.5
        return naive_recurrent_kda, (q, k, v, g, torch.rand(B, T, H))
    raise ValueError(family)


def slice_args(family, args, a, b):
    """The inputs of tokens [a, b) (parameters that are not per-token stay whole)."""
    if family == "mamba2":
        x, dt, A, Bm, Cm = args
        return (x[:, a:b], dt[:, a:b], A, Bm[:, a:b], Cm[:, a:b])
    return tuple(t[:, a:b] for t in args)


# family -> kind of its transition T
FAMILIES = dict(gla="vector", simple_gla="scalar", lightning="scalar", mamba2="scalar", kda="matrix")
SHAPES = [(1, 37, 2, 16, 12), (2, 21, 3, 8, 20)]
SHAPE_IDS = [f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in SHAPES]


@pytest.mark.parametrize("B,T,H,K,V", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_transition(family, B, T, H, K, V):
    """T has the family's kind, equals the run from S0 = I with zero values, and the fused pass
    reproduces the plain pass with an initial state (outputs and final state)."""
    fn, args = family_inputs(family, B, T, H, K, V)
    init = torch.randn(B, H, K, V)
    o_ref, s_ref = fn(*args, initial_state=init)
    o, s, (Tr, S0) = fn(*args, initial_state=init, output_transition=True)
    assert transition_kind(Tr, S0) == FAMILIES[family]
    _, s0_ref = fn(*args)
    assert rel_rms(S0, s0_ref) < 1e-5
    assert rel_rms(o, o_ref) < 1e-5
    assert rel_rms(s, s_ref) < 1e-5
    assert rel_rms(apply_segment(Tr, S0, init), s_ref) < 1e-5
    # definition: T is the final state of the same recurrence from I with all values zero
    eye = torch.eye(K).expand(B, H, K, K)
    if family == "mamba2":
        _, dt, A, Bm, Cm = args
        _, s_eye = naive_ssd(torch.zeros(B, T, H, K), dt, A, Bm, Cm, initial_state=eye)
    else:
        zero_v = (args[0], args[1], torch.zeros(B, T, H, K), *args[3:])
        _, s_eye = fn(*zero_v, initial_state=eye)
    assert rel_rms(apply_transition(Tr, eye), s_eye) < 1e-5


@pytest.mark.parametrize("splits", [(0, 9, 20, 37), (0, 1, 2, 30, 37), (0, 36, 37)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_composition_exact(family, splits):
    """Composing the (T, S(C|0)) pairs of consecutive segments equals the sequential run from any start."""
    B, T, H, K, V = 1, 37, 2, 16, 12
    fn, args = family_inputs(family, B, T, H, K, V)
    init = torch.randn(B, H, K, V)
    _, s_ref = fn(*args, initial_state=init)
    bounds = zip(splits, splits[1:])
    pairs = [fn(*slice_args(family, args, a, b), output_transition=True)[2] for a, b in bounds]
    Tr, S = compose_many(pairs)
    assert rel_rms(apply_segment(Tr, S, init), s_ref) < 1e-5
    # naive addition (no T) is wrong for every family with decay
    naive = init + sum(p[1] for p in pairs)
    assert rel_rms(naive, s_ref) > 1e-2


def test_gla_matches_attention_form():
    """o_t = sum_{s<=t} v_s (k_s . (q_t * prod_{s<r<=t} alpha_r)): the parallel form of GLA."""
    B, T, H, K, V = 1, 11, 2, 6, 5
    _, (q, k, v, gk) = family_inputs("gla", B, T, H, K, V)
    o, _ = naive_recurrent_gla(q, k, v, gk, scale=1.0)
    cum = gk.cumsum(1)
    ref = torch.zeros(B, T, H, V)
    for t in range(T):
        for s in range(t + 1):
            w = (q[:, t] * k[:, s] * (cum[:, t] - cum[:, s]).exp()).sum(-1)  # [B, H]
            ref[:, t] += w[..., None] * v[:, s]
    assert rel_rms(o, ref) < 1e-5


def test_gla_with_uniform_gate_is_simple_gla():
    B, T, H, K, V = 1, 13, 2, 8, 4
    _, (q, k, v, g) = family_inputs("simple_gla", B, T, H, K, V)
    o1, s1 = naive_recurrent_gla(q, k, v, g[..., None].expand(B, T, H, K))
    o2, s2 = naive_recurrent_simple_gla(q, k, v, g)
    assert rel_rms(o1, o2) < 1e-6 and rel_rms(s1, s2) < 1e-6


def test_lightning_slopes():
    s = lightning_slopes(8)
    assert torch.allclose(s, torch.tensor([2.0 ** (-i) for i in range(1, 9)]))
    assert lightning_slopes(6).shape == (6,) and bool((lightning_slopes(6) > 0).all())


@pytest.fixture(scope="module")
def hf_modules():
    sys.modules.setdefault("fla", None)  # keep transformers on its pure-torch paths
    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.nemotron_h import modeling_nemotron_h

    return modeling_kimi_linear, modeling_nemotron_h


def test_kda_matches_transformers(hf_modules):
    kimi, _ = hf_modules
    B, T, H, K, V = 1, 19, 2, 16, 12
    _, (q, k, v, g, beta) = family_inputs("kda", B, T, H, K, V)
    init = torch.randn(B, H, K, V)
    o_ref, s_ref = kimi.recurrent_kimi_delta_attention(q, k, v, g, beta, init.clone(), True)
    o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=init)
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5


def test_ssd_matches_transformers_chunk_scan(hf_modules):
    _, nem = hf_modules
    B, T, H, N, P = 1, 23, 4, 8, 6
    torch.manual_seed(0)
    x, dt_raw = torch.randn(B, T, H, P), torch.randn(B, T, H)
    A, D, dt_bias = -torch.rand(H) * 2, torch.randn(H), torch.randn(H)
    Bm, Cm = torch.randn(B, T, 2, N), torch.randn(B, T, 2, N)
    init = torch.randn(B, H, P, N)  # transformers keeps the transposed state [H, P, N]
    y_ref, s_ref = nem.mamba2_chunk_scan(
        x, dt_raw, A, Bm, Cm, chunk_size=8, D=D, dt_bias=dt_bias, initial_states=init,
        dt_softplus=True, return_final_states=True,
    )
    y, s = naive_ssd(x, F.softplus(dt_raw + dt_bias), A, Bm, Cm, D=D, initial_state=init.transpose(-1, -2))
    assert rel_rms(y, y_ref) < 1e-5 and rel_rms(s.transpose(-1, -2), s_ref) < 1e-5
