"""Batched prefill of plain prompts (Engine.prefill_plain, Scheduler): prompts that run all live from
an empty state are prefilled together but for their last token, which runs in the next decode
step. The states equal a prefill's, every family; the answers equal those given one by one; the
pages they leave serve later prompts; what the batched pass cannot do (a prefix-cache checkpoint
inside the prompt, a page-tree hit, segments) goes the usual way."""

import pytest
import torch
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.scheduler import Scheduler, SchedulerConfig
from test_scheduler import FAMILIES, _engine, serve, tiny_dirs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory.mktemp("plain_models"))


def _prompts(seed, lengths=(5, 23, 40, 67, 101), max_new=(9, 4, 12, 7, 10)):
    gen = torch.Generator().manual_seed(seed)
    return [{"suffix": torch.randint(0, 250, (n,), generator=gen).tolist(),
             "sampling_params": {"max_new_tokens": m, "ignore_eos": True}} for n, m in zip(lengths, max_new)]


@pytest.mark.parametrize("arch", FAMILIES)
def test_state_equals_a_prefill_of_the_prompt(arch, dirs):
    eng = _engine(dirs(arch), mode="full")
    reqs = [eng.parse_request(r) for r in _prompts(1)]
    got = eng.prefill_plain(reqs)
    for req, pre in zip(reqs, got):
        ref = _engine(dirs(arch), mode="full").prefill(eng.parse_request({"suffix": req.prompt_ids[:-1]})).state
        assert pre.logits is None and pre.state.length == ref.length == len(req.prompt_ids) - 1
        for i, a in ref.linear.items():
            b = pre.state.linear[i]
            assert b.ssm.dtype == a.ssm.dtype and b.conv.dtype == a.conv.dtype
            assert a.ssm.abs().max().item() > 1e-3  # a state that says something
            assert torch.allclose(b.ssm, a.ssm, rtol=0, atol=1e-5) and b.conv.shape == a.conv.shape
            assert torch.allclose(b.conv, a.conv, rtol=0, atol=1e-5)  # minimax: no conv (empty tails)
        for i, a in ref.attn.items():
            b = pre.state.attn[i]
            assert b.k.shape == a.k.shape and b.v.shape == a.v.shape
            assert torch.allclose(b.k, a.k, rtol=0, atol=1e-5) and torch.allclose(b.v, a.v, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", FAMILIES)
def test_batched_plain_prompts_answer_as_one_by_one(arch, dirs):
    reqs = _prompts(2)
    ref = [LLM(_engine(dirs(arch), mode="prefix")).generate(r) for r in reqs]
    reqs[2]["sampling_params"].update(ignore_eos=False, stop_token_ids=[ref[2].output_ids[3]])
    reqs[4]["sampling_params"].update(temperature=0.9, top_k=20, seed=5)
    ref = [LLM(_engine(dirs(arch), mode="prefix")).generate(r) for r in reqs]
    eng = _engine(dirs(arch), mode="prefix")
    sched, handles, events = serve(eng, reqs, max_num_seqs=4, overlap=True)
    for a, h, ev in zip(ref, handles, events):
        assert (h.output_ids, h.finish_reason) == (a.output_ids, a.finish_reason)
        assert "".join(d for _, d in ev) == a.text
        assert h.prefill.stats.ttft_ms > 0
    assert sched.plain_prefilled == len(reqs)
    assert sched._kv_reserved == 0 and sorted(sched.pool.free) == list(range(4))


@pytest.mark.parametrize("mode", ["pic", "full"])
def test_modes_and_logprobs(qwen35_dir, mode):
    reqs = _prompts(3)
    reqs[1]["sampling_params"].update(logprobs=2)
    ref = [LLM(_engine(qwen35_dir, mode=mode)).generate(r) for r in reqs]
    sched, handles, _ = serve(_engine(qwen35_dir, mode=mode), reqs, max_num_seqs=3)
    assert [h.output_ids for h in handles] == [a.output_ids for a in ref]
    assert sched.plain_prefilled == len(reqs)
    for (lp, top), (want, want_top) in zip(handles[1].logprobs, ref[1].logprobs):
        assert [i for i, _ in top] == [i for i, _ in want_top] and abs(lp - want) < 1e-4


def test_pages_serve_later_prompts_and_what_cannot_be_batched_runs_as_before(qwen35_dir):
    gen = torch.Generator().manual_seed(4)
    first = {"suffix": torch.randint(0, 250, (150,), generator=gen).tolist(),
             "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    eng = _engine(qwen35_dir, mode="prefix")
    sched, handles, _ = serve(eng, [first], max_num_seqs=2)
    assert sched.plain_prefilled == 1
    # the same prompt and more: a page-tree hit (128 tokens from the first one's pages), not batched
    later = {"suffix": first["suffix"] + handles[0].output_ids + [3, 4, 5],
             "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    # over a checkpoint interval (256 tokens): the batched pass has no state at 256, not batched
    long = {"suffix": torch.randint(0, 250, (300,), generator=gen).tolist(),
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    want = [LLM(_engine(qwen35_dir, mode="prefix")).generate(r) for r in (later, long)]
    sched, handles, _ = serve(eng, [later, long], max_num_seqs=2)
    assert [h.output_ids for h in handles] == [w.output_ids for w in want]
    assert sched.plain_prefilled == 0
    assert handles[0].prefill.stats.cached_tokens >= 128
    # a full-mode engine keeps no pages: the long prompt is batched there
    full = _engine(qwen35_dir, mode="full")
    assert full.plain_prefill_ok(full.parse_request(long))
    assert not _engine(qwen35_dir, mode="prefix", batch_plain_prefills=False).plain_prefill_ok(
        full.parse_request(first))


def test_bf16_logits_close(dirs):
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.tokenizer import Tokenizer

    path = dirs("qwen3_5_text")
    eng = Engine(load_model(path, "cpu", torch.bfloat16), Tokenizer.from_dir(path), EngineConfig(mode="full"))
    req = eng.parse_request(_prompts(6)[3])
    pre = eng.prefill_plain([req])[0]
    ref = eng.prefill(req)
    pool = eng.new_state_pool(1, 256)
    slot = pool.assign(pre.state)
    logits = eng.decode_batch([pre], [req.prompt_ids[-1]], pool, [slot])[0]
    assert logits.argmax().item() == ref.logits.argmax().item()
    assert (logits - ref.logits).abs().max().item() <= 0.05 * ref.logits.abs().max().item()


def test_prompts_sharing_a_page_arriving_together_reuse_it(qwen35_dir):
    """Two prompts with the same first 100 tokens admitted in one step: the first is batched, the
    second (it shares a page with it) runs its own prefill, from the first one's page."""
    gen = torch.Generator().manual_seed(8)
    head = torch.randint(0, 250, (100,), generator=gen).tolist()
    reqs = [{"suffix": head + torch.randint(0, 250, (k,), generator=gen).tolist(),
             "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}} for k in (7, 12)]
    want = [LLM(_engine(qwen35_dir, mode="prefix")).generate(r) for r in reqs]
    eng = _engine(qwen35_dir, mode="prefix")
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=2))
    try:
        parsed = [eng.parse_request(r) for r in reqs]
        with sched._cv:  # both queued before the scheduler admits either (its condition's lock is re-entrant)
            handles = [sched.add_request(r) for r in parsed]
        out = [h.result() for h in handles]
    finally:
        sched.stop()
    assert [o.output_ids for o in out] == [w.output_ids for w in want]
    assert sched.plain_prefilled == 1 and out[1].stats.cached_tokens >= 64
