"""The linear states running requests' page recorders hold for pages not inserted yet (decode-time
checkpoints, request-end candidates) count in the page tree's byte budget: reserved before they are
copied (PageTree.reserve), skipped when there is no room, and greedy answers stay the same."""

import random

import pytest
from hybridcache.services.runtime.cache import PagePayload, PageTree
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM

P = 64
BUDGET = 150_000  # a few of the tiny model's dense states (16,896 bytes each) and pages
STREAMS, PROMPT, NEW = 6, 40, 100  # each stream passes positions 64 and 128 in decode


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from hybridcache.services.runtime.modelzoo import init_model_dir

    return init_model_dir("qwen3_5_text", "tiny", tmp_path_factory.mktemp("ckpt_budget") / "m", seed=0, std=0.08)


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def request(ids, new):
    return {"suffix": ids, "sampling_params": {"max_new_tokens": new, "ignore_eos": True}}


def held_bytes(recorders):
    """Bytes of the distinct storages behind the linear states the recorders hold, measured from
    the tensors themselves (not from the engine's accounting)."""
    storages = {}
    for r in recorders:
        states = list(r.checkpoints.values()) + ([r.end_state[1]] if r.end_state is not None else [])
        for linear in states:
            for s in linear.values():
                for t in (s.ssm, s.conv):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def watched_engine(model_dir, budget, **cfg):
    """An engine whose every decode step checks, after it ran, that the pages and the states its
    requests' recorders hold fit the prefix budget, and that the tree's reservation is exactly those
    states; `peak` records the most bytes held."""
    if budget is not None:
        cfg["prefix_cache_bytes"] = budget
    eng = Engine.from_dir(model_dir, config=EngineConfig(mode="prefix", checkpoint_every=1, **cfg))
    eng.peak = 0
    decode = eng.decode_batch

    def checked(prefills, *args, **kw):
        out = decode(prefills, *args, **kw)
        held = held_bytes([p.recorder for p in prefills if p.recorder is not None])
        eng.peak = max(eng.peak, held)
        assert eng.pages.used_bytes + held <= eng.pages.capacity_bytes
        assert eng.pages.reserved_bytes == held
        return out

    eng.decode_batch = checked
    return eng


@pytest.mark.parametrize("policy, cfg", [("exact_replay", {}), ("checkpoint", {"checkpoint_request_ends": True})],
                         ids=["exact_replay", "checkpoint-request-ends"])
def test_concurrent_decodes_hold_checkpoints_within_the_prefix_budget(tiny_dir, policy, cfg):
    prompts = [tokens(PROMPT, seed=i) for i in range(STREAMS)]
    eng = watched_engine(tiny_dir, BUDGET, prefix_policy=policy, **cfg)
    out = LLM(eng).generate([request(p, NEW) for p in prompts])
    free = watched_engine(tiny_dir, None, prefix_policy=policy, **cfg)
    ref = LLM(free).generate([request(p, NEW) for p in prompts])
    assert [r.output_ids for r in out] == [r.output_ids for r in ref]
    # unbounded, the streams hold more than the budget: what the bound is about
    assert free.peak > BUDGET
    assert 0 < eng.peak <= BUDGET
    assert eng.pages.reserved_bytes == 0  # every request gave its reservation back
    assert eng.pages.used_bytes <= BUDGET

    # pages whose checkpoint had no room went in without one
    runs = [p + r.output_ids[:-1] for p, r in zip(prompts, out)]  # the last sampled token never ran
    paths = {i: eng.pages.match(run) for i, run in enumerate(runs)}
    bare = [i for i, path in paths.items() if path and any(n.payload.checkpoint is None for n in path)]
    assert bare

    # the next turn hits where the budget allowed, with the answer of an unbounded cache
    i = bare[-1]
    follow = runs[i] + out[i].output_ids[-1:] + tokens(10, seed=100)
    want = LLM(free).generate(request(follow, 8))
    expected = len(eng.pages.match(follow[:-1], eng.page_policy.usable)) * P
    got = LLM(eng).generate(request(follow, 8))
    assert got.output_ids == want.output_ids
    assert got.stats.prefix_reused_tokens == expected
    if policy == "exact_replay":
        # every page is a hit: the one without a checkpoint replays its anchors from the one before
        assert expected == len(paths[i]) * P
    else:
        # a hit ends at a page with a state; the follow-up's prefill gave the bare page its own
        assert 0 < expected < len(paths[i]) * P
        node = eng.pages.match(runs[i][: len(paths[i]) * P])[-1]
        assert node.payload.checkpoint is not None
        again = LLM(eng).generate(request(follow, 8))
        assert again.output_ids == want.output_ids
        assert again.stats.prefix_reused_tokens > expected
    assert eng.pages.reserved_bytes == 0


def payload(nbytes):
    import torch

    return PagePayload(attn={0: (torch.zeros(nbytes // 4), torch.zeros(0))})


def test_reserve_evicts_unused_pages_and_refuses_past_locked_ones():
    tree = PageTree(1000, page_size=2)
    a = tree.insert([1, 2], lambda s: payload(400))  # locked
    tree.insert([3, 4], lambda s: payload(400))
    tree.unlock(tree.match([3, 4])[-1])
    assert tree.reserve(200) and tree.reserved_bytes == 200
    # 400 more: [3, 4], the unreferenced leaf, goes
    assert tree.reserve(400)
    assert len(tree) == 1 and tree.used_bytes == 400 and tree.reserved_bytes == 600
    # nothing left to evict: refused, nothing held
    assert not tree.reserve(1)
    assert tree.reserved_bytes == 600
    # an insert sees the reservation as used
    assert tree.insert([5, 6], lambda s: payload(8)) is None
    tree.unreserve(600)
    assert tree.reserved_bytes == 0 and tree.insert([5, 6], lambda s: payload(8)) is not None
    with pytest.raises(RuntimeError, match="unreserve"):
        tree.unreserve(1)
    tree.unlock(a)


@pytest.mark.parametrize("room", [True, False])
def test_a_prefill_request_end_state_is_held_in_the_budget_or_dropped(tiny_dir, room):
    """A prefill cut at the prompt's last page boundary keeps the request-end state there (4 new
    tokens cannot reach the next one) until the request ends: reserved beside its two locked pages
    when the budget has room, dropped at once when it has not (no hit at the next turn)."""
    probe = Engine.from_dir(tiny_dir, config=EngineConfig(mode="prefix", prefix_policy="checkpoint"))
    dense = sum(t.numel() * t.element_size() for s in probe.model.empty_state().linear.values()
                for t in (s.ssm, s.conv))
    ids = tokens(150, seed=7)
    LLM(probe).generate(request(ids[:2 * P + 1], 1))
    kv_page = probe.pages.used_bytes // 2
    budget = 2 * kv_page + dense - (0 if room else 1)
    eng = Engine.from_dir(tiny_dir, config=EngineConfig(mode="prefix", prefix_policy="checkpoint", checkpoint_every=128,
                                                         checkpoint_request_ends=True, prefix_cache_bytes=budget))
    pre = eng.prefill(eng.parse_request(request(ids, 4)))
    assert len(eng.pages) == 2
    assert eng.pages.reserved_bytes == (dense if room else 0)
    assert (pre.recorder.end_state is not None) == room
    eng.finish_prefix(pre)
    assert eng.pages.reserved_bytes == 0
    follow = eng.prefill(eng.parse_request(request(ids + [1, 2, 3], 1)))
    eng.finish_prefix(follow)
    assert follow.stats.prefix_reused_tokens == (2 * P if room else 0)
