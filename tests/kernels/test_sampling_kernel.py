"""The sampling kernel (kernels/ops/sampling/triton.py, under the interpreter on the CPU) draws
from the reference distribution (naive.py): nothing outside the support of temperature, top-k,
top-p and min-p, and a chi-square within 6 sigma over many seeds; a seed gives the same pick in
any row; sampling.sample's CUDA path (the rows' settings, top-k thresholds and seeds) the same."""

import pytest
import torch
from hybridcache.kernels.ops.sampling import naive_sampling_probs
from kernel_testing import device, sample_rows

SETTINGS = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.3, top_k=12, top_p=0.6),
            dict(temperature=1.0, min_p=0.08), dict(temperature=0.5, top_k=30, top_p=0.9, min_p=0.02)]
V, N = 50, 1500


def _logits(seed):
    return (torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2).to(device())


def _check(picks, ref):
    """No pick outside the support; Pearson's chi-square over bins of >= 5 expected picks (the
    rest pooled) within 6 sigma of its degrees of freedom."""
    n = picks.numel()
    counts = torch.bincount(picks.cpu(), minlength=V).double()
    ref = ref.cpu().double()
    assert counts[ref == 0].sum() == 0
    exp = ref * n
    big = exp >= 5
    obs_b, exp_b = counts[big].tolist(), exp[big].tolist()
    if (~big & (ref > 0)).any():
        obs_b.append(counts[~big].sum().item())
        exp_b.append(exp[~big].sum().item())
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs_b, exp_b))
    df = len(exp_b) - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)


def _rows(logits, s, n):
    """The kernel's per-row arguments for n rows of one setting (the k-th largest logit for top-k)."""
    k = s.get("top_k", -1)
    kth = torch.topk(logits, k).values[-1].item() if k > 0 else float("-inf")
    full = lambda v: torch.full((n,), float(v), device=logits.device)  # noqa: E731
    return full(s["temperature"]), full(s.get("top_p", 2.0)), full(s.get("min_p", 0.0)), full(kth)


@pytest.mark.parametrize("chunk", [None, 16], ids=["one-program-a-row", "split-vocabulary"])
@pytest.mark.parametrize("case", range(len(SETTINGS)))
def test_kernel_draws_the_reference_distribution(case, chunk):
    """Both paths: one program over a row's whole vocabulary, and the vocabulary cut in chunks of
    16 (four programs a row, the GPU's path) whose first rounds hand undecided rows to the first."""
    s = SETTINGS[case]
    logits = _logits(case)
    seeds = torch.arange(N, device=device()) * 7919 + case
    picks = sample_rows(logits.expand(N, V), *_rows(logits, s, N), seeds, chunk=chunk)
    ref = naive_sampling_probs(logits, s["temperature"], s.get("top_k", -1), s.get("top_p", 1.0), s.get("min_p", 0.0))
    assert 1 < int((ref > 0).sum()) < V  # the setting cuts something
    _check(picks, ref)


@pytest.mark.parametrize("chunk", [None, 16], ids=["one-program-a-row", "split-vocabulary"])
def test_a_seed_picks_the_same_in_any_row(chunk):
    logits = _logits(11)
    s = dict(temperature=4.0, top_p=0.95)  # flat: different seeds pick differently
    seeds = torch.tensor([5, 6, 5, 7, 5, 8, 9, 10], device=device())
    picks = sample_rows(logits.expand(8, V), *_rows(logits, s, 8), seeds, chunk=chunk).tolist()
    assert picks[0] == picks[2] == picks[4]
    assert len(set(picks)) > 1
    # the row's own logits matter, not its neighbours'
    other = torch.stack([logits, _logits(12), logits, _logits(13)])
    s4 = sample_rows(other, *_rows(logits, s, 4), torch.tensor([5, 5, 5, 5], device=device()), chunk=chunk).tolist()
    assert s4[0] == s4[2] == picks[0]


def test_the_split_path_hands_undecided_rows_on():
    """top-p 0.05 on flat logits: most draws fall outside a nucleus of a token or two, so many rows
    are still undecided after the split path's rounds and the one-program kernel decides them;
    every pick lies in its row's nucleus."""
    logits = _logits(31) * 0.05
    s = dict(temperature=1.0, top_p=0.05)
    ref = naive_sampling_probs(logits, 1.0, -1, 0.05, 0.0)
    seeds = torch.arange(400, device=device()) * 31 + 1
    picks = sample_rows(logits.expand(400, V), *_rows(logits, s, 400), seeds, chunk=16)
    assert (ref[picks.cpu()] > 0).all()
    _check(picks, ref)


def test_the_cuda_path_of_sample_draws_each_rows_distribution(monkeypatch):
    """sampling._sample_kernel over a batch mixing settings (top-k rows among others) and a seeded
    generator: each setting's rows follow their reference; the seeded row repeats with its seed."""
    from hybridcache.services.runtime import sampling
    from hybridcache.services.runtime.sampling import SamplingParams

    logits = _logits(21)
    params = [SamplingParams(**SETTINGS[b % 2]) for b in range(2 * 600)]
    torch.manual_seed(0)
    picks = sampling._sample_kernel(logits.expand(len(params), V), params, [None] * len(params))
    for which in (0, 1):
        s = SETTINGS[which]
        ref = naive_sampling_probs(logits, s["temperature"], s.get("top_k", -1), s.get("top_p", 1.0),
                                   s.get("min_p", 0.0))
        _check(picks[which::2], ref)
    gens = lambda seed: [torch.Generator().manual_seed(seed)] + [None] * 3  # noqa: E731
    p4 = [SamplingParams(**SETTINGS[1])] * 4
    g1, g2 = gens(3), gens(3)
    a = [int(sampling._sample_kernel(logits.expand(4, V), p4, g1)[0]) for _ in range(6)]
    b = [int(sampling._sample_kernel(logits.expand(1, V), p4[:1], g2[:1])[0]) for _ in range(6)]
    assert a == b


@pytest.mark.gpu
def test_kernel_at_the_9b_vocabulary_beats_the_sorting_sampler_gpu():
    """32 and 128 rows of a 248,320-token vocabulary (temperature 0.8, top-p 0.95): the kernel's
    picks lie in each row's nucleus, and it takes less time than the torch path (one sort)."""
    from hybridcache.services.runtime import sampling
    from hybridcache.services.runtime.sampling import SamplingParams

    for B in (32, 128):
        logits = torch.randn(B, 248320, device="cuda") * 3
        params = [SamplingParams(temperature=0.8, top_p=0.95)] * B
        probs = sampling.sampling_probs(logits, params)  # the sorting path's distribution
        picks = sampling._sample_kernel(logits, params, [None] * B)
        assert (probs.gather(1, picks[:, None]) > 0).all()

        def timed(fn, logits=logits, params=params, B=B):
            for _ in range(3):
                fn(logits, params, B)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fn(logits, params, B)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 20

        kernel = timed(lambda x, p, b: sampling._sample_kernel(x, p, [None] * b))
        sort = timed(lambda x, p, b: sampling.sampling_probs(x, p))
        print(f"B={B}: kernel {kernel:.3f} ms, sorting path {sort:.3f} ms")
        assert kernel < sort


def test_warm_kernels_compiles_nothing_off_cuda():
    from hybridcache.services.runtime.sampling import warm_kernels

    assert warm_kernels("cpu", 1000, 32) == 0


@pytest.mark.gpu
def test_warm_kernels_leaves_no_batch_size_to_compile_gpu():
    """After warm_kernels every batch of 1..128 sampled rows of the 9B vocabulary runs kernels
    already compiled: no Triton cache of the sampling kernels grows."""
    from hybridcache.kernels.ops.sampling import triton as st
    from hybridcache.services.runtime.sampling import SamplingParams, sample, warm_kernels

    dev, V = torch.device("cuda"), 248320
    shapes = warm_kernels(dev, V, 128)
    assert shapes > 1  # the split path's partial count changes with the rows
    kernels = (st._race_kernel, st._mass_kernel, st._decide_kernel, st.sample_rows_kernel)

    def compiled():
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]

    before = compiled()
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=20)
    for rows in range(1, 129):
        sample(torch.randn(rows, V, device=dev), [params] * rows, [None] * rows)
    torch.cuda.synchronize()
    assert compiled() == before
