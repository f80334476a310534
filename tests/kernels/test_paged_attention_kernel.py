"""The paged decode attention kernel (kernels/ops/attention/paged_triton.py) against its PyTorch
reference (paged.py) and against attention over each request's contiguous keys: GQA groupings
Hq/Hkv = 1, 2, 4, 8, head dims 64/128/256, pages scattered over the pool in any order, lengths
that are not multiples of the page size (one key, a page and one, many pages), key splits; fp32
under Triton's interpreter on CPU, bf16 on a GPU."""

import pytest
import torch
from hybridcache.kernels.ops.attention.paged import gather_pages, paged_decode_reference
from kernel_testing import device, paged_decode, rel_rms


def make(lengths, Hq, Hkv, d, page, gen, dtype=torch.float32, extra_pages=3, dv=None):
    """A pool holding each request's keys in pages taken in a random order (page 0 unused), a
    table with one spare row and columns past what any request uses; returns the pool, the table,
    rows, lengths and each request's contiguous K/V."""
    dv = dv or d
    dev = device()
    B = len(lengths)
    need = [-(-n // page) for n in lengths]
    total = sum(need) + extra_pages + 1
    order = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    width = max(need) + 2
    table = torch.zeros(B + 1, width, dtype=torch.int32)
    k_pages = torch.randn(total, page, Hkv, d, generator=gen) * 50  # junk where no key was written
    v_pages = torch.randn(total, page, Hkv, dv, generator=gen) * 50
    ks, vs = [], []
    rows = torch.randperm(B + 1, generator=gen)[:B]
    for b, n in enumerate(lengths):
        k = torch.randn(Hkv, n, d, generator=gen)
        v = torch.randn(Hkv, n, dv, generator=gen)
        ids = [order.pop() for _ in range(need[b])]
        table[rows[b], : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for j in range(n):
            k_pages[ids[j // page], j % page] = k[:, j]
            v_pages[ids[j // page], j % page] = v[:, j]
        ks.append(k)
        vs.append(v)
    q = torch.randn(B, Hq, d, generator=gen)
    cast = dict(device=dev, dtype=dtype)
    return (q.to(**cast), k_pages.to(**cast), v_pages.to(**cast), table.to(dev), rows.to(dev),
            torch.tensor(lengths, dtype=torch.int32, device=dev), ks, vs)


def contiguous(q, ks, vs, scale):
    """Attention of each request over its own contiguous keys, KV heads repeated, fp32."""
    out = []
    for b, (k, v) in enumerate(zip(ks, vs)):
        G = q.shape[1] // k.shape[0]
        kf, vf = k.float().repeat_interleave(G, 0), v.float().repeat_interleave(G, 0)
        s = torch.einsum("hd,hjd->hj", q[b].float().cpu(), kf) * scale
        out.append(torch.einsum("hj,hjd->hd", s.softmax(-1), vf))
    return torch.stack(out)


@pytest.mark.parametrize("Hq,Hkv", [(1, 1), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_reference_equals_contiguous_attention(Hq, Hkv, d):
    gen = torch.Generator().manual_seed(Hq + 10 * Hkv + d)
    lengths, page = [1, 17, 5, 40], 16
    q, kp, vp, table, rows, lens, ks, vs = make(lengths, Hq, Hkv, d, page, gen)
    got = paged_decode_reference(q.cpu(), kp.cpu(), vp.cpu(), table.cpu(), rows.cpu(), lens.cpu(), d**-0.5, 3)
    ref = contiguous(q, ks, vs, d**-0.5)
    assert got.shape == (4, Hq, d)
    assert rel_rms(got, ref) < 1e-5


def test_gather_pages_layout():
    gen = torch.Generator().manual_seed(3)
    q, kp, vp, table, rows, lens, ks, vs = make([7, 20], 2, 2, 8, 4, gen)
    K = gather_pages(kp.cpu(), table.cpu(), rows.cpu(), 5)  # [B, H, 20, d]
    assert K.shape == (2, 2, 20, 8)
    assert torch.equal(K[0, :, :7], ks[0]) and torch.equal(K[1], ks[1])


CASES = [  # (lengths, Hq, Hkv, d, page)
    ([1], 1, 1, 64, 16),
    ([17, 3, 33], 2, 1, 64, 16),
    ([5, 64, 65], 4, 1, 128, 16),
    ([70, 1, 9, 31], 8, 1, 64, 8),
    ([40, 21], 8, 2, 256, 16),
    ([129], 4, 4, 128, 32),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_matches_reference(case, splits):
    lengths, Hq, Hkv, d, page = case
    gen = torch.Generator().manual_seed(len(lengths) * 7 + Hq + d + page)
    q, kp, vp, table, rows, lens, ks, vs = make(lengths, Hq, Hkv, d, page, gen)
    got = paged_decode(q, kp, vp, table, rows, lens, d**-0.5, splits)
    max_pages = -(-max(lengths) // page)
    ref = paged_decode_reference(q, kp, vp, table, rows, lens, d**-0.5, max_pages)
    assert got.shape == ref.shape and got.dtype == q.dtype
    assert rel_rms(got, ref) < 1e-5, case
    assert rel_rms(got.cpu(), contiguous(q, ks, vs, d**-0.5)) < 1e-5


def test_kernel_reads_strided_queries():
    """q as the model hands it over: [1, Hq, B, d] viewed as [B, Hq, d]."""
    gen = torch.Generator().manual_seed(11)
    q, kp, vp, table, rows, lens, ks, vs = make([9, 30], 4, 2, 64, 16, gen)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    got = paged_decode(strided, kp, vp, table, rows, lens, 0.125, 2)
    assert rel_rms(got.cpu(), contiguous(q, ks, vs, 0.125)) < 1e-5


@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_gates_its_output_in_place(splits):
    """gate: the attention's output gate as the model has it (a token-major slice of the query
    projection, [B, Hq, dv] with request and head strides): o * sigmoid(gate) from the kernel (the
    no-split store and the split merge) equals the reference's output gated after it."""
    gen = torch.Generator().manual_seed(13)
    lengths, Hq, Hkv, d, page = [70, 1, 9], 8, 2, 64, 8
    q, kp, vp, table, rows, lens, ks, vs = make(lengths, Hq, Hkv, d, page, gen)
    qg = torch.randn(len(lengths), Hq, 2 * d, generator=gen).to(q.device)
    gate = qg[..., d:]
    assert not gate.is_contiguous()
    got = paged_decode(q, kp, vp, table, rows, lens, d**-0.5, splits, gate)
    plain = paged_decode(q, kp, vp, table, rows, lens, d**-0.5, splits)
    assert rel_rms(got, plain * torch.sigmoid(gate)) < 1e-5
    assert rel_rms(got, plain * torch.sigmoid(qg[..., :d])) > 0.05  # another slice is far off
    with pytest.raises(ValueError, match="gate"):
        paged_decode(q, kp, vp, table, rows, lens, d**-0.5, splits, gate[:, :-1])


@pytest.mark.parametrize("splits,R", [(1, 64), (3, 16)])
def test_kernel_normalizes_and_rotates_raw_queries(splits, R):
    """q_rope: the raw query heads (a token-major slice of the projection) RMS-normalized with the
    head norm's scale and rotated at each request's angles in the kernel, full and partial rotary:
    equal to the kernel on the queries the reference norm + rope made."""
    from hybridcache.kernels.ops.rope import naive as rope_naive

    gen = torch.Generator().manual_seed(17)
    lengths, Hq, Hkv, d, page = [33, 5, 70], 8, 2, 64, 8
    q, kp, vp, table, rows, lens, ks, vs = make(lengths, Hq, Hkv, d, page, gen)
    B = len(lengths)
    qg = (torch.randn(B, Hq, 2 * d, generator=gen) * 3).to(q.device)
    raw = qg[..., :d]
    scale = (1 + 0.2 * torch.randn(d, generator=gen)).to(q.device)
    pos = torch.tensor([40.0, 7.0, 301.0])
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float) / R))
    f = pos[:, None] * inv[None, :]
    cos, sin = torch.cat((f, f), -1).cos().to(q.device), torch.cat((f, f), -1).sin().to(q.device)
    ready = rope_naive.norm_rope(raw[None], scale, 1e-6, cos, sin)[0].transpose(0, 1).contiguous()  # [B, Hq, d]
    got = paged_decode(raw, kp, vp, table, rows, lens, d**-0.5, splits, q_rope=(scale, 1e-6, cos, sin))
    want = paged_decode(ready, kp, vp, table, rows, lens, d**-0.5, splits)
    assert rel_rms(got, want) < 1e-5
    assert rel_rms(got, paged_decode(raw, kp, vp, table, rows, lens, d**-0.5, splits)) > 0.05
    with pytest.raises(ValueError, match="q_rope"):
        paged_decode(raw, kp, vp, table, rows, lens, d**-0.5, splits, q_rope=(scale, 1e-6, cos[:-1], sin[:-1]))


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv", [(16, 4), (8, 8), (8, 1), (4, 2)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("splits", [None, 1])
def test_kernel_bf16_gpu(Hq, Hkv, d, splits):
    gen = torch.Generator().manual_seed(Hq + Hkv + d)
    lengths = [1, 15, 16, 17, 700, 2049, 33, 4100]
    q, kp, vp, table, rows, lens, ks, vs = make(lengths, Hq, Hkv, d, 16, gen, dtype=torch.bfloat16)
    got = paged_decode(q, kp, vp, table, rows, lens, d**-0.5, splits)
    ref = paged_decode_reference(q.float(), kp.float(), vp.float(), table, rows, lens, d**-0.5, -(-4100 // 16))
    assert rel_rms(got, ref) < 2e-2
