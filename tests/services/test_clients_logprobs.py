"""Input (prompt) log-probabilities: SGLang's logprob_start_len with return_logprob (and the
frontend's `select`, which needs them), OpenAI completions' echo with logprobs. They are the
model's own: the log-softmax of one forward over the whole prompt."""

from __future__ import annotations

import math

import pytest
import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.sequence import LiveRun
from serving_helpers import http

PROMPT = "Document: the Varnel Bridge spans the Osk river. It was built by Ilse Marrow.\nQuestion: who built it?"


def _reference(engine, ids: list[int]) -> torch.Tensor:
    """log p [len(ids) - 1, vocab] of tokens 1.. of ids, from one forward over them all."""
    logits, _ = engine.model.forward_layout(engine.model.empty_state(), [LiveRun(torch.tensor(ids), 0)],
                                            logits_for="all")
    return torch.log_softmax(logits.float(), -1)[:-1]


@pytest.mark.parametrize("start", [0, 1, 5])
def test_prompt_logprobs_are_the_models_chunk_by_chunk(qwen35_dir, start):
    engine = Engine.from_dir(qwen35_dir, config=EngineConfig(mode="pic"))
    ids = list(range(40, 83))
    ref = _reference(engine, ids)
    got = engine.prompt_logprobs(ids, start, top=3, chunk=7)  # several chunks, one boundary in the range
    assert len(got) == len(ids) - start
    if start == 0:
        assert math.isnan(got[0][0]) and got[0][1] == []
        got = got[1:]
    for pos, (lp, top) in zip(range(max(start, 1), len(ids)), got):
        assert abs(lp - ref[pos - 1, ids[pos]].item()) <= 1e-4
        values, top_ids = torch.topk(ref[pos - 1], 3)
        assert [i for i, _ in top] == top_ids.tolist()
        assert all(abs(v - w) <= 1e-4 for (_, v), w in zip(top, values.tolist()))


def test_sglang_input_logprobs_from_logprob_start_len(clients_cluster, engine):
    ids = engine.tokenizer.encode(PROMPT)
    status, res = http("POST", f"{clients_cluster.url}/generate", {
        "text": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True,
        "logprob_start_len": 3, "top_logprobs_num": 2, "return_text_in_logprobs": True})
    assert status == 200, res
    meta = res["meta_info"]
    ref = _reference(engine, ids)
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == ids[3:]
    assert all(abs(lp - ref[3 + j - 1, ids[3 + j]].item()) <= 1e-4 for j, (lp, _, _) in enumerate(inputs))
    assert [text for _, _, text in inputs] == [engine.tokenizer.tok.decode([t]) for t in ids[3:]]
    assert all(len(top) == 2 for top in meta["input_top_logprobs"])
    assert len(meta["output_token_logprobs"]) == 2
    # from 0: the prompt's first token has none
    status, res = http("POST", f"{clients_cluster.url}/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0})
    meta = res["meta_info"]
    assert status == 200 and meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert len(meta["input_token_logprobs"]) == len(ids)


def test_completions_echo_with_logprobs(clients_cluster, engine):
    ids = engine.tokenizer.encode(PROMPT)
    status, res = http("POST", f"{clients_cluster.url}/v1/completions", {
        "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1, "ignore_eos": True})
    assert status == 200, res
    choice = res["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _reference(engine, ids)
    assert all(abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) <= 1e-4 for p in range(1, len(ids)))
    # echo alone: the prompt text, no log-probabilities
    url = f"{clients_cluster.url}/v1/completions"
    status, res = http("POST", url, {"prompt": PROMPT, "max_tokens": 2, "echo": True})
    assert status == 200 and res["choices"][0]["text"].startswith(PROMPT) and res["choices"][0]["logprobs"] is None
    status, res = http("POST", url, {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 0, "stream": True})
    assert status == 400 and "echo with logprobs" in res["error"]["message"]


def test_sglang_frontend_select(clients_cluster, engine):
    sgl = pytest.importorskip("sglang", reason="sglang frontend not installed (pip install --no-deps sglang)")

    @sgl.function
    def pick(s):
        s += "Document: the Varnel Bridge was built by Ilse Marrow.\nQuestion: who built the bridge?\nAnswer:"
        s += sgl.select("answer", choices=[" Ilse Marrow", " the Osk river", " Tarn"])

    state = pick.run(backend=sgl.RuntimeEndpoint(clients_cluster.url))
    assert state["answer"] in (" Ilse Marrow", " the Osk river", " Tarn")
    meta = state.get_meta_info("answer")
    # the choice taken is the one with the highest mean log-probability of its tokens (the frontend's
    # default token-length-normalized method), over what the server returned for each choice
    norms = meta["normalized_prompt_logprobs"]
    assert state["answer"] == [" Ilse Marrow", " the Osk river", " Tarn"][max(range(3), key=norms.__getitem__)]
    assert all(math.isfinite(v) for v in norms)
