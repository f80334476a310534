"""Live-token attention over one sequence's paged K/V (kernels/ops/attention/triton.py
paged_live_attention, the prefill of a long prompt's chunk and of an assembly whose K/V are in
their request's pages) against its reference (paged.py paged_prefill_reference) and against the
contiguous kernel on the same keys: pages scattered over the pool in any order, a chunk at the end
of a long context, seams, GQA, head dims that are not powers of two, key splits; fp32 under
Triton's interpreter on CPU, bf16 on a GPU."""

import pytest
import torch
from hybridcache.kernels.ops.attention import naive
from hybridcache.kernels.ops.attention.paged import paged_prefill_reference, sequence_keys
from kernel_testing import device, live_attention, paged_live_attention, rel_rms


def paged_sequence(N, Hkv, dq, dv, page, gen, dtype=torch.float32, row=2):
    """A pool holding one sequence's N keys in pages taken in a random order (junk elsewhere), its
    table row `row` of a table with other rows; returns (pools, table, [row, N] on the device,
    contiguous k, v)."""
    dev = device()
    need = -(-N // page)
    total = need + 5
    ids = (torch.randperm(total - 1, generator=gen) + 1)[:need]
    table = torch.randint(0, total, (row + 2, need + 3), generator=gen, dtype=torch.int32)
    table[row, :need] = ids.to(torch.int32)
    k_pages = torch.randn(total, page, Hkv, dq, generator=gen) * 30
    v_pages = torch.randn(total, page, Hkv, dv, generator=gen) * 30
    k = torch.randn(Hkv, N, dq, generator=gen)
    v = torch.randn(Hkv, N, dv, generator=gen)
    for j in range(N):
        k_pages[ids[j // page], j % page] = k[:, j]
        v_pages[ids[j // page], j % page] = v[:, j]
    cast = dict(device=dev, dtype=dtype)
    # the row tensor holds the table row and the sequence's length, as the kernel reads them
    return (k_pages.to(**cast), v_pages.to(**cast), table.to(dev), torch.tensor([row, N], device=dev),
            k[None].to(**cast), v[None].to(**cast))


@pytest.mark.parametrize("Hq,Hkv", [(1, 1), (4, 2), (8, 1)])
@pytest.mark.parametrize("dq,dv", [(8, 8), (24, 40)])
def test_chunk_at_the_end_of_a_paged_context(Hq, Hkv, dq, dv):
    """A prompt's chunk: queries at the last n positions over N keys (the chunk's own included)."""
    gen = torch.Generator().manual_seed(Hq * 10 + Hkv + dq)
    for N, n, page in [(1, 1, 4), (37, 5, 4), (70, 13, 16), (33, 33, 8)]:
        k_pages, v_pages, table, row, k, v = paged_sequence(N, Hkv, dq, dv, page, gen)
        q = torch.randn(1, Hq, n, dq, generator=gen).to(device())
        pos = torch.arange(N - n, N, device=device())
        got = paged_live_attention(q, k_pages, v_pages, table, row, pos, N, dq**-0.5)
        ref = paged_prefill_reference(q, k_pages, v_pages, table, row, pos, N, dq**-0.5)
        assert got.shape == (1, Hq, n, dv) and got.is_contiguous()
        assert rel_rms(ref, naive.live_attention(q, k, v, pos, dq**-0.5)) < 1e-6
        assert rel_rms(got, ref) < 1e-5, (N, n, page)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_seams_over_pages_equal_the_contiguous_kernel(num_splits):
    """Seams between cached spans and a tail, with and without key splits; the table row as data."""
    gen = torch.Generator().manual_seed(7)
    N = 150
    pos = torch.tensor([3, 4, 5, 60, 61, 62, *range(140, 150)], device=device())
    k_pages, v_pages, table, row, k, v = paged_sequence(N, 2, 24, 24, 16, gen, row=0)
    q = (torch.randn(1, 6, len(pos), 24, generator=gen) * 3).to(device())
    got = paged_live_attention(q, k_pages, v_pages, table, row, pos, N, 0.2, num_splits=num_splits)
    flat = live_attention(q, k, v, pos, 0.2, num_splits=num_splits)
    assert rel_rms(got, flat) < 1e-5
    assert rel_rms(got, naive.live_attention(q, k, v, pos, 0.2)) < 1e-5
    # the length read on the device alone (as a CUDA graph replays it): the same answer
    unknown = paged_live_attention(q, k_pages, v_pages, table, row, pos, None, 0.2, num_splits=num_splits)
    assert rel_rms(unknown, flat) < 1e-5


def test_sequence_keys_gathers_the_row_s_pages_in_order():
    gen = torch.Generator().manual_seed(1)
    k_pages, _, table, row, k, _ = paged_sequence(29, 3, 8, 8, 4, gen, row=1)
    assert torch.equal(sequence_keys(k_pages, table, 1, 29), k)
    assert torch.equal(sequence_keys(k_pages, table, row, 29), k)
    assert torch.equal(sequence_keys(k_pages, table, 1, 10), k[:, :, :10])


def test_bad_arguments():
    gen = torch.Generator().manual_seed(2)
    k_pages, v_pages, table, row, _, _ = paged_sequence(9, 2, 8, 8, 4, gen)
    q = torch.randn(1, 4, 3, 8).to(device())
    pos = torch.arange(6, 9, device=device())
    with pytest.raises(ValueError, match="GQA"):
        paged_live_attention(torch.randn(1, 3, 3, 8).to(device()), k_pages, v_pages, table, row, pos, 9, 1.0)
    with pytest.raises(ValueError, match="q_pos"):
        paged_live_attention(q, k_pages, v_pages, table, row, pos[:2], 9, 1.0)
    with pytest.raises(ValueError, match="length"):
        paged_live_attention(q, k_pages, v_pages, table, row, pos, 0, 1.0)
    with pytest.raises(ValueError, match="row"):
        paged_live_attention(q, k_pages, v_pages, table, row[:1], pos, 9, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_at_the_engine_shape():
    """Qwen3.5-9B's attention (16 query / 4 KV heads, d = 256), a 2k-token chunk after 6k keys in
    pages of 16, bf16: within bf16 rounding of the fp32 reference on the same keys."""
    gen = torch.Generator().manual_seed(3)
    N, n = 8192, 2048
    k_pages, v_pages, table, row, k, v = paged_sequence(N, 4, 256, 256, 16, gen, dtype=torch.bfloat16)
    q = torch.randn(1, 16, n, 256, generator=gen).to("cuda", torch.bfloat16)
    pos = torch.arange(N - n, N, device="cuda")
    got = paged_live_attention(q, k_pages, v_pages, table, row, pos, N, 256**-0.5)
    ref = naive.live_attention(q.float(), k.float(), v.float(), pos, 256**-0.5)
    assert rel_rms(got, ref) < 1e-2
