"""The SwiGLU activation kernel (kernels/ops/activation/triton.py) against its reference
(naive.py): odd widths and row counts, gate and up as column halves of one buffer (the merged
gate|up GEMM's output), fp32 on CPU under Triton's interpreter and bf16 on a GPU."""

import pytest
import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.activation import naive
from kernel_testing import device, rel_rms, sigmoid_gate_heads, silu_mul


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 33), (17, 2100)])
def test_silu_mul_matches_reference(shape):
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(*shape, generator=g) * 4).to(device())
    up = torch.randn(*shape, generator=g).to(device())
    got = silu_mul(gate, up)
    assert got.shape == gate.shape and got.dtype == gate.dtype and got.is_contiguous()
    assert rel_rms(got, naive.silu_mul(gate, up)) < 1e-6
    assert rel_rms(got, F.silu(gate) * up) < 1e-6


def test_silu_mul_reads_column_halves_in_place():
    """gate and up as the two halves of a [rows, 2I] GEMM output: strided rows, no copies needed."""
    g = torch.Generator().manual_seed(1)
    merged = torch.randn(1, 9, 2 * 45, generator=g).to(device())
    gate, up = merged.split(45, dim=-1)
    assert not gate.is_contiguous()
    got = silu_mul(gate, up)
    assert rel_rms(got, naive.silu_mul(gate, up)) < 1e-6
    # a wrong half (the kernel reading up where gate belongs) is far off
    assert rel_rms(naive.silu_mul(up, gate), naive.silu_mul(gate, up)) > 0.1


def test_silu_mul_rejects_mismatched_inputs_and_takes_no_rows():
    with pytest.raises(ValueError, match="shape"):
        silu_mul(torch.zeros(3, 4, device=device()), torch.zeros(3, 5, device=device()))
    assert silu_mul(torch.zeros(0, 8, device=device()), torch.zeros(0, 8, device=device())).shape == (0, 8)


@pytest.mark.parametrize("B,H,n,d", [(1, 1, 1, 4), (1, 3, 7, 20), (2, 4, 5, 16)])
def test_sigmoid_gate_heads_matches_reference(B, H, n, d):
    """Gated attention's output: head-major o times sigmoid of the gate, where the gate is the second
    half of each head's [q | gate] projection columns (strided heads read in place)."""
    g = torch.Generator().manual_seed(2)
    o = torch.randn(B, H, n, d, generator=g).to(device())
    qg = (torch.randn(B, n, H, 2 * d, generator=g) * 3).to(device())
    gate = qg[..., d:]
    assert n * H == 1 or not gate.is_contiguous()
    got = sigmoid_gate_heads(o, gate)
    ref = naive.sigmoid_gate_heads(o, gate)
    assert got.shape == (B, n, H * d) and got.is_contiguous()
    assert rel_rms(got, ref) < 1e-6
    assert rel_rms(sigmoid_gate_heads(o, gate.reshape(B, n, H * d)), ref) < 1e-6  # flat gate too
    # a head-major reading of o (no transpose) is far off
    if n > 1 and H > 1:
        assert rel_rms(o.reshape(B, n, H * d) * torch.sigmoid(gate.reshape(B, n, H * d)), ref) > 0.1
    with pytest.raises(ValueError, match="gate"):
        sigmoid_gate_heads(o, gate[..., :-1])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 77, 4099])
def test_silu_mul_bf16_gpu(rows):
    torch.manual_seed(3)
    for inter in (96, 12288):
        merged = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
        gate, up = merged.split(inter, dim=-1)
        got = silu_mul(gate, up)
        assert got.dtype == torch.bfloat16
        assert rel_rms(got, naive.silu_mul(gate, up)) < 5e-3


@pytest.mark.gpu
def test_sigmoid_gate_heads_bf16_gpu():
    torch.manual_seed(4)
    for n, H, d in ((1, 16, 256), (4099, 16, 256)):
        o = torch.randn(1, H, n, d, device="cuda", dtype=torch.bfloat16)
        qg = torch.randn(1, n, H, 2 * d, device="cuda", dtype=torch.bfloat16)
        got = sigmoid_gate_heads(o, qg[..., d:])
        assert got.dtype == torch.bfloat16
        assert rel_rms(got, naive.sigmoid_gate_heads(o, qg[..., d:])) < 5e-3
