"""Decoding: greedy, seeded sampling, top-k/top-p, stop strings and stop ids."""

import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.sampling import SamplingParams, sample_token

REQ = {"segments": [list(range(30, 100))], "suffix": [7, 8, 9]}


def gen(engine, **sp):
    return engine.generate(dict(REQ, sampling_params=dict({"max_new_tokens": 12, "ignore_eos": True}, **sp)))


def test_seeded_sampling_is_reproducible(qwen35_dir):
    eng = Engine.from_dir(qwen35_dir, config=EngineConfig())
    a = gen(eng, temperature=1.0, seed=1).output_ids
    assert a == gen(eng, temperature=1.0, seed=1).output_ids
    others = {tuple(gen(eng, temperature=1.0, seed=s).output_ids) for s in range(2, 6)}
    assert len(others | {tuple(a)}) > 1
    assert gen(eng, temperature=1.0, top_k=1, seed=3).output_ids == gen(eng).output_ids


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0, 1.0])
    g = torch.Generator().manual_seed(0)
    picks = {sample_token(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert picks == {1, 2}
    picks = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.3), g) for _ in range(200)}
    assert picks == {1}


def test_stop_string_and_stop_ids(qwen35_dir):
    eng = Engine.from_dir(qwen35_dir, config=EngineConfig())
    base = gen(eng)
    assert base.finish_reason == "length" and len(base.output_ids) == 12
    # a stop string taken from the middle of the greedy text truncates there
    text = base.text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2] not in text[: i + 1])
    res = gen(eng, stop=[stop])
    assert res.finish_reason == "stop" and res.text == text[: text.index(stop)]
    res = gen(eng, stop_token_ids=[base.output_ids[3]])
    first = base.output_ids.index(base.output_ids[3])
    assert res.finish_reason == "stop" and res.output_ids == base.output_ids[:first]


def test_streamed_deltas_add_up_to_the_text(qwen35_dir):
    eng = Engine.from_dir(qwen35_dir, config=EngineConfig())
    req = eng.parse_request(dict(REQ, sampling_params={"max_new_tokens": 10, "ignore_eos": True}))
    g = eng.start(req)
    deltas = [d for _, d in g]
    assert "".join(deltas) == eng.tokenizer.decode(g.output_ids)
    assert g.prefill.stats.ttft_ms > 0
