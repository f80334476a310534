"""Fused entry construction on fla's kernels (GPU) vs the step-loop reference and the S0 = I trick; the fold of a
batch of runs onto one row for fla's cumsum (CPU, with a reference cumsum)."""

import pytest
import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from kernel_testing import rel_rms

SHAPES = [(1, 203, 4, 64, 64), (2, 130, 3, 64, 32), (1, 64, 2, 128, 128), (3, 37, 2, 128, 64)]


def make_inputs(B, T, H, K, V, seed=42):
    torch.manual_seed(seed)
    dev = "cuda"
    q = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(B, T, H, V, device=dev).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, H, device=dev)) * 0.3
    beta = torch.rand(B, T, H, device=dev).bfloat16()
    return q, k, v, g, beta


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,K,V", SHAPES, ids=[f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in SHAPES])
@pytest.mark.parametrize("with_init", [False, True])
def test_entry_matches_reference(B, T, H, K, V, with_init):
    from hybridcache.kernels.ops.gated_delta_rule.fla_entry import chunk_gated_delta_rule_entry

    q, k, v, g, beta = make_inputs(B, T, H, K, V)
    init = torch.randn(B, H, K, V, device="cuda") if with_init else None
    o, S, (Tr, S0) = chunk_gated_delta_rule_entry(q, k, v, g, beta, initial_state=init)
    o_ref, S_ref, (Tr_ref, S0_ref) = naive_recurrent_gated_delta_rule(
        q.float(), k.float(), v.float(), g, beta.float(), initial_state=init, output_transition=True
    )
    assert rel_rms(o, o_ref) < 2e-2
    assert rel_rms(S, S_ref) < 2e-2
    assert rel_rms(Tr, Tr_ref) < 2e-2
    assert rel_rms(S0, S0_ref) < 2e-2


@pytest.mark.gpu
def test_entry_transition_equals_identity_start_trick():
    from hybridcache.kernels.ops.gated_delta_rule.fla_entry import (
        chunk_gated_delta_rule_entry,
        transition_by_identity_start,
    )

    q, k, v, g, beta = make_inputs(1, 1000, 4, 128, 128)
    _, _, (Tr, _) = chunk_gated_delta_rule_entry(q, k, v, g, beta)
    assert rel_rms(Tr, transition_by_identity_start(k, g, beta)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,K,V", SHAPES, ids=[f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in SHAPES])
def test_entry_query_transition_matches_reference(B, T, H, K, V):
    """u (the T run's outputs) on fla's kernels, K == V (stacked output stage) and K != V, against
    the step loop; and o0 + u S_in equals the run's outputs from S_in."""
    from hybridcache.kernels.ops.gated_delta_rule.fla_entry import chunk_gated_delta_rule_entry

    q, k, v, g, beta = make_inputs(B, T, H, K, V)
    o0, _, (Tr, S0), u = chunk_gated_delta_rule_entry(q, k, v, g, beta, output_query_transition=True)
    r = naive_recurrent_gated_delta_rule(
        q.float(), k.float(), v.float(), g, beta.float(), output_transition=True, output_query_transition=True
    )
    assert u.shape == (B, T, H, K)
    assert rel_rms(o0, r[0]) < 2e-2 and rel_rms(Tr, r[2][0]) < 2e-2 and rel_rms(u, r[3]) < 2e-2
    s_in = torch.randn(B, H, K, V, device="cuda")
    o_ref, _ = naive_recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), initial_state=s_in)
    assert rel_rms(o0.float() + torch.einsum("bthk,bhkv->bthv", u.float(), s_in), o_ref) < 2e-2


@pytest.mark.parametrize("B,T", [(1, 77), (3, 130), (4, 128), (2, 5)])
def test_local_cumsum_runs_fla_with_a_batch_of_one_cpu(B, T):
    """The fold of B runs onto one row (fla's cumsum autotunes per B) gives each run's chunk-local
    cumsum; checked with a reference cumsum standing in for fla's kernel."""
    from hybridcache.kernels.ops.gated_delta_rule.fla_entry import local_cumsum_one_row

    calls = []

    def ref(x, c=64):
        calls.append(x.shape[0])
        n = x.shape[1]
        return torch.cat([x[:, i : i + c].cumsum(1) for i in range(0, n, c)], 1)

    g = torch.randn(B, T, 3)
    out = local_cumsum_one_row(g, 64, ref)
    expect = torch.stack([ref(g[b : b + 1])[0] for b in range(B)])
    assert calls[0] == 1 and out.shape == (B, T, 3) and out.is_contiguous()
    assert torch.allclose(out, expect, atol=1e-6)


@pytest.mark.parametrize("B,L,H,HV", [(3, 37, 2, 2), (2, 64, 1, 3), (1, 1, 2, 4)])
def test_single_chunk_transition_matches_reference_cpu(B, L, H, HV):
    """The closed-form T of a run of at most one chunk, from fla's w (here its definition, the
    WY stage in fp32 with the log2 cumsum fla's kernels take) equals the step loop's transition;
    grouped value heads (HV a multiple of H) included."""
    from hybridcache.kernels.ops.gated_delta_rule.fla_entry import single_chunk_transition

    torch.manual_seed(0)
    K = 16
    k = F.normalize(torch.randn(B, L, H, K), dim=-1)
    g = F.logsigmoid(torch.randn(B, L, HV)) * 0.5
    beta = torch.rand(B, L, HV)
    kv = k.repeat_interleave(HV // H, dim=2)  # [B, L, HV, K]
    gc = g.cumsum(1)
    kh, gh, bh = kv.transpose(1, 2), gc.transpose(1, 2), beta.transpose(1, 2)  # [B, HV, L, ...]
    decay = (gh[..., :, None] - gh[..., None, :]).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -1e30).exp()
    kbeta = kh * bh[..., None]
    A = ((kbeta @ kh.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(L)
    w = torch.linalg.solve_triangular(eye + A, eye, upper=False) @ (kbeta * gh.exp()[..., None])
    Tr, h_t, v_t = single_chunk_transition(k, w.transpose(1, 2), gc / torch.log(torch.tensor(2.0)), True)
    zeros = torch.zeros(B, L, HV, K)
    _, _, (Tr_ref, _) = naive_recurrent_gated_delta_rule(kv, kv, zeros, g, beta, output_transition=True)
    assert Tr.shape == (B, HV, K, K) and torch.allclose(Tr, Tr_ref, atol=1e-5)
    assert torch.equal(v_t, -w.transpose(1, 2))
    assert h_t.shape == (B, 1, HV, K, K) and torch.equal(h_t, torch.eye(K).expand(B, 1, HV, K, K))


@pytest.mark.parametrize("B,L,H,HV,V", [(3, 37, 2, 2, 8), (2, 64, 1, 3, 16), (1, 1, 2, 4, 4), (2, 8, 2, 4, 16)])
def test_single_chunk_from_zero_matches_reference_cpu(B, L, H, HV, V):
    """A run of at most one chunk from a zero state in closed form from fla's WY stage (here its
    definition in fp32, with the log2 cumsum fla's kernels take): its outputs, final state, T and
    the T run's outputs equal the step loop's; grouped value heads included."""
    from hybridcache.kernels.ops.gated_delta_rule.fla_entry import single_chunk_from_zero

    torch.manual_seed(1)
    K = 16
    q = F.normalize(torch.randn(B, L, H, K), dim=-1)
    k = F.normalize(torch.randn(B, L, H, K), dim=-1)
    v = torch.randn(B, L, HV, V)
    g = F.logsigmoid(torch.randn(B, L, HV)) * 0.5
    beta = torch.rand(B, L, HV)
    qv, kv = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    gc = g.cumsum(1)
    kh, gh, bh, vh = kv.transpose(1, 2), gc.transpose(1, 2), beta.transpose(1, 2), v.transpose(1, 2)
    decay = (gh[..., :, None] - gh[..., None, :]).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -1e30).exp()
    kbeta = kh * bh[..., None]
    A = ((kbeta @ kh.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(L)
    Linv = torch.linalg.solve_triangular(eye + A, eye, upper=False)
    w = (Linv @ (kbeta * gh.exp()[..., None])).transpose(1, 2)
    u = (Linv @ (vh * bh[..., None])).transpose(1, 2)
    scale = K**-0.5
    o, S0, Tr, u_t = single_chunk_from_zero(q, k, u, w, gc / torch.log(torch.tensor(2.0)), scale, True)
    o_ref, S_ref, (Tr_ref, S0_ref), u_ref = naive_recurrent_gated_delta_rule(
        qv, kv, v, g, beta, scale=scale, output_transition=True, output_query_transition=True)
    assert o.shape == (B, L, HV, V) and S0.shape == (B, HV, K, V) and u_t.shape == (B, L, HV, K)
    for got, want in ((o, o_ref), (S0, S0_ref), (S0, S_ref), (Tr, Tr_ref), (u_t, u_ref)):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    if L > 1:  # a wrong decay (natural exp of the log2 cumsum) is far off
        _, S_bad, _, _ = single_chunk_from_zero(q, k, u, w, gc, scale, False)
        assert not torch.allclose(S_bad, S0_ref, atol=1e-3)


def test_identity_states_are_views_of_one_kept_buffer_cpu():
    from hybridcache.kernels.ops.gated_delta_rule.fla_entry import identity_states

    a = identity_states(3, 2, 8, torch.bfloat16, "cpu")
    b = identity_states(2, 2, 8, torch.bfloat16, "cpu")
    assert a.shape == (3, 1, 2, 8, 8) and b.data_ptr() == a.data_ptr()
    c = identity_states(5, 2, 8, torch.bfloat16, "cpu")  # grown: a new buffer, the old one kept
    assert c.shape[0] == 5 and c.data_ptr() != a.data_ptr() and torch.equal(a[0, 0, 0], torch.eye(8).bfloat16())
