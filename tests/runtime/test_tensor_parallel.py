"""Tensor parallelism on the CPU: two ranks as two processes (gloo), one group for the module.

Every rank holds a ModelRunner over its shard; rank 0 holds the engines (their caches, the
scheduler) and every runner call reaches both ranks. TP = 2 `full` logits equal TP = 1 for every
family (tiny random models); greedy outputs through the one path (llm.LLM: the scheduler, batched
plain prefills, the paged decode) equal TP = 1 in modes prefix and pic, with page-tree hits,
entries reused after another prefix and entries staged from the host tier; in pic, TP = 2 entries
are built per rank, and warm equals cold equals TP = 1; the handles that name per-rank objects
across the ranks refuse what would carry rank 0's slice to the others, and a pool's methods refuse
to run on rank 0 alone. Each rank reads only its slices of the checkpoint: about half of it at
TP = 2, the same weights as a whole load split afterwards.
"""

import functools
import types

import pytest
import torch
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.engine import Engine
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.modelzoo import init_model_dir
from hybridcache.services.runtime.sequence import LinearState, LiveRun, SequenceState
from hybridcache.services.runtime.tensor_parallel import ranks
from hybridcache.services.runtime.tensor_parallel.shard import shard_model

# every family: GDN (Qwen3.5 apart, Qwen3-Next packed; dense and MoE), OLMo's GDN with cross-head
# q/k norms, Mamba2 (Nemotron-H, Bamba), KDA with MLA and a DeepSeek MoE, lightning with a softmax MoE
ARCHS = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "olmo_hybrid", "nemotron_h", "kimi_linear", "bamba",
         "minimax"]
PIC_ARCHS = ["qwen3_5_text", "nemotron_h", "minimax"]
SIZE = 2


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the logits' scale (fp32 sums over ranks add in another order)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    return {a: str(init_model_dir(a, "tiny", root / a, seed=1, std=0.08)) for a in ARCHS}


# the checkpoint policy keeping each finished request's end state (SGLang's peer in benchmarks/multiturn.py)
REQUEST_ENDS = RuntimeConfig(mode="prefix", prefix_policy="checkpoint", checkpoint_every=128,
                             checkpoint_request_ends=True)

# a prefix budget (per rank) too small for every decode checkpoint of six streams
HELD_BUDGET = RuntimeConfig(mode="prefix", prefix_policy="exact_replay", checkpoint_every=1,
                            prefix_cache_bytes=100_000)


def _named(dirs) -> dict:
    """The runners of the group: a `full` one per family, `pic` and `prefix` ones of some, a pic one
    with a host tier."""
    named = {a: (p, RuntimeConfig(mode="full")) for a, p in dirs.items()}
    named.update({f"pic_{a}": (dirs[a], RuntimeConfig(mode="pic")) for a in PIC_ARCHS})
    named.update({f"prefix_{a}": (dirs[a], RuntimeConfig(mode="prefix")) for a in PIC_ARCHS})
    named["tiered"] = (dirs["qwen3_5_text"], RuntimeConfig(mode="pic", host_cache_bytes=1 << 30))
    named["request_ends"] = (dirs["qwen3_5_text"], REQUEST_ENDS)
    named["held_budget"] = (dirs["qwen3_5_text"], HELD_BUDGET)
    return named


@pytest.fixture(scope="module")
def group(dirs):
    """One group of two ranks holding the runners of _named."""
    g = ranks.start(SIZE, functools.partial(ranks.build_runners, _named(dirs)))
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def engines(dirs, group):
    """Rank 0's engine over each of the group's runners."""
    return types.SimpleNamespace(**{n: ranks.engine_of(group, p, n) for n, (p, _) in _named(dirs).items()})


@pytest.mark.parametrize("arch", ARCHS)
def test_full_logits_equal_tp1(arch, dirs, group):
    ids = torch.randint(0, 256, (61,), generator=torch.Generator().manual_seed(3))
    ref_model = load_model(dirs[arch])
    ref_state = ref_model.empty_state()
    ref, _ = ref_model.forward_layout(ref_state, [LiveRun(ids[:-1], 0)], logits_for="all")
    ref_next, _ = ref_model.forward_layout(ref_state, [LiveRun(ids[-1:], 60)])
    runner = group.runner(arch)
    state = runner.empty_state()
    out, _ = runner.forward(state, [LiveRun(ids[:-1], 0)], logits_for="all")
    # the state left behind is rank 0's share: half the linear heads, half the key/value heads
    lin = next(iter(state.linear.values())).ssm
    assert lin.shape[1] * SIZE == next(iter(ref_state.linear.values())).ssm.shape[1]
    nxt, _ = runner.forward(state, [LiveRun(ids[-1:], 60)])
    assert ref.abs().max().item() > 1e-2
    assert _close(out, ref) <= 1e-5
    assert _close(nxt, ref_next) <= 1e-5
    # a batched decode step of two requests (the runner's, over its pool) continues both
    s1, s2 = runner.empty_state(), runner.empty_state()
    runner.forward(s1, [LiveRun(ids[:30], 0)], logits_for="none")
    runner.forward(s2, [LiveRun(ids[:-1], 0)], logits_for="none")
    pool = runner.new_state_pool(2, 128)
    both, _ = runner.decode(pool, [runner.assign(pool, s1), runner.assign(pool, s2)], [int(ids[30]), int(ids[-1])])
    assert _close(both[0], ref[30]) <= 1e-5
    assert _close(both[1], ref_next) <= 1e-5


def test_generate_through_llm_equals_tp1(dirs, engines):
    req = {"segments": [list(range(40, 90))], "suffix": [5, 6, 7],
           "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
    ref = LLM(Engine.from_dir(dirs["qwen3_5_text"], config=RuntimeConfig(mode="full"))).generate(req)
    out = LLM(engines.qwen3_5_text).generate(req)
    assert out.output_ids == ref.output_ids and len(out.output_ids) == 6


def _conversation(seed: int) -> list[dict]:
    """Requests of every path, run in this order as two batches: plain prompts (prefilled
    together), a RAG request, and after them the same documents reordered after another system
    prompt, a second turn that extends the first plain prompt (a page-tree hit), another plain
    prompt."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(0, 256, (n,), generator=g).tolist()

    sp = {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}
    docs, plain = [ids(45), ids(37), ids(52)], ids(150)
    first = [{"suffix": plain, "sampling_params": sp}, {"suffix": ids(23), "sampling_params": sp},
             {"system": ids(6), "segments": docs, "suffix": ids(9), "sampling_params": sp}]
    second = [{"system": ids(7), "segments": docs[::-1], "suffix": ids(8), "sampling_params": sp},
              {"suffix": plain + ids(30), "sampling_params": sp}, {"suffix": ids(19), "sampling_params": sp}]
    return [first, second]


@pytest.mark.parametrize("mode", ["prefix", "pic"])
@pytest.mark.parametrize("arch", PIC_ARCHS)
def test_greedy_through_the_one_path_equals_tp1(arch, mode, dirs, engines):
    """The same requests through llm.LLM at TP = 1 and TP = 2 (the scheduler over rank 0's engine,
    every runner call on both ranks): the same greedy tokens, the same cache hits; plain prompts
    are prefilled batched on both ranks, and the page tree's hits restore the state on both."""
    tp1 = LLM(Engine.from_dir(dirs[arch], config=RuntimeConfig(mode=mode)))
    tp2 = LLM(getattr(engines, f"{mode}_{arch}"))
    try:
        for batch in _conversation(7):
            want, got = tp1.generate(batch), tp2.generate(batch)
            assert [r.output_ids for r in got] == [r.output_ids for r in want]
            assert [r.stats.prefix_reused_tokens for r in got] == [r.stats.prefix_reused_tokens for r in want]
            assert [[s.source for s in r.stats.segments] for r in got] == [
                [s.source for s in r.stats.segments] for r in want]
        assert tp2.scheduler.plain_prefilled >= 2 and tp2.scheduler.plain_prefilled == tp1.scheduler.plain_prefilled
        assert max(tp2.scheduler.batch_sizes) >= 2
        if mode == "prefix":
            assert want[1].stats.prefix_reused_tokens > 0  # the second turn hit the page tree
    finally:
        tp1.close()
        tp2.close()


def test_host_tier_entries_stage_on_every_rank(dirs, engines):
    """A TP = 2 engine with a host tier: its entries move to host memory on both ranks
    (ModelRunner.to_host) and a request after another prefix stages them back on both; the TP = 1
    answer."""
    tp1 = Engine.from_dir(dirs["qwen3_5_text"], config=RuntimeConfig(mode="pic", host_cache_bytes=1 << 30))
    tp2 = engines.tiered
    first, second = _conversation(8)
    rag, again = first[2], second[0]
    for eng in (tp1, tp2):
        LLM(eng).generate(rag)
        eng.entries.demote_all()
    want, got = LLM(tp1).generate(again), LLM(tp2).generate(again)
    assert [s.source for s in got.stats.segments] == ["host"] * 3
    assert got.output_ids == want.output_ids


def test_unnamed_float_tensor_is_refused(group):
    """A tensor rank 0 made on its own holds its slice only: passing it to a runner call fails; the
    model is not reached from rank 0, and a pool's methods refuse to run on rank 0 alone."""
    runner = group.runner("qwen3_5_text")
    state = runner.empty_state()
    mine = state.linear[0].ssm.clone()  # made outside a runner call
    bad = SequenceState(state.length, {**state.linear, 0: LinearState(mine, state.linear[0].conv)}, dict(state.attn))
    with pytest.raises(ranks.TPError, match="outside the runner's calls"):
        runner.forward(bad, [LiveRun(torch.arange(3), 0)])
    with pytest.raises(ranks.TPError, match="module of rank 0 only"):
        runner.model  # noqa: B018 - reading it is what fails
    pool = runner.new_state_pool(1, 16)
    assert isinstance(pool, ranks.RankObject) and pool.slots == 1  # its attributes read rank 0's
    with pytest.raises(ranks.TPError, match="rank 0 alone"):
        pool.assign(state)
    assert runner.assign(pool, state) == 0  # through the runner: on every rank


def test_an_error_on_every_rank_reaches_the_caller_and_the_group_goes_on(group):
    runner = group.runner("qwen3_5_text")
    with pytest.raises(ValueError, match="starts at 5"):
        runner.forward(runner.empty_state(), [LiveRun(torch.arange(4), 5)])
    logits, _ = runner.forward(runner.empty_state(), [LiveRun(torch.arange(4), 0)])
    assert logits.shape == (320,)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_rank_reads_only_its_slices_of_the_checkpoint(arch, dirs):
    """Rank r's load reads ~1/2 of the checkpoint's bytes (what stays whole on every rank: norms,
    routers, MLA's latents, is little) and holds exactly the weights of a whole load split after."""
    whole = load_model(dirs[arch])
    for rank in range(SIZE):
        part = load_model(dirs[arch], tp_rank=rank, tp_size=SIZE)
        assert part.fingerprint == whole.fingerprint  # sampled from the file, the same id
        ratio = part.checkpoint_bytes_read / whole.checkpoint_bytes_read
        assert 1 / SIZE <= ratio < 1 / SIZE + 0.05, ratio
        ref = shard_model(load_model(dirs[arch]), rank, SIZE).state_dict()
        got = part.state_dict()
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_split_must_divide_heads(dirs):
    model = load_model(dirs["qwen3_5_text"])
    with pytest.raises(ModelConfigError, match="tensor-parallel size 3 must divide"):
        shard_model(model, 0, 3)


def test_split_shapes(dirs):
    """Each rank keeps its block of heads: rank 1's q/k/v rows are the second half of each section."""
    full = load_model(dirs["qwen3_5_text"])
    part = shard_model(load_model(dirs["qwen3_5_text"]), 1, 2)
    a, b = full.layers[0].linear_attn, part.layers[0].linear_attn
    kd, vd = a.key_dim, a.value_dim
    w = a.in_proj_qkv.weight
    want = torch.cat([w[kd // 2 : kd], w[kd + kd // 2 : 2 * kd], w[2 * kd + vd // 2 :]])
    assert torch.equal(b.in_proj_qkv.weight, want)
    assert (b.hk, b.hv, b.conv_dim) == (a.hk // 2, a.hv // 2, a.conv_dim // 2)
    assert torch.equal(b.out_proj.weight, a.out_proj.weight[:, vd // 2 :])


def _requests():
    g = torch.Generator().manual_seed(5)

    def ids(n):
        return torch.randint(0, 256, (n,), generator=g).tolist()

    a, b, c, q = ids(40), ids(33), ids(52), ids(9)
    # cold, the same again (warm), then the segments reordered after another system prompt
    return [(ids(6), [a, b, c], q), (None, None, None), (ids(11), [c, a, b], ids(7))]


@pytest.mark.parametrize("arch", PIC_ARCHS)
def test_pic_warm_equals_cold_and_tp1(arch, dirs, engines):
    tp1 = Engine.from_dir(dirs[arch], config=RuntimeConfig(mode="pic"))
    tp2 = getattr(engines, f"pic_{arch}")
    r1, _, r3 = _requests()
    sampling = {"max_new_tokens": 0}
    reqs = [r1, r1, r3]
    logits = {1: [], 2: []}
    for system, segments, suffix in reqs:
        obj = {"system": system, "segments": segments, "suffix": suffix, "sampling_params": sampling}
        for n, eng in ((1, tp1), (2, tp2)):
            pre = eng.prefill(eng.parse_request(obj))
            logits[n].append((pre.logits, pre.stats))
            eng.finish_prefix(pre)
    (cold, s_cold), (warm, s_warm), (other, s_other) = logits[2]
    assert s_cold.built_tokens > 0 and all(not s.hit for s in s_cold.segments)
    assert s_warm.built_tokens == 0 and s_warm.segments[0].source == "prefix"  # the whole prompt's chain
    # after another prefix: every segment is folded in from the entries the TP = 2 ranks built
    assert [s.source for s in s_other.segments] == ["entry"] * 3 and s_other.built_tokens == 0
    assert _close(warm, cold) <= 1e-5
    # warm equals cold: the reordered request on a fresh engine builds all its entries
    fresh = Engine.from_dir(dirs[arch], config=RuntimeConfig(mode="pic"))
    r3_cold = fresh.prefill(fresh.parse_request({"system": r3[0], "segments": r3[1], "suffix": r3[2]}))
    assert r3_cold.stats.built_tokens > 0
    assert _close(other, r3_cold.logits) <= 1e-5
    for (x, _), (ref, _) in zip(logits[2], logits[1]):
        assert _close(x, ref) <= 1e-5
    # the entry key carries the split, the entry its rank: rank 0's holds half the heads
    seg = r1[1][0]
    assert tp2.entry_key(seg) != tp1.entry_key(seg)
    e2, e1 = tp2.entries.get(tp2.entry_key(seg)), tp1.entries.get(tp1.entry_key(seg))
    assert e2.meta["tensor_parallel"] == "0/2" and "tensor_parallel" not in e1.meta
    layer = next(iter(e1.data.linear))
    assert e2.data.linear[layer].S.shape[1] * SIZE == e1.data.linear[layer].S.shape[1]


def test_entry_of_another_split_is_a_miss(dirs):
    """A pinned entry whose tensor-parallel layout is not the engine's is rebuilt, never folded in."""
    eng = Engine.from_dir(dirs["qwen3_5_text"], config=RuntimeConfig(mode="pic"))
    r1 = _requests()[0]
    req = eng.parse_request({"system": r1[0], "segments": r1[1], "suffix": r1[2]})
    entry = eng.build_entry(r1[1][0])
    entry.meta["tensor_parallel"] = "1/2"
    for span in entry.data.linear.values():
        span.S.add_(1.0)  # would change the answer if it were used
    ref = Engine.from_dir(dirs["qwen3_5_text"], config=RuntimeConfig(mode="pic")).prefill(req)
    pre = eng.prefill(req, pinned={entry.key: entry})
    assert pre.stats.segments[0].source == "built"
    assert torch.allclose(pre.logits, ref.logits, atol=1e-6)


def test_scheduler_batched_decode_over_ranks(dirs, engines):
    """Concurrent requests through a Scheduler over the TP = 2 engine: batched decode steps over
    both ranks, the outputs those of TP = 1 one by one."""
    from hybridcache.services.runtime.scheduler import Scheduler

    tp1 = Engine.from_dir(dirs["qwen3_5_text"], config=RuntimeConfig(mode="pic"))
    r1, _, r3 = _requests()
    reqs = [{"system": r[0], "segments": r[1], "suffix": r[2],
             "sampling_params": {"max_new_tokens": 5 + i, "temperature": 0.0, "ignore_eos": True}}
            for i, r in enumerate([r1, r3, r1])]
    want = [LLM(tp1).generate(r).output_ids for r in reqs]
    sched = Scheduler(engines.pic_qwen3_5_text)
    try:
        handles = [sched.add_request(sched.engine.parse_request(r)) for r in reqs]
        got = [h.result().output_ids for h in handles]
    finally:
        sched.stop()
    assert got == want
    assert max(sched.batch_sizes) >= 2  # decode steps ran over several requests at once


def test_a_long_prompt_in_layer_parts_over_ranks(dirs, engines):
    """A plain prompt prefilled in chunks of three layer parts (Engine.prefill_chunk layer_parts)
    on the TP = 2 engine: each rank steps its own part-way forward (ModelRunner.run_part), the
    job is part-way between the parts, and the logits are TP = 1's; then through a Scheduler with
    chunk_layer_parts 3, TP = 1's greedy answer."""
    from hybridcache.services.runtime.scheduler import Scheduler, SchedulerConfig

    g = torch.Generator().manual_seed(11)
    req = {"suffix": torch.randint(0, 256, (200,), generator=g).tolist(),
           "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}
    tp1 = Engine.from_dir(dirs["qwen3_5_text"], config=RuntimeConfig(mode="full"))
    ref = tp1.prefill(tp1.parse_request(req))
    eng = engines.qwen3_5_text
    job = eng.start_prefill(eng.parse_request(req))
    part_way = 0
    while (pre := eng.prefill_chunk(job, 70, layer_parts=3)) is None:
        part_way += job.part_way
    assert part_way == 3 * 2  # three chunks, two of each one's three calls left it part-way
    assert _close(pre.logits, ref.logits) < 1e-4
    want = LLM(tp1).generate(req).output_ids
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=24, chunk_layer_parts=3))
    try:
        got = sched.add_request(eng.parse_request(req)).result().output_ids
    finally:
        sched.stop()
    assert got == want


def test_the_runner_of_a_tp_engine_runs_on_every_rank(dirs, engines):
    """An engine's runner is rank 0's RankedRunner: its forward and its pool's decode step run over
    both ranks (a call on rank 0 alone would wait for the other forever) and equal TP = 1."""
    ids = torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(6))
    tp1 = Engine.from_dir(dirs["qwen3_5_text"], config=RuntimeConfig(mode="full")).runner
    ref_state = tp1.empty_state()
    ref, _ = tp1.forward(ref_state, [LiveRun(ids[:-1], 0)], logits_for="last")
    ref_pool = tp1.new_state_pool(2, 128)
    ref_next, _ = tp1.decode(ref_pool, [ref_pool.assign(ref_state)], [int(ids[-1])])
    runner = engines.qwen3_5_text.runner
    assert isinstance(runner, ranks.RankedRunner) and engines.qwen3_5_text.group is runner.group
    assert not runner.graphs_apply and not runner.overlaps  # what a split model runs otherwise
    state = runner.empty_state()
    out, _ = runner.forward(state, [LiveRun(ids[:-1], 0)], logits_for="last")
    pool = runner.new_state_pool(2, 128)
    nxt, _ = runner.decode(pool, [runner.assign(pool, state)], [int(ids[-1])])
    assert ref.abs().max().item() > 1e-2
    assert _close(out, ref) <= 1e-5
    assert _close(nxt[0], ref_next[0]) <= 1e-5


def test_request_end_states_are_kept_on_every_rank(dirs, engines):
    """A finished request's end state (a prefill cut, then the page's payload replaced) is kept on
    both ranks: the next turn resumes there and answers as at TP = 1."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (150,), generator=g).tolist()
    sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    tp1 = LLM(Engine.from_dir(dirs["qwen3_5_text"], config=REQUEST_ENDS))
    tp2 = LLM(engines.request_ends)
    try:
        turns = []
        for llm in (tp1, tp2):
            first = llm.generate({"suffix": prompt, "sampling_params": sp})
            follow = {"suffix": prompt + first.output_ids + [9, 8, 7], "sampling_params": sp}
            turns.append((first.output_ids, llm.generate(follow)))
        (want_first, want), (got_first, got) = turns
        assert got_first == want_first and got.output_ids == want.output_ids
        assert got.stats.prefix_reused_tokens == want.stats.prefix_reused_tokens == 128
    finally:
        tp1.close()
        tp2.close()


def test_checkpoints_without_room_are_declined_on_every_rank(dirs, engines):
    """Six streams decoding under a small prefix budget: the checkpoints rank 0's page tree has no
    room for are not kept on any rank, so every rank's page lacks its state alike; outputs, and the
    next turn that replays through such a page, are those of TP = 1 with no budget."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (40,), generator=g).tolist() for _ in range(6)]
    sp = {"max_new_tokens": 100, "temperature": 0.0, "ignore_eos": True}
    tp1 = LLM(Engine.from_dir(dirs["qwen3_5_text"], config=RuntimeConfig(
        mode="prefix", prefix_policy="exact_replay", checkpoint_every=1)))
    eng = engines.held_budget
    tp2 = LLM(eng)
    try:
        want = tp1.generate([{"suffix": p, "sampling_params": sp} for p in prompts])
        got = tp2.generate([{"suffix": p, "sampling_params": sp} for p in prompts])
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert eng.pages.reserved_bytes == 0
        runs = [p + r.output_ids for p, r in zip(prompts, got)]
        bare = [i for i, run in enumerate(runs)
                if any(n.payload.checkpoint is None for n in eng.pages.match(run[:-1]))]
        assert bare
        follow = {"suffix": runs[bare[-1]] + [9, 8, 7], "sampling_params": dict(sp, max_new_tokens=5)}
        hit = len(eng.pages.match(runs[bare[-1]][:-1])) * 64
        a, b = tp1.generate(follow), tp2.generate(follow)
        assert b.output_ids == a.output_ids
        assert b.stats.prefix_reused_tokens == hit > 0
    finally:
        tp1.close()
        tp2.close()


def test_rendezvous_port_is_the_os_choice_outside_the_launchers_window():
    """The group's store listens on a port the OS picks from its ephemeral range: a port picked from
    `hybridcache up`'s window (below that range) could be one the launcher already gave this very
    service for its gRPC door, which binds only after the group starts."""
    from hybridcache.services.launcher import _ephemeral_low

    store = ranks._store(0, 2, timeout_s=10.0)
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert low == _ephemeral_low() and low <= store.port <= high
    store.set("k", "v")
    assert ranks._store(store.port, 2, timeout_s=10.0).get("k") == b"v"
