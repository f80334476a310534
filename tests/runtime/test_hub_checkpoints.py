"""Checkpoints as the Hugging Face hub holds them load for every family the runtime serves.

Each tiny model is built with transformers' own classes and written by its `save_pretrained`
(which restores the hub's tensor names: `backbone.*`, `block_sparse_moe.experts.E.w1`,
`q_conv1d`, `model.language_model.*`, per-expert Qwen MoE tensors, ...), sharded or not, fp32 or
bf16, tied or untied embeddings, multimodal wrappers with their vision weights; the engine's
`full` logits and greedy outputs equal transformers'. `hybridcache model init` writes the same
names, a checkpoint that does not map is one error naming the first unknown and missing tensor.
"""

import json
from pathlib import Path

import pytest
import torch
from hf_models import FAMILIES, MULTIMODAL, hf_model, reference_model, save_checkpoint
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.loader import ModelLoadError, load_model
from hybridcache.services.runtime.modelzoo import hf_config, init_model_dir
from hybridcache.services.runtime.sequence import LiveRun
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

# kimi_linear's transformers forward is slow on CPU (~0.8 s at 256 tokens): shorter sequences
SEQ_LEN = {"kimi_linear": 21}
NEW_TOKENS = {"kimi_linear": 6}


def _names(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                t = h.get_slice(k)
                out[k] = (tuple(t.get_shape()), t.get_dtype())
    return out


def _ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


CASES = [(arch, torch.float32, False, True) for arch in FAMILIES] + [
    (arch, torch.bfloat16, True, False) for arch in FAMILIES
]


@pytest.mark.parametrize(
    "arch,dtype,tied,sharded",
    CASES,
    ids=[f"{a}-{str(d)[6:]}-{'tied' if t else 'untied'}-{'sharded' if s else 'one-file'}" for a, d, t, s in CASES],
)
def test_save_pretrained_checkpoint_loads(arch, dtype, tied, sharded, tmp_path):
    hf = hf_model(arch, tied, seed=11)
    path = save_checkpoint(hf, tmp_path / arch, dtype, sharded)
    names = _names(path)
    assert {d for _, d in names.values()} == {"F32" if dtype == torch.float32 else "BF16"}
    assert (path / "model.safetensors.index.json").is_file() == sharded
    if sharded:
        assert len(list(path.glob("*.safetensors"))) > 2
    # transformers ties these two families' LM heads to nothing and writes them whatever the config says
    assert ("lm_head.weight" in names) == (not tied or arch in ("kimi_linear", "nemotron_h"))
    if arch in MULTIMODAL:
        assert any(k.startswith("model.visual.") for k in names)
        assert any(k.startswith("model.language_model.") for k in names)

    ids = _ids(SEQ_LEN.get(arch, 48))
    # the reference reads the same file upcast to fp32, so bf16 weights compare exactly too
    ref_model = reference_model(arch, path)
    with torch.no_grad():
        ref = ref_model(ids).logits[0]
    model = load_model(path)
    ours, _ = model.forward_layout(model.empty_state(), [LiveRun(ids[0], 0)], logits_for="all")
    assert ref.abs().max().item() > 1e-2
    assert (ours - ref).abs().max().item() <= 1e-4
    if dtype == torch.bfloat16:
        assert load_model(path, dtype=torch.bfloat16).dtype == torch.bfloat16
        return

    n_new = NEW_TOKENS.get(arch, 12)
    prompt = ids[:, :16]
    with torch.no_grad():
        expect = ref_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new, do_sample=False, eos_token_id=None
        )[0, 16:].tolist()
    engine = Engine.from_dir(path, config=EngineConfig(mode="full"))
    res = LLM(engine).generate(
        {"suffix": prompt[0].tolist(), "sampling_params": {"max_new_tokens": n_new, "ignore_eos": True}}
    )
    assert len(expect) == n_new and res.output_ids == expect


def _comparable(arch: str, names: dict) -> dict:
    # transformers' save_pretrained splits a fused olmo_hybrid conv1d into three equal parts,
    # not at the q/k/v sizes the hub's checkpoints (and `model init`) use: compare names only there
    out = {k: s for k, (s, _) in names.items() if not k.startswith("model.visual.")}
    if arch == "olmo_hybrid":
        out = {k: (None if "_conv1d" in k else s) for k, s in out.items()}
    return out


@pytest.mark.parametrize("arch", FAMILIES)
def test_model_init_writes_hub_names(arch, tmp_path):
    """`model init` writes what save_pretrained writes for the same config; transformers loads it
    with no missing or unexpected tensor and computes what the runtime computes."""
    ours = init_model_dir(arch, "tiny", tmp_path / "ours", seed=2, std=0.08)
    theirs = save_checkpoint(hf_model(arch, tied=False, seed=2), tmp_path / "theirs", torch.float32, sharded=False)
    assert _comparable(arch, _names(ours)) == _comparable(arch, _names(theirs))
    if arch in MULTIMODAL:
        return  # the text model's causal-LM class loads it: checked by the names above
    hf, info = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = _ids(SEQ_LEN.get(arch, 24), seed=5)
    model = load_model(ours)
    with torch.no_grad():
        ref = hf.eval()(ids).logits[0]
    got, _ = model.forward_layout(model.empty_state(), [LiveRun(ids[0], 0)], logits_for="all")
    assert (got - ref).abs().max().item() <= 1e-4


def test_olmo_hybrid_conv_parts_keep_their_sizes(tmp_path):
    """The hub's q/k/v convolutions have the key, key and value widths; they concatenate in order."""
    path = init_model_dir("olmo_hybrid", "tiny", tmp_path / "m", seed=3)
    names = _names(path)
    cfg = hf_config("olmo_hybrid", "tiny")
    key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    assert [names[f"model.layers.0.linear_attn.{p}_conv1d.weight"][0][0] for p in "qkv"] == [key, key, value]
    weights = load_file(str(path / "model.safetensors"))
    model = load_model(path)
    fused = model.layers[0].linear_attn.conv1d.weight
    parts = [weights[f"model.layers.0.linear_attn.{p}_conv1d.weight"] for p in "qkv"]
    assert torch.equal(fused, torch.cat(parts))


def test_unmappable_checkpoint_names_first_unknown_and_missing(tmp_path):
    path = init_model_dir("nemotron_h", "tiny", tmp_path / "m", seed=0)
    weights = load_file(str(path / "model.safetensors"))
    weights["backbone.layers.0.mixer.D_renamed"] = weights.pop("backbone.layers.0.mixer.D")
    weights["backbone.layers.9.extra.weight"] = weights["backbone.norm_f.weight"].clone()
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    msg = str(err.value)
    assert "2 tensor(s) it cannot map, the first 'backbone.layers.0.mixer.D_renamed'" in msg
    assert "1 missing tensor(s), the first 'model.layers.0.mixer.D'" in msg
    assert msg.count("\n") == 0


def test_incomplete_expert_and_conv_groups_are_named(tmp_path):
    path = init_model_dir("kimi_linear", "tiny", tmp_path / "m", seed=0)
    weights = load_file(str(path / "model.safetensors"))
    w = dict(weights)
    del w["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(w, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"expert\(s\) \[2\] under model.layers.1.mlp.experts"):
        load_model(path)
    w = dict(weights)
    del w["model.layers.0.self_attn.k_conv1d.weight"]
    save_file(w, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing model.layers.0.self_attn.k_conv1d.weight"):
        load_model(path)


def test_multimodal_tie_only_at_top_level(tmp_path):
    """text_config says untied (its default), the wrapper's config ties: the LM head is the embedding."""
    path = save_checkpoint(hf_model("qwen3_5", tied=True, seed=4), tmp_path / "m", torch.float32, sharded=False)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["text_config"].get("tie_word_embeddings") is False
    model = load_model(path)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_loading_builds_without_initialising_and_leaves_torch_init_as_it_was(tmp_path, monkeypatch):
    # the loader builds on the meta device with torch.nn.init's initialisers off (every weight
    # comes from the checkpoint); they are torch's own again afterwards, after a failed build too
    from hybridcache.services.runtime import loader

    inits = {name: getattr(torch.nn.init, name) for name in ("normal_", "uniform_", "kaiming_uniform_", "zeros_")}
    path = init_model_dir("qwen3_5_text", "tiny", tmp_path / "m", seed=0)
    model = load_model(path)
    weights = load_file(str(path / "model.safetensors"))
    state = model.state_dict()
    shared = [k for k in weights if k in state]
    assert len(shared) > len(weights) // 2 and all(torch.equal(state[k], weights[k]) for k in shared)
    assert {name: getattr(torch.nn.init, name) for name in inits} == inits

    def failing_build(cfg):
        assert torch.nn.init.normal_ is not inits["normal_"]  # off while building
        raise RuntimeError("build failed")

    monkeypatch.setattr(loader, "build_model", failing_build)
    with pytest.raises(RuntimeError, match="build failed"):
        load_model(path)
    assert {name: getattr(torch.nn.init, name) for name in inits} == inits
    w = torch.empty(64, 64)
    torch.nn.init.normal_(w)
    assert w.std() > 0.5
