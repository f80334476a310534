"""A burst of short prompts queued at once is admitted within the steps its tokens need under the
prefill budget (ceil(total / max_num_batched_tokens)), every one prefilled together with others
(Engine.prefill_plain) and no step past its budget, and the decode step after the last of them
runs them all in one batch (vLLM's and nano-vllm's admission: as many waiting requests as the
token budget allows, each step). A step whose plain prefills spent its budget runs no assembly
besides (one request's own forward a step, over the budget, is only for a step that did nothing
else)."""

import math

import pytest
import torch
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.scheduler import SchedulerConfig


@pytest.mark.parametrize("budget", [8192, 2048])
def test_a_burst_of_128_prompts_is_admitted_in_the_steps_its_tokens_need(qwen35_dir, budget):
    n, prompt = 128, 64
    llm = LLM.from_dir(qwen35_dir, scheduling=SchedulerConfig(max_num_seqs=n, max_waiting=n,
                                                              max_num_batched_tokens=budget))
    try:
        gen = torch.Generator().manual_seed(3)
        reqs = [llm.parse_request({"suffix": torch.randint(5, 250, (prompt,), generator=gen).tolist(),
                                   "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
                for _ in range(n)]
        sched = llm.scheduler
        with sched._cv:  # queued together: the scheduler's next step sees them all
            handles = [sched.add_request(r) for r in reqs]
        for h in handles:
            assert len(h.result().output_ids) == 6
        prefills = [(step, tokens, batch) for step, tokens, batch in sched.step_log if tokens]
        need = math.ceil(n * prompt / budget)
        assert sum(t for _, t, _ in prefills) == n * prompt
        assert all(t <= budget for _, t, _ in prefills), prefills  # no step past its budget
        assert len(prefills) == need, prefills
        # consecutive steps, the last of them decoding every request (none has ended yet)
        assert [s for s, _, _ in prefills] == list(range(prefills[0][0], prefills[0][0] + need))
        assert prefills[-1][2] == n
        assert sched.plain_prefilled == n
    finally:
        llm.close()
