"""Decode-step ops that update states in place through slot indices: recurrent_step (Triton) and
causal_conv1d_update (Triton) against their references, output AND the pool after the step, on odd
shapes with slots out of order; the references against the families' own recurrences at one token."""

import pytest
import torch
from hybridcache.kernels.ops.causal_conv import loop_causal_conv1d, naive_causal_conv1d_update
from hybridcache.kernels.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from hybridcache.kernels.ops.gated_delta_rule.naive import gdn_gates_reference
from hybridcache.kernels.ops.kda import naive_recurrent_kda
from hybridcache.kernels.ops.mamba2 import naive_ssd
from hybridcache.kernels.ops.recurrent_step import naive_recurrent_step
from hybridcache.kernels.ops.simple_gla import naive_recurrent_simple_gla
from kernel_testing import causal_conv1d_update, device, recurrent_step, rel_rms

# B, H (q/k heads), HV (value heads), K, V
SHAPES = [(3, 1, 2, 20, 36), (2, 2, 4, 16, 16), (1, 3, 3, 60, 33)]
SLOTS = 7


def _inputs(B, H, HV, K, V, kind, dev, gen):
    """Row-strided q, k, v (views of one projection, as a layer's conv output gives them), gates,
    and a pool whose rows outside `slots` are NaN (they must be neither read nor written)."""
    proj = torch.randn(B, 2 * H * K + HV * V + 5, generator=gen).to(dev)
    q = proj[:, : H * K].view(B, H, K)
    k = proj[:, H * K : 2 * H * K].view(B, H, K)
    v = proj[:, 2 * H * K : 2 * H * K + HV * V].view(B, HV, V)
    if kind in ("delta", "plain"):
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    gates = {}
    if kind == "gdn_fused":
        gates = dict(A_log=torch.randn(HV, generator=gen).to(dev), dt_bias=torch.randn(HV, generator=gen).to(dev),
                     beta_scale=2.0, l2norm_qk=True)
        g, beta = torch.randn(B, HV, generator=gen).to(dev), torch.randn(B, HV, generator=gen).to(dev)
    elif kind == "per_key":
        g = -torch.rand(B, HV, K, generator=gen).to(dev)
        beta = torch.rand(B, HV, generator=gen).to(dev)
    else:
        g = -torch.rand(B, HV, generator=gen).to(dev)
        beta = torch.rand(B, HV, generator=gen).to(dev) if kind == "delta" else None
    slots = torch.tensor([5, 1, 3, 0, 6][:B], device=dev)
    pool = torch.full((SLOTS, HV, K, V), float("nan"), device=dev)
    pool[slots] = torch.randn(B, HV, K, V, generator=gen).to(dev)
    return q, k, v, g, beta, pool, slots, gates


@pytest.mark.parametrize("B,H,HV,K,V", SHAPES, ids=[f"B{b}-H{h}-HV{hv}-K{k}-V{v}" for b, h, hv, k, v in SHAPES])
@pytest.mark.parametrize("kind", ["delta", "per_key", "plain", "gdn_fused"])
def test_recurrent_step_matches_reference(B, H, HV, K, V, kind):
    gen = torch.Generator().manual_seed(42)
    dev = device()
    q, k, v, g, beta, pool, slots, gates = _inputs(B, H, HV, K, V, kind, dev, gen)
    ref_pool = pool.clone()
    o_ref = naive_recurrent_step(q, k, v, g, beta, ref_pool, slots, **gates)
    o = recurrent_step(q, k, v, g, beta, pool, slots, block_v=16, **gates)
    assert rel_rms(o, o_ref) < 1e-5
    assert rel_rms(pool[slots], ref_pool[slots]) < 1e-5
    others = [i for i in range(SLOTS) if i not in slots.tolist()]
    assert torch.isnan(pool[others]).all()  # untouched
    assert not torch.isnan(o).any()


def test_recurrent_step_chains_like_a_run():
    """Four tokens stepped one by one through the pool equal the gated delta rule's run over them."""
    gen = torch.Generator().manual_seed(42)
    dev = device()
    B, HV, K, V, T = 2, 2, 16, 24, 4
    q = torch.nn.functional.normalize(torch.randn(B, T, HV, K, generator=gen), dim=-1).to(dev)
    k = torch.nn.functional.normalize(torch.randn(B, T, HV, K, generator=gen), dim=-1).to(dev)
    v = torch.randn(B, T, HV, V, generator=gen).to(dev)
    g, beta = -torch.rand(B, T, HV, generator=gen).to(dev), torch.rand(B, T, HV, generator=gen).to(dev)
    S0 = torch.randn(B, HV, K, V, generator=gen).to(dev)
    o_ref, S_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0)
    pool = torch.zeros(4, HV, K, V, device=dev)
    slots = torch.tensor([2, 0], device=dev)
    pool[slots] = S0
    outs = [recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pool, slots) for t in range(T)]
    assert rel_rms(torch.stack(outs, 1), o_ref) < 1e-5
    assert rel_rms(pool[slots], S_ref) < 1e-5


def _one_token(pool, slots, run):
    """(o [B, H, V], new state [B, H, K, V]) of a family's own reference run over one token."""
    o, S = run(pool[slots].clone())[:2]
    return o[:, 0], S


@pytest.mark.parametrize("family", ["gdn", "gdn_gates", "kda", "simple_gla", "mamba2"])
def test_reference_step_equals_the_families_recurrence(family):
    """naive_recurrent_step at one token is each family's own recurrence (their references)."""
    gen = torch.Generator().manual_seed(7)
    B, HV, K, V = 3, 4, 12, 10
    pool = torch.randn(6, HV, K, V, generator=gen)
    slots = torch.tensor([4, 0, 2])
    q = torch.nn.functional.normalize(torch.randn(B, HV, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, HV, K, generator=gen), dim=-1)
    v = torch.randn(B, HV, V, generator=gen)
    step_pool = pool.clone()
    if family in ("gdn", "gdn_gates"):
        a, b = torch.randn(B, HV, generator=gen), torch.randn(B, HV, generator=gen)
        A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
        g, beta = gdn_gates_reference(a, b, A_log, dt_bias)
        o_ref, S_ref = _one_token(pool, slots, lambda S: naive_recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=S))
        if family == "gdn":
            o = naive_recurrent_step(q, k, v, g, beta, step_pool, slots)
        else:  # raw projections, gates and norms inside (q, k given unnormalized)
            o = naive_recurrent_step(q * 3.0, k * 0.5, v, a, b, step_pool, slots, A_log=A_log, dt_bias=dt_bias,
                                     l2norm_qk=True)
    elif family == "kda":
        g, beta = -torch.rand(B, HV, K, generator=gen), torch.rand(B, HV, generator=gen)
        o_ref, S_ref = _one_token(pool, slots, lambda S: naive_recurrent_kda(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=S))
        o = naive_recurrent_step(q, k, v, g, beta, step_pool, slots)
    elif family == "simple_gla":
        g = -torch.rand(B, HV, generator=gen)
        o_ref, S_ref = _one_token(pool, slots, lambda S: naive_recurrent_simple_gla(
            q[:, None], k[:, None], v[:, None], g[:, None], scale=0.7, initial_state=S))
        o = naive_recurrent_step(q, k, v, g, None, step_pool, slots, scale=0.7)
    else:  # Mamba2: q = C, k = dt B, v = x, g = dt A (groups of heads share B and C), scale 1, D skip outside
        G = 2
        x, dt = v, torch.rand(B, HV, generator=gen)
        A = -torch.rand(HV, generator=gen)
        Bm, C = torch.randn(B, G, K, generator=gen), torch.randn(B, G, K, generator=gen)
        o_ref, S_ref = _one_token(pool, slots, lambda S: naive_ssd(
            x[:, None], dt[:, None], A, Bm[:, None], C[:, None], initial_state=S))
        rep = HV // G
        kk = Bm.repeat_interleave(rep, dim=1) * dt[..., None]
        o = naive_recurrent_step(C.repeat_interleave(rep, dim=1), kk, x, dt * A, None, step_pool, slots, scale=1.0)
    assert rel_rms(o, o_ref) < 1e-5
    assert rel_rms(step_pool[slots], S_ref) < 1e-5
    others = [i for i in range(6) if i not in slots.tolist()]
    assert torch.equal(step_pool[others], pool[others])


def test_recurrent_step_rejects_bad_arguments():
    q = k = torch.randn(2, 2, 8)
    v = torch.randn(2, 3, 8)
    pool = torch.zeros(4, 3, 8, 8)
    with pytest.raises(ValueError, match="multiple"):
        recurrent_step(q, k, v, torch.zeros(2, 3), None, pool, torch.tensor([0, 1]))
    v = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="pool"):
        recurrent_step(q, k, v, torch.zeros(2, 4), None, torch.zeros(4, 4, 8, 8, dtype=torch.float16),
                       torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="A_log"):
        recurrent_step(q, k, v, torch.zeros(2, 4), None, torch.zeros(4, 4, 8, 8), torch.tensor([0, 1]),
                       A_log=torch.zeros(4), dt_bias=torch.zeros(4))


CONV_SHAPES = [(3, 20, 4), (1, 37, 3), (2, 64, 2)]


@pytest.mark.parametrize("B,D,W", CONV_SHAPES, ids=[f"B{b}-D{d}-W{w}" for b, d, w in CONV_SHAPES])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_update_matches_reference(B, D, W, with_bias):
    gen = torch.Generator().manual_seed(42)
    dev = device()
    proj = torch.randn(B, D + 3, generator=gen).to(dev)
    x = proj[:, 1 : D + 1]  # a row-strided view
    w = torch.randn(D, W, generator=gen).to(dev)
    bias = torch.randn(D, generator=gen).to(dev) if with_bias else None
    slots = torch.tensor([4, 0, 2][:B], device=dev)
    state = torch.full((5, D, W - 1), float("nan"), device=dev)
    state[slots] = torch.randn(B, D, W - 1, generator=gen).to(dev)
    before = state[slots].clone()
    ref_state = state.clone()
    y_ref = naive_causal_conv1d_update(x, w, bias, ref_state, slots, "silu")
    y = causal_conv1d_update(x, w, bias, state, slots, "silu", block_d=16)
    # the reference against the prefill conv's definition at one token
    y_loop, tail = loop_causal_conv1d(x[:, None], w, bias, before, "silu")
    assert rel_rms(y_ref, y_loop[:, 0]) < 1e-6 and torch.equal(ref_state[slots], tail)
    assert rel_rms(y, y_ref) < 1e-5
    assert torch.equal(state[slots], ref_state[slots])
    others = [i for i in range(5) if i not in slots.tolist()]
    assert torch.isnan(state[others]).all()


def test_conv_update_chains_like_a_run():
    """Tokens fed one by one through the pool equal the conv over the whole run, and its tail."""
    gen = torch.Generator().manual_seed(3)
    dev = device()
    B, T, D, W = 2, 6, 24, 4
    x = torch.randn(B, T, D, generator=gen).to(dev)
    w, bias = torch.randn(D, W, generator=gen).to(dev), torch.randn(D, generator=gen).to(dev)
    s0 = torch.randn(B, D, W - 1, generator=gen).to(dev)
    y_ref, tail = loop_causal_conv1d(x, w, bias, s0, None)
    state = torch.zeros(3, D, W - 1, device=dev)
    slots = torch.tensor([1, 2], device=dev)
    state[slots] = s0
    ys = [causal_conv1d_update(x[:, t], w, bias, state, slots, None) for t in range(T)]
    assert rel_rms(torch.stack(ys, 1), y_ref) < 1e-5
    assert torch.allclose(state[slots], tail)


@pytest.mark.gpu
def test_recurrent_step_model_shape_gpu():
    """The 9B shape's layer at batch 128: 16 key heads, 32 value heads of 128 x 128, fused gates."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, H, HV, K = 128, 16, 32, 128
    proj = torch.randn(B, 2 * H * K + HV * K, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k = proj[:, : H * K].view(B, H, K), proj[:, H * K : 2 * H * K].view(B, H, K)
    v = proj[:, 2 * H * K :].view(B, HV, K)
    a, b = torch.randn(B, HV, device="cuda", generator=gen), torch.randn(B, HV, device="cuda", generator=gen)
    A_log, dt_bias = torch.randn(HV, device="cuda", generator=gen), torch.randn(HV, device="cuda", generator=gen)
    slots = torch.randperm(B + 1, device="cuda", generator=gen)[:B]
    pool = torch.randn(B + 1, HV, K, K, device="cuda", generator=gen)
    ref_pool = pool.clone()
    kw = dict(A_log=A_log, dt_bias=dt_bias, l2norm_qk=True)
    o_ref = naive_recurrent_step(q, k, v, a, b, ref_pool, slots, **kw)
    o = recurrent_step(q, k, v, a, b, pool, slots, **kw)
    assert rel_rms(o, o_ref) < 1e-2
    assert rel_rms(pool, ref_pool) < 1e-5


@pytest.mark.parametrize("arch", ["qwen3_5_text", "kimi_linear", "nemotron_h", "minimax"])
def test_model_steps_through_the_kernels_equal_gather_scatter(arch, monkeypatch):
    """A whole model's in-place decode steps with these kernels (under the interpreter on the CPU)
    equal its gather/scatter reference steps, requests joining and leaving
    (tests/runtime/test_decode_in_place.py runs the same with the references)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from hybridcache.services.runtime import backends
    from hybridcache.services.runtime.paged import eager_step
    from test_decode_in_place import run_requests, tiny_model

    calls = []

    def kernel(op):
        def run(*args, **kw):
            calls.append(op.__name__)
            return op(*args, **kw)

        return run

    model = tiny_model(arch).to(device())
    # every other op the reference (on a GPU too: fla's prefill kernels would autotune for minutes),
    # so that the two runs differ in these kernels alone
    with torch.no_grad(), backends.dispatching(backends.OpDispatch(kernels="reference")):
        ref, ref_pool = run_requests(model, lambda p, s, h, m: eager_step(model, p, s, h, m, in_place=False), steps=5)
        monkeypatch.setattr(backends, "recurrent_step", kernel(recurrent_step))
        monkeypatch.setattr(backends, "causal_conv1d_update", kernel(causal_conv1d_update))
        got, pool = run_requests(model, lambda p, s, h, m: eager_step(model, p, s, h, m), steps=5)
    assert "recurrent_step" in calls
    assert ("causal_conv1d_update" in calls) == (arch != "minimax")  # lightning attention has no short conv
    tol = 1e-4 if device() == "cpu" else 2e-3
    for a, b in zip(got, ref):
        assert rel_rms(a, b) < tol
    live = [s for s in range(pool.slots) if s not in pool.free]
    for i in pool.ssm:
        assert rel_rms(pool.ssm[i][live], ref_pool.ssm[i][live]) < tol
        if pool.conv[i].numel():
            assert rel_rms(pool.conv[i][live], ref_pool.conv[i][live]) < tol
