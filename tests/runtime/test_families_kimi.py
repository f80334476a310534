"""Kimi-Linear (KDA + NoPE MLA + DeepSeek-V3 MoE): `full` logits equal transformers' (fp32, tiny
random config), decode continues the prefill, pic consistency, latent-only attention entries and
`hybridcache model init --arch kimi_linear`. transformers' kimi_linear forward takes ~0.8 s on
CPU, so sequences stay short and the reference runs once per configuration."""

import json

import pytest
import torch
from hybridcache.services import cli
from hybridcache.services.runtime.cache import MemoryEntryStore, expected_entry_nbytes
from hybridcache.services.runtime.cache.single_state import SingleStateStore
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.loader import ModelLoadError, load_model
from hybridcache.services.runtime.models.registry import config_from_dict
from hybridcache.services.runtime.modelzoo import hf_config, init_model_dir
from hybridcache.services.runtime.sequence import LiveRun
from hybridcache.services.runtime.tokenizer import Tokenizer
from transformers import AutoModelForCausalLM, KimiLinearConfig

SEQ_LEN = 29


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return init_model_dir("kimi_linear", "tiny", tmp_path_factory.mktemp("kimi") / "tiny", seed=1, std=0.08)


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    return load_model(kimi_dir)


def _reference_logits(path, ids):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits[0]


def _ids(n, seed=3):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_full_logits_equal_transformers_and_decode_continues(kimi, kimi_dir):
    ids = _ids(SEQ_LEN)
    ref = _reference_logits(kimi_dir, ids)
    ours, _ = kimi.forward_layout(kimi.empty_state(), [LiveRun(ids[0], 0)], logits_for="all")
    assert ref.abs().max().item() > 1e-2
    assert (ours - ref).abs().max().item() <= 1e-4
    # prefill n - 3 tokens, then decode two one at a time: same logits as the long forward
    state, n = kimi.empty_state(), SEQ_LEN
    kimi.forward_layout(state, [LiveRun(ids[0, : n - 3], 0)], logits_for="none")
    for t in (n - 3, n - 2):
        step, _ = kimi.forward_layout(state, [LiveRun(ids[0, t : t + 1], t)])
        assert (step - ours[t]).abs().max().item() <= 1e-4


def test_q_lora_variant_equals_transformers(tmp_path):
    """The low-rank query path (q_a_proj, q_a_layernorm, q_b_proj) and attention biases."""
    path = init_model_dir(
        "kimi_linear",
        "tiny",
        tmp_path / "qlora",
        seed=2,
        std=0.08,
        overrides={
            "q_lora_rank": 24,
            "attention_bias": True,
            "num_hidden_layers": 2,
            "layer_types": ["full_attention", "linear_attention"],
            "mlp_layer_types": ["sparse", "dense"],
        },
    )
    ids = _ids(12, seed=4)
    model = load_model(path)
    assert hasattr(model.layers[0].self_attn, "q_a_proj")
    ours, _ = model.forward_layout(model.empty_state(), [LiveRun(ids[0], 0)], logits_for="all")
    assert (ours - _reference_logits(path, ids)).abs().max().item() <= 1e-4


def _engine(model, path, **cfg):
    return Engine(model, Tokenizer.from_dir(path), EngineConfig(**cfg))


def _request():
    g = torch.Generator().manual_seed(5)
    segs = [torch.randint(0, 256, (9,), generator=g).tolist() for _ in range(3)]
    return {
        "segments": segs,
        "suffix": [7, 8, 9, 10],
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
    }


def test_pic_consistency(kimi, kimi_dir):
    obj = _request()
    full = _engine(kimi, kimi_dir, mode="full")
    ref = full.prefill(full.parse_request(obj)).logits

    pic = _engine(kimi, kimi_dir, mode="pic", seam_window=4)
    cold = pic.prefill(pic.parse_request(obj))
    warm = pic.prefill(pic.parse_request(obj))
    assert cold.stats.built_tokens > 0 and warm.stats.built_tokens == 0 and warm.stats.reused_tokens > 0
    # not bitwise: the warm run's MoE experts see other token batches (BLAS gemv vs gemm rounding)
    assert (cold.logits - warm.logits).abs().max().item() <= 1e-5
    naive = _engine(kimi, kimi_dir, mode="naive", seam_window=4)
    naive_logits = naive.prefill(naive.parse_request(obj)).logits
    assert (cold.logits - ref).abs().max() < (naive_logits - ref).abs().max()

    # the entry holds MLA latents only ([c, k_r] per token), as large as the config predicts
    entry, hit = pic.get_or_build_entry(obj["segments"][1])
    assert hit and entry.nbytes == expected_entry_nbytes(kimi.cfg, entry.data.num_tokens, kimi.dtype)
    (attn,) = entry.data.attn.values()
    assert attn.k.shape == (1, 1, entry.data.num_tokens, kimi.cfg.kv_lora_rank)
    assert attn.v.shape == (1, 1, entry.data.num_tokens, kimi.cfg.qk_rope_head_dim)
    d = kimi.cfg.linear_head_dim
    assert all(s.T.shape == (1, kimi.cfg.linear_num_heads, d, d) for s in entry.data.linear.values())

    # a seam window covering whole segments leaves nothing to reuse: exactly full
    whole = _engine(kimi, kimi_dir, mode="pic", seam_window=9)
    assert (whole.prefill(whole.parse_request(obj)).logits - ref).abs().max().item() <= 1e-4


def test_entry_reused_at_any_position_is_exact_without_a_prefix(kimi, kimi_dir):
    """One segment after nothing, w = 0: folding its (T, S) and latents equals running it live; the
    same entry then serves the segment after a prefix (NoPE: no re-rotation) and decodes."""
    seg = _request()["segments"][0]
    one = {"segments": [seg], "suffix": [7, 8], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    full = _engine(kimi, kimi_dir, mode="full")
    pic = _engine(kimi, kimi_dir, mode="pic", seam_window=0)
    a = full.prefill(full.parse_request(one)).logits
    b = pic.prefill(pic.parse_request(one)).logits
    assert (a - b).abs().max().item() <= 1e-4
    shifted = dict(one, system="a system prompt")
    res = LLM(pic).generate(shifted)
    assert res.stats.reused_tokens == len(seg) and len(res.output_ids) == 2


def test_cli_model_init(tmp_path, capsys):
    out = tmp_path / "kimi"
    assert cli.main(["model", "init", "--arch", "kimi_linear", "--preset", "tiny", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["arch"] == "kimi_linear"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_linear" and "full_attention" in cfg["layer_types"]
    assert load_model(out).cfg.model_type == "kimi_linear"


def test_checkpoint_style_config_and_bad_configs(tmp_path):
    """config.json as the released checkpoint writes it: linear_attn_config with 1-indexed layer lists."""
    raw = hf_config("kimi_linear", "tiny")
    for key in (
        "layer_types",
        "linear_num_heads",
        "linear_head_dim",
        "linear_conv_kernel_dim",
        "mlp_layer_types",
    ):
        raw.pop(key)
    raw.update(
        linear_attn_config={
            "full_attn_layers": [4],
            "kda_layers": [1, 2, 3],
            "num_heads": 2,
            "head_dim": 32,
            "short_conv_kernel_size": 3,
        },
        first_k_dense_replace=2,
    )
    cfg = config_from_dict(raw)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.mlp_layer_types == ("dense", "dense", "sparse", "sparse")
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim) == (2, 32, 3)

    # transformers reads the same layout from both configs
    real = hf_config("kimi_linear", "kimi-linear-48b-a3b")
    for raw_cfg in (raw, real):
        ours = config_from_dict(raw_cfg)
        theirs = KimiLinearConfig(**{k: v for k, v in raw_cfg.items() if k != "model_type"})
        assert list(ours.layer_types) == theirs.layer_types
        assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
        assert (ours.linear_num_heads, ours.linear_head_dim) == (
            theirs.linear_num_heads,
            theirs.linear_head_dim,
        )
    real_cfg = config_from_dict(real)
    assert len(real_cfg.linear_layers) == 20 and len(real_cfg.attention_layers) == 7
    # MLA has no key/value head count of its own: the field is not needed
    assert config_from_dict(dict(raw, num_key_value_heads=1)) == cfg
    with pytest.raises(ModelConfigError, match="topk_group"):
        config_from_dict(dict(raw, n_group=3))
    bad = tmp_path / "bad"
    init_model_dir("kimi_linear", "tiny", bad, seed=0)
    cfg_json = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg_json, hidden_act="gelu")))
    with pytest.raises(ModelLoadError, match="hidden_act"):
        load_model(bad)


def test_single_state_policy_drops_the_dense_transition(kimi, kimi_dir):
    """Single state (composition with T = 0) on KDA: cold = warm, smaller entries than exact (dense T
    dropped), and a different answer from exact composition once a prefix carries state."""
    tok = Tokenizer.from_dir(kimi_dir)
    obj = _request()

    def engine(single):
        store = MemoryEntryStore(1 << 30)
        return Engine(
            kimi, tok, EngineConfig(mode="pic", seam_window=4), SingleStateStore(store) if single else store
        )

    single, exact = engine(True), engine(False)
    cold = single.prefill(single.parse_request(obj)).logits
    warm = single.prefill(single.parse_request(obj)).logits
    assert (cold - warm).abs().max().item() <= 1e-5
    assert (cold - exact.prefill(exact.parse_request(obj)).logits).abs().max().item() > 1e-4
    sizes = [e.get_or_build_entry(obj["segments"][1])[0].nbytes for e in (single, exact)]
    h, d = kimi.cfg.linear_num_heads, kimi.cfg.linear_head_dim
    # a K x K fp32 matrix per head becomes one zero scalar per head
    assert sizes[1] - sizes[0] == len(kimi.cfg.linear_layers) * 4 * h * (d * d - 1)
