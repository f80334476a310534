"""Reference ops: chunked path vs step loop, fused T vs the S0 = I definition, composition, conv."""

import pytest
import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.causal_conv import loop_causal_conv1d, naive_causal_conv1d
from hybridcache.kernels.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    naive_transition,
)
from hybridcache.kernels.ops.transition import apply_segment, compose_many


def rel_rms(a, b):
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


def make_inputs(B, T, H, K, V, seed=42):
    torch.manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H)) * 0.3
    beta = torch.rand(B, T, H)
    return q, k, v, g, beta


SHAPES = [(1, 63, 2, 16, 12), (2, 130, 3, 8, 20), (1, 5, 1, 60, 4)]


@pytest.mark.parametrize("B,T,H,K,V", SHAPES, ids=[f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in SHAPES])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunk_matches_recurrent(B, T, H, K, V, with_init):
    q, k, v, g, beta = make_inputs(B, T, H, K, V)
    init = torch.randn(B, H, K, V) if with_init else None
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=init)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init, chunk_size=16)
    assert rel_rms(o, o_ref) < 1e-5
    assert rel_rms(s, s_ref) < 1e-5


@pytest.mark.parametrize("impl", ["naive", "chunk"])
@pytest.mark.parametrize("B,T,H,K,V", SHAPES, ids=[f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in SHAPES])
def test_fused_transition_equals_definition(impl, B, T, H, K, V):
    """T from the prefill pass equals the S0 = I, v = 0 run; outputs and state still include the init."""
    q, k, v, g, beta = make_inputs(B, T, H, K, V)
    init = torch.randn(B, H, K, V)
    fn = naive_recurrent_gated_delta_rule if impl == "naive" else chunk_gated_delta_rule
    o, s, (Tr, S0) = fn(q, k, v, g, beta, initial_state=init, output_transition=True)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=init)
    _, s0_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta)
    assert rel_rms(Tr, naive_transition(k, g, beta)) < 1e-5
    assert rel_rms(S0, s0_ref) < 1e-5
    assert rel_rms(o, o_ref) < 1e-5
    assert rel_rms(s, s_ref) < 1e-5


@pytest.mark.parametrize("splits", [(0, 17, 40, 63), (0, 1, 2, 50, 63), (0, 30, 31, 63)])
def test_composition_equals_sequential(splits):
    """k >= 3 segments' (T, S(C|0)), each from its own zero-start run, compose to the sequential state."""
    q, k, v, g, beta = make_inputs(2, 63, 3, 12, 10)
    init = torch.randn(2, 3, 12, 10)
    _, s_seq = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=init)
    pairs = []
    for a, b in zip(splits[:-1], splits[1:]):
        _, _, (Tr, S0) = naive_recurrent_gated_delta_rule(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], output_transition=True
        )
        pairs.append((Tr, S0))
    T_all, S_all = compose_many(pairs)
    assert rel_rms(apply_segment(T_all, S_all, init), s_seq) < 1e-5
    # segment by segment gives the same state
    state = init
    for Tr, S0 in pairs:
        state = apply_segment(Tr, S0, state)
    assert rel_rms(state, s_seq) < 1e-5
    # dropping T (naive addition) is wrong with decay and erasure
    naive = init
    for Tr, S0 in pairs:
        naive = apply_segment(Tr, S0, naive, use_transition=False)
    assert rel_rms(naive, s_seq) > 0.05


@pytest.mark.parametrize("T,D,W", [(1, 5, 4), (3, 7, 4), (33, 12, 2), (2, 3, 5)])
def test_causal_conv_state_in_tail_out(T, D, W):
    torch.manual_seed(42)
    x = torch.randn(2, T, D)
    w, b = torch.randn(D, W), torch.randn(D)
    state = torch.randn(2, D, W - 1)
    y, tail = naive_causal_conv1d(x, w, b, state)
    y_ref, tail_ref = loop_causal_conv1d(x, w, b, state)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, tail_ref)
    # split run == whole run: the tail carries the state across
    cut = T // 2
    y1, t1 = naive_causal_conv1d(x[:, :cut], w, b, state)
    y2, t2 = naive_causal_conv1d(x[:, cut:], w, b, t1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t2, tail)


@pytest.mark.parametrize("T,chunk", [(1, 16), (15, 16), (77, 16), (130, 64)])
def test_query_transition_folds_any_initial_state(T, chunk):
    """o(S_in) = o(0) + u S_in and S(S_in) = T S_in + S(run|0), for the step loop and the chunked form."""
    import torch.nn.functional as F
    from hybridcache.kernels.ops.gated_delta_rule.chunk import chunk_gated_delta_rule as chunked
    from hybridcache.kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule as naive

    g = torch.Generator().manual_seed(T)
    B, H, K, V = 2, 3, 16, 24
    q = torch.randn(B, T, H, K, generator=g)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, generator=g) + 2)
    beta = torch.rand(B, T, H, generator=g)
    s_in = torch.randn(B, H, K, V, generator=g)
    o_ref, s_ref = naive(q, k, v, gate, beta, initial_state=s_in)
    for run in (naive, lambda *a, **kw: chunked(*a, chunk_size=chunk, **kw)):
        o0, _, (tr, s0), u = run(q, k, v, gate, beta, output_transition=True, output_query_transition=True)
        assert u.shape == (B, T, H, K)
        o = o0 + torch.einsum("bthk,bhkv->bthv", u, s_in)
        assert ((o - o_ref).norm() / o_ref.norm()).item() < 1e-5
        s = torch.einsum("bhkj,bhjv->bhkv", tr, s_in) + s0
        assert ((s - s_ref).norm() / s_ref.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="output_transition"):
        naive(q, k, v, gate, beta, output_query_transition=True)
