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
@pytest.mark.parametrize("ci", [0, 2, 4, 6])
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


def test_pick_takes_another_path_only_under_the_margin():
    cfg = GEMV_CONFIGS[0]
    m = backends.GEMV_MARGIN
    base = {"cublas": 100.0, "cublas_batch": 200.0, "cublas_t": 150.0, "cublas_t_batch": 200.0}
    assert backends.pick_gemv(dict(base, triton=90.0), cfg).path == "triton"
    assert backends.pick_gemv(dict(base, triton=90.0), cfg).config == cfg
    assert backends.pick_gemv(dict(base, triton=m * 100.0 + 0.5), cfg).path == "cublas"
    assert backends.pick_gemv(dict(base, cublas_t=90.0)).path == "cublas_t"
    assert backends.pick_gemv(dict(base, cublas_t=90.0, triton=85.0), cfg).path == "triton"
    assert backends.pick_gemv(dict(base, cublas_t=80.0, triton=85.0), cfg).path == "cublas_t"
    # column-major faster for one row but slower at a batch: kept row-major
    assert backends.pick_gemv(dict(base, cublas_t=80.0, cublas_t_batch=240.0)).path == "cublas"
    none = backends.pick_gemv(dict(base))
    assert none.path == "cublas" and none.config is None and none.times_us["cublas"] == 100.0


def test_linear_runs_torch_where_nothing_was_planned():
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(1, 16, generator=g), torch.randn(5, 16, generator=g), torch.randn(5, generator=g)
    assert torch.equal(backends.linear(x, w, b), F.linear(x, w, b))
    assert backends.plan_gemv([w]) == {}  # CPU weights are never planned
    with pytest.raises(ValueError, match="gemv must be one of"):
        backends.OpDispatch(gemv="fast")


def _plan_all(monkeypatch, model, path="cublas_t"):
    """A plan (as plan_gemv leaves it) of `path` for every weight shape of the model."""
    plan = {}
    for w in backends.gemv_weights(model):
        plan[backends._gemv_key(w)] = backends.GemvChoice(path, None, {"cublas": 1.0})
    monkeypatch.setattr(backends, "_GEMV_PLAN", plan)


def _logits(model, n=9):
    ids = torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(5))
    return model.forward_layout(model.empty_state(), [LiveRun(ids, 0)], "all")[0]


def test_model_layers_route_through_linear_with_the_same_logits(model_dirs):
    """use_gemv_plan turns every nn.Linear into DispatchLinear (parameters and state_dict kept), and
    gemv_weights finds the merged projections as well as the layers' own weights."""
    for arch, d in model_dirs.items():
        model = load_model(d)
        want = _logits(model)
        keys = model.state_dict().keys()
        lins = sum(type(m) is nn.Linear for m in model.modules())
        weights = backends.gemv_weights(model)
        assert backends.use_gemv_plan(model) == lins > 0
        assert not any(type(m) is nn.Linear for m in model.modules())
        assert model.state_dict().keys() == keys
        assert torch.equal(_logits(model), want), arch
        merged = [g for g, _ in backends._merged_groups(model)]
        assert all(any(w is g for w in weights) for g in merged)
        routers = [m.weight for m in model.modules() if hasattr(m, "linear_weights")]
        assert all(any(w is r for w in weights) for r in routers)
        if "moe" in arch:
            assert routers, arch  # the MoE router's GEMV is planned too
        if arch.startswith("qwen3_5"):
            assert merged, arch  # the in-projections, qkv and gate|up merge on these models
        for w in merged:
            assert any(m.weight.data_ptr() == w.data_ptr() for m in model.modules() if isinstance(m, nn.Linear))


def test_column_major_weights_keep_the_logits_and_the_merges(model_dirs, monkeypatch):
    """Every family with every planned weight stored column-major: same logits (fp32), the merged
    projections merged again in that layout (one GEMM each), the layers the MoE kernels read kept
    row-major, and to_row_major undoing it all."""
    for arch, d in model_dirs.items():
        model = load_model(d)
        want = _logits(model)
        want1 = _logits(model, 1)
        _plan_all(monkeypatch, model)
        changed = backends.column_major_linears(model)
        assert changed, arch
        assert all(lin.weight.stride(0) == 1 for lin in changed)
        for m in model.modules():
            if getattr(m, "keeps_row_major", False):
                assert m not in changed and m.weight.stride(1) == 1, arch
        for merged, members in backends._merged_groups(model):
            if any(lin in changed for lin in members):
                assert merged.stride(0) == 1 and all(lin in changed for lin in members), arch
        assert (_logits(model) - want).abs().max().item() < 1e-4, arch
        assert (_logits(model, 1) - want1).abs().max().item() < 1e-4, arch
        backends.to_row_major(model, changed)
        assert all(lin.weight.is_contiguous() for lin in changed)
        assert (_logits(model) - want).abs().max().item() < 1e-4, arch


def test_merge_weights_keeps_a_column_major_layout():
    from hybridcache.services.runtime.models.common import merge_weights, merged_linear

    g = torch.Generator().manual_seed(6)
    lins = [nn.Linear(8, n, bias=False) for n in (5, 3)]
    x = torch.randn(2, 8, generator=g)
    want = [lin(x) for lin in lins]
    for lin in lins:
        lin.weight = nn.Parameter(lin.weight.detach().t().contiguous().t())
    merged = merge_weights(*lins)
    assert merged.shape == (8, 8) and merged.stride() == (1, 8)
    assert lins[1].weight.data_ptr() == merged.data_ptr() + 5 * merged.element_size()
    got = merged_linear(x, merged, lins)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)


def test_the_runner_undoes_a_relayout_that_moves_the_probe(qwen35_dir, monkeypatch):
    """ModelRunner._plan_linears (CUDA only; here with a plan made by hand on the CPU): the planned
    weights go column-major when the probe's logits hold, and back row-major when they move."""
    from hybridcache.services.runtime.runner import ModelRunner

    model = load_model(qwen35_dir)
    runner = ModelRunner(model)
    assert runner.column_major_layers == 0 and runner.gemv_plan == {}  # CPU: nothing planned
    monkeypatch.setattr(backends, "plan_gemv", lambda weights: _plan_all(monkeypatch, model) or {})
    runner._plan_linears()
    assert runner.column_major_layers > 0
    n = runner.column_major_layers
    backends.to_row_major(model, [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.stride(0) == 1])
    probes = iter([[torch.zeros(3)], [torch.ones(3)]])
    monkeypatch.setattr(runner, "_probe", lambda: next(probes))
    runner._plan_linears()
    assert runner.column_major_layers == 0 and n > 0
    assert all(m.weight.stride(1) == 1 for m in model.modules() if isinstance(m, nn.Linear))


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
        assert choice["times_us"]["cublas"] > 0 and choice["path"] in ("cublas", "cublas_t", "triton"), name
        x = torch.randn(1, w.shape[1], device=dev, dtype=torch.bfloat16)
        got, ref = backends.linear(x, w), F.linear(x.float(), w.float())
        assert rel_rms(got.float(), ref) < 1e-2, name
        x2 = torch.randn(2, w.shape[1], device=dev, dtype=torch.bfloat16)
        assert torch.equal(backends.linear(x2, w), F.linear(x2, w))
    print(plan)


@pytest.mark.parametrize("arch", ["kimi_linear", "nemotron_h", "olmo_hybrid", "minimax", "bamba"])
def test_column_major_weights_keep_the_other_families_logits(arch, tmp_path, monkeypatch):
    """The families outside model_dirs: every planned weight column-major, the same logits, and the
    layers read directly by other code (kimi's kv_b_proj, its shared experts) left row-major."""
    from hybridcache.services.runtime.modelzoo import init_model_dir

    model = load_model(init_model_dir(arch, "tiny", tmp_path / arch, seed=1, std=0.08))
    want, want1 = _logits(model), _logits(model, 1)
    _plan_all(monkeypatch, model)
    changed = backends.column_major_linears(model)
    assert changed
    kept = [m for m in model.modules() if getattr(m, "keeps_row_major", False)]
    assert all(m not in changed and m.weight.stride(1) == 1 for m in kept)
    if arch == "kimi_linear":
        assert kept
    assert (_logits(model) - want).abs().max().item() < 1e-4
    assert (_logits(model, 1) - want1).abs().max().item() < 1e-4
