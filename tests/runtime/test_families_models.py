"""Non-Qwen architectures (OLMo-Hybrid, Nemotron-H, Kimi-Linear): `full` logits equal transformers'
(fp32, tiny random configs), pic consistency, and `hybridcache model init` for each."""

import json

import pytest
import torch
from hybridcache.services import cli
from hybridcache.services.runtime.cache import MemoryEntryStore, expected_entry_nbytes
from hybridcache.services.runtime.cache.single_state import SingleStateStore
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.modelzoo import init_model_dir
from hybridcache.services.runtime.sequence import LiveRun
from hybridcache.services.runtime.tokenizer import Tokenizer
from transformers import AutoModelForCausalLM

FAMILY_ARCHS = ["olmo_hybrid", "nemotron_h", "bamba"]
# kimi_linear runs ~0.8 s per transformers forward on CPU: keep its sequences short
SEQ_LEN = {"olmo_hybrid": 61, "nemotron_h": 61, "bamba": 61, "kimi_linear": 29}


class _ModelDirs(dict):
    """Tiny random model dirs, each written on first use."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, arch):
        self[arch] = init_model_dir(arch, "tiny", self.root / arch, seed=1, std=0.08)
        return self[arch]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return _ModelDirs(tmp_path_factory.mktemp("family_models"))


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_full_logits_equal_transformers(arch, family_dirs):
    ids = torch.randint(0, 256, (1, SEQ_LEN[arch]), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(family_dirs[arch], dtype=torch.float32).eval()
        ref = hf(ids).logits[0]
    model = load_model(family_dirs[arch])
    ours, _ = model.forward_layout(model.empty_state(), [LiveRun(ids[0], 0)], logits_for="all")
    assert ref.abs().max().item() > 1e-2
    assert (ours - ref).abs().max().item() <= 1e-4
    # decode continues from the state a prefill leaves: same logits as one long forward
    state = model.empty_state()
    n = ids.shape[1]
    model.forward_layout(state, [LiveRun(ids[0, : n - 2], 0)], logits_for="none")
    last, _ = model.forward_layout(state, [LiveRun(ids[0, n - 2 : n - 1], n - 2)])
    assert (last - ours[n - 2]).abs().max().item() <= 1e-4


def _engine(model, path, **cfg):
    return Engine(model, Tokenizer.from_dir(path), EngineConfig(**cfg))


def _request(arch):
    g = torch.Generator().manual_seed(5)
    seg_len = 9 if arch == "kimi_linear" else 16
    segs = [torch.randint(0, 256, (seg_len,), generator=g).tolist() for _ in range(3)]
    sampling = {"max_new_tokens": 4, "ignore_eos": True}
    return {"segments": segs, "suffix": [7, 8, 9, 10], "sampling_params": sampling}


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_pic_consistency(arch, family_dirs):
    model = load_model(family_dirs[arch])
    obj = _request(arch)
    full = _engine(model, family_dirs[arch], mode="full")
    ref = full.prefill(full.parse_request(obj)).logits

    pic = _engine(model, family_dirs[arch], mode="pic", seam_window=4)
    cold = pic.prefill(pic.parse_request(obj))
    warm = pic.prefill(pic.parse_request(obj))
    assert cold.stats.built_tokens > 0 and warm.stats.built_tokens == 0
    # the warm request resumes from the part chain's state after the last segment, so its live
    # tokens are only the suffix: GEMMs of another row count, which on some CPUs (AVX-512 MKL)
    # round differently in the last bit
    assert (cold.logits - warm.logits).abs().max().item() <= 1e-5
    # entries are as large as the config says before they are built
    entry, hit = pic.get_or_build_entry(obj["segments"][1])
    assert hit and entry.nbytes == expected_entry_nbytes(model.cfg, entry.data.num_tokens, model.dtype)
    # pic approximates full, naive addition drifts further away (mean deviation over the vocabulary:
    # on bamba's tiny model the largest single deviation comes from the deeper layers' stale inputs)
    naive = _engine(model, family_dirs[arch], mode="naive", seam_window=4)
    naive_logits = naive.prefill(naive.parse_request(obj)).logits
    assert (cold.logits - ref).abs().mean() < (naive_logits - ref).abs().mean()

    # a seam window covering whole segments leaves nothing to reuse: exactly full
    seg_len = len(obj["segments"][0])
    whole = _engine(model, family_dirs[arch], mode="pic", seam_window=seg_len)
    assert (whole.prefill(whole.parse_request(obj)).logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_single_segment_entry_is_exact(arch, family_dirs):
    """One cached segment after an empty prefix with w = 0: its (T, S) fold equals running it live."""
    model = load_model(family_dirs[arch])
    obj = _request(arch)
    obj["segments"] = obj["segments"][:1]
    full = _engine(model, family_dirs[arch], mode="full")
    pic = _engine(model, family_dirs[arch], mode="pic", seam_window=0)
    a = full.prefill(full.parse_request(obj)).logits
    b = pic.prefill(pic.parse_request(obj)).logits
    assert (a - b).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_cli_model_init(arch, tmp_path, capsys):
    out = tmp_path / arch
    assert cli.main(["model", "init", "--arch", arch, "--preset", "tiny", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["arch"] == arch
    assert json.loads((out / "config.json").read_text())["model_type"] == arch
    assert load_model(out).cfg.model_type == arch


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_single_state_policy(arch, family_dirs):
    """Single state = composition with T = 0: consistent cold/warm, exact when nothing precedes the
    segment, different from exact composition once a prefix carries state, and smaller entries."""
    model = load_model(family_dirs[arch])
    tok = Tokenizer.from_dir(family_dirs[arch])
    obj = _request(arch)

    def engine(single, w=4):
        store = MemoryEntryStore(1 << 30)
        return Engine(model, tok, EngineConfig(mode="pic", seam_window=w), SingleStateStore(store) if single else store)

    single, exact = engine(True), engine(False)
    cold = single.prefill(single.parse_request(obj))
    warm = single.prefill(single.parse_request(obj))
    # the warm request resumes from the part chain's state after the last segment, so its live
    # tokens are only the suffix: GEMMs of another row count, which on some CPUs (AVX-512 MKL)
    # round differently in the last bit
    assert (cold.logits - warm.logits).abs().max().item() <= 1e-5
    ref = exact.prefill(exact.parse_request(obj)).logits
    assert (cold.logits - ref).abs().max().item() > 1e-4
    sizes = [e.get_or_build_entry(obj["segments"][1])[0].nbytes for e in (single, exact)]
    # a dense T (delta-rule families) is dropped; a scalar T (Mamba2) costs the same as the zero
    assert sizes[0] < sizes[1] if arch == "olmo_hybrid" else sizes[0] == sizes[1]

    one = dict(obj, segments=obj["segments"][:1])
    a, b = engine(True, w=0), engine(False, w=0)
    assert (a.prefill(a.parse_request(one)).logits - b.prefill(b.parse_request(one)).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_bf16_entry_states_sized_as_configured(arch, family_dirs):
    """entry_state_dtype="bfloat16": every family's entry holds T and S in bf16 and is as large
    as its config's entry_nbytes says for that state dtype (scalar and dense T alike)."""
    model = load_model(family_dirs[arch])
    obj = _request(arch)
    eng = _engine(model, family_dirs[arch], mode="pic", seam_window=4, entry_state_dtype="bfloat16")
    eng.prefill(eng.parse_request(obj))
    entry, hit = eng.get_or_build_entry(obj["segments"][1])
    assert hit and {s.S.dtype for s in entry.data.linear.values()} == {torch.bfloat16}
    assert entry.nbytes == expected_entry_nbytes(model.cfg, entry.data.num_tokens, model.dtype, torch.bfloat16)
    assert entry.nbytes < expected_entry_nbytes(model.cfg, entry.data.num_tokens, model.dtype)
