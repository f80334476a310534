"""Several completions from one request, as standard clients ask for them: a completions prompt list
(one choice per prompt), n > 1 (chat, completions, SGLang's sampling_params.n), best_of (the n
likeliest of best_of candidates), SGLang's batched text; refusals name the field the client sent."""

from __future__ import annotations

import json

import pytest
from serving_helpers import http
from test_clients_load_generators import sse

PROMPTS = ["The Osk river runs to the sea past Lowmere and", "Ilse Marrow designed two lighthouses and"]


def _one(url, prompt, **kw):
    status, res = http("POST", f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 5, **kw})
    assert status == 200, res
    return res


def test_completions_prompt_list_gives_a_choice_per_prompt(clients_cluster):
    url = clients_cluster.url
    res = _one(url, PROMPTS, temperature=0)
    assert [c["index"] for c in res["choices"]] == [0, 1]
    alone = [_one(url, p, temperature=0) for p in PROMPTS]
    assert [c["text"] for c in res["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert res["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert res["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    assert isinstance(res["hybridcache"], list) and len(res["hybridcache"]) == 2
    # token-id prompts, and a list of them
    ids = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100]]
    assert len(_one(url, ids)["choices"]) == 2 and len(_one(url, ids[0])["choices"]) == 1


def test_n_copies_are_samples_of_their_own_and_stream_by_index(clients_cluster):
    url = clients_cluster.url
    res = _one(url, PROMPTS[0], n=3, temperature=1.0, seed=11, ignore_eos=True)
    texts = [c["text"] for c in res["choices"]]
    assert [c["index"] for c in res["choices"]] == [0, 1, 2] and len(set(texts)) > 1
    # the prompt counted once, the tokens of all three
    assert res["usage"]["prompt_tokens"] == _one(url, PROMPTS[0])["usage"]["prompt_tokens"]
    assert res["usage"]["completion_tokens"] == 15
    # copy 0 is the request itself; seeded, the copies are reproducible
    assert texts[0] == _one(url, PROMPTS[0], temperature=1.0, seed=11, ignore_eos=True)["choices"][0]["text"]
    again = _one(url, PROMPTS[0], n=3, temperature=1.0, seed=11, ignore_eos=True)
    assert texts == [c["text"] for c in again["choices"]]

    events = sse(f"{url}/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 5, "n": 3, "temperature": 1.0,
                                           "seed": 11, "stream": True, "ignore_eos": True})
    assert events[-1] == "[DONE]"
    streamed = {0: "", 1: "", 2: ""}
    for e in events[:-2]:
        for ch in e["choices"]:
            streamed[ch["index"]] += ch["text"]
    assert [streamed[i] for i in range(3)] == texts
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 15

    status, chat = http("POST", f"{url}/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 4, "n": 2, "temperature": 1.0,
        "seed": 3})
    assert status == 200 and [c["index"] for c in chat["choices"]] == [0, 1], chat


def test_best_of_returns_the_likeliest_candidates(clients_cluster):
    url = clients_cluster.url
    body = {"prompt": PROMPTS[1], "max_tokens": 5, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    # best_of's candidates are the n = best_of copies of the same request (same seeds)
    candidates = _one(url, body["prompt"], **{k: v for k, v in body.items() if k != "prompt"}, n=4, logprobs=0)
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"])
             for c in candidates["choices"]]
    order = sorted(range(4), key=lambda k: -means[k])
    best = _one(url, body["prompt"], **{k: v for k, v in body.items() if k != "prompt"}, best_of=4, n=2)
    assert [c["text"] for c in best["choices"]] == [candidates["choices"][k]["text"] for k in order[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])  # not asked for by the client
    assert best["usage"]["completion_tokens"] == 20  # every candidate's tokens


def test_sglang_batched_text_and_n(clients_cluster):
    url = clients_cluster.url
    sp = {"max_new_tokens": 4, "temperature": 0}
    status, res = http("POST", f"{url}/generate", {"text": PROMPTS, "sampling_params": sp})
    assert status == 200 and isinstance(res, list) and len(res) == 2, res
    for out, p in zip(res, PROMPTS):
        status, alone = http("POST", f"{url}/generate", {"text": p, "sampling_params": sp})
        assert out["text"] == alone["text"] and out["meta_info"]["prompt_tokens"] == alone["meta_info"]["prompt_tokens"]
    status, res = http("POST", f"{url}/generate", {"input_ids": [[72, 101, 108], [87, 111, 114]],
                                                   "sampling_params": dict(sp, n=2)})
    assert status == 200 and len(res) == 4 and res[0]["output_ids"] == res[1]["output_ids"]  # greedy copies
    events = sse(f"{url}/generate", {"text": PROMPTS, "sampling_params": sp, "stream": True})
    last = {}
    for e in events[:-1]:
        last[e["index"]] = e
    assert sorted(last) == [0, 1] and all(e["meta_info"]["finish_reason"] for e in last.values())


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of must be >= n"),
    ({"prompt": "x", "best_of": 2, "stream": True}, "best_of > n cannot be streamed"),
    ({"prompt": []}, "prompt must be"),
    ({"prompt": [[1, 2], []]}, "prompt[1] must be"),
    ({"prompt": [5, 999999]}, "prompt has token id 999999"),
    ({"prompt": "x", "n": 0}, "n must be >= 1"),
    ({"prompt": ["x"] * 40, "n": 2}, "at most 64"),
])
def test_refusals_name_the_field_sent(clients_cluster, body, message):
    status, res = http("POST", f"{clients_cluster.url}/v1/completions", dict(body, max_tokens=2))
    assert status == 400 and res["error"]["message"].startswith(message) or message in res["error"]["message"], res
    status, res = http("POST", f"{clients_cluster.url}/generate", {"input_ids": [5, 999999]})
    assert status == 400 and res["error"]["message"].startswith("input_ids has token id"), res
    assert json.dumps(res).count("suffix") == 0
