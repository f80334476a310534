"""Fused entry construction on fla's kernels (GPU) vs the step-loop reference and the S0 = I trick; the fold of a
batch of runs onto one row for fla's cumsum (CPU, with a reference cumsum)."""

import pytest
import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from kernel_testing import rel_rms

SHAPES = [(1, 203, 4, 64, 64), (2, 130, 3, 64, 32), (1, 64, 2, 128, 128)]


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
