"""Continuous batching (runtime/scheduler.py, LayoutLM.decode_batch): requests run concurrently give
the answers they give one by one, for every family; batched decode logits equal sequential ones;
admission, queue bound, cancellation and interleaving behave as a server needs; K/V is reserved as
sequences grow, and requests preempted for lack of it resume with the answers they would have given."""

import json
import shutil
import time

import pytest
import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.modelzoo import init_model_dir
from hybridcache.services.runtime.scheduler import KVBudgetError, QueueFull, Scheduler, SchedulerConfig
from hybridcache.services.runtime.sequence import LiveRun
from hybridcache.services.runtime.tokenizer import Tokenizer

FAMILIES = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "olmo_hybrid", "nemotron_h", "bamba", "kimi_linear",
            "minimax"]


def tiny_dirs(root):
    """arch -> the directory of a tiny random model of that family under root, made on first use."""
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = init_model_dir(arch, "tiny", root / arch, seed=1, std=0.08)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory.mktemp("sched_models"))


def _ids(gen, n):
    return torch.randint(0, 250, (n,), generator=gen).tolist()


def _requests(n, seed=0, max_new=(12, 5, 9, 16, 3)):
    """Requests with shared and own segments (cold builds batched across requests, entry reuse,
    prefix-page hits) and different lengths, so the batch has padding and changes as they finish."""
    gen = torch.Generator().manual_seed(seed)
    shared = _ids(gen, 40)
    sys_ids = _ids(gen, 70)  # over one 64-token page: the page tree holds it after the first request
    out = []
    for i in range(n):
        segs = [shared, _ids(gen, 20 + 7 * i)] if i % 2 == 0 else [_ids(gen, 30 + 3 * i), shared]
        out.append({"system": sys_ids if i % 3 == 0 else _ids(gen, 5 + i), "segments": segs,
                    "suffix": _ids(gen, 4 + i),
                    "sampling_params": {"max_new_tokens": max_new[i % len(max_new)], "ignore_eos": True}})
    return out


def serve(eng, reqs, **cfg):
    """Requests (dicts) through a Scheduler(eng, SchedulerConfig(**cfg)), all queued at once:
    (the scheduler, the handles, each handle's streamed events)."""
    sched = Scheduler(eng, SchedulerConfig(**cfg))
    try:
        handles = [sched.add_request(eng.parse_request(r)) for r in reqs]
        events = [list(h) for h in handles]
    finally:
        sched.stop()
    return sched, handles, events


def _engine(path, **cfg):
    return Engine(load_model(path), Tokenizer.from_dir(path), EngineConfig(**cfg))


@pytest.mark.parametrize("arch", FAMILIES)
def test_batched_decode_logits_equal_sequential(arch, dirs):
    """Decode steps of four requests in one pool (the scheduler's: linear states in slots, K/V in
    pages) equal each request's own one-token forward; the states copied out at the end too."""
    from hybridcache.services.runtime.runner import ModelRunner

    model = load_model(dirs(arch))
    runner = ModelRunner(model)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.tensor(_ids(gen, n)) for n in (5, 23, 11, 1)]
    seq, bat = [], []
    for p in prompts:
        for states in (seq, bat):
            s = model.empty_state()
            model.forward_layout(s, [LiveRun(p, 0)], logits_for="none")
            states.append(s)
    pool = runner.new_state_pool(len(bat), 256)
    slots = [pool.assign(s) for s in bat]
    for _ in range(3):
        toks = _ids(gen, len(prompts))
        ref = torch.stack(
            [model.forward_layout(s, [LiveRun(torch.tensor([t]), s.length)])[0] for s, t in zip(seq, toks)]
        )
        out, _ = runner.decode(pool, slots, toks)
        assert ref.abs().max().item() > 0.1
        assert (out - ref).abs().max().item() <= 1e-5
    for s, slot in zip(bat, slots):
        pool.release(slot, keep=s)
        s.length += 3
    for a, b in zip(seq, bat):
        assert a.length == b.length
        for i in a.linear:
            assert torch.allclose(a.linear[i].ssm, b.linear[i].ssm, atol=1e-5)
        for i in a.attn:
            assert torch.allclose(a.attn[i].k, b.attn[i].k, atol=1e-5)


@pytest.mark.parametrize("arch", FAMILIES)
def test_concurrent_greedy_equals_one_by_one(arch, dirs):
    n = 3 if arch == "kimi_linear" else 5
    reqs = _requests(n)
    one = _engine(dirs(arch))
    ref = [LLM(one).generate(r) for r in reqs]
    eng = _engine(dirs(arch))
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    try:
        handles = [sched.add_request(eng.parse_request(r)) for r in reqs]
        out = [h.result() for h in handles]
    finally:
        sched.stop()
    for a, b in zip(ref, out):
        assert b.output_ids == a.output_ids
        assert b.text == a.text and b.finish_reason == a.finish_reason
    assert [len(r.output_ids) for r in out] == [r["sampling_params"]["max_new_tokens"] for r in reqs]
    # several requests decoded in one step, and the batch changed as requests came and went
    assert max(sched.batch_sizes) >= max(2, n - 2) and len(sched.batch_sizes) >= 2
    assert sched.pool.free and sorted(sched.pool.free) == list(range(4))


def test_modes_sampling_and_stops_equal_one_by_one(qwen35_dir):
    reqs = _requests(4, seed=5)
    reqs[0]["sampling_params"].update(temperature=0.8, top_p=0.9, top_k=20, seed=7)
    reqs[1]["sampling_params"].update(temperature=1.3, seed=11)
    reqs[2]["sampling_params"].update(ignore_eos=False, stop_token_ids=[3, 17, 99])
    for mode in ("full", "prefix", "pic"):
        base = _engine(qwen35_dir, mode=mode)
        ref = [LLM(base).generate(r) for r in reqs]
        # a stop string from the middle of request 3's own greedy output
        text = ref[3].text
        stops = [dict(r) for r in reqs]
        stops[3] = dict(reqs[3], sampling_params=dict(reqs[3]["sampling_params"], stop=[text[len(text) // 2:][:3]]))
        ref[3] = LLM(_engine(qwen35_dir, mode=mode)).generate(stops[3])
        eng = _engine(qwen35_dir, mode=mode)
        sched = Scheduler(eng, SchedulerConfig(max_num_seqs=3))
        try:
            out = [h.result() for h in [sched.add_request(eng.parse_request(r)) for r in stops]]
        finally:
            sched.stop()
        for a, b in zip(ref, out):
            assert (b.output_ids, b.text, b.finish_reason) == (a.output_ids, a.text, a.finish_reason), mode
        assert ref[3].finish_reason == "stop" and len(ref[3].text) < len(text)


def _long(max_new=2000):
    return {"segments": [list(range(10, 80))], "suffix": [5, 6, 7],
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}


def test_queue_full_cancel_and_short_behind_long(qwen35_dir):
    eng = _engine(qwen35_dir, mode="prefix")
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=2, max_waiting=1))
    try:
        long = sched.add_request(eng.parse_request(_long()))
        it = iter(long)
        next(it)  # running
        short = sched.add_request(eng.parse_request(_long(4)))
        res = short.result()
        # the short one finished while the long one still decodes
        assert len(res.output_ids) == 4 and not long.done.is_set()
        # two running, one waiting: the next is refused
        blocker = sched.add_request(eng.parse_request(_long()))
        next(iter(blocker))
        waiting = sched.add_request(eng.parse_request(_long(2)))
        with pytest.raises(QueueFull) as e:
            sched.add_request(eng.parse_request(_long(2)))
        assert e.value.retry_after_s >= 1
        # cancelling frees a seat within a step: the waiting request runs next
        steps = sched.steps
        long.cancel()
        blocker.cancel()
        assert long.done.wait(5) and blocker.done.wait(5)
        assert long.finish_reason == "abort" and long.finished_step - steps <= 1
        assert len(waiting.result().output_ids) == 2
        assert sched.load() == {"waiting": 0, "prefilling": 0, "running": 0}
        assert len(long.output_ids) < 2000
        # a consumer that stops iterating cancels its request too
        h = sched.add_request(eng.parse_request(_long()))
        for n, _ in enumerate(h):
            if n == 3:
                break
        assert h.done.wait(5) and h.finish_reason == "abort"
        assert sched._kv_reserved == 0 and sorted(sched.pool.free) == [0, 1]
        # no page of the tree stays locked by the cancelled requests
        nodes, todo = [], [eng.pages.root]
        while todo:
            node = todo.pop()
            nodes.append(node)
            todo += node.children.values()
        assert len(nodes) > 1 and all(node.ref_count == 0 for node in nodes)
    finally:
        sched.stop()


def test_memory_budget_admits_what_fits(qwen35_dir):
    eng = _engine(qwen35_dir, mode="full")
    probe = Scheduler(eng, SchedulerConfig())
    per_token = probe._kv_per_token
    probe.stop()
    req = _long(30)
    need = (len(eng.parse_request(req).prompt_ids) + 30) * per_token
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=4, kv_cache_bytes=need + need // 2))
    try:
        a, b = (sched.add_request(eng.parse_request(req)) for _ in range(2))
        first_b = None
        for _ in b:
            first_b = time.perf_counter()
            break
        # b got no token before a had finished: only one fits the budget
        assert a.done.is_set() and first_b is not None
        b.result()
        assert max(sched.batch_sizes) == 1
    finally:
        sched.stop()


def _per_token(eng) -> int:
    probe = Scheduler(eng, SchedulerConfig())
    probe.stop()
    return probe._kv_per_token


def test_requests_without_max_tokens_run_concurrently(qwen35_dir):
    """Requests that run to the end of the context (no max_new_tokens) reserve a chunk, not the
    context: a budget far below two contexts of K/V still runs max_num_seqs of them at once."""
    eng = _engine(qwen35_dir, mode="prefix")
    per_token = _per_token(eng)
    req = {"segments": [list(range(10, 80))], "suffix": [5, 6, 7], "sampling_params": {"ignore_eos": True}}
    parsed = eng.parse_request(req)
    limit = eng.planner.context_limit
    assert parsed.sampling.max_new_tokens == limit - len(parsed.prompt_ids)
    budget = 12 * (len(parsed.prompt_ids) + 256) * per_token
    assert budget < 2 * limit * per_token  # reserved up front, the second would wait for the first
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=4, kv_cache_bytes=budget))
    try:
        handles = [sched.add_request(eng.parse_request(req)) for _ in range(5)]
        its = [iter(h) for h in handles[:4]]
        for it in its:
            next(it)  # each of the four streams while the others run
        deadline = time.monotonic() + 10
        while sched.load() != {"waiting": 1, "prefilling": 0, "running": 4}:
            assert time.monotonic() < deadline, sched.load()
            time.sleep(0.001)
        assert not any(h.done.is_set() for h in handles)
        for h in handles:
            h.cancel()
        assert all(h.done.wait(10) for h in handles)
        assert max(sched.batch_sizes) == 4
    finally:
        sched.stop()
    # a prompt whose first chunk can never fit the budget is refused, with what it needs
    small = Scheduler(eng, SchedulerConfig(kv_cache_bytes=(len(parsed.prompt_ids) + 10) * per_token))
    try:
        with pytest.raises(KVBudgetError, match="kv_cache_bytes"):
            small.add_request(eng.parse_request(req))
        assert small.load() == {"waiting": 0, "prefilling": 0, "running": 0}
    finally:
        small.stop()


def _preempting(eng, budget_requests: float, reqs, chunk=4, seqs=4):
    """A scheduler whose K/V budget holds about `budget_requests` of the longest prompt and a chunk:
    the requests' growth preempts some of them."""
    longest = max(len(eng.parse_request(r).prompt_ids) for r in reqs)
    budget = int(budget_requests * (longest + chunk) * _per_token(eng))
    preempted = []
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=seqs, kv_cache_bytes=budget, kv_chunk_tokens=chunk),
                      on_preempt=lambda h: preempted.append((h, len(h.output_ids))))
    return sched, preempted


@pytest.mark.parametrize("mode", ["full", "prefix", "pic"])
def test_preempted_requests_resume_with_one_by_one_outputs(qwen35_dir, mode):
    reqs = _requests(5, seed=3, max_new=(30, 17, 41, 24, 9))
    ref = [LLM(_engine(qwen35_dir, mode=mode)).generate(r) for r in reqs]
    eng = _engine(qwen35_dir, mode=mode)
    sched, preempted = _preempting(eng, 2, reqs)
    try:
        handles = [sched.add_request(eng.parse_request(r)) for r in reqs]
        streamed = [list(h) for h in handles]
    finally:
        sched.stop()
    assert sched.preemptions == len(preempted) >= 1
    # preempted after generating some tokens, then resumed: the stream neither repeats nor loses any
    assert any(n > 0 for _, n in preempted)
    for a, h, events in zip(ref, handles, streamed):
        assert (h.output_ids, h.finish_reason) == (a.output_ids, a.finish_reason)
        assert [t for t, _ in events if t >= 0] == a.output_ids and "".join(d for _, d in events) == a.text
        assert h.prefill.stats.prompt_tokens == a.stats.prompt_tokens
    assert sched._kv_reserved == 0 and sorted(sched.pool.free) == list(range(4))


@pytest.mark.parametrize("arch", ["kimi_linear", "nemotron_h", "minimax", "olmo_hybrid"])
def test_preemption_and_page_boundaries_every_family(arch, dirs):
    """Outputs long enough to cross several 16-token K/V pages, requests preempted (their K/V copied
    out of the pages into the page tree) and resumed: the answers one by one, every page back."""
    reqs = _requests(4, seed=3, max_new=(33, 20, 40, 28))
    ref = [LLM(_engine(dirs(arch), mode="prefix")).generate(r) for r in reqs]
    eng = _engine(dirs(arch), mode="prefix")
    sched, preempted = _preempting(eng, 2, reqs)
    try:
        out = [h.result() for h in [sched.add_request(eng.parse_request(r)) for r in reqs]]
    finally:
        sched.stop()
    assert sched.preemptions >= 1
    for a, b in zip(ref, out):
        assert (b.output_ids, b.finish_reason) == (a.output_ids, a.finish_reason)
    kv = sched.pool.kv
    assert sched._kv_reserved == 0 and len(kv.free) == kv.num_pages - 1  # all but the scratch page


def test_stops_after_a_resume(qwen35_dir, tmp_path):
    """An eos id of generation_config.json and a stop string still end a request that was preempted
    before it reached them."""
    model_dir = tmp_path / "m"
    shutil.copytree(qwen35_dir, model_dir)
    reqs = _requests(4, seed=8, max_new=(40, 40, 40, 40))
    free = [LLM(_engine(model_dir, mode="prefix")).generate(r) for r in reqs]
    # request 3 (admitted last: the first preempted) stops at an eos id late in its free output
    stop_id = next(t for i, t in enumerate(free[3].output_ids) if i >= 20 and t not in free[3].output_ids[:i])
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_id]}))
    reqs[3]["sampling_params"] = dict(reqs[3]["sampling_params"], ignore_eos=False)
    # request 2 stops at a string from late in its output
    text = free[2].text
    reqs[2]["sampling_params"] = dict(reqs[2]["sampling_params"], stop=[text[3 * len(text) // 4:][:3]])
    ref = [LLM(_engine(model_dir, mode="prefix")).generate(r) for r in reqs]
    assert ref[3].finish_reason == ref[2].finish_reason == "stop"
    assert len(ref[3].output_ids) >= 20 and len(ref[2].text) < len(text)
    eng = _engine(model_dir, mode="prefix")
    sched, preempted = _preempting(eng, 2.5, reqs)
    try:
        handles = [sched.add_request(eng.parse_request(r)) for r in reqs]
        out = [h.result() for h in handles]
    finally:
        sched.stop()
    for a, b in zip(ref, out):
        assert (b.output_ids, b.text, b.finish_reason) == (a.output_ids, a.text, a.finish_reason)
    # a stopping request was preempted before it stopped, then resumed to its stop
    early = [h for h, n in preempted if h in handles[2:] and 0 < n < len(h.output_ids)]
    assert early, [(handles.index(h), n) for h, n in preempted]


def test_bad_config():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_chunk_tokens"):
        SchedulerConfig(kv_chunk_tokens=0)
    with pytest.raises(ValueError, match="max_waiting"):
        SchedulerConfig(max_waiting=-1)
