"""KDA, GLA, Lightning and Mamba2 SSD on fla-core's GPU kernels (backends.kda / gla /
lightning_attention / ssd on CUDA tensors) against the fp32 step-loop references: outputs, final states and the run's
(T, S(run|0)), with and without an initial state, on odd shapes; and per family a tiny fp32 model
on CUDA against the same model on CPU (full logits) with pic cold == warm.

GPU only (`pytest -m gpu tests/kernels/test_families_gpu.py`); skips without CUDA or fla.
Tolerances as for the gated delta rule's entry (test_fla_entry.py): bf16 inputs, relative RMS
error < 2e-2 against the fp32 reference; the scalar T is computed in torch from the gates, so it
matches to fp32 rounding.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.gla import naive_recurrent_gla
from hybridcache.kernels.ops.kda import naive_recurrent_kda
from hybridcache.kernels.ops.mamba2 import naive_ssd
from hybridcache.kernels.ops.simple_gla import lightning_slopes, naive_lightning_attention
from hybridcache.services.runtime import backends
from kernel_testing import rel_rms  # unhides fla on a GPU machine (tests/conftest.py hides it)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = 2e-2
# (B, T, H, K, V): T not a multiple of the 64-token chunk, H = 3
SHAPES = [(1, 77, 3, 32, 64), (2, 200, 3, 64, 32), (1, 200, 3, 64, 64)]
IDS = [f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in SHAPES]


def _need_fla(module):
    pytest.importorskip(module, reason=f"{module} (fla-core) is not installed")
    # a probe made earlier in the session, while tests/conftest.py hid fla, may have cached False
    backends.fla_has.cache_clear()
    backends.fla_available.cache_clear()
    assert backends.fla_has(module)


@pytest.fixture(autouse=True)
def _fast_kernels():
    with backends.dispatching(backends.OpDispatch(kernels="auto")):
        yield


def _check(got, ref, with_transition):
    assert rel_rms(got[0], ref[0]) < TOL
    assert got[1].dtype == torch.float32
    assert rel_rms(got[1], ref[1]) < TOL
    if with_transition:
        (Tr, S0), (Tr_ref, S0_ref) = got[2], ref[2]
        assert Tr.shape == Tr_ref.shape and S0.shape == S0_ref.shape
        assert rel_rms(Tr, Tr_ref) < TOL
        assert rel_rms(S0, S0_ref) < TOL
    else:
        assert len(got) == 2


# KDA (dense T)


def _kda_inputs(B, T, H, K, V, seed=0):
    torch.manual_seed(seed)
    dev = "cuda"
    q = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(B, T, H, V, device=dev).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, H, K, device=dev) + 2)  # per-channel log gate, fp32
    beta = torch.rand(B, T, H, device=dev)
    init = torch.randn(B, H, K, V, device=dev)
    return q, k, v, g, beta, init


@pytest.mark.parametrize("B,T,H,K,V", SHAPES, ids=IDS)
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("with_transition", [False, True])
def test_kda_fla_matches_reference(B, T, H, K, V, with_init, with_transition):
    _need_fla("fla.ops.kda")
    q, k, v, g, beta, init = _kda_inputs(B, T, H, K, V)
    init = init if with_init else None
    got = backends.kda(q, k, v, g, beta, init, with_transition)
    ref = naive_recurrent_kda(
        q.float(), k.float(), v.float(), g, beta, initial_state=init, output_transition=with_transition
    )
    assert got[0].dtype == v.dtype
    _check(got, ref, with_transition)


def test_kda_fla_short_run_matches_reference():
    """Below SHORT_RUN tokens (decode, seam windows) the fused recurrent kernel runs."""
    _need_fla("fla.ops.kda")
    q, k, v, g, beta, init = _kda_inputs(1, 9, 3, 32, 32, seed=1)
    got = backends.kda(q, k, v, g, beta, init, False)
    ref = naive_recurrent_kda(q.float(), k.float(), v.float(), g, beta, initial_state=init)
    _check(got, ref, False)
    assert torch.equal(init, _kda_inputs(1, 9, 3, 32, 32, seed=1)[-1])  # the initial state is not written


# GLA (vector T)


@pytest.mark.parametrize("with_transition", [False, True])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("B,T,H,K,V", SHAPES + [(1, 9, 3, 32, 32)], ids=IDS + ["short-T9"])
def test_gla_fla_matches_reference(B, T, H, K, V, with_init, with_transition):
    _need_fla("fla.ops.gla")
    torch.manual_seed(4)
    dev = "cuda"
    q = (torch.randn(B, T, H, K, device=dev) * K**-0.5).bfloat16()
    k = (torch.randn(B, T, H, K, device=dev) * K**-0.5).bfloat16()
    v = torch.randn(B, T, H, V, device=dev).bfloat16()
    gk = F.logsigmoid(torch.randn(B, T, H, K, device=dev) + 4)  # per-channel log gate, fp32
    init = torch.randn(B, H, K, V, device=dev) if with_init else None
    got = backends.gla(q, k, v, gk, None, init, with_transition)
    ref = naive_recurrent_gla(
        q.float(), k.float(), v.float(), gk, initial_state=init, output_transition=with_transition
    )
    assert got[0].dtype == torch.bfloat16
    _check(got, ref, with_transition)
    if with_transition:  # T = exp(sum of the log-gates) in torch, fp32: rounding only
        assert torch.allclose(got[2][0], ref[2][0], rtol=1e-4, atol=1e-6)


# Lightning attention (scalar T)


def scalar_cases(test):
    """The odd shapes plus a run below SHORT_RUN (fused recurrent kernel), with and without an
    initial state and the transition."""
    test = pytest.mark.parametrize("with_transition", [False, True])(test)
    test = pytest.mark.parametrize("with_init", [False, True])(test)
    return pytest.mark.parametrize("B,T,H,K,V", SHAPES + [(1, 9, 3, 32, 32)], ids=IDS + ["short-T9"])(test)


def _check_scalar(got, ref, with_transition):
    assert got[0].dtype == torch.bfloat16
    _check(got, ref, with_transition)
    if with_transition:  # T = exp(sum of the log-gates) in torch, fp32: rounding only
        assert torch.allclose(got[2][0], ref[2][0], rtol=1e-4, atol=1e-6)


@scalar_cases
def test_lightning_fla_matches_reference(B, T, H, K, V, with_init, with_transition):
    _need_fla("fla.ops.simple_gla")
    torch.manual_seed(2)
    dev = "cuda"
    q = (torch.randn(B, T, H, K, device=dev) * K**-0.5).bfloat16()
    k = (torch.randn(B, T, H, K, device=dev) * K**-0.5).bfloat16()
    v = torch.randn(B, T, H, V, device=dev).bfloat16()
    init = torch.randn(B, H, K, V, device=dev) if with_init else None
    slopes = lightning_slopes(H) * 0.1  # decays that keep part of the initial state over 200 tokens
    got = backends.lightning_attention(q, k, v, slopes, 1.0, init, with_transition)
    ref = naive_lightning_attention(
        q.float(), k.float(), v.float(), slopes, scale=1.0, initial_state=init, output_transition=with_transition
    )
    _check_scalar(got, ref, with_transition)


# Mamba2 SSD (scalar T)


@scalar_cases
def test_ssd_fla_matches_reference(B, T, H, K, V, with_init, with_transition):
    """N = K (state size), P = V (head dim); H = 3 heads share G = 1 group of B, C."""
    _need_fla("fla.ops.simple_gla")
    torch.manual_seed(3)
    dev = "cuda"
    x = torch.randn(B, T, H, V, device=dev).bfloat16()
    dt = F.softplus(torch.randn(B, T, H, device=dev) - 2)
    A = -torch.rand(H, device=dev) - 0.1
    Bm = (torch.randn(B, T, 1, K, device=dev) * K**-0.5).bfloat16()
    C = (torch.randn(B, T, 1, K, device=dev) * K**-0.5).bfloat16()
    D = torch.randn(H, device=dev)
    init = torch.randn(B, H, K, V, device=dev) if with_init else None
    got = backends.ssd(x, dt, A, Bm, C, D, init, with_transition)
    ref = naive_ssd(x.float(), dt, A, Bm.float(), C.float(), D=D, initial_state=init, output_transition=with_transition)
    _check_scalar(got, ref, with_transition)


# Engine level, per family

FAMILIES = {
    "kimi_linear": "fla.ops.kda",
    "nemotron_h": "fla.ops.simple_gla",
    "bamba": "fla.ops.simple_gla",
    "minimax": "fla.ops.simple_gla",
    "olmo_hybrid": "fla.ops.gated_delta_rule",
}
# Bound on |logits(CUDA) - logits(CPU)|, fp32. fla's chunked gated delta rule runs the dots of its
# triangular solve in TF32 on GPUs that have it, whatever TRITON_F32_DEFAULT says
# (fla/ops/gated_delta_rule/chunk_fwd.py: SOLVE_TRIL_DOT_PRECISION = 'tf32'): the first chunk agrees
# to fp32 rounding, later chunks to TF32's (errors of order 1e-2 at logits of order 1). fla's KDA
# does the same (fla/ops/kda/chunk_intra.py). A wrong mapping (gate sign, scale, state layout)
# gives errors of order 0.1-1.
LOGITS_ATOL = {"olmo_hybrid": 2e-2, "kimi_linear": 2e-2}


@pytest.fixture
def one_autotune_config(monkeypatch):
    """Every autotuned Triton kernel (fla's) runs one of its configurations, untimed.

    Correctness does not depend on which configuration runs, and benchmarking each one compiles
    all of them: from a cold Triton cache, fla's KDA kernels under the kimi_linear model take
    longer than a device call's time limit. With one
    configuration a kernel compiles once per specialization. HYBRIDCACHE_TEST_AUTOTUNE=full
    keeps Triton's autotuning."""
    if os.environ.get("HYBRIDCACHE_TEST_AUTOTUNE", "one") == "full":
        return
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def first_config(self, kwargs):
        return prune(self, kwargs)[:1]

    monkeypatch.setattr(Autotuner, "prune_configs", first_config)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_tiny_model_cuda_fp32_matches_cpu_and_pic_is_consistent(arch, tmp_path, monkeypatch, one_autotune_config):
    _need_fla(FAMILIES[arch])
    # fp32 tl.dot in IEEE precision where Triton reads this knob (its default on Hopper is TF32)
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.modelzoo import init_model_dir
    from hybridcache.services.runtime.sequence import LiveRun
    from hybridcache.services.runtime.tokenizer import Tokenizer

    path = init_model_dir(arch, "tiny", tmp_path / arch, seed=1, std=0.08)
    cpu, gpu = load_model(path), load_model(path, "cuda")
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref, _ = cpu.forward_layout(cpu.empty_state(), [LiveRun(ids, 0)], logits_for="all")
        got, _ = gpu.forward_layout(gpu.empty_state(), [LiveRun(ids, 0)], logits_for="all")
    assert ref.abs().max().item() > 1e-2
    err = (got.float().cpu() - ref).abs().max().item()
    print(f"\n{arch}: max |logits CUDA - CPU| = {err:.3g} (logits up to {ref.abs().max().item():.3g})")
    assert err <= LOGITS_ATOL.get(arch, 1e-3), f"{arch}: max |logits CUDA - CPU| = {err:.3g}"

    # pic on CUDA: segments of 70 tokens (chunked path for the entries), cold == warm (up to rounding)
    gen = torch.Generator().manual_seed(5)
    segs = [torch.randint(0, 256, (70,), generator=gen).tolist() for _ in range(3)]
    obj = {"segments": segs, "suffix": [7, 8, 9, 10], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    pic = Engine(gpu, Tokenizer.from_dir(path), EngineConfig(mode="pic", seam_window=4))
    cold = pic.prefill(pic.parse_request(obj))
    warm = pic.prefill(pic.parse_request(obj))
    assert cold.stats.built_tokens > 0 and warm.stats.built_tokens == 0
    # warm resumes from the prefix cache; on the CPU reference path kimi_linear and minimax differ
    # from cold by float rounding (max 1.2e-6 / 4.2e-7, measured 2026-11-30), the others are equal.
    # On CUDA, cold and warm run fla's chunked kernels over different runs (a batched cold build,
    # then a restore and a live tail); where those kernels take TF32 dots whatever the fp32 setting
    # (olmo_hybrid, kimi_linear: LOGITS_ATOL above), their results differ by TF32 rounding too.
    gap = (cold.logits - warm.logits).abs().max().item()
    print(f"{arch}: max |cold - warm| = {gap:.3g}")
    assert gap <= (LOGITS_ATOL[arch] if arch in LOGITS_ATOL else 1e-4), f"{arch}: max |cold - warm| = {gap:.3g}"


# Zero-start pieces of the batched live scan (mixer.LinearMixer.batched_scan): o0, (T, S(run|0)) and
# the query transition u, so that a run from any S_in has outputs o0 + u S_in


def _check_pieces(pieces, run_from, init):
    """pieces = (o0, T, S0, u) of the CUDA path; run_from(init) the fp32 reference run from init
    with its transition: o0 + u init equals its outputs, T and S0 its pair."""
    o0, Tr, S0, u = pieces
    o_ref, _, (T_ref, S0_ref) = run_from(init)
    assert rel_rms(o0.float() + backends.run_outputs_from_states(u, init), o_ref) < TOL
    assert rel_rms(Tr, T_ref) < TOL and rel_rms(S0, S0_ref) < TOL


@pytest.mark.parametrize("B,T,H,K,V", SHAPES + [(3, 9, 3, 32, 32)], ids=IDS + ["short-B3-T9"])
def test_kda_pieces_match_reference(B, T, H, K, V):
    _need_fla("fla.ops.kda")
    q, k, v, g, beta, init = _kda_inputs(B, T, H, K, V, seed=6)
    pieces = backends.kda_pieces(q, k, v, g, beta)
    assert pieces[3].shape == (B, T, H, K)
    _check_pieces(
        pieces,
        lambda s: naive_recurrent_kda(
            q.float(), k.float(), v.float(), g, beta, initial_state=s, output_transition=True
        ),
        init,
    )


@pytest.mark.parametrize("B,T,H,K,V", SHAPES + [(3, 9, 3, 32, 32)], ids=IDS + ["short-B3-T9"])
def test_lightning_and_ssd_pieces_match_reference(B, T, H, K, V):
    """simple_gla_pieces with per-step decays (lightning's fixed rates, zeroed on padding steps)
    and ssd_pieces, CUDA against the step loops."""
    _need_fla("fla.ops.simple_gla")
    from hybridcache.kernels.ops.simple_gla.naive import naive_recurrent_simple_gla

    torch.manual_seed(7)
    dev = "cuda"
    q = (torch.randn(B, T, H, K, device=dev) * K**-0.5).bfloat16()
    k = (torch.randn(B, T, H, K, device=dev) * K**-0.5).bfloat16()
    v = torch.randn(B, T, H, V, device=dev).bfloat16()
    g = (-(lightning_slopes(H) * 0.1).to(dev))[None, None].expand(B, T, H).clone()
    g[0, T // 2 :] = 0.0  # padding steps of the first run: no decay (and k = 0 there)
    k[0, T // 2 :] = 0
    init = torch.randn(B, H, K, V, device=dev)
    _check_pieces(
        backends.simple_gla_pieces(q, k, v, g, 1.0),
        lambda s: naive_recurrent_simple_gla(
            q.float(), k.float(), v.float(), g, scale=1.0, initial_state=s, output_transition=True
        ),
        init,
    )
    x = torch.randn(B, T, H, V, device=dev).bfloat16()
    dt = F.softplus(torch.randn(B, T, H, device=dev) - 2)
    A = -torch.rand(H, device=dev) - 0.1
    Bm = (torch.randn(B, T, 1, K, device=dev) * K**-0.5).bfloat16()
    C = (torch.randn(B, T, 1, K, device=dev) * K**-0.5).bfloat16()
    D = torch.randn(H, device=dev)
    _check_pieces(
        backends.ssd_pieces(x, dt, A, Bm, C, D),
        lambda s: naive_ssd(x.float(), dt, A, Bm.float(), C.float(), D=D, initial_state=s, output_transition=True),
        init,
    )


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_tiny_model_batched_build_and_scan_on_cuda(arch, tmp_path, monkeypatch, one_autotune_config):
    """On CUDA (fp32, fla's kernels): the batched cold build of segments of several lengths equals
    building each alone, and the batched scan of a pic assembly equals one scan per run."""
    _need_fla(FAMILIES[arch])
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.models.mixer import LinearMixer
    from hybridcache.services.runtime.modelzoo import init_model_dir
    from hybridcache.services.runtime.sequence import CachedSpan, LiveRun

    tol = LOGITS_ATOL.get(arch, 1e-3)
    path = init_model_dir(arch, "tiny", tmp_path / arch, seed=1, std=0.08)
    gpu = load_model(path, "cuda")
    gen = torch.Generator().manual_seed(9)
    segs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 9, 17, 70, 131)]
    with torch.inference_mode():
        batched = gpu.build_span_data(segs, 4)
        for seg, b in zip(segs, batched):
            (a,) = gpu.build_span_data([seg], 4)
            for i in a.linear:
                for f in ("T", "S", "conv_tail"):
                    x, y = getattr(b.linear[i], f), getattr(a.linear[i], f)
                    assert x.shape == y.shape and (not y.numel() or rel_rms(x, y) < tol), (arch, len(seg), i, f)
            for i in a.attn:
                assert rel_rms(b.attn[i].k, a.attn[i].k) < tol and rel_rms(b.attn[i].v, a.attn[i].v) < tol
        layout, pos = [LiveRun(torch.arange(3, 9), 0)], 6
        for seg, data in zip(segs[1:], batched[1:]):
            layout += [LiveRun(torch.tensor(seg[:4]), pos), CachedSpan(data, pos + 4)]
            pos += len(seg)
        layout.append(LiveRun(torch.tensor([7, 8, 9, 10, 11]), pos))
        fast, _ = gpu.forward_layout(gpu.empty_state(), layout, logits_for="all")
        monkeypatch.setattr(LinearMixer, "batched_scan", lambda self, *a: self.sequential_scan(*a))
        slow, _ = gpu.forward_layout(gpu.empty_state(), layout, logits_for="all")
    err = (fast.float() - slow.float()).abs().max().item()
    print(f"\n{arch}: max |batched - sequential scan| = {err:.3g}")
    assert err <= tol
