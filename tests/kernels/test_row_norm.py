"""The row-norm Triton kernel (kernels/ops/norm/triton.py) against its reference (naive.py): RMS,
gated RMS and L2, odd widths and row counts, strided inputs, fp32 on CPU under Triton's
interpreter and fp32/bf16 on a GPU."""

import pytest
import torch
from hybridcache.kernels.ops.norm import naive
from kernel_testing import L2, RMS, add_rms_norm, device, l2norm_heads, rel_rms, row_norm


@pytest.mark.parametrize("shape", [(1, 7), (5, 33), (2, 19, 96), (300, 16)])
def test_rms_norm_matches_reference(shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(device())
    w = torch.randn(shape[-1], generator=g).to(device())
    got = row_norm(x, w, None, 1e-6, RMS)
    ref = naive.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_rms(got, ref) < 1e-6


@pytest.mark.parametrize("rows,dim", [(1, 64), (13, 40), (77, 128)])
def test_gated_rms_norm_matches_reference(rows, dim):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, dim, generator=g).to(device())
    z = (torch.randn(rows, dim, generator=g) * 2).to(device())
    w = (1 + 0.3 * torch.randn(dim, generator=g)).to(device())
    got = row_norm(x, w, z, 1e-6, RMS)
    assert rel_rms(got, naive.rms_norm_gated(x, z, w, 1e-6)) < 1e-6


@pytest.mark.parametrize("B,n", [(1, 1), (3, 1), (2, 5)])
def test_gated_rms_norm_reads_a_strided_gate_in_place(B, n):
    """The gate z [B, n, H, D] as the linear attention's finish takes it: columns of a wider
    projection, its heads D apart within a token and its tokens a whole projection row apart (no
    [rows, D] view exists for B * n > 1). Equal to the reference on a contiguous copy."""
    g = torch.Generator().manual_seed(3)
    H, D = 3, 24
    proj = torch.randn(B, n, 5 * H * D + 7, generator=g).to(device())
    z = proj[..., 2 * H * D : 3 * H * D].view(B, n, H, D)
    assert B * n == 1 or not z.is_contiguous()
    x = torch.randn(B, n, H, D, generator=g).to(device())
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(device())
    got = row_norm(x.reshape(-1, D), w, z, 1e-6, RMS)  # as finish calls it: x's rows, z's heads
    ref = naive.rms_norm_gated(x.reshape(-1, D), z.reshape(-1, D), w, 1e-6).view(B, n, H, D)
    assert got.shape == (B * n * H, D) and rel_rms(got.view(B, n, H, D), ref) < 1e-6
    # another head's gate is far off: the (token, head) index is the one the view implies
    shifted = proj[..., 2 * H * D + D : 3 * H * D + D].view(B, n, H, D)
    assert rel_rms(got, naive.rms_norm_gated(x.reshape(-1, D), shifted.reshape(-1, D), w, 1e-6)) > 0.1


def test_l2norm_strided_input_fp32_out():
    """q and k come as strided slices of a fused projection; the output is fp32 and contiguous."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, 11, 3, 48, generator=g).to(device())
    x = base[..., :40]
    assert not x.is_contiguous()
    got = row_norm(x, None, None, 1e-6, L2, torch.float32)
    ref = naive.l2norm(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert rel_rms(got, ref) < 1e-6
    assert torch.allclose(got.norm(dim=-1), torch.ones(2, 11, 3, device=got.device), atol=1e-5)


@pytest.mark.parametrize("rep", [1, 2, 3])
def test_l2norm_heads_repeats_and_normalizes_strided_heads(rep):
    """q as the first columns of a conv output [B, n, conv_dim] viewed [B, n, Hk, D]: every head
    L2-normalized and written rep times in a row, equal to repeat_interleave then the reference."""
    g = torch.Generator().manual_seed(4)
    B, n, Hk, D = 2, 7, 3, 20
    conv_out = torch.randn(B, n, 2 * Hk * D + 11, generator=g).to(device())
    q = conv_out[..., : Hk * D].reshape(B, n, Hk, D)
    assert not q.is_contiguous()
    got = l2norm_heads(q, rep, 1e-6, torch.float32)
    ref = naive.l2norm(q.repeat_interleave(rep, dim=2))
    assert got.shape == (B, n, Hk * rep, D) and got.is_contiguous()
    assert rel_rms(got, ref) < 1e-6
    # the wrong grouping (heads tiled instead of repeated in place) is far off
    if rep > 1:
        assert rel_rms(got, naive.l2norm(q.repeat(1, 1, rep, 1))) > 0.1
    with pytest.raises(ValueError, match="repeat"):
        l2norm_heads(q, 0)


@pytest.mark.parametrize("shape", [(1, 7), (2, 5, 33), (300, 16)])
def test_add_rms_norm_matches_reference(shape):
    """The residual sum and the norm of it in one launch: both outputs equal the reference's."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(*shape, generator=g) * 3).to(device())
    r = torch.randn(*shape, generator=g).to(device())
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(device())
    s, y = add_rms_norm(x, r, w, 1e-6)
    s_ref, y_ref = naive.add_rms_norm(x, r, w, 1e-6)
    assert torch.allclose(s, s_ref, atol=1e-6) and rel_rms(y, y_ref) < 1e-6
    assert rel_rms(y, naive.rms_norm(x, w, 1e-6)) > 0.05  # the norm is of the sum, not of x
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, r[..., :-1], w, 1e-6)


def test_row_norm_rejects_mismatched_inputs():
    x = torch.randn(4, 8, device=device())
    with pytest.raises(ValueError, match="weight"):
        row_norm(x, torch.ones(7, device=device()))
    with pytest.raises(ValueError, match="gate"):
        row_norm(x, torch.ones(8, device=device()), torch.ones(4, 9, device=device()))


def test_row_norm_no_rows():
    x = torch.randn(0, 8, device=device())
    assert row_norm(x, torch.ones(8, device=device())).shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 77, 2049, 40000])
def test_row_norm_bf16_gpu(rows):
    torch.manual_seed(3)
    for dim in (96, 128, 256, 4096):
        x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16) * 3
        z = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(dim, device="cuda")
        for got, ref in (
            (row_norm(x, w, None, 1e-6, RMS), naive.rms_norm(x, w, 1e-6)),
            (row_norm(x, w, z, 1e-6, RMS), naive.rms_norm_gated(x, z, w, 1e-6)),
            (row_norm(x, None, None, 1e-6, L2, torch.float32), naive.l2norm(x)),
        ):
            assert got.dtype == ref.dtype
            assert rel_rms(got, ref) < 4e-3, (rows, dim)


@pytest.mark.gpu
def test_l2norm_heads_bf16_gpu():
    torch.manual_seed(5)
    for n, Hk, rep, D in ((1, 16, 2, 128), (4099, 16, 2, 128), (33, 4, 1, 64)):
        conv_out = torch.randn(1, n, 2 * Hk * D + 4096, device="cuda", dtype=torch.bfloat16)
        k = conv_out[..., Hk * D : 2 * Hk * D].reshape(1, n, Hk, D)
        got = l2norm_heads(k, rep, 1e-6, torch.bfloat16)
        ref = naive.l2norm(k.repeat_interleave(rep, dim=2)).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and rel_rms(got, ref) < 1e-2


@pytest.mark.gpu
def test_add_rms_norm_bf16_gpu():
    torch.manual_seed(7)
    for rows in (1, 4099):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) * 3
        r = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        w = 1 + 0.1 * torch.randn(4096, device="cuda")
        s, y = add_rms_norm(x, r, w, 1e-6)
        s_ref, y_ref = naive.add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(s, s_ref) and rel_rms(y, y_ref) < 1e-2
