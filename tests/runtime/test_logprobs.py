"""Log-probabilities of generated tokens: what the model's own distribution gives at each step
(log-softmax of a full forward over prompt and output), with the top alternatives, from the
engine and from the scheduler's batched decode alike."""

import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.scheduler import Scheduler, SchedulerConfig
from hybridcache.services.runtime.sequence import LiveRun


def _reference(engine, prompt, output):
    """log p of every output token and the sorted top ids, from one forward over prompt + output."""
    ids = torch.tensor(prompt + output)
    logits, _ = engine.model.forward_layout(engine.model.empty_state(), [LiveRun(ids, 0)], logits_for="all")
    lp = torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    return lp


def test_logprobs_are_the_models_and_the_scheduler_agrees(qwen35_dir):
    engine = Engine.from_dir(qwen35_dir, config=EngineConfig(mode="full"))
    prompt = list(range(60, 90))
    greedy = {"suffix": prompt, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "logprobs": 3}}
    res = LLM(engine).generate(greedy)
    assert len(res.logprobs) == len(res.output_ids) == 6
    ref = _reference(engine, prompt, res.output_ids)
    for n, (tok, (lp, top)) in enumerate(zip(res.output_ids, res.logprobs)):
        assert abs(lp - ref[n, tok].item()) <= 1e-4
        values, ids = torch.topk(ref[n], 3)
        assert [i for i, _ in top] == ids.tolist() and top[0][0] == tok  # greedy: the chosen is the likeliest
        assert all(abs(v - w) <= 1e-4 for (_, v), w in zip(top, values.tolist()))
    # sampled tokens: still the model's log p (before temperature), 0 alternatives asked for
    sampled = dict(greedy, sampling_params={"max_new_tokens": 5, "ignore_eos": True, "logprobs": 0,
                                            "temperature": 1.5, "seed": 3})
    res2 = LLM(engine).generate(sampled)
    ref2 = _reference(engine, prompt, res2.output_ids)
    assert all(top == [] and abs(lp - ref2[n, t].item()) <= 1e-4
               for n, (t, (lp, top)) in enumerate(zip(res2.output_ids, res2.logprobs)))
    assert LLM(engine).generate(dict(greedy, sampling_params={"max_new_tokens": 2})).logprobs is None

    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=4))
    try:
        handles = [sched.add_request(engine.parse_request(r)) for r in (greedy, sampled, greedy)]
        out = [h.result() for h in handles]
    finally:
        sched.stop()
    for got, want in zip(out, (res, res2, res)):
        assert got.output_ids == want.output_ids
        assert all(abs(a[0] - b[0]) <= 1e-4 and [i for i, _ in a[1]] == [i for i, _ in b[1]]
                   for a, b in zip(got.logprobs, want.logprobs))
