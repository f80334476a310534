"""Chunked prefill (Engine.start_prefill / prefill_chunk, the scheduler's per-step token budget):
a prompt, a segment's live part or an assembly runs a budget of live tokens a step, from the
state the previous chunk left, its K/V in the request's pages; greedy outputs equal the one-unit
run for several families and modes, a long prompt's chunks interleave with the decode steps of
running requests, and a request that leaves mid-prefill gives back its slot, pages and locks."""

import pytest
import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.modelzoo import init_model_dir
from hybridcache.services.runtime.paged import PagedAttnState
from hybridcache.services.runtime.scheduler import Scheduler, SchedulerConfig
from hybridcache.services.runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk_models")
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = init_model_dir(arch, "tiny", root / arch, seed=1, std=0.08)
        return cache[arch]

    return get


def _engine(path, **cfg):
    return Engine(load_model(path), Tokenizer.from_dir(path), EngineConfig(**cfg))


def _ids(gen, n):
    return torch.randint(0, 250, (n,), generator=gen).tolist()


def _requests(seed=0, max_new=6):
    """A plain prompt, an assembly of three segments (one longer than a chunk) after a system
    prompt, and a prompt of several live parts: each longer than the test's budget."""
    gen = torch.Generator().manual_seed(seed)
    params = {"max_new_tokens": max_new, "ignore_eos": True}
    return [
        {"suffix": _ids(gen, 150), "sampling_params": params},
        {"system": _ids(gen, 30), "segments": [_ids(gen, 40), _ids(gen, 90), _ids(gen, 25)],
         "suffix": _ids(gen, 35), "sampling_params": params},
        {"system": _ids(gen, 70), "segments": [_ids(gen, 12)], "suffix": _ids(gen, 60), "sampling_params": params},
    ]


def _serve(eng, reqs, **cfg):
    sched = Scheduler(eng, SchedulerConfig(**cfg))
    try:
        out = [h.result() for h in [sched.add_request(eng.parse_request(r)) for r in reqs]]
    finally:
        sched.stop()
    return sched, out


@pytest.mark.parametrize("arch,mode", [("qwen3_5_text", "pic"), ("qwen3_5_text", "prefix"), ("qwen3_5_text", "full"),
                                       ("nemotron_h", "pic"), ("olmo_hybrid", "prefix"), ("kimi_linear", "pic"),
                                       ("minimax", "pic")])
def test_greedy_outputs_equal_the_one_unit_prefill(arch, mode, dirs):
    """Every request longer than a 24-token budget runs in several chunks (the step log shows
    steps of at most the budget each, but for the build of a cold segment longer than the budget,
    which runs whole), with the answers of a budget that runs each in one unit."""
    reqs = _requests()
    _, ref = _serve(_engine(dirs(arch), mode=mode), reqs, max_num_seqs=1, max_num_batched_tokens=8192)
    sched, out = _serve(_engine(dirs(arch), mode=mode), reqs, max_num_seqs=1, max_num_batched_tokens=24)
    for a, b in zip(ref, out):
        assert b.output_ids == a.output_ids
        assert b.stats.prompt_tokens == a.stats.prompt_tokens and b.stats.live_tokens == a.stats.live_tokens
    prefill_steps = [t for _, t, _ in sched.step_log if t]
    assert max(prefill_steps) <= (90 if mode == "pic" else 24)
    # the plain prompt alone takes ceil(150 / 24) chunks
    assert len(prefill_steps) >= 7 + 2


def test_paged_prefill_off_keeps_k_v_contiguous_with_the_same_answers(qwen35_dir):
    """--paged-prefill off: chunks run on contiguous K/V (moved into pages at decode start), the
    answers those of paged chunks."""
    reqs = _requests(seed=2)
    _, paged = _serve(_engine(qwen35_dir, mode="pic"), reqs, max_num_seqs=1, max_num_batched_tokens=24)
    eng = _engine(qwen35_dir, mode="pic", paged_prefill=False)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=24))
    seen = []
    forward = eng.runner.forward

    def spy(state, layout, *a, **k):
        seen.append(all(not isinstance(x, PagedAttnState) for x in state.attn.values()))
        return forward(state, layout, *a, **k)

    eng.runner.forward = spy
    try:
        out = [h.result() for h in [sched.add_request(eng.parse_request(r)) for r in reqs]]
    finally:
        sched.stop()
    assert [r.output_ids for r in out] == [r.output_ids for r in paged]
    assert len(seen) > 3 and all(seen)


def test_a_long_prompt_interleaves_with_decode_steps(qwen35_dir):
    """While a long prompt prefills a chunk a step, the running request decodes in every one of
    those steps: its tokens keep coming between the chunks. Each step that ran anything is reported
    to on_step (the combine worker's step histogram) with what it ran."""
    eng = _engine(qwen35_dir, mode="prefix")
    gen = torch.Generator().manual_seed(3)
    running = {"suffix": _ids(gen, 20), "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    long = {"suffix": _ids(gen, 300), "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    steps = []
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32),
                      on_step=lambda kind, s: steps.append((kind, s)))
    try:
        first = sched.add_request(eng.parse_request(running))
        it = iter(first)
        next(it)  # decoding
        h = sched.add_request(eng.parse_request(long))
        out = h.result()
        rest = first.result()
    finally:
        sched.stop()
    assert len(out.output_ids) == 3 and len(rest.output_ids) == 60
    chunks = [(tokens, batch) for _, tokens, batch in sched.step_log if tokens]
    # 300 tokens at 32 a step: at least 10 chunk steps, each with the running request's decode step
    assert len(chunks) >= 10
    assert all(tokens <= 32 for tokens, _ in chunks)
    assert sum(1 for tokens, batch in chunks if batch >= 1) >= 9
    kinds = ["mixed" if tokens and batch else "prefill" if tokens else "decode" for _, tokens, batch in sched.step_log]
    assert [k for k, _ in steps] == kinds and all(s > 0 for _, s in steps)
    assert kinds.count("mixed") >= 9 and "decode" in kinds
    # and its answer is the one it gives alone
    alone = _serve(_engine(qwen35_dir, mode="prefix"), [long], max_num_batched_tokens=8192)[1][0]
    assert out.output_ids == alone.output_ids


@pytest.mark.parametrize("arch", ["qwen3_5_text", "nemotron_h", "bamba"])
def test_chunks_in_pages_equal_one_contiguous_forward(arch, dirs):
    """Engine level: a prefill run chunk by chunk in a slot's pages (the scheduler's long-prompt
    path) leaves the logits, linear states and K/V of the one-forward prefill; its K/V never leave
    the pages."""
    eng = _engine(dirs(arch), mode="pic")
    req = eng.parse_request(_requests(seed=4)[1])
    ref = eng.prefill(req)
    eng.finish_prefix(ref)
    eng.reset_caches()
    pool = eng.new_state_pool(2, 4096)
    job = eng.start_prefill(req)
    slot = pool.assign(job.state)
    chunks = 0
    while (pre := eng.prefill_chunk(job, 17)) is None:
        chunks += 1
        assert all(isinstance(a, PagedAttnState) for a in job.state.attn.values())
    assert chunks >= 3
    torch.testing.assert_close(pre.logits, ref.logits, rtol=1e-4, atol=1e-4)
    for i, s in ref.state.linear.items():
        torch.testing.assert_close(pre.state.linear[i].ssm, s.ssm, rtol=1e-4, atol=1e-4)
    for i, a in ref.state.attn.items():
        assert isinstance(pre.state.attn[i], PagedAttnState)
        torch.testing.assert_close(pre.state.attn[i].k, a.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pre.state.attn[i].v, a.v, rtol=1e-5, atol=1e-5)
    pool.adopt(slot, pre.state)
    eng.finish_prefix(pre)
    pool.release(slot)
    assert sorted(pool.free) == [0, 1]


def test_chunk_bounds_and_a_finished_prefill(qwen35_dir):
    eng = _engine(qwen35_dir, mode="full")
    job = eng.start_prefill(eng.parse_request({"suffix": list(range(5, 45))}))
    with pytest.raises(ValueError, match="max_tokens"):
        eng.prefill_chunk(job, 0)
    assert eng.prefill_chunk(job, 39) is None and job.live_left == 1
    pre = eng.prefill_chunk(job, 39)
    assert pre is not None and pre.state.length == 40
    with pytest.raises(ValueError, match="run to its end"):
        eng.prefill_chunk(job, 5)


def test_a_request_cancelled_mid_prefill_gives_back_its_slot_and_pages(qwen35_dir):
    eng = _engine(qwen35_dir, mode="prefix")
    gen = torch.Generator().manual_seed(5)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16))
    try:
        free_pages = len(sched.pool.kv.free)
        h = sched.add_request(eng.parse_request({"suffix": _ids(gen, 400),
                                                 "sampling_params": {"max_new_tokens": 4}}))
        # wait until its prefill holds its slot (25 chunks of 16 tokens), then cancel it
        caught = False
        for _ in range(5000):
            if any(s.job is not None and s.slot >= 0 for s in list(sched._admitted)):
                caught = True
                break
            h.done.wait(0.001)
        h.cancel()
        assert caught
        assert h.done.wait(10) and h.finish_reason == "abort"
        done = sched.add_request(eng.parse_request({"suffix": _ids(gen, 40), "sampling_params": {"max_new_tokens": 2}}))
        assert len(done.result().output_ids) == 2
        assert sorted(sched.pool.free) == [0, 1] and len(sched.pool.kv.free) == free_pages
        assert sched._kv_reserved == 0
        nodes, todo = [], [eng.pages.root]
        while todo:
            node = todo.pop()
            nodes.append(node)
            todo += node.children.values()
        assert all(node.ref_count == 0 for node in nodes)
    finally:
        sched.stop()


def test_prefix_pages_go_into_the_tree_chunk_by_chunk(qwen35_dir):
    """A long prompt in prefix mode (checkpoints every 256 tokens) inserts its pages as its chunks
    complete them; the same prompt again is a page-tree hit with the same answer."""
    eng = _engine(qwen35_dir, mode="prefix")
    gen = torch.Generator().manual_seed(6)
    req = {"suffix": _ids(gen, 600), "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=100))
    try:
        a = sched.add_request(eng.parse_request(req)).result()
        b = sched.add_request(eng.parse_request(req)).result()
    finally:
        sched.stop()
    assert b.output_ids == a.output_ids
    assert b.stats.prefix_reused_tokens >= 512


def test_attention_cost_per_position_counts_attention_keys_over_the_token_s_matmuls(dirs):
    """The slope is every attention layer's 2 Hq (dk + dv) per key over twice the weights a token
    multiplies (LM head left out; a MoE layer's experts at their top-k share)."""
    from hybridcache.services.runtime.scheduler import attention_cost_per_position

    model = load_model(dirs("qwen3_5_text"))
    cfg = model.cfg
    weights = sum(m.weight.numel() for m in model.modules()
                  if isinstance(m, torch.nn.Linear) and m.out_features != cfg.vocab_size)
    attn = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    per_key = len(attn) * 2 * cfg.num_attention_heads * 2 * cfg.head_dim
    assert attn and attention_cost_per_position(model) == pytest.approx(per_key / (2 * weights))
    moe = load_model(dirs("qwen3_5_moe_text"))
    dense_part = sum(m.weight.numel() for m in moe.modules()
                     if isinstance(m, torch.nn.Linear) and m.out_features != moe.cfg.vocab_size)
    experts = sum(p.numel() for p in moe.parameters() if p.dim() == 3 and p.shape[0] == moe.cfg.num_experts)
    assert experts
    active = experts * moe.cfg.num_experts_per_tok / moe.cfg.num_experts
    per_key = sum(2 * moe.cfg.num_attention_heads * 2 * moe.cfg.head_dim
                  for t in moe.cfg.layer_types if t == "full_attention")
    assert attention_cost_per_position(moe) == pytest.approx(per_key / (2 * (dense_part + active)))


def test_chunks_shrink_as_the_context_grows(qwen35_dir):
    """A long prompt's chunks (whole forwards: chunk_layer_parts 1): each as many tokens as the
    step's budget buys at its context (chunk_tokens), so later chunks are shorter and none costs
    more than the budget; the answer is the one of a single-unit prefill."""
    from hybridcache.services.runtime.scheduler import chunk_cost, chunk_tokens

    eng = _engine(qwen35_dir, mode="full")
    gen = torch.Generator().manual_seed(4)
    long = {"system": _ids(gen, 8), "suffix": _ids(gen, 600),
            "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    sched, (out,) = _serve(eng, [long], max_num_seqs=1, max_num_batched_tokens=64, chunk_layer_parts=1)
    slope = sched._attention_slope
    assert slope > 0
    chunks = [tokens for _, tokens, _ in sched.step_log if tokens]
    assert sum(chunks) == 608
    context, want = 0, []
    while context < 608:
        c = min(chunk_tokens(64, context, slope), 608 - context)
        want.append(c)
        assert chunk_cost(c, context, slope) <= 64
        context += c
    assert chunks == want
    assert chunks[0] == 64 and chunks[-2] < chunks[0]  # the context's keys cost budget
    alone = _serve(_engine(qwen35_dir, mode="full"), [long], max_num_batched_tokens=8192)[1][0]
    assert out.output_ids == alone.output_ids


@pytest.mark.parametrize("max_new", [1, 5])
def test_part_chains_are_kept_after_the_first_token_goes_out(qwen35_dir, max_new):
    """Through the scheduler a pic request's part chains (the state after each part) go into the
    chain store after its first token was emitted, not before (reading the prompt's K/V out of its
    pages stays off the time to first token), also when that token ends the request; the store then
    holds the same chains as after Engine.prefill."""
    gen = torch.Generator().manual_seed(6)
    req = {"system": _ids(gen, 20), "segments": [_ids(gen, 40), _ids(gen, 30)], "suffix": _ids(gen, 12),
           "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
    eng = _engine(qwen35_dir, mode="pic")
    seen = []
    keep = eng._keep_chains

    def watched(job):
        seen.append(len(handle.output_ids))
        keep(job)

    eng._keep_chains = watched
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=2))
    try:
        handle = sched.add_request(eng.parse_request(req))
        out = handle.result()
    finally:
        sched.stop()
    assert len(out.output_ids) == max_new
    assert seen == [1]  # once, with the first token out
    ref = _engine(qwen35_dir, mode="pic")
    pre = ref.prefill(ref.parse_request(req))
    ref.finish_prefix(pre)
    keys = ref.planner.chain_keys(ref.parse_request(req))
    kept = [k for k in keys if ref.prefixes.get(k) is not None]
    assert kept and [k for k in keys if eng.prefixes.get(k) is not None] == kept
    for k in kept:
        a, b = eng.prefixes.get(k), ref.prefixes.get(k)
        assert a.length == b.length
        for i, s in b.linear.items():
            torch.testing.assert_close(a.linear[i].ssm, s.ssm)


@pytest.mark.parametrize("arch,parts", [("qwen3_5_text", 3), ("nemotron_h", 2), ("bamba", 4)])
def test_a_chunk_in_layer_parts_equals_its_whole_forward(arch, parts, dirs):
    """Engine level: chunks of a plain prompt run `parts` calls each (a run of layers a call; the
    calls before the last return None and leave the job part-way) give the logits, linear states
    and K/V of the chunks run whole."""
    eng = _engine(dirs(arch), mode="prefix")
    prompt = _ids(torch.Generator().manual_seed(6), 130)
    req = eng.parse_request({"suffix": prompt})
    results = []
    for layer_parts in (1, parts):
        eng.reset_caches()
        pool = eng.new_state_pool(1, 1024)  # each run's K/V in pages of its own
        job = eng.start_prefill(req)
        pool.assign(job.state)
        calls = part_way = 0
        while (pre := eng.prefill_chunk(job, 50, layer_parts=layer_parts)) is None:
            calls += 1
            part_way += job.part_way
        results.append((pre, pool))
        # 130 tokens in chunks of 50: three chunks; in parts, the end of each but the last (its
        # pages into the prefix tree) is a call of its own after its last run of layers
        ends_apart = 0 if layer_parts == 1 else 2
        assert calls + 1 == 3 * layer_parts + ends_apart
        assert part_way == 3 * (layer_parts - 1) + ends_apart
    (whole, _), (split, _) = results
    torch.testing.assert_close(split.logits, whole.logits, rtol=1e-5, atol=1e-5)
    for i, s in whole.state.linear.items():
        torch.testing.assert_close(split.state.linear[i].ssm, s.ssm, rtol=1e-5, atol=1e-5)
    for i, a in whole.state.attn.items():
        torch.testing.assert_close(split.state.attn[i].k, a.k, rtol=1e-5, atol=1e-5)
    assert split.state.length == whole.state.length == 130


def test_a_part_way_chunk_goes_on_whatever_the_budget_and_abandoning_it_closes_its_forward(qwen35_dir):
    eng = _engine(qwen35_dir, mode="prefix")
    pool = eng.new_state_pool(1, 1024)
    job = eng.start_prefill(eng.parse_request({"suffix": list(range(5, 125))}))
    pool.assign(job.state)
    assert eng.prefill_chunk(job, 40, layer_parts=2) is None and job.part_way
    left = job.live_left
    assert eng.prefill_chunk(job, 1) is None and job.part_way  # its second half: no new tokens
    assert eng.prefill_chunk(job, 1) is None and not job.part_way  # its end: pages into the tree
    assert job.live_left == left == 80
    assert eng.prefill_chunk(job, 40, layer_parts=2) is None and job.part_way
    forward = job.running.forward
    eng.abandon_prefill(job)
    assert job.running is None and forward.gen.gi_frame is None  # closed


def _counting(start_chunk, sizes):
    """Engine._start_chunk that also notes each chunk's max_tokens in `sizes`."""
    def start(job, n, parts):
        sizes.append(n)
        return start_chunk(job, n, parts)
    return start


def test_a_long_prompt_in_layer_parts_interleaves_with_decode_and_keeps_its_answer(qwen35_dir):
    """Scheduler level, chunk_layer_parts 3: the long prompt's chunks are three times the tokens
    a step's budget buys, each run over three steps; every step counts at most its budget, the
    running request decodes in each, and the answers equal those of whole chunks."""
    gen = torch.Generator().manual_seed(3)
    running = {"suffix": _ids(gen, 20), "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    long = {"suffix": _ids(gen, 300), "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    outs = []
    for parts in (1, 3):
        eng = _engine(qwen35_dir, mode="prefix")
        starts = []
        eng._start_chunk = _counting(eng._start_chunk, starts)
        sched = Scheduler(eng, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, chunk_layer_parts=parts))
        try:
            first = sched.add_request(eng.parse_request(running))
            it = iter(first)
            next(it)  # decoding
            out = sched.add_request(eng.parse_request(long)).result()
            rest = first.result()
        finally:
            sched.stop()
        chunks = [(tokens, batch) for _, tokens, batch in sched.step_log if tokens]
        assert all(tokens <= 32 for tokens, _ in chunks)
        assert sum(1 for tokens, batch in chunks if batch >= 1) >= len(chunks) - 1
        outs.append((out.output_ids, rest.output_ids, len(chunks), starts))
    (a_long, a_run, a_steps, a_starts), (b_long, b_run, b_steps, b_starts) = outs
    assert b_long == a_long and b_run == a_run
    # the long prompt: chunks of up to 32 tokens, a step each, vs chunks of three times that over
    # three steps each (the chunks asked for; the last takes what is left)
    assert max(a_starts) <= 32 and len(a_starts) >= 10 and a_steps >= 10
    assert 64 < max(b_starts) <= 96 and len(b_starts) <= 5 and b_steps >= 3 * (len(b_starts) - 1)


def test_layer_parted_chunks_take_at_most_entry_batch_tokens(qwen35_dir):
    """A chunk in layer parts is the budget's chunk times the parts but no more tokens than a
    batched cold build runs (entry_batch_tokens, the activations the warm-up sees), and never
    fewer than the budget's chunk."""
    gen = torch.Generator().manual_seed(8)
    long = {"suffix": _ids(gen, 400), "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    for cap, lo, hi in ((100, 90, 100), (20, 30, 32)):
        eng = _engine(qwen35_dir, mode="full", entry_batch_tokens=cap)
        sizes = []
        eng._start_chunk = _counting(eng._start_chunk, sizes)
        _serve(eng, [long], max_num_seqs=1, max_num_batched_tokens=32, chunk_layer_parts=4)
        assert lo <= max(sizes) <= hi, (cap, sizes)


def test_chunks_end_at_piece_ends_and_their_equal_runs_run_batched(qwen35_dir, monkeypatch):
    """A prompt cut at the prefix cache's checkpoints (every 256 tokens): a chunk that runs a
    piece to its end stops there instead of cutting the next one, so the chunks after it start
    on a piece and a chunk of several whole pieces runs them batched (one recurrence call a
    linear layer); a budget smaller than a piece still cuts it. The logits equal the one-unit
    prefill's."""
    from hybridcache.services.runtime.models.mixer import LinearMixer

    eng = _engine(qwen35_dir, mode="prefix")
    req = eng.parse_request({"suffix": _ids(torch.Generator().manual_seed(9), 1000)})
    ref = eng.prefill(req)
    eng.finish_prefix(ref)
    batched = []
    real = LinearMixer.batched_scan
    # the layer index of each batched call (arguments: inputs, layout, state, rec, layer_idx, ...)
    monkeypatch.setattr(LinearMixer, "batched_scan", lambda self, *a: batched.append(a[4]) or real(self, *a))
    for max_tokens, ends in ((600, [512, 1000]), (100, [100, 200, 256, 356, 456, 512, 612])):
        eng.reset_caches()
        batched.clear()
        job = eng.start_prefill(req)
        seen = []
        while (pre := eng.prefill_chunk(job, max_tokens)) is None:
            seen.append(job.state.length)
        seen.append(pre.state.length)
        assert seen[: len(ends)] == ends
        torch.testing.assert_close(pre.logits, ref.logits, rtol=1e-4, atol=1e-4)
        if max_tokens == 600:  # [0, 256) + [256, 512), then [512, 768) + [768, 1000): batched each time
            linear = sorted(eng.model.linear_groups()[0] + tuple(i for g in eng.model.linear_groups()[1:] for i in g))
            assert sorted(batched) == sorted(linear * 2)
        eng.finish_prefix(pre)


@pytest.mark.parametrize("budget", [64, 8192])
def test_first_token_stats_say_where_the_wait_went(qwen35_dir, budget):
    """RequestStats.prefill_steps: the scheduler steps the request spent admitted before its first
    token; build_ms: the host time of the batched cold builds that built its segments (a budget of
    64 tokens builds the three segments in three steps, 8,192 in one); assembly_ms: from its
    prefill's start to the first token. A warm request of the same segments builds nothing."""
    eng = _engine(qwen35_dir, mode="pic")
    cold = _requests()[1]
    sched = Scheduler(eng, SchedulerConfig(max_num_batched_tokens=budget))
    admitted_steps, builds = [], []
    step, build = sched._prefill_step, sched._build

    def counting_step():
        admitted_steps.append(len(sched._admitted))
        step()

    def counting_build(todo):
        builds.append(len(todo))
        return build(todo)

    sched._prefill_step, sched._build = counting_step, counting_build
    try:
        h = sched.add_request(eng.parse_request(cold))
        h.result()
        stats = h.prefill.stats
        steps_cold = sum(1 for n in admitted_steps if n)
        admitted_steps.clear()
        w = sched.add_request(eng.parse_request(dict(cold, system=cold["system"][::-1])))
        w.result()
        warm = w.prefill.stats
    finally:
        sched.stop()
    assert builds == ([1, 1, 1] if budget == 64 else [3])
    assert stats.prefill_steps == steps_cold >= len(builds)
    assert 0 < stats.build_ms < stats.ttft_ms
    assert 0 < stats.assembly_ms < stats.ttft_ms
    assert stats.build_ms + stats.assembly_ms <= stats.ttft_ms + 1e-6
    assert warm.build_ms == 0 and warm.prefill_steps == sum(1 for n in admitted_steps if n) >= 1
    assert 0 < warm.assembly_ms <= warm.ttft_ms
    assert {"prefill_steps", "build_ms", "assembly_ms"} <= stats.to_dict().keys()


def test_a_parted_chunk_ends_in_a_call_of_its_own(qwen35_dir, monkeypatch):
    """With layer parts, no call both runs layers and ends a chunk (its kept states, its pages
    recorded and inserted into the prefix tree) but the prompt's last; the tree holds the same
    pages as after whole chunks. Without a page recorder (mode full) the last run of layers ends
    the chunk itself."""
    prompt = _ids(torch.Generator().manual_seed(9), 150)
    trees = []
    for mode, parts in (("prefix", 1), ("prefix", 3), ("full", 3)):
        eng = _engine(qwen35_dir, mode=mode)
        pool = eng.new_state_pool(1, 1024)
        job = eng.start_prefill(eng.parse_request({"suffix": prompt}))
        pool.assign(job.state)
        calls = []
        run_part, finish = eng.runner.run_part, eng._finish_chunk
        monkeypatch.setattr(eng.runner, "run_part", lambda fwd, f=run_part, c=calls: c[-1].append("layers") or f(fwd))
        monkeypatch.setattr(eng, "_finish_chunk", lambda *a, f=finish, c=calls, **k: c[-1].append("end") or f(*a, **k))
        pre = None
        while pre is None:
            calls.append([])
            pre = eng.prefill_chunk(job, 64, layer_parts=parts)
        # three chunks; the last one's end gives the first token: it ends in its last run of layers
        if parts == 1:
            assert all(c == ["layers", "end"] for c in calls)
        elif mode == "prefix":
            assert all(c in (["layers"], ["end"]) for c in calls[:-1]) and calls.count(["end"]) == 2
            assert all(calls[i - 1] == ["layers"] for i, c in enumerate(calls) if c == ["end"])
            assert calls[-1] == ["layers", "end"] and len(calls) == 3 * 3 + 2
        else:
            assert calls.count(["layers", "end"]) == 3 and calls.count(["layers"]) == 6
        if mode == "prefix":
            trees.append(len(eng.pages.match(prompt[:-1], salt=None)))
    assert trees[0] == trees[1] > 0
