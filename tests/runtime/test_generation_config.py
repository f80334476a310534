"""generation_config.json is honoured: its eos ids stop generation, its sampling values are
defaults a request overrides, max_new_tokens defaults to the rest of the context, and the stats
count generated tokens and, as cached, only what came from caches filled before the request."""

import json
import shutil

import pytest
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.sampling import GenerationDefaults, RequestError


@pytest.fixture
def model_dir(qwen35_dir, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(qwen35_dir, out)
    return out


def _write(path, **cfg):
    (path / "generation_config.json").write_text(json.dumps(cfg))


def _greedy(engine, prompt, n):
    res = LLM(engine).generate({"suffix": prompt, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}})
    return res.output_ids


def test_every_eos_id_of_a_list_stops(model_dir):
    prompt = list(range(40, 60))
    free = _greedy(Engine.from_dir(model_dir), prompt, 6)
    # a token the model emits third that is not among the first two: an eos listed second
    stop = next(t for t in free[2:] if t not in free[:2])
    at = free.index(stop)
    _write(model_dir, eos_token_id=[300, stop])
    engine = Engine.from_dir(model_dir)
    assert {300, stop} <= engine.eos_ids
    res = LLM(engine).generate({"suffix": prompt, "sampling_params": {"max_new_tokens": 6}})
    assert res.output_ids == free[:at] and res.finish_reason == "stop"
    assert res.stats.generated_tokens == at + 1  # the eos token was generated too
    # ignore_eos still runs to max_new_tokens
    assert _greedy(engine, prompt, 6) == free


def test_sampling_values_are_defaults_a_request_overrides(model_dir):
    _write(model_dir, do_sample=True, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=7)
    engine = Engine.from_dir(model_dir)
    s = engine.parse_request({"suffix": "hi"}).sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.7, 0.9, 5, 7)
    s = engine.parse_request(
        {"suffix": "hi", "sampling_params": {"temperature": 0, "top_k": 2, "max_new_tokens": 3}}
    ).sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.0, 0.9, 2, 3)
    # null is "not given": the default holds
    assert engine.parse_request({"suffix": "hi", "sampling_params": {"temperature": None}}).sampling.temperature == 0.7


def test_do_sample_false_is_greedy():
    g = GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.6, "top_p": 0.95, "eos_token_id": 5})
    assert g.sampling_defaults() == {"temperature": 0.0} and g.eos_token_ids == (5,)
    assert GenerationDefaults.from_dict({}).sampling_defaults() == {}


def test_max_new_tokens_defaults_to_the_rest_of_the_context(model_dir):
    _write(model_dir, eos_token_id=256)
    engine = Engine.from_dir(model_dir)
    limit = engine.cfg.max_position_embeddings
    req = engine.parse_request({"suffix": list(range(30))})
    assert req.sampling.max_new_tokens == limit - 30
    capped = Engine(engine.model, engine.tokenizer, EngineConfig(max_model_len=100))
    assert capped.parse_request({"suffix": list(range(30))}).sampling.max_new_tokens == 70
    with pytest.raises(RequestError, match="leaves no room to generate within this server's max model length of 100"):
        capped.parse_request({"suffix": [1] * 100})


def test_cached_tokens_count_only_caches_filled_before(model_dir):
    engine = Engine.from_dir(model_dir, config=EngineConfig(mode="pic", seam_window=4))
    segs = [list(range(10 + i, 40 + i)) for i in range(3)]
    obj = {"segments": segs, "suffix": [7, 8, 9], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    cold = LLM(engine).generate(obj).stats
    assert cold.reused_tokens > 0 and cold.built_tokens > 0 and cold.cached_tokens == 0
    warm = LLM(engine).generate(obj).stats
    assert warm.built_tokens == 0 and warm.cached_tokens == warm.reused_tokens > 0
    assert cold.generated_tokens == warm.generated_tokens == 2


def test_only_the_config_files_end_tokens_end_generation(model_dir):
    """The tokenizer's chat markers (<|im_end|>, <|endoftext|>) end generation only where
    config.json or generation_config.json lists them, as in transformers and vLLM."""
    from hybridcache.services.runtime.models.registry import config_from_dir
    from hybridcache.services.runtime.plan import Planner
    from hybridcache.services.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    im_end = tok.token_id("<|im_end|>")
    assert im_end is not None
    cfg = config_from_dir(model_dir)
    _write(model_dir, eos_token_id=300)
    planner = Planner(cfg, tok, generation=GenerationDefaults.from_dir(model_dir))
    assert planner.eos_ids == frozenset(cfg.eos_token_ids) | {300}
    assert im_end not in planner.eos_ids
    _write(model_dir, eos_token_id=[300, im_end])
    assert im_end in Planner(cfg, tok, generation=GenerationDefaults.from_dir(model_dir)).eos_ids
