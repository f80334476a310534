"""The gated delta rule's gate kernel (kernels/ops/gated_delta_rule/gates.py) against its reference:
g and beta over odd row counts and head counts, a and b as column slices of one projection output,
large and very negative inputs (softplus's two branches); fp32 under Triton's interpreter on CPU,
bf16 inputs on a GPU."""

import pytest
import torch
from hybridcache.kernels.ops.gated_delta_rule.naive import gdn_gates_reference
from kernel_testing import device, gdn_gates, rel_rms


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 7, 3), (2, 33, 32), (1, 130, 6)])
def test_gates_match_reference(shape):
    gen = torch.Generator().manual_seed(0)
    H = shape[-1]
    # the merged projection's output: [.., a | b | other], a and b read in place
    merged = (torch.randn(*shape[:-1], 2 * H + 5, generator=gen) * 8).to(device())
    a, b = merged[..., :H], merged[..., H : 2 * H]
    a[..., 0] = 30.0  # softplus passes large inputs through
    b[..., -1] = -40.0
    A_log = torch.randn(H, generator=gen).to(device())
    dt_bias = torch.randn(H, generator=gen).to(device())
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    g_ref, beta_ref = gdn_gates_reference(a, b, A_log, dt_bias)
    assert g.shape == a.shape and g.dtype == torch.float32 and beta.dtype == torch.float32
    assert rel_rms(g, g_ref) < 1e-6 and rel_rms(beta, beta_ref) < 1e-6
    assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-6)
    # swapping a and b is far off: the kernel reads each where it belongs
    assert rel_rms(gdn_gates(b, a, A_log, dt_bias)[0], g_ref) > 0.1


def test_gates_reject_bad_shapes_and_take_no_rows():
    x, h4 = torch.zeros(2, 4, device=device()), torch.zeros(4, device=device())
    with pytest.raises(ValueError, match="differ in shape"):
        gdn_gates(x, torch.zeros(2, 5, device=device()), h4, h4)
    with pytest.raises(ValueError, match="must be"):
        gdn_gates(x, x, torch.zeros(3, device=device()), h4)
    empty = torch.zeros(0, 4, device=device())
    g, beta = gdn_gates(empty, empty, h4, h4)
    assert g.shape == beta.shape == (0, 4)


@pytest.mark.gpu
def test_gates_bf16_gpu():
    torch.manual_seed(1)
    for rows, H in ((1, 32), (4099, 32), (77, 48)):
        merged = torch.randn(rows, 2 * H, device="cuda", dtype=torch.bfloat16) * 4
        a, b = merged[:, :H], merged[:, H:]
        A_log, dt_bias = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
        g, beta = gdn_gates(a, b, A_log, dt_bias)
        g_ref, beta_ref = gdn_gates_reference(a, b, A_log, dt_bias)
        assert rel_rms(g, g_ref) < 1e-5 and rel_rms(beta, beta_ref) < 1e-5
