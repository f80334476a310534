"""backends.attention: SDPA backend selection (--sdpa-backends, the OpDispatch) and its three paths
(decode, bottom-right causal, seams interleaved with cached spans) against explicit softmax
attention, GQA included."""

import pytest
import torch
from hybridcache.services.runtime import backends


def test_default_backends_leave_out_cudnn():
    from torch.nn.attention import SDPBackend

    allowed = backends.sdpa_backends()
    assert SDPBackend.CUDNN_ATTENTION not in allowed
    assert allowed == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def test_backends_from_the_dispatch():
    from torch.nn.attention import SDPBackend

    with backends.dispatching(backends.OpDispatch(sdpa_backends="torch")):
        assert backends.sdpa_backends() is None
    with backends.dispatching(backends.OpDispatch(sdpa_backends=" cudnn, math ")):
        assert backends.sdpa_backends() == [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    assert backends.sdpa_backends() == backends.sdpa_backends(backends.DEFAULT_SDPA_BACKENDS)  # restored


@pytest.mark.parametrize("spec", ["fast", "flash,,nope", ","])
def test_bad_backend_spec_is_a_clear_error(spec):
    with pytest.raises(ValueError, match="sdpa_backends"):
        backends.OpDispatch(sdpa_backends=spec)


def reference(q, k, v, live_pos, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    s = (q.float() @ k.transpose(-1, -2)) * scale
    keep = torch.arange(k.shape[2], device=q.device)[None, :] <= live_pos[:, None]
    return (s.masked_fill(~keep, float("-inf")).softmax(-1) @ v).to(q.dtype)


def cases(device, dtype):
    torch.manual_seed(0)
    hq, hkv, d, N = 8, 2, 64, 301
    k = torch.randn(1, hkv, N, d, device=device, dtype=dtype)
    v = torch.randn(1, hkv, N, d, device=device, dtype=dtype)
    seams = torch.cat([torch.arange(40, 48), torch.arange(150, 158), torch.arange(280, N)])
    for name, pos in (("decode", torch.tensor([N - 1])), ("tail", torch.arange(N - 37, N)), ("seams", seams)):
        q = torch.randn(1, hq, len(pos), d, device=device, dtype=dtype)
        yield name, q, k, v, pos.to(device)


def test_attention_paths_match_explicit_softmax_cpu():
    for name, q, k, v, pos in cases("cpu", torch.float32):
        out = backends.attention(q, k, v, pos, 0.125)
        assert (out - reference(q, k, v, pos, 0.125)).abs().max().item() < 1e-5, name


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [backends.DEFAULT_SDPA_BACKENDS, "torch"])
def test_attention_paths_match_explicit_softmax_gpu(spec):
    with backends.dispatching(backends.OpDispatch(sdpa_backends=spec)):
        for name, q, k, v, pos in cases("cuda", torch.bfloat16):
            out = backends.attention(q, k, v, pos, 0.125)
            ref = reference(q, k, v, pos, 0.125)
            assert (out.float() - ref.float()).abs().max().item() < 2e-2, name


def test_models_call_attention_only_through_backends():
    """The SDPA backend restriction (no cuDNN by default on CUDA) holds only if every model's
    attention goes through backends.sdpa; a direct call would bring back per-shape graph builds."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    direct = [
        str(p.relative_to(root))
        for p in [*(root / "services").rglob("*.py"), root / "benchmarks" / "gpu_bench.py"]
        if "scaled_dot_product_attention(" in p.read_text() and p.name != "backends.py"
    ]
    assert direct == [], f"call backends.sdpa instead of F.scaled_dot_product_attention in {direct}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA path runs for real on a GPU")
def test_seams_take_the_live_attention_kernel_on_the_fast_path(monkeypatch):
    """Seams (live queries between cached spans) go to kernels/ops/attention on the fast path, with
    the same result as the masked SDPA path; a live tail and wide heads do not."""
    import kernel_testing  # noqa: F401  (Triton's interpreter on CPU, set before the kernel loads)
    from hybridcache.kernels.ops.attention import triton as attn

    calls = []
    real = attn.live_attention
    monkeypatch.setattr(attn, "live_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    gen = torch.Generator().manual_seed(4)
    N = 40

    def run(d, pos, fast=True):
        q = torch.randn(1, 4, len(pos), d, generator=gen)
        k, v = torch.randn(1, 2, N, d, generator=gen), torch.randn(1, 2, N, d, generator=gen)
        live = torch.tensor(pos)
        monkeypatch.setattr(backends, "use_fast_kernels", lambda t: fast)
        return backends.attention(q, k, v, live, d**-0.5, first_pos=pos[0]), (q, k, v, live)

    seams = [3, 4, 20, 21, 39]
    got, (q, k, v, live) = run(16, seams)
    assert calls == [q.shape]
    monkeypatch.setattr(backends, "use_fast_kernels", lambda t: False)
    ref = backends.attention(q, k, v, live, 16**-0.5, first_pos=seams[0])
    assert (got - ref).abs().max().item() < 1e-5
    run(16, list(range(N - 5, N)))  # a live tail: fused SDPA
    run(288, seams)  # heads wider than the kernel's tested tiles: SDPA
    assert len(calls) == 1
