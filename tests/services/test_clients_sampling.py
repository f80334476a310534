"""Sampling fields standard clients send, implemented as vLLM implements them: repetition,
frequency and presence penalties and min_tokens on the logits of each request before its token is
picked (LogitsAdjuster, in the scheduler's sampling path), checked against a hand-computed
reference; ignore_eos; and their names on the OpenAI and SGLang requests."""

from __future__ import annotations

import math

import pytest
import torch
from hybridcache.services.api.openai_compat import chat_to_native, completion_to_native, sglang_to_native
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.modelzoo import SHIPPED_MODEL
from hybridcache.services.runtime.sampling import LogitsAdjuster, RequestError, SamplingParams
from hybridcache.services.runtime.scheduler import Scheduler, SchedulerConfig
from hybridcache.services.runtime.sequence import LiveRun


def _by_hand(logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float, pres: float):
    """vLLM's apply_penalties written out one token at a time."""
    out = []
    for t, x in enumerate(logits):
        if t in prompt or t in output:
            x = x / rep if x > 0 else x * rep
        count = output.count(t)
        x -= freq * count
        x -= pres * (1.0 if count else 0.0)
        out.append(x)
    return out


def test_penalties_equal_the_hand_computed_reference():
    logits = [2.0, -1.0, 0.5, 3.0, -0.25, 0.0, 1.5]
    prompt, outputs = [1, 2, 2], [[], [3], [3, 3, 5], [3, 3, 5, 0]]
    params = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.3)
    adjust = LogitsAdjuster(params, prompt)
    for output in outputs:  # one adjuster across steps, as a request keeps it
        got = adjust(torch.tensor(logits), output).tolist()
        want = _by_hand(logits, prompt, output, 1.7, 0.4, 0.3)
        assert got == pytest.approx(want, abs=1e-6), output
    # the logits given are not changed in place
    t = torch.tensor(logits)
    LogitsAdjuster(params, prompt)(t, [0])
    assert t.tolist() == logits


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_new_tokens=2, stop_token_ids=(4,))
    adjust = LogitsAdjuster(params, [1], eos_ids={6})
    logits = torch.zeros(8)
    for n, masked in ((0, True), (1, True), (2, False)):
        got = adjust(logits, [0] * n)
        assert (math.isinf(got[4]) and math.isinf(got[6])) == masked and not math.isinf(got[0])
    # ignore_eos: eos is no stop, so not masked either
    got = LogitsAdjuster(SamplingParams(min_new_tokens=2, ignore_eos=True), [1], eos_ids={6})(logits, [])
    assert not math.isinf(got[6])


def _reference_decode(engine, prompt: list[int], n: int, rep: float, freq: float, pres: float) -> list[int]:
    """Greedy tokens with the penalties applied by hand to a full forward's logits at every step."""
    output: list[int] = []
    for _ in range(n):
        ids = torch.tensor(prompt + output)
        logits, _ = engine.model.forward_layout(engine.model.empty_state(), [LiveRun(ids, 0)], logits_for="last")
        adjusted = _by_hand(logits.float().tolist(), prompt, output, rep, freq, pres)
        output.append(max(range(len(adjusted)), key=adjusted.__getitem__))
    return output


def test_scheduler_applies_penalties_per_request():
    # the shipped QA model repeats its prompt's words after an answer, so penalties change its output
    engine = Engine.from_dir(SHIPPED_MODEL, config=EngineConfig(mode="full"))
    prompt = engine.tokenizer.encode("Document: Mardra Lora\nMardra Lora lives in Corvale. Mardra Lora plays the "
                                     "harp.\n\nQuestion: Where does Mardra Lora live?\nAnswer:")
    plain = {"suffix": prompt, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    penalized = {"suffix": prompt, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True,
                                                       "repetition_penalty": 1.3, "frequency_penalty": 0.5,
                                                       "presence_penalty": 0.5}}
    want = _reference_decode(engine, prompt, 8, 1.3, 0.5, 0.5)
    unpenalized = LLM(engine).generate(plain).output_ids
    assert want != unpenalized  # the penalties change this output: the comparison below can fail
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=4))
    try:
        # one batch: a penalized request beside plain ones, each with its own logits
        handles = [sched.add_request(engine.parse_request(r)) for r in (plain, penalized, plain)]
        out = [h.result().output_ids for h in handles]
    finally:
        sched.stop()
    assert out == [unpenalized, want, unpenalized]
    assert LLM(engine).generate(penalized).output_ids == want  # alone in a scheduler too


def test_min_tokens_holds_off_eos_in_the_scheduler(qwen35_dir):
    engine = Engine.from_dir(qwen35_dir, config=EngineConfig(mode="full"))
    prompt = [80, 81, 82, 83]
    free = LLM(engine).generate({"suffix": prompt, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
    first = free.output_ids[0]
    # the first greedy token as a stop id: without min_tokens the request stops at once
    stop = {"suffix": prompt, "sampling_params": {"max_new_tokens": 6, "stop_token_ids": [first]}}
    held = {"suffix": prompt, "sampling_params": {"max_new_tokens": 6, "stop_token_ids": [first],
                                                  "min_new_tokens": 3}}
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=2))
    try:
        got_stop, got_held = (sched.add_request(engine.parse_request(r)).result() for r in (stop, held))
    finally:
        sched.stop()
    assert got_stop.output_ids == [] and got_stop.finish_reason == "stop"
    assert len(got_held.output_ids) >= 3 and first not in got_held.output_ids[:3]


def test_openai_and_sglang_fields_map_onto_sampling_params():
    body = {"messages": [{"role": "user", "content": "q"}], "ignore_eos": True, "min_tokens": 4,
            "repetition_penalty": 1.0, "frequency_penalty": 0.5, "presence_penalty": -0.5}
    sp = chat_to_native(body)["sampling_params"]
    assert sp == {"ignore_eos": True, "min_new_tokens": 4, "repetition_penalty": 1.0, "frequency_penalty": 0.5,
                  "presence_penalty": -0.5}
    assert completion_to_native({"prompt": "q", "min_tokens": 2})["sampling_params"] == {"min_new_tokens": 2}
    gen = sglang_to_native({"text": "q", "return_routed_experts": False, "sampling_params": {
        "min_new_tokens": 2, "repetition_penalty": 1.2, "ignore_eos": True}})
    assert gen["sampling_params"] == {"min_new_tokens": 2, "repetition_penalty": 1.2, "ignore_eos": True}
    # refusals name the field the client sent
    for bad, field in (({"min_tokens": -1}, "min_tokens"), ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"presence_penalty": 3}, "presence_penalty"), ({"ignore_eos": "yes"}, "ignore_eos")):
        with pytest.raises(RequestError, match=f"^{field}"):
            chat_to_native(dict(body, **bad))
    with pytest.raises(RequestError, match="^return_routed_experts"):
        sglang_to_native({"text": "q", "return_routed_experts": True})
