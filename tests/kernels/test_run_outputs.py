"""The planned assembly's run outputs from the states the fold left (kernels/ops/transition/
outputs_triton.py) against their pure-PyTorch reference: odd shapes, strided inputs, repeated and
initial rows, bf16 and fp32."""

import pytest
import torch
from kernel_testing import device, rel_rms, run_outputs, run_outputs_reference

SHAPES = [(1, 1, 1, 16, 16), (3, 5, 2, 20, 12), (4, 17, 3, 32, 40), (2, 70, 1, 24, 8)]


def make(m, L, H, K, V, R, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    o0 = torch.randn(m, L, H, V, generator=g).to(device(), dtype)
    u = torch.randn(m, L, H, K, generator=g).to(device(), dtype)
    hs = torch.randn(R, H, K, V, generator=g).to(device())
    rows = torch.randint(0, R, (m,), generator=g).to(device())
    return o0, u, hs, rows


@pytest.mark.parametrize("m,L,H,K,V", SHAPES, ids=[f"m{m}-L{L}-H{h}-K{k}-V{v}" for m, L, h, k, v in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_outputs_match_reference(m, L, H, K, V, dtype):
    o0, u, hs, rows = make(m, L, H, K, V, R=m + 2, dtype=dtype)
    got = run_outputs(o0, u, hs, rows)
    want = run_outputs_reference(o0, u, hs, rows)
    assert got.dtype == dtype and got.shape == (m, L, H, V)
    # fp32: the interpreter's fp32 products, the GPU's TF32 ones; bf16: two roundings of the output
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-5 if device() == "cpu" else 2e-3
    assert rel_rms(got, want) < tol


def test_run_outputs_read_each_runs_own_row():
    """Rows repeat (two runs entering with one state, the initial row 0 for several) and strided
    inputs (views of a wider batch, as the scan's outputs are) read as their values say; a row
    changed changes only the runs that read it."""
    o0_w, u_w, hs, _ = make(4, 6, 2, 16, 12, R=5, dtype=torch.float32, seed=1)
    o0 = torch.cat([o0_w, o0_w], dim=-1)[..., :12]  # strided in its last-but-one dims
    u = u_w.transpose(0, 0)
    rows = torch.tensor([0, 3, 3, 0], device=device())
    got = run_outputs(o0, u, hs, rows)
    assert rel_rms(got, run_outputs_reference(o0, u, hs, rows)) < 1e-5
    hs2 = hs.clone()
    hs2[3] += 1.0
    again = run_outputs(o0, u, hs2, rows)
    assert torch.equal(again[0], got[0]) and torch.equal(again[3], got[3])
    assert not torch.allclose(again[1], got[1]) and not torch.allclose(again[2], got[2])


def test_run_outputs_reject_bad_inputs():
    o0, u, hs, rows = make(2, 3, 1, 16, 8, R=3, dtype=torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        run_outputs(o0, u[:, :2], hs, rows)
    with pytest.raises(ValueError, match="rows"):
        run_outputs(o0, u, hs, rows[:1])
    with pytest.raises(ValueError, match="fp32"):
        run_outputs(o0, u, hs.double(), rows)


@pytest.mark.gpu
def test_run_outputs_engine_shape_gpu():
    """The MoE and 9B shapes' planned assembly: 44 sub-runs of 8 tokens, 32 heads x 128^2, bf16
    outputs, rows of an 81-row fold: within bf16 rounding of the fp32 reference."""
    o0, u, hs, rows = make(44, 8, 32, 128, 128, R=81, dtype=torch.bfloat16)
    got = run_outputs(o0, u, hs, rows)
    assert rel_rms(got, run_outputs_reference(o0, u, hs, rows)) < 2**-7
