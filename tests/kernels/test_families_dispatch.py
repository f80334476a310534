"""backends' KDA / Lightning / Mamba2 SSD dispatch on CPU (the references, bit for bit) and the
math the CUDA paths use for (T, S(run|0)): S_final - T * S_init for diagonal T, and the extra
value columns started from I for KDA's dense T, both checked with the references standing in for
fla's kernels (odd shapes, fp32)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.gla import naive_recurrent_gla
from hybridcache.kernels.ops.kda import naive_recurrent_kda
from hybridcache.kernels.ops.kda.fla_entry import transition_by_value_columns
from hybridcache.kernels.ops.mamba2 import naive_ssd
from hybridcache.kernels.ops.simple_gla import lightning_slopes, naive_lightning_attention, naive_recurrent_simple_gla
from hybridcache.kernels.ops.simple_gla.fla_entry import diagonal_entry
from hybridcache.services.runtime import backends

B, T, H, K, V = 2, 23, 3, 5, 7


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _kda_inputs(seed=0):
    g = _gen(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, K, generator=g)) * 0.5
    beta = torch.rand(B, T, H, generator=g)
    init = torch.randn(B, H, K, V, generator=g)
    return q, k, v, gate, beta, init


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            _assert_same(x, y)
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("output_transition", [False, True])
def test_kda_dispatch_on_cpu_is_the_reference(with_init, output_transition):
    q, k, v, gate, beta, init = _kda_inputs()
    init = init if with_init else None
    got = backends.kda(q, k, v, gate, beta, init, output_transition)
    ref = naive_recurrent_kda(q, k, v, gate, beta, initial_state=init, output_transition=output_transition)
    assert len(got) == (3 if output_transition else 2)
    _assert_same(got, ref)


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("output_transition", [False, True])
def test_gla_dispatch_on_cpu_is_the_reference(with_init, output_transition):
    g = _gen(4)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gk = F.logsigmoid(torch.randn(B, T, H, K, generator=g) + 2)
    init = torch.randn(B, H, K, V, generator=g) if with_init else None
    got = backends.gla(q, k, v, gk, None, init, output_transition)
    ref = naive_recurrent_gla(q, k, v, gk, initial_state=init, output_transition=output_transition)
    assert len(got) == (3 if output_transition else 2)
    _assert_same(got, ref)


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("output_transition", [False, True])
def test_lightning_dispatch_on_cpu_is_the_reference(with_init, output_transition):
    g = _gen(1)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    init = torch.randn(B, H, K, V, generator=g) if with_init else None
    slopes = lightning_slopes(H)
    got = backends.lightning_attention(q, k, v, slopes, 1.0, init, output_transition)
    ref = naive_lightning_attention(q, k, v, slopes, scale=1.0, initial_state=init, output_transition=output_transition)
    _assert_same(got, ref)


def _ssd_inputs(seed=2, G=1):
    g = _gen(seed)
    x = torch.randn(B, T, H, V, generator=g)
    dt = F.softplus(torch.randn(B, T, H, generator=g))
    A = -torch.rand(H, generator=g) - 0.1
    Bm, C = torch.randn(B, T, G, K, generator=g), torch.randn(B, T, G, K, generator=g)
    D = torch.randn(H, generator=g)
    init = torch.randn(B, H, K, V, generator=g)
    return x, dt, A, Bm, C, D, init


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("output_transition", [False, True])
def test_ssd_dispatch_on_cpu_is_the_reference(with_init, output_transition):
    x, dt, A, Bm, C, D, init = _ssd_inputs()
    init = init if with_init else None
    got = backends.ssd(x, dt, A, Bm, C, D, init, output_transition)
    ref = naive_ssd(x, dt, A, Bm, C, D=D, initial_state=init, output_transition=output_transition)
    _assert_same(got, ref)


def test_fla_probe_is_false_without_fla():
    # tests/conftest.py hides fla on CPU; the dispatch then never reaches the fla modules
    assert backends.fla_has("fla.ops.kda") is False
    assert backends.fla_has("hybridcache_no_such_module") is False
    assert backends.fla_has("torch") is True


def test_scalar_diagonal_entry_equals_reference_transition():
    """S_final - T * S_init with T = exp(sum g) reproduces simple GLA's (T, S(run|0)) (fp32)."""
    g = _gen(3)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, generator=g) + 4)  # T stays well above 0
    init = torch.randn(B, H, K, V, generator=g) * 3
    _, S_final, (Tr_ref, S0_ref) = naive_recurrent_simple_gla(q, k, v, gate, initial_state=init, output_transition=True)
    Tr, S0 = diagonal_entry(gate.sum(1), S_final, init)
    assert Tr.shape == (B, H) and S0.shape == (B, H, K, V)
    assert torch.allclose(Tr, Tr_ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(S0, S0_ref, rtol=1e-4, atol=1e-4)
    assert (S_final - S0_ref).abs().max() > 1e-2  # the initial state's share is not negligible
    # no initial state: S(run|0) is the final state itself
    _, S_zero = naive_recurrent_simple_gla(q, k, v, gate)
    assert torch.equal(diagonal_entry(gate.sum(1), S_zero, None)[1], S_zero)


def test_vector_diagonal_entry_equals_reference_transition():
    """The same derivation for a per-channel (GLA) gate: T [B, H, K]."""
    g = _gen(4)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gk = F.logsigmoid(torch.randn(B, T, H, K, generator=g) + 2)
    init = torch.randn(B, H, K, V, generator=g) * 3
    _, S_final, (Tr_ref, S0_ref) = naive_recurrent_gla(q, k, v, gk, initial_state=init, output_transition=True)
    Tr, S0 = diagonal_entry(gk.sum(1), S_final, init)
    assert Tr.shape == (B, H, K)
    assert (S_final - S0_ref).abs().max() > 1e-2
    assert torch.allclose(Tr, Tr_ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(S0, S0_ref, rtol=1e-4, atol=1e-4)


def test_ssd_scalar_entry_equals_reference_transition():
    """Mamba2's T = exp(A sum dt) and S(run|0) by the diagonal derivation."""
    x, dt, A, Bm, C, D, init = _ssd_inputs(seed=5)
    dt = dt * 0.05  # T stays well above 0
    _, S_final, (Tr_ref, S0_ref) = naive_ssd(x, dt, A, Bm, C, D=D, initial_state=init, output_transition=True)
    Tr, S0 = diagonal_entry((dt * A).sum(1), S_final, init)
    assert (S_final - S0_ref).abs().max() > 1e-2
    assert torch.allclose(Tr, Tr_ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(S0, S0_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("with_init", [False, True])
def test_kda_transition_by_value_columns_equals_reference(with_init):
    """KDA's dense T from K extra value columns started from I, in the same run (what the CUDA
    path does with chunk_kda), with the reference standing in for fla's kernel."""
    q, k, v, gate, beta, init = _kda_inputs(seed=6)
    init = init if with_init else None
    run = functools.partial(naive_recurrent_kda, output_final_state=True)
    o, S, (Tr, S0) = transition_by_value_columns(run, q, k, v, gate, beta, None, init)
    o_ref, S_ref, (Tr_ref, S0_ref) = naive_recurrent_kda(
        q, k, v, gate, beta, initial_state=init, output_transition=True
    )
    assert Tr.shape == (B, H, K, K) and S0.shape == (B, H, K, V)
    for got, ref in ((o, o_ref), (S, S_ref), (Tr, Tr_ref), (S0, S0_ref)):
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert (Tr - torch.eye(K)).abs().max() > 1e-2
