"""MiniMax (lightning attention + RoPE softmax attention + softmax MoE): `full` logits equal
transformers' (fp32, tiny random config, several of transformers' lightning blocks), the scalar T
of a lightning layer and its composition, pic consistency, RoPE re-rotation of cached K, config
parsing and `hybridcache model init --arch minimax`."""

import json

import pytest
import torch
from hybridcache.kernels.ops.simple_gla import lightning_slopes
from hybridcache.kernels.ops.transition import apply_segment
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
from transformers import AutoModelForCausalLM
from transformers import MiniMaxConfig as HFMiniMaxConfig

# the tiny preset's block_size is 16: 45 tokens are two full blocks of transformers' lightning
# attention and a partial one
SEQ_LEN = 45


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory):
    return init_model_dir("minimax", "tiny", tmp_path_factory.mktemp("minimax") / "tiny", seed=1, std=0.08)


@pytest.fixture(scope="module")
def mm(mm_dir):
    return load_model(mm_dir)


def _ids(n, seed=3):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _reference_logits(path, ids):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits[0]


def test_full_logits_equal_transformers_and_decode_continues(mm, mm_dir):
    ids = _ids(SEQ_LEN)
    ref = _reference_logits(mm_dir, ids)
    ours, _ = mm.forward_layout(mm.empty_state(), [LiveRun(ids[0], 0)], logits_for="all")
    assert ref.abs().max().item() > 1e-2
    assert (ours - ref).abs().max().item() <= 1e-4
    # prefill, then decode three tokens one at a time: same logits as the long forward
    state, n = mm.empty_state(), SEQ_LEN
    mm.forward_layout(state, [LiveRun(ids[0, : n - 3], 0)], logits_for="none")
    for t in range(n - 3, n):
        step, _ = mm.forward_layout(state, [LiveRun(ids[0, t : t + 1], t)])
        assert (step - ours[t]).abs().max().item() <= 1e-4


def test_directory_saved_by_transformers_loads(mm, mm_dir, tmp_path):
    """save_pretrained writes the lightning layers' decay buffers: such a directory loads, our
    buffers equal transformers' own, and a checkpoint without them is refused with their names."""
    hf = AutoModelForCausalLM.from_pretrained(mm_dir, dtype=torch.float32).eval()
    theirs = {k: v for k, v in hf.state_dict().items() if k.endswith(("decay", "slope_rate"))}
    ours = mm.state_dict()
    assert len(theirs) == 4 * len(mm.cfg.linear_layers)
    assert all(torch.allclose(ours[k], v, rtol=1e-6, atol=0) for k, v in theirs.items())
    hf.save_pretrained(tmp_path / "saved")
    (tmp_path / "saved" / "tokenizer.json").write_bytes((mm_dir / "tokenizer.json").read_bytes())
    again = load_model(tmp_path / "saved")
    ids = _ids(20, seed=9)[0]
    a, _ = again.forward_layout(again.empty_state(), [LiveRun(ids, 0)], logits_for="all")
    b, _ = mm.forward_layout(mm.empty_state(), [LiveRun(ids, 0)], logits_for="all")
    assert torch.equal(a, b)
    from safetensors.torch import load_file, save_file

    stripped = tmp_path / "stripped"
    init_model_dir("minimax", "tiny", stripped, seed=0)
    weights = load_file(str(stripped / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.endswith("decay")}, str(stripped / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensor.*decay"):
        load_model(stripped)


def test_slopes_follow_transformers_schedule(mm):
    """Per-head rates times the per-layer factor, as transformers' buffers hold them; the kernel
    package's lightning_slopes agrees with the head part for a power-of-two head count only."""
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    for heads in (4, 6):
        raw = dict(hf_config("minimax", "tiny"), num_attention_heads=heads, num_key_value_heads=heads, head_dim=8)
        cfg = config_from_dict(raw)
        hf_cfg = HFMiniMaxConfig(**{k: v for k, v in raw.items() if k != "model_type"})
        for layer in cfg.linear_layers:
            theirs = MiniMaxLightningAttention(hf_cfg, layer).get_slope_rate().flatten()
            assert torch.equal(cfg.slopes(layer), theirs)
        head_part = cfg.slopes(0) / (1 + 1e-5)
        assert torch.allclose(head_part, lightning_slopes(heads)) == (heads == 4)
    # the last layer barely decays, the first decays fastest
    tiny = config_from_dict(hf_config("minimax", "tiny"))
    assert (tiny.slopes(3) < 1e-4).all() and (tiny.slopes(0) > tiny.slopes(1)).all()


def test_lightning_transition_is_scalar_and_composes(mm):
    """A lightning layer's (T, S) pair: T = exp(-s n) per head, and scanning two runs then composing
    equals one scan (rel <= 1e-5)."""
    layer = mm.layers[1].self_attn
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 40, mm.cfg.hidden_size, generator=g)
    qkv = torch.nn.functional.silu(layer.qkv_proj(x))
    _, whole, _, _ = layer.scan((qkv,), layer.empty_state("cpu"), False)
    _, s_a, _, _ = layer.scan((qkv[:, :25],), layer.empty_state("cpu"), False)
    _, _, (T_b, S_b), _ = layer.scan((qkv[:, 25:],), layer.empty_state("cpu"), True)
    assert T_b.shape == (1, mm.cfg.num_attention_heads)
    assert torch.allclose(T_b[0], torch.exp(-15 * mm.cfg.slopes(1)), rtol=1e-5)
    composed = apply_segment(T_b, S_b, s_a, True)
    assert ((composed - whole).norm() / whole.norm()).item() <= 1e-5
    assert ((S_b - whole).norm() / whole.norm()).item() > 1e-3  # the prefix's state matters


def _engine(model, path, **cfg):
    return Engine(model, Tokenizer.from_dir(path), EngineConfig(**cfg))


def _request():
    g = torch.Generator().manual_seed(5)
    segs = [torch.randint(0, 256, (16,), generator=g).tolist() for _ in range(3)]
    return {
        "segments": segs,
        "suffix": [7, 8, 9, 10],
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
    }


def test_pic_consistency(mm, mm_dir):
    obj = _request()
    full = _engine(mm, mm_dir, mode="full")
    ref = full.prefill(full.parse_request(obj)).logits

    pic = _engine(mm, mm_dir, mode="pic", seam_window=4)
    cold = pic.prefill(pic.parse_request(obj))
    warm = pic.prefill(pic.parse_request(obj))
    assert cold.stats.built_tokens > 0 and warm.stats.built_tokens == 0 and warm.stats.reused_tokens > 0
    # not bitwise: the warm run's MoE experts see other token batches (BLAS gemv vs gemm rounding)
    assert (cold.logits - warm.logits).abs().max().item() <= 1e-5
    naive = _engine(mm, mm_dir, mode="naive", seam_window=4)
    naive_logits = naive.prefill(naive.parse_request(obj)).logits
    assert (cold.logits - ref).abs().mean() < (naive_logits - ref).abs().mean()

    # entries hold a scalar T per head, S, no conv tail, and K/V: as large as the config predicts
    entry, hit = pic.get_or_build_entry(obj["segments"][1])
    assert hit and entry.nbytes == expected_entry_nbytes(mm.cfg, entry.data.num_tokens, mm.dtype)
    h, d = mm.cfg.num_attention_heads, mm.cfg.head_dim
    assert sorted(entry.data.linear) == mm.cfg.linear_layers
    for span in entry.data.linear.values():
        assert span.T.shape == (1, h) and span.S.shape == (1, h, d, d) and span.conv_tail.numel() == 0

    # a seam window covering whole segments leaves nothing to reuse: exactly full
    whole = _engine(mm, mm_dir, mode="pic", seam_window=16)
    assert (whole.prefill(whole.parse_request(obj)).logits - ref).abs().max().item() <= 1e-4
    res = LLM(pic).generate(obj)
    assert len(res.output_ids) == 3


def test_single_segment_entry_is_exact(mm, mm_dir):
    """One cached segment after an empty prefix with w = 0: its (T, S) fold equals running it live."""
    obj = dict(_request())
    obj["segments"] = obj["segments"][:1]
    full = _engine(mm, mm_dir, mode="full")
    pic = _engine(mm, mm_dir, mode="pic", seam_window=0)
    a = full.prefill(full.parse_request(obj)).logits
    b = pic.prefill(pic.parse_request(obj)).logits
    assert (a - b).abs().max().item() <= 1e-4


def test_cached_keys_are_rerotated_after_a_prefix(tmp_path):
    """With one softmax-attention layer the cached K/V depend on the segment's tokens only, so the
    entry reused after a prefix (K re-rotated to absolute positions) equals the full run."""
    path = init_model_dir(
        "minimax",
        "tiny",
        tmp_path / "attn1",
        seed=2,
        std=0.3,
        overrides={"num_hidden_layers": 1, "layer_types": ["full_attention"]},
    )
    model = load_model(path)
    seg = _request()["segments"][0]
    obj = {"segments": [[1, 2, 3, 4, 5], seg], "suffix": [7, 8], "sampling_params": {"max_new_tokens": 1}}
    full = _engine(model, path, mode="full")
    pic = _engine(model, path, mode="pic", seam_window=0)
    pic.get_or_build_entry(seg)
    res = pic.prefill(pic.parse_request(obj))
    ref = full.prefill(full.parse_request(obj)).logits
    assert res.stats.reused_tokens >= len(seg)
    assert (res.logits - ref).abs().max().item() <= 1e-4
    assert (ref - _reference_logits(path, torch.tensor([[1, 2, 3, 4, 5, *seg, 7, 8]]))[-1]).abs().max() <= 1e-4


def test_cli_model_init(tmp_path, capsys):
    out = tmp_path / "minimax"
    assert cli.main(["model", "init", "--arch", "minimax", "--preset", "tiny", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["arch"] == "minimax"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "minimax" and "full_attention" in cfg["layer_types"]
    assert load_model(out).cfg.model_type == "minimax"


def test_config_parsing_and_bad_configs(tmp_path):
    raw = hf_config("minimax", "tiny")
    # the original MiniMax-Text-01 config lists layer kinds as attn_type_list (1 = softmax)
    legacy = {k: v for k, v in raw.items() if k != "layer_types"}
    cfg = config_from_dict(dict(legacy, attn_type_list=[0, 1, 0, 0]))
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    # without either list, transformers' default (softmax attention in even layers)
    theirs = HFMiniMaxConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    assert list(config_from_dict(legacy).layer_types) == theirs.layer_types
    assert config_from_dict(raw).mlp_alpha_factor == theirs.mlp_alpha_factor == 0.8
    # the remote-code checkpoint's names of the residual factors
    remote = {k: v for k, v in raw.items() if not k.endswith("_factor")}
    remote.update(layernorm_linear_attention_alpha=3.5, layernorm_mlp_beta=0.5, postnorm=True)
    parsed = config_from_dict(remote)
    assert (parsed.linear_attn_alpha_factor, parsed.mlp_beta_factor, parsed.mlp_alpha_factor) == (3.5, 0.5, 1.0)
    with pytest.raises(ModelConfigError, match="postnorm"):
        config_from_dict(dict(remote, postnorm=False))
    with pytest.raises(ModelConfigError, match="partial RoPE"):
        config_from_dict(dict(raw, rotary_dim=8))
    with pytest.raises(ModelConfigError, match="sliding_window"):
        config_from_dict(dict(raw, sliding_window=8))
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        config_from_dict(dict(raw, num_experts_per_tok=5))
    bad = init_model_dir("minimax", "tiny", tmp_path / "bad", seed=0)
    (bad / "config.json").write_text(json.dumps(dict(raw, hidden_act="gelu")))
    with pytest.raises(ModelLoadError, match="hidden_act"):
        load_model(bad)


def test_real_shape_entry_size():
    """MiniMax-Text-01 shape: 70 lightning layers (scalar T + 128 x 128 S per head) and 10 softmax layers."""
    cfg = config_from_dict(hf_config("minimax", "minimax-text-01"))
    assert len(cfg.linear_layers) == 70 and cfg.attention_layers == list(range(7, 80, 8))
    per_linear = 4 * 64 * (1 + 128 * 128)
    per_token_attn = 2 * 2 * 8 * 128
    assert cfg.entry_nbytes(1024, torch.bfloat16) == 70 * per_linear + 10 * per_token_attn * 1024


@pytest.mark.parametrize("policy", ["checkpoint", "exact_replay"])
def test_prefix_cache_hit_equals_full(mm, mm_dir, policy):
    """A second turn that extends the first hits the page tree (lightning states restored from a
    dense checkpoint or replayed exactly) and gives full's logits."""
    g = torch.Generator().manual_seed(8)
    first = {"segments": [torch.randint(0, 256, (150,), generator=g).tolist()], "suffix": [5, 6]}
    second = dict(first, suffix=[5, 6, 40, 41, 42])
    eng = _engine(mm, mm_dir, mode="prefix", prefix_policy=policy, checkpoint_every=1)
    LLM(eng).generate(dict(first, sampling_params={"max_new_tokens": 1}))
    hit = eng.prefill(eng.parse_request(second))
    full = _engine(mm, mm_dir, mode="full")
    assert hit.stats.prefix_reused_tokens >= 128
    assert (hit.logits - full.prefill(full.parse_request(second)).logits).abs().max().item() <= 1e-4


def test_single_state_policy(mm, mm_dir):
    """Single state (T = 0) on a scalar-T family: same entry size, cold = warm, and a different
    answer from exact composition once a prefix carries state."""
    tok = Tokenizer.from_dir(mm_dir)
    obj = _request()

    def engine(single):
        store = MemoryEntryStore(1 << 30)
        return Engine(mm, tok, EngineConfig(mode="pic", seam_window=4), SingleStateStore(store) if single else store)

    single, exact = engine(True), engine(False)
    cold = single.prefill(single.parse_request(obj)).logits
    warm = single.prefill(single.parse_request(obj)).logits
    assert (cold - warm).abs().max().item() <= 1e-5
    assert (cold - exact.prefill(exact.parse_request(obj)).logits).abs().max().item() > 1e-3
    sizes = [e.get_or_build_entry(obj["segments"][1])[0].nbytes for e in (single, exact)]
    assert sizes[0] == sizes[1]
