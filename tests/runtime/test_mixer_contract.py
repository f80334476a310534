"""The mixer contract (models/mixer.py) for every family: the batched cold build equals building
each segment alone, the batched scan of several live runs equals the sequential one (and, where
the layout is exact, transformers' full forward), and the batched scan's op count does not grow
with the number of runs. CPU, fp32, tiny random models."""

import random

import pytest
import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.models.mixer import LinearMixer
from hybridcache.services.runtime.modelzoo import init_model_dir
from hybridcache.services.runtime.sequence import CachedSpan, LiveRun
from hybridcache.services.runtime.tokenizer import Tokenizer
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

FAMILIES = ["qwen3_5_text", "qwen3_next", "olmo_hybrid", "nemotron_h", "bamba", "kimi_linear", "minimax"]
# dense-T families fold with one launch on CUDA (a step loop on CPU); scalar-T ones in fixed ops everywhere
DENSE_T = {"qwen3_5_text", "qwen3_next", "olmo_hybrid", "kimi_linear"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixer_contract")
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = init_model_dir(arch, "tiny", root / arch, seed=1, std=0.08)
        return made[arch]

    return get


@pytest.fixture(scope="module")
def models(dirs):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = load_model(dirs(arch))
        return made[arch]

    return get


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def engine(model, path, **cfg):
    return Engine(model, Tokenizer.from_dir(path), EngineConfig(**cfg))


def linear_mixers(model):
    return [m for m in model.modules() if isinstance(m, LinearMixer)]


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("w", [0, 3])
def test_batched_build_equals_single_builds(arch, w, models, dirs, monkeypatch):
    """Segments of several lengths (a body of one token, odd lengths, shorter and longer than the
    CPU chunk of 64 and the step-loop threshold of 16) built in one padded batch give the entries
    each built alone gives: T, S, conv tails, K/V."""
    model = models(arch)
    assert linear_mixers(model), "the family's linear layers are not on the mixer contract"
    eng = engine(model, dirs(arch), mode="pic", seam_window=w)
    lengths = [w + 1, 9, 16, 17, 70, 131]
    segs = [tokens(n, seed=n) for n in lengths]
    batches = []
    real = model.build_span_data

    def spy(segments, seam, on_layer=None):
        batches.append(len(segments))
        return real(segments, seam, on_layer)

    monkeypatch.setattr(model, "build_span_data", spy)
    built = eng.build_entries(segs)
    assert sum(batches) == len(segs) and max(batches) > 1
    for seg, b in zip(segs, built):
        a = eng.build_entry(seg).data
        assert set(a.linear) == set(b.data.linear) and set(a.attn) == set(b.data.attn)
        for i in a.linear:
            for f in ("T", "S", "conv_tail"):
                x, y = getattr(b.data.linear[i], f), getattr(a.linear[i], f)
                assert x.shape == y.shape, (i, f)
                if y.numel():
                    assert rel(x, y) <= 1e-5, (len(seg), i, f)
        for i in a.attn:
            for f in ("k", "v"):
                x, y = getattr(b.data.attn[i], f), getattr(a.attn[i], f)
                assert x.shape == y.shape and rel(x, y) <= 1e-5, (len(seg), i, f)


def assembly(model, n_segments, w=4, seg_len=21, suffix_len=5, seed=0):
    """A pic layout: a system run, then per segment its w-token seam live and its body cached
    (built standalone), then the question; every piece at its absolute position."""
    segs = [tokens(seg_len, seed + 100 + j) for j in range(n_segments)]
    datas = model.build_span_data(segs, w)
    layout, pos = [LiveRun(torch.tensor(tokens(6, seed)), 0)], 6
    for seg, data in zip(segs, datas):
        layout.append(LiveRun(torch.tensor(seg[:w]), pos))
        layout.append(CachedSpan(data, pos + w))
        pos += len(seg)
    layout.append(LiveRun(torch.tensor(tokens(suffix_len, seed + 1)), pos))
    return layout


def sequential_only(monkeypatch):
    monkeypatch.setattr(
        LinearMixer, "batched_scan", lambda self, *args: self.sequential_scan(*args)
    )


@pytest.mark.parametrize("arch", FAMILIES)
def test_batched_scan_equals_sequential_on_a_pic_assembly(arch, models, monkeypatch):
    """A layout of live seams between cached spans: the batched scan's logits, final states and
    conv tails equal one scan per run."""
    model = models(arch)
    layout = assembly(model, 4)
    calls = []
    real = LinearMixer.batched_scan

    def spy(self, *args):
        calls.append(args[-3:])
        return real(self, *args)

    monkeypatch.setattr(LinearMixer, "batched_scan", spy)
    fast_state = model.empty_state()
    fast, _ = model.forward_layout(fast_state, layout, logits_for="all")
    assert calls, "no batched scan ran"
    sequential_only(monkeypatch)
    slow_state = model.empty_state()
    slow, _ = model.forward_layout(slow_state, layout, logits_for="all")
    assert (fast - slow).abs().max().item() <= 1e-4
    for i in fast_state.linear:
        assert rel(fast_state.linear[i].ssm, slow_state.linear[i].ssm) <= 1e-5
        assert torch.allclose(fast_state.linear[i].conv, slow_state.linear[i].conv, atol=1e-5)


@pytest.mark.parametrize("arch", FAMILIES)
def test_batched_live_runs_equal_transformers(arch, models, dirs, monkeypatch):
    """Live runs in a row from position 0 (conv tails handed from run to run, entering states from
    the fold): an exact layout, so the batched scan's logits equal transformers' full forward and
    the sequential scan's. The runs are of about equal length, so the region before any cached
    span runs batched; one is shorter than the conv window."""
    model = models(arch)
    r = 7 if arch == "kimi_linear" else 12  # transformers' kimi_linear is slow on CPU
    lengths = [r, 2, r, r, r]
    n = sum(lengths)
    ids = torch.tensor(tokens(n, seed=7))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    record = [None, None, "entry", None, None]
    layout = [LiveRun(ids[a : a + m], a, record=r) for a, m, r in zip(starts, lengths, record)]
    calls = []
    real = LinearMixer.batched_scan
    monkeypatch.setattr(LinearMixer, "batched_scan", lambda self, *a: calls.append(1) or real(self, *a))
    state = model.empty_state()
    ours, rec = model.forward_layout(state, layout, logits_for="all", snapshot_after=(1, 3))
    assert len(calls) == len(linear_mixers(model))
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(dirs(arch), dtype=torch.float32).eval()
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4
    sequential_only(monkeypatch)
    slow, slow_rec = model.forward_layout(model.empty_state(), layout, logits_for="all", snapshot_after=(1, 3))
    assert (ours - slow).abs().max().item() <= 1e-4
    # the run recorded as an entry and the states kept after runs 1 and 3 (the short run among them)
    for i, span in slow_rec.entries[2].linear.items():
        got = rec.entries[2].linear[i]
        for f in ("T", "S", "conv_tail"):
            assert getattr(got, f).shape == getattr(span, f).shape
            if getattr(span, f).numel():
                assert rel(getattr(got, f), getattr(span, f)) <= 1e-5, (i, f)
    for idx in (1, 3):
        for i, snap in slow_rec.snapshots[idx].items():
            assert rel(rec.snapshots[idx][i].ssm, snap.ssm) <= 1e-5
            if snap.conv.numel():
                assert rel(rec.snapshots[idx][i].conv, snap.conv) <= 1e-5


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that compute (views excluded: they launch nothing); `paused` skips them."""

    def __init__(self):
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        is_view = bool(schema.returns) and schema.returns[0].alias_info is not None
        if not self.paused and not is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def scan_op_counts(model, layout, monkeypatch, method, dense_fold):
    """Ops of each linear layer's `method` scan of the region after the first cached span. A
    dense-T fold counts as the one launch it is on CUDA (a step loop on CPU)."""
    counts, counter = [], OpCounter()
    real_fold, real_scan = backends.fold_states, getattr(LinearMixer, method)

    def fold(*args):
        if not dense_fold:
            return real_fold(*args)
        counter.paused = True
        try:
            return real_fold(*args)
        finally:
            counter.paused = False
            counter.count += 1

    def scan(self, *args):
        if args[-3] == 0:  # the region before the first span (the system run alone)
            return real_scan(self, *args)
        counter.count = 0
        with counter:
            out = real_scan(self, *args)
        counts.append(counter.count)
        return out

    monkeypatch.setattr(backends, "fold_states", fold)
    monkeypatch.setattr(LinearMixer, method, scan)
    if method == "sequential_scan":
        monkeypatch.setattr(LinearMixer, "batched_scan", lambda self, *a: scan(self, *a))
    model.forward_layout(model.empty_state(), layout, logits_for="last")
    monkeypatch.undo()
    return counts


@pytest.mark.parametrize("arch", FAMILIES)
def test_batched_scan_ops_do_not_grow_with_runs(arch, models, monkeypatch):
    """2 and 8 cached segments (3 and 9 live runs after the first span): the batched scan runs
    the same number of ops per layer (the scratch indices built once per forward included only in
    the first layer), where one scan per run grows with the runs."""
    model = models(arch)
    dense = arch in DENSE_T
    few = scan_op_counts(model, assembly(model, 2), monkeypatch, "batched_scan", dense)
    many = scan_op_counts(model, assembly(model, 8), monkeypatch, "batched_scan", dense)
    assert len(few) == len(many) == len(linear_mixers(model))
    assert few == many
    seq_few = scan_op_counts(model, assembly(model, 2), monkeypatch, "sequential_scan", dense)
    seq_many = scan_op_counts(model, assembly(model, 8), monkeypatch, "sequential_scan", dense)
    assert all(b > a for a, b in zip(seq_few, seq_many))


def test_diagonal_fold_equals_the_step_fold():
    """fold_diagonal (scalar and vector T, some pieces without T, one T that underflowed to 0)
    equals folding the pairs one at a time."""
    from hybridcache.kernels.ops.transition import apply_segment

    g = torch.Generator().manual_seed(0)
    H, K, V, n = 3, 5, 4, 7
    for shape in ((1, H), (1, H, K)):
        Ts = [torch.rand(*shape, generator=g) for _ in range(n)]
        Ts[3] = torch.zeros(*shape)
        Ss = [torch.randn(1, H, K, V, generator=g) for _ in range(n)]
        s0 = torch.randn(1, H, K, V, generator=g)
        use = [True, True, False, True, True, False, True]
        got = backends.fold_diagonal(Ts, Ss, s0, use)
        S = s0
        for i in range(n):
            S = apply_segment(Ts[i], Ss[i], S, use[i])
            assert torch.allclose(got[i], S, atol=1e-6, rtol=1e-5)
