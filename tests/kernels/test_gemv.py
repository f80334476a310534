"""The one-row GEMV (kernels/ops/gemv/triton.py) against its reference (torch's linear) on odd
shapes, strided rows and a bias, under Triton's interpreter on CPU and bf16 on a GPU; the choice
between it and cuBLAS (backends.plan_gemv / pick_gemv / linear) and the model's layers routed
through it (use_gemv_plan, gemv_weights)."""

import pytest
import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.gemv import naive
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.sequence import LiveRun
from kernel_testing import GEMV_CONFIGS, device, gemv, rel_rms
from torch import nn


@pytest.mark.parametrize("N,K", [(1, 1), (7, 33), (37, 1000), (130, 257), (5, 2049)])
@pytest.mark.parametrize("ci", [0, 2, 4])
def test_gemv_matches_reference(N, K, ci):
    config = GEMV_CONFIGS[ci]
    g = torch.Generator().manual_seed(N * 31 + K)
    x = torch.randn(1, K, generator=g).to(device())
    w = torch.randn(N, K, generator=g).to(device())
    b = torch.randn(N, generator=g).to(device())
    got = gemv(x, w, None, config)
    assert got.shape == (1, N) and got.dtype == x.dtype
    assert rel_rms(got, naive.gemv(x, w)) < 1e-5
    assert rel_rms(gemv(x, w, b, config), naive.gemv(x, w, b)) < 1e-5
    if N > 1:  # a row of W read for its neighbour is far off
        assert rel_rms(naive.gemv(x, w.roll(1, 0)), naive.gemv(x, w)) > 0.1


def test_gemv_reads_strided_rows_and_leading_dims():
    """W as rows of a wider buffer (a merged projection's view), x as [1, 1, K] (a decode step's)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(19, 300, generator=g).to(device())
    w = base[:, :257]
    assert not w.is_contiguous() and w.stride(1) == 1
    x = torch.randn(1, 1, 257, generator=g).to(device())
    got = gemv(x, w, None, GEMV_CONFIGS[1])
    assert got.shape == (1, 1, 19)
    assert rel_rms(got, F.linear(x, w)) < 1e-5


def test_gemv_refuses_what_it_cannot_run():
    x = torch.zeros(2, 8, device=device())
    with pytest.raises(ValueError, match="one row"):
        gemv(x, torch.zeros(4, 8, device=device()))
    with pytest.raises(ValueError, match="columns"):
        gemv(x[:1], torch.zeros(4, 9, device=device()))
    with pytest.raises(ValueError, match="bias"):
        gemv(x[:1], torch.zeros(4, 8, device=device()), torch.zeros(5, device=device()))
    assert gemv(x[:1], torch.zeros(0, 8, device=device())).shape == (1, 0)


def test_pick_takes_triton_only_under_the_margin():
    cfg = GEMV_CONFIGS[0]
    assert backends.pick_gemv(100.0, (90.0, cfg)).config == cfg
    assert backends.pick_gemv(100.0, (backends.GEMV_MARGIN * 100.0 + 0.5, cfg)).config is None
    assert backends.pick_gemv(100.0, (120.0, cfg)).config is None
    none = backends.pick_gemv(100.0, None)
    assert none.config is None and none.triton_us is None and none.cublas_us == 100.0


def test_linear_runs_torch_where_nothing_was_planned():
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(1, 16, generator=g), torch.randn(5, 16, generator=g), torch.randn(5, generator=g)
    assert torch.equal(backends.linear(x, w, b), F.linear(x, w, b))
    assert backends.plan_gemv([w]) == {}  # CPU weights are never planned
    with pytest.raises(ValueError, match="gemv must be one of"):
        backends.OpDispatch(gemv="fast")


def test_model_layers_route_through_linear_with_the_same_logits(model_dirs):
    """use_gemv_plan turns every nn.Linear into DispatchLinear (parameters and state_dict kept), and
    gemv_weights finds the merged projections as well as the layers' own weights."""
    for arch, d in model_dirs.items():
        model = load_model(d)
        ids = torch.randint(3, 200, (9,), generator=torch.Generator().manual_seed(5))
        want, _ = model.forward_layout(model.empty_state(), [LiveRun(ids, 0)], "all")
        keys = model.state_dict().keys()
        lins = sum(type(m) is nn.Linear for m in model.modules())
        weights = backends.gemv_weights(model)
        assert backends.use_gemv_plan(model) == lins > 0
        assert not any(type(m) is nn.Linear for m in model.modules())
        assert model.state_dict().keys() == keys
        got, _ = model.forward_layout(model.empty_state(), [LiveRun(ids, 0)], "all")
        assert torch.equal(got, want), arch
        merged = [w for w in weights if not any(w is m.weight for m in model.modules() if isinstance(m, nn.Linear))]
        if arch.startswith("qwen3_5"):
            assert merged, arch  # the in-projections, qkv and gate|up merge on these models
        for w in merged:
            assert any(m.weight.data_ptr() == w.data_ptr() for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.gpu
def test_plan_and_linear_on_the_9b_shapes_gpu():
    """On the GPU: plan_gemv measures each shape, keeps cuBLAS or a Triton config, and linear's one
    row then equals torch's within bf16 rounding while more rows stay on torch's linear."""
    dev = torch.device("cuda")
    shapes = [(24576, 4096), (4096, 12288), (12352, 4096), (4096, 4096), (10240, 4096)]
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for n, k in shapes]
    plan = backends.plan_gemv(weights)
    assert len(plan) == len(shapes)
    for w, (name, choice) in zip(weights, plan.items()):
        assert choice["cublas_us"] > 0 and choice["path"] in ("cublas", "triton"), name
        x = torch.randn(1, w.shape[1], device=dev, dtype=torch.bfloat16)
        got, ref = backends.linear(x, w), F.linear(x.float(), w.float())
        assert rel_rms(got.float(), ref) < 1e-2, name
        x2 = torch.randn(2, w.shape[1], device=dev, dtype=torch.bfloat16)
        assert torch.equal(backends.linear(x2, w), F.linear(x2, w))
    print(plan)
