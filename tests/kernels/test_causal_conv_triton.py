"""causal_conv1d_fwd (Triton) against the reference conv: output and tail, odd shapes."""

import pytest
import torch
from hybridcache.kernels.ops.causal_conv import loop_causal_conv1d, naive_causal_conv1d
from kernel_testing import causal_conv1d_fwd, device, rel_rms

SHAPES = [(1, 1, 8, 4), (2, 3, 20, 4), (1, 37, 24, 3), (2, 63, 40, 4)]


@pytest.mark.parametrize("B,T,D,W", SHAPES, ids=[f"B{b}-T{t}-D{d}-W{w}" for b, t, d, w in SHAPES])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_matches_reference(B, T, D, W, with_state, with_bias):
    torch.manual_seed(42)
    dev = device()
    x = torch.randn(B, T, D, device=dev)
    w = torch.randn(D, W, device=dev)
    bias = torch.randn(D, device=dev) if with_bias else None
    state = torch.randn(B, D, W - 1, device=dev) if with_state else None
    y, tail = causal_conv1d_fwd(x, w, bias, state, "silu", block_t=16, block_d=16)
    y_ref, tail_ref = loop_causal_conv1d(x, w, bias, state, "silu")
    assert rel_rms(y, y_ref) < 1e-5
    assert torch.equal(tail, tail_ref)


def test_conv_without_activation_and_split_runs():
    """Two runs chained through the tail equal one run over the concatenation."""
    torch.manual_seed(42)
    dev = device()
    x = torch.randn(1, 29, 16, device=dev)
    w = torch.randn(16, 4, device=dev)
    y_all, tail_all = naive_causal_conv1d(x, w, None, None, None)
    y1, t1 = causal_conv1d_fwd(x[:, :11], w, activation=None)
    y2, t2 = causal_conv1d_fwd(x[:, 11:], w, initial_state=t1, activation=None)
    assert rel_rms(torch.cat([y1, y2], 1), y_all) < 1e-5
    assert torch.equal(t2, tail_all)


def test_conv_rejects_bad_arguments():
    x = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_fwd(x, torch.randn(8, 4), activation="gelu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d_fwd(x, torch.randn(8, 4), initial_state=torch.zeros(1, 8, 2))


@pytest.mark.gpu
def test_conv_bf16_model_shape_gpu():
    torch.manual_seed(42)
    x = torch.randn(1, 4099, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, 4, device="cuda", dtype=torch.bfloat16) * 0.5
    state = torch.randn(1, 8192, 3, device="cuda", dtype=torch.bfloat16)
    y, tail = causal_conv1d_fwd(x, w, None, state, "silu")
    y_ref, tail_ref = naive_causal_conv1d(x, w, None, state, "silu")
    assert rel_rms(y, y_ref) < 1e-2
    assert torch.equal(tail, tail_ref)
