"""backends.attention: every dispatch branch against explicit masked attention (CPU and GPU)."""

import pytest
import torch
import torch.nn.functional as F
from hybridcache.services.runtime import backends
from kernel_testing import device, rel_rms

CASES = [
    # (n live, N keys, first live position, Hq, Hkv)
    (7, 7, 0, 4, 2),  # plain prefill
    (5, 12, 7, 4, 4),  # prefix-cache resume: live tail
    (5, 12, 7, 4, 2),  # same with GQA
    (1, 9, 8, 4, 2),  # decode
]


def reference(q, k, v, live_pos, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] <= live_pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("n,N,start,hq,hkv", CASES, ids=[f"n{c[0]}-N{c[1]}-p{c[2]}-Hq{c[3]}-Hkv{c[4]}" for c in CASES])
def test_attention_tail_branches(n, N, start, hq, hkv):
    torch.manual_seed(42)
    dev = device()
    q = torch.randn(1, hq, n, 16, device=dev)
    k, v = torch.randn(1, hkv, N, 16, device=dev), torch.randn(1, hkv, N, 16, device=dev)
    live_pos = torch.arange(start, start + n, device=dev)
    out = backends.attention(q, k, v, live_pos, 0.25)
    assert rel_rms(out, reference(q, k, v, live_pos, 0.25)) < 1e-5


def test_attention_interleaved_live_tokens():
    """Seams between cached spans: live positions with gaps take the explicit-mask branch."""
    torch.manual_seed(42)
    dev = device()
    q = torch.randn(1, 4, 4, 16, device=dev)
    k, v = torch.randn(1, 2, 20, 16, device=dev), torch.randn(1, 2, 20, 16, device=dev)
    live_pos = torch.tensor([0, 1, 10, 19], device=dev)
    out = backends.attention(q, k, v, live_pos, 0.25)
    ref = reference(q, k, v, live_pos, 0.25)
    assert rel_rms(out, ref) < 1e-5
    # the first query must not see key 5: dropping the mask changes the output
    assert rel_rms(F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True), ref) > 1e-2


def test_gqa_fold_roundtrip_groups_heads_like_repeat_interleave():
    """gqa_fold puts query head h in KV group h // rep (the grouping repeat_interleave gives the
    keys); gqa_unfold restores the head order."""
    torch.manual_seed(0)
    q = torch.randn(1, 6, 5, 8)
    f = backends.gqa_fold(q, 2)
    assert f.shape == (1, 2, 15, 8)
    assert torch.equal(f[0, 1, 5:10], q[0, 4])  # KV head 1, second query head of its group = head 4
    assert torch.equal(backends.gqa_unfold(f, 6), q)


def test_masked_gqa_folds_query_heads(monkeypatch):
    """Seams with GQA: SDPA gets the KV heads as they are and each KV head's query heads as extra
    rows (equal to the reference); above GQA_FOLD_MAX_MASK the other path answers the same."""
    torch.manual_seed(1)
    q = torch.randn(1, 8, 4, 16)
    k, v = torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    live_pos = torch.tensor([3, 4, 17, 29])
    ref = reference(q, k, v, live_pos, 0.25)
    seen = []
    real = backends.sdpa
    monkeypatch.setattr(
        backends, "sdpa", lambda q_, k_, v_, **kw: seen.append((q_.shape, k_.shape)) or real(q_, k_, v_, **kw)
    )
    assert rel_rms(backends.attention(q, k, v, live_pos, 0.25), ref) < 1e-5
    assert seen == [((1, 2, 16, 16), (1, 2, 30, 16))]
    monkeypatch.setattr(backends, "GQA_FOLD_MAX_MASK", 10)
    assert rel_rms(backends.attention(q, k, v, live_pos, 0.25), ref) < 1e-5
    assert seen[1][0] == (1, 8, 4, 16)


def test_equal_runs_go_to_fla_as_one_varlen_row():
    """B equal-length runs reach fla's chunk function as one row with cu_seqlens (its cumsum kernel
    compiles per batch size); outputs and final states equal each run on its own. A reference
    chunked rule stands in for fla's kernel (CPU)."""
    from hybridcache.kernels.ops.gated_delta_rule import chunk_gated_delta_rule

    seen = []

    def fake_fla(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens=None, cu_seqlens_cpu=None):
        assert q.shape[0] == 1 and torch.equal(cu_seqlens, cu_seqlens_cpu)
        seen.append((cu_seqlens, cu_seqlens_cpu))
        bounds = cu_seqlens_cpu.tolist()
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            s0 = initial_state[i : i + 1] if initial_state is not None else None
            o, S = chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=s0)
            outs.append(o)
            finals.append(S)
        return torch.cat(outs, 1), torch.cat(finals)

    torch.manual_seed(3)
    B, T, H, K, V = 3, 37, 2, 8, 6
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(B, T, H, V), -torch.rand(B, T, H) * 0.2, torch.rand(B, T, H)
    state = torch.randn(B, H, K, V)
    o, S = backends.chunk_as_varlen(fake_fla, q, k, v, g, beta, state)
    o_ref, S_ref = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V)
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(S, S_ref) < 1e-5
    # a second call with the same run shape (the next layer) passes the very same cu_seqlens
    # objects: fla caches its chunk-index tables by the tensors' identity
    backends.chunk_as_varlen(fake_fla, q, k, v, g, beta, state)
    assert seen[1][0] is seen[0][0] and seen[1][1] is seen[0][1]
    assert seen[0][1].tolist() == [0, T, 2 * T, 3 * T]


def test_live_mask_kept_per_positions_tensor():
    """Every attention layer of a forward builds the same [n, N] mask: the last is reused for the
    very same, unmodified positions tensor with the same N and repeat, and never otherwise."""
    pos = torch.tensor([3, 4, 9])
    m = backends._live_mask(pos, 12, 2)
    want = (torch.arange(12)[None, :] <= pos[:, None]).repeat(2, 1)
    assert torch.equal(m, want)
    assert backends._live_mask(pos, 12, 2) is m
    assert backends._live_mask(pos, 13, 2) is not m and backends._live_mask(pos, 13, 2).shape == (6, 13)
    assert torch.equal(backends._live_mask(pos, 12, 1), want[:3])
    assert torch.equal(backends._live_mask(pos.clone(), 12, 2), want)
    pos += 1  # modified in place: rebuilt
    assert torch.equal(backends._live_mask(pos, 12, 2), (torch.arange(12)[None, :] <= pos[:, None]).repeat(2, 1))
