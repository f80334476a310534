"""The rotary-embedding kernel (kernels/ops/rope/triton.py) against its reference (naive.py): full
and partial rotary widths, odd token, head and channel counts, token-major strided views of a
projection's output (with the head RMSNorm) and head-major tensors; fp32 under Triton's
interpreter on CPU, bf16 on a GPU."""

import pytest
import torch
from hybridcache.kernels.ops.rope import naive
from kernel_testing import device, norm_rope_into_pages, norm_rope_tokens, rel_rms, rope_heads, spans_into_pages


def angles(n, R, gen, start=0):
    pos = torch.arange(start, start + n, dtype=torch.float)
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float) / R))
    f = pos[:, None] * inv[None, :]
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().to(device()), emb.sin().to(device())


@pytest.mark.parametrize("B,n,H,D,R", [(1, 1, 1, 8, 8), (2, 7, 3, 20, 8), (1, 13, 5, 32, 32), (1, 4, 2, 64, 16)])
def test_rope_heads_matches_reference(B, n, H, D, R):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(B, H + 1, n, D, generator=gen).to(device())
    x = base[:, 1:]  # a strided head-major view
    cos, sin = angles(n, R, gen, start=37)
    got = rope_heads(x, cos, sin)
    ref = naive.rope(x, cos, sin)
    assert got.shape == (B, H, n, D) and got.is_contiguous()
    assert rel_rms(got, ref) < 1e-6
    if R < D:  # channels past R pass through untouched
        assert torch.equal(got[..., R:], x[..., R:])
    # a wrong sign in rotate_half is far off
    assert rel_rms(naive.rope(x, cos, -sin), ref) > 0.05


@pytest.mark.parametrize("B,n,H,D,R", [(1, 1, 2, 16, 16), (2, 9, 3, 24, 8), (1, 33, 4, 32, 16)])
def test_norm_rope_tokens_reads_projection_views(B, n, H, D, R):
    """q as [B, n, H, D] chunks of a [B, n, H, 2D] projection (q | gate per head), as the model has it."""
    gen = torch.Generator().manual_seed(1)
    qg = (torch.randn(B, n, H, 2 * D, generator=gen) * 3).to(device())
    q = qg[..., :D]
    assert not q.is_contiguous()
    scale = (1 + 0.2 * torch.randn(D, generator=gen)).to(device())
    cos, sin = angles(n, R, gen)
    got = norm_rope_tokens(q, scale, 1e-6, cos, sin)
    ref = naive.norm_rope(q, scale, 1e-6, cos, sin)
    assert got.shape == (B, H, n, D) and rel_rms(got, ref) < 1e-6


@pytest.mark.parametrize("n,H,D,DV,R,P", [(1, 1, 16, 16, 16, 4), (5, 3, 24, 20, 8, 3), (9, 2, 32, 32, 32, 16)])
def test_norm_rope_into_pages_writes_the_rows_of_the_reference(n, H, D, DV, R, P):
    """A decode step's keys and values as the model has them (token-major views of one projection
    of k | v per token), written into pools at scattered rows: each row holds the reference's
    normalized, rotated key and the value; no other row changes."""
    gen = torch.Generator().manual_seed(2)
    kv = (torch.randn(n, H * D + H * DV + 3, generator=gen) * 3).to(device())
    k = kv[:, : H * D].view(n, H, D)
    v = kv[:, H * D : H * D + H * DV].view(n, H, DV)
    scale = (1 + 0.2 * torch.randn(D, generator=gen)).to(device())
    cos, sin = angles(n, R, gen, start=11)
    pages = 2 * n // P + 2
    k_pages = torch.randn(pages, P, H, D, generator=gen).to(device())
    v_pages = torch.randn(pages, P, H, DV, generator=gen).to(device())
    rows = torch.randperm(pages * P, generator=gen)[:n].to(device())
    want_k, want_v = k_pages.clone(), v_pages.clone()
    ref = naive.norm_rope(k[None], scale, 1e-6, cos, sin)[0].transpose(0, 1)  # [n, H, D]
    want_k.view(-1, H, D)[rows] = ref
    want_v.view(-1, H, DV)[rows] = v
    norm_rope_into_pages(k, v, scale, 1e-6, cos, sin, k_pages, v_pages, rows)
    assert rel_rms(k_pages, want_k) < 1e-6 and torch.equal(v_pages, want_v)
    with pytest.raises(ValueError, match="rows"):
        norm_rope_into_pages(k, v, scale, 1e-6, cos, sin, k_pages, v_pages, rows[:-1] if n > 1 else rows[:0])


@pytest.mark.parametrize("lens,H,D,DV,R,P", [((1,), 1, 8, 8, 8, 2), ((5, 1, 12), 3, 20, 12, 8, 4),
                                             ((7, 16), 2, 32, 24, 16, 8)])
@pytest.mark.parametrize("given_index", [False, True])
def test_spans_into_pages_writes_the_rows_of_the_reference(lens, H, D, DV, R, P, given_index):
    """Cached spans' K/V, each a tensor of its own, rotated by their shifts and written into pools
    at scattered rows in one launch: each row holds the reference's rotated key (the spans'
    keys concatenated, then rotated) and the value; no other row changes."""
    gen = torch.Generator().manual_seed(3)
    ks = [torch.randn(1, H, n, D, generator=gen).to(device()) for n in lens]
    # values token-major, as the model's projection leaves them ([1, n, H, DV] viewed head-major)
    vs = [torch.randn(1, n, H, DV, generator=gen).to(device()).transpose(1, 2) for n in lens]
    S = sum(lens)
    cos, sin = angles(S, R, gen, start=5)
    pages = 2 * S // P + 2
    k_pages = torch.randn(pages, P, H, D, generator=gen).to(device())
    v_pages = torch.randn(pages, P, H, DV, generator=gen).to(device())
    rows = torch.randperm(pages * P, generator=gen)[:S].to(device())
    want_k, want_v = k_pages.clone(), v_pages.clone()
    K, V = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    want_k.view(-1, H, D)[rows] = naive.rope(K, cos, sin)[0].transpose(0, 1)
    want_v.view(-1, H, DV)[rows] = V[0].transpose(0, 1)
    index = {}
    if given_index:
        span = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        local = torch.cat([torch.arange(n) for n in lens])
        index = dict(tok_span=span.to(device()), tok_local=local.to(device()))
    spans_into_pages(ks, vs, cos, sin, k_pages, v_pages, rows, **index)
    assert rel_rms(k_pages, want_k) < 1e-6 and torch.equal(v_pages, want_v)
    with pytest.raises(ValueError, match="rows"):
        spans_into_pages(ks, vs, cos, sin, k_pages, v_pages, rows[:-1])
    with pytest.raises(ValueError, match="unit-stride"):
        spans_into_pages([torch.cat([ks[0], ks[0]], dim=-1)[..., ::2]] + ks[1:], vs, cos, sin, k_pages, v_pages, rows)


def test_rope_rejects_bad_angles():
    x = torch.zeros(1, 2, 3, 8, device=device())
    with pytest.raises(ValueError, match="cos/sin"):
        rope_heads(x, torch.zeros(3, 7, device=device()), torch.zeros(3, 7, device=device()))
    with pytest.raises(ValueError, match="cos/sin"):
        rope_heads(x, torch.zeros(2, 8, device=device()), torch.zeros(2, 8, device=device()))
    with pytest.raises(ValueError, match="scale"):
        norm_rope_tokens(torch.zeros(1, 3, 2, 8, device=device()), torch.ones(7, device=device()), 1e-6,
                         torch.zeros(3, 8, device=device()), torch.zeros(3, 8, device=device()))


@pytest.mark.gpu
def test_norm_rope_bf16_gpu():
    torch.manual_seed(2)
    for n, H, D, R in ((1, 16, 256, 64), (4099, 16, 256, 64), (77, 4, 128, 128)):
        qg = torch.randn(1, n, H, 2 * D, device="cuda", dtype=torch.bfloat16)
        q = qg[..., :D]
        scale = 1 + 0.1 * torch.randn(D, device="cuda")
        cos, sin = (t.cuda() for t in angles(n, R, None))
        got = norm_rope_tokens(q, scale, 1e-6, cos, sin)
        assert got.dtype == torch.bfloat16 and rel_rms(got, naive.norm_rope(q, scale, 1e-6, cos, sin)) < 1e-2
        k = got.float().bfloat16()
        assert rel_rms(rope_heads(k, cos, sin), naive.rope(k, cos, sin)) < 1e-2


@pytest.mark.gpu
def test_spans_into_pages_engine_shape_gpu():
    """The Qwen3.5 shapes' warm request: 32 spans of 1,016 tokens, 2 K/V heads of 256 channels
    (64 rotated), bf16 entries (values token-major) into bf16 pages: equal to the reference's
    concatenate-rotate-write up to the rotation's fp32 rounding."""
    gen = torch.Generator().manual_seed(4)
    lens, H, D, R, P = [1016] * 32, 2, 256, 64, 16
    ks = [torch.randn(1, H, n, D, generator=gen).to("cuda", torch.bfloat16) for n in lens]
    vs = [torch.randn(1, n, H, D, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2) for n in lens]
    S = sum(lens)
    cos, sin = angles(S, R, gen, start=8)
    pages = S // P + 4
    k_pages = torch.zeros(pages, P, H, D, device="cuda", dtype=torch.bfloat16)
    v_pages = torch.zeros_like(k_pages)
    rows = torch.randperm(pages * P, generator=gen)[:S].to("cuda")
    spans_into_pages(ks, vs, cos, sin, k_pages, v_pages, rows)
    K, V = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    want_k = naive.rope(K.float(), cos, sin)[0].transpose(0, 1).to(torch.bfloat16)
    assert rel_rms(k_pages.view(-1, H, D)[rows], want_k) < 2**-8
    assert torch.equal(v_pages.view(-1, H, D)[rows], V[0].transpose(0, 1))
