"""Overlapped decoding (Scheduler with SchedulerConfig.overlap): each decode step is launched
before the host handles the one before it, the picks (greedy or sampled) fed to the next step on
the device. The answers are the ones given one by one, for every way a request can end (length,
stop id, stop string, cancellation, preemption), with sampled and logprobs requests in the mix,
and the page tree built from overlapped requests serves later prompts correctly."""

import pytest
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.scheduler import Scheduler, SchedulerConfig

# the requests and models of the scheduler's own tests (shared segments, page-tree hits, padding)
from test_scheduler import _engine, _requests, serve, tiny_dirs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory.mktemp("overlap_models"))


def _run(eng, reqs, **cfg):
    return serve(eng, reqs, overlap=True, **cfg)


def _same(ref, handles, events):
    for a, h, ev in zip(ref, handles, events):
        assert (h.output_ids, h.finish_reason) == (a.output_ids, a.finish_reason)
        assert [t for t, _ in ev if t >= 0] == a.output_ids and "".join(d for _, d in ev) == a.text


@pytest.mark.parametrize(("arch", "mode"), [("qwen3_5_text", "pic"), ("qwen3_5_text", "prefix"),
                                          ("nemotron_h", "prefix"), ("olmo_hybrid", "pic")])
def test_overlapped_greedy_equals_one_by_one(arch, mode, dirs):
    reqs = _requests(5, max_new=(12, 5, 9, 16, 3))
    ref = [LLM(_engine(dirs(arch), mode=mode)).generate(r) for r in reqs]
    # a stop id and a stop string from the middle of two requests' own outputs: they end a step
    # after the step that was launched with them
    reqs[1]["sampling_params"].update(ignore_eos=False, stop_token_ids=[ref[1].output_ids[2]])
    text = ref[3].text
    for at in range(len(text) // 2, len(text) - 3):  # a 3-character string a one-by-one run stops at
        reqs[3]["sampling_params"].update(stop=[text[at:at + 3]])
        if LLM(_engine(dirs(arch), mode=mode)).generate(reqs[3]).finish_reason == "stop":
            break
    ref = [LLM(_engine(dirs(arch), mode=mode)).generate(r) for r in reqs]
    assert ref[1].finish_reason == ref[3].finish_reason == "stop"
    eng = _engine(dirs(arch), mode=mode)
    sched, handles, events = _run(eng, reqs, max_num_seqs=4, max_num_batched_tokens=64)
    _same(ref, handles, events)
    assert sched.overlapped_steps >= 5 and max(sched.batch_sizes) >= 3
    assert sched._launched is None or all(s.handle.done.is_set() for s in sched._launched.batch)
    assert sched._kv_reserved == 0 and sorted(sched.pool.free) == list(range(4))
    kv = sched.pool.kv
    assert len(kv.free) == kv.num_pages - 1


def test_pages_of_overlapped_requests_serve_later_prompts(qwen35_dir):
    """A request that stopped on a token ran one step more (its K/V and state went a token
    further): the pages it leaves in the tree hold exactly the tokens they say, so a later prompt
    made of its prompt and output reuses them and answers as a fresh engine does."""
    base = {"system": list(range(10, 90)), "segments": [], "suffix": list(range(100, 150)),
            "sampling_params": {"max_new_tokens": 220, "ignore_eos": True}}
    free = LLM(_engine(qwen35_dir, mode="prefix")).generate(base)
    out = free.output_ids
    stop = next(t for i, t in enumerate(out) if i >= 140 and t not in out[:i])  # ends past 4 pages of 64
    first = dict(base, sampling_params={"max_new_tokens": 220, "ignore_eos": False, "stop_token_ids": [stop]})
    eng = _engine(qwen35_dir, mode="prefix")
    _, handles, _ = _run(eng, [first], max_num_seqs=2)
    done = handles[0]
    assert done.finish_reason == "stop" and done.output_ids == free.output_ids[:free.output_ids.index(stop)]
    later = {"system": base["system"], "segments": [], "suffix": base["suffix"] + done.output_ids + [stop] + [7, 8],
             "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    want = LLM(_engine(qwen35_dir, mode="prefix")).generate(later)
    _, handles, events = _run(eng, [later], max_num_seqs=2)
    _same([want], handles, events)
    # the prompt and the first request's output up to its last whole page came from pages
    assert handles[0].prefill.stats.cached_tokens >= 256


def test_logprobs_requests_step_without_overlap(qwen35_dir):
    """A request asking for logprobs joining the running ones makes those steps synchronous (its
    logprobs are read from the logits on the host); a seeded sampled one does not. The answers
    stay those given one by one, seeds included."""
    reqs = _requests(4, seed=5, max_new=(40, 14, 18, 9))  # request 0 runs on alone, greedy, for ~20 steps
    reqs[2]["sampling_params"].update(temperature=0.9, top_k=20, seed=3)
    reqs[3]["sampling_params"].update(logprobs=2)
    ref = [LLM(_engine(qwen35_dir, mode="pic")).generate(r) for r in reqs]
    eng = _engine(qwen35_dir, mode="pic")
    sched, handles, events = _run(eng, reqs, max_num_seqs=4)
    _same(ref, handles, events)
    # batched rows round differently from one-by-one ones (fp32): the same ids, values within 1e-4
    assert len(handles[3].logprobs) == len(ref[3].logprobs) == 9
    for (lp, top), (want, want_top) in zip(handles[3].logprobs, ref[3].logprobs):
        assert [i for i, _ in top] == [i for i, _ in want_top]
        assert abs(lp - want) < 1e-4 and all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(top, want_top))
    assert sched.overlapped_steps >= 10  # overlapped once the logprobs request had ended
    assert sum(sched.batch_sizes.values()) > sched.overlapped_steps


def test_sampled_requests_take_overlapped_steps(qwen35_dir):
    """Requests sampling on the device (temperature, top-p, top-k, min-p; seeded) decode in
    overlapped steps, their picks fed to the next step on the device, and give the tokens their
    seeds give one by one."""
    reqs = _requests(4, seed=7, max_new=(16, 12, 14, 10))
    settings = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0, top_k=20),
                dict(temperature=0.6, min_p=0.05), dict(temperature=1.2, top_p=0.9, top_k=50)]
    for i, (r, sp) in enumerate(zip(reqs, settings)):
        r["sampling_params"].update(sp, seed=11 + i)
    ref = [LLM(_engine(qwen35_dir, mode="pic")).generate(r) for r in reqs]
    eng = _engine(qwen35_dir, mode="pic")
    sched, handles, events = _run(eng, reqs, max_num_seqs=4)
    _same(ref, handles, events)
    greedy = [LLM(_engine(qwen35_dir, mode="pic")).generate(dict(r, sampling_params=dict(r["sampling_params"],
                                                                                     temperature=0.0)))
              for r in reqs]
    assert any(h.output_ids != g.output_ids for h, g in zip(handles, greedy))  # they did sample
    steps = sum(sched.batch_sizes.values())
    assert sched.overlapped_steps >= steps - 2 and steps >= 10


def test_cancel_and_preempt_while_overlapped(qwen35_dir):
    reqs = _requests(5, seed=3, max_new=(30, 17, 41, 24, 9))
    ref = [LLM(_engine(qwen35_dir, mode="prefix")).generate(r) for r in reqs]
    eng = _engine(qwen35_dir, mode="prefix")
    longest = max(len(eng.parse_request(r).prompt_ids) for r in reqs)
    empty = eng.model.empty_state()
    per_token = sum((a.k.shape[1] * a.k.shape[3] + a.v.shape[1] * a.v.shape[3]) * a.k.element_size()
                    for a in empty.attn.values())
    preempted = []
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=4, kv_cache_bytes=int(2 * (longest + 4) * per_token),
                                           kv_chunk_tokens=4, overlap=True),
                      on_preempt=lambda h: preempted.append(len(h.output_ids)))
    try:
        handles = [sched.add_request(eng.parse_request(r)) for r in reqs]
        cut = []
        for tok, _ in handles[0]:  # the client goes away after 5 tokens
            cut.append(tok)
            if len(cut) == 5:
                break
        streamed = [list(h) for h in handles[1:]]
    finally:
        sched.stop()
    assert handles[0].finish_reason == "abort" and cut == ref[0].output_ids[:5]
    _same(ref[1:], handles[1:], streamed)
    assert sched.preemptions == len(preempted) >= 1 and sched.overlapped_steps >= 5
    assert sched._kv_reserved == 0 and sorted(sched.pool.free) == list(range(4))


def test_overlap_follows_the_config_and_the_runner(qwen35_dir):
    from hybridcache.services.config import RuntimeConfig
    from hybridcache.services.runtime.scheduler import scheduler_config

    assert scheduler_config(RuntimeConfig(), "cuda").overlap
    assert not scheduler_config(RuntimeConfig(decode_overlap=False), "cuda").overlap
    assert not scheduler_config(RuntimeConfig(), "cpu").overlap
    # a runner that cannot overlap its steps (a split model's: the picks would stay on rank 0's GPU,
    # ModelRunner.__init__) turns it off whatever the config asks
    eng = _engine(qwen35_dir, mode="pic")
    assert eng.runner.overlaps
    asked = SchedulerConfig(overlap=True)
    for overlaps in (True, False):
        eng.runner.overlaps = overlaps
        sched = Scheduler(eng, asked)
        try:
            assert sched.config.overlap is overlaps
        finally:
            sched.stop()
