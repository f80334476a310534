"""The Qwen3.5 norms on CUDA through the row-norm kernel (kernels/ops/norm) against their eager references (the
same modules under the reference OpDispatch), fp32 and bf16, odd row counts."""

import pytest
import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.models.qwen3_hybrid import GatedRMSNorm, ZeroCenteredRMSNorm

pytestmark = pytest.mark.gpu


def _both(monkeypatch, fn):
    got = fn()
    with backends.dispatching(backends.OpDispatch(kernels="reference")):
        ref = fn()
    return got, ref


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(1, 77, 96), (3, 5, 256), (1, 1, 4096)])
def test_zero_centered_rms_norm_fused_matches_eager(monkeypatch, dtype, tol, shape):
    torch.manual_seed(0)
    norm = ZeroCenteredRMSNorm(shape[-1], 1e-6).cuda().to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = torch.randn(*shape, device="cuda", dtype=dtype) * 3
    got, ref = _both(monkeypatch, lambda: norm(x))
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < tol
    # the cached 1 + weight follows weight updates
    with torch.no_grad():
        norm.weight.add_(1.0)
    got2, ref2 = _both(monkeypatch, lambda: norm(x))
    assert ((got2.float() - ref2.float()).norm() / ref2.float().norm()).item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows,dim", [(77, 128), (1, 64), (300, 256)])
def test_gated_rms_norm_fused_matches_eager(monkeypatch, dtype, tol, rows, dim):
    torch.manual_seed(1)
    norm = GatedRMSNorm(dim, 1e-6).cuda().to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    x = torch.randn(rows, dim, device="cuda", dtype=dtype)
    gate = torch.randn(rows, dim, device="cuda", dtype=dtype) * 2
    got, ref = _both(monkeypatch, lambda: norm(x, gate))
    assert got.dtype == ref.dtype == dtype
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2norm_fp32_fused_matches_eager(monkeypatch, dtype):
    from hybridcache.services.runtime import backends

    torch.manual_seed(2)
    x = torch.randn(2, 77, 3, 128, device="cuda", dtype=dtype)[:, :, :, :96]  # strided, as after a split
    got, ref = _both(monkeypatch, lambda: backends.l2norm_fp32(x))
    assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-5
