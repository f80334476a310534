"""Prefix page tree: the three linear-state policies, conversation reuse, eviction and locking."""

import random

import pytest
import torch
from hybridcache.services.runtime.cache import PagePayload, PageTree, PrefixPolicy, restore_state
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.sequence import LiveRun

P = 64


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from hybridcache.services.runtime.modelzoo import init_model_dir

    return init_model_dir("qwen3_5_text", "tiny", tmp_path_factory.mktemp("prefix") / "m", seed=0, std=0.08)


def make_engine(model_dir, **kw):
    kw.setdefault("mode", "prefix")
    return Engine.from_dir(model_dir, config=EngineConfig(**kw))


def tokens(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def request(ids, new=1):
    return {"suffix": ids, "sampling_params": {"max_new_tokens": new, "ignore_eos": True}}


def full_prefill(model, ids):
    state = model.empty_state()
    model.forward_layout(state, [LiveRun(torch.tensor(ids), 0)], "none")
    return state


def state_error(got, ref):
    errs = [rel(got.linear[i].ssm, ref.linear[i].ssm) for i in ref.linear]
    errs += [rel(got.linear[i].conv, ref.linear[i].conv) for i in ref.linear]
    errs += [rel(got.attn[i].k, ref.attn[i].k) for i in ref.attn]
    errs += [rel(got.attn[i].v, ref.attn[i].v) for i in ref.attn]
    return max(errs)


def test_exact_replay_restores_full_prefill_at_every_page(tiny_dir):
    # Checkpoints after pages 2 and 4: pages 1, 3, 5 restore by replaying anchors.
    eng = make_engine(tiny_dir, prefix_policy="exact_replay", checkpoint_every=2)
    ids = tokens(5 * P + 7)
    LLM(eng).generate(request(ids))
    assert len(eng.pages) == 5
    for d in range(1, 6):
        path = eng.pages.match(ids[: d * P], eng.page_policy.usable)
        assert len(path) == d
        got = restore_state(eng.model, eng.page_policy, path)
        assert got.length == d * P
        assert state_error(got, full_prefill(eng.model, ids[: d * P])) <= 1e-5, d


@pytest.mark.parametrize("read_tokens", [2 * P, 4096])
def test_pages_are_read_a_group_at_a_time(tiny_dir, monkeypatch, read_tokens):
    """A prefill's pages get their K/V from one read of each attention layer a group of pages
    (PageRecorder.READ_TOKENS: here 2 pages, or all 5 at once): each page's K/V equal the full
    prefill's rows there, stored apart (one storage of the page's own, all of its layers' K/V and
    nothing else; another for all of its anchors), and restoring gives the full prefill."""
    from hybridcache.services.runtime.cache.policies import PageRecorder
    from hybridcache.services.runtime.paged import PagedAttnState
    from hybridcache.services.runtime.sequence import AttnState

    monkeypatch.setattr(PageRecorder, "READ_TOKENS", read_tokens)
    reads = []
    for cls in (AttnState, PagedAttnState):
        monkeypatch.setattr(cls, "span",
                            lambda self, lo, hi, span=cls.span: reads.append((lo, hi)) or span(self, lo, hi))
    eng = make_engine(tiny_dir, prefix_policy="exact_replay", checkpoint_every=2)
    ids = tokens(5 * P + 7, seed=3)
    LLM(eng).generate(request(ids))
    ref = full_prefill(eng.model, ids)
    path = eng.pages.match(ids[: 5 * P], eng.page_policy.usable)
    assert len(path) == 5
    storages = set()
    for d, node in enumerate(path):
        payload = node.payload if hasattr(node, "payload") else node
        own = {t.untyped_storage().data_ptr() for kv in payload.attn.values() for t in kv}
        page_bytes = sum(t.nbytes for kv in payload.attn.values() for t in kv)
        assert len(own) == 1 and not own & storages
        storages |= own
        # its anchors (every group entry's P rows) in one buffer of the page's own, apart from its K/V
        anchors = list(payload.anchors.values())
        mine = {a.untyped_storage().data_ptr() for a in anchors}
        assert len(anchors) == len(eng.model.linear_groups()) and all(a.shape[0] == P for a in anchors)
        assert len(mine) == 1 and not mine & storages
        assert anchors[0].untyped_storage().nbytes() == sum(a.nbytes for a in anchors)
        storages |= mine
        for i, (k, v) in payload.attn.items():
            assert k.is_contiguous() and v.is_contiguous() and k.shape[2] == P
            assert k.untyped_storage().nbytes() == page_bytes
            assert rel(k, ref.attn[i].k[:, :, d * P : (d + 1) * P]) <= 1e-6
            assert rel(v, ref.attn[i].v[:, :, d * P : (d + 1) * P]) <= 1e-6
    # one read a layer and group of pages: (0, 2P), (2P, 4P), (4P, 5P) or (0, 5P)
    want = [(0, 2 * P), (2 * P, 4 * P), (4 * P, 5 * P)] if read_tokens == 2 * P else [(0, 5 * P)]
    assert sorted(set(reads)) == want and len(reads) == len(ref.attn) * len(want), reads
    got = restore_state(eng.model, eng.page_policy, path)
    assert state_error(got, full_prefill(eng.model, ids[: 5 * P])) <= 1e-5


@pytest.mark.parametrize("page_major", [False, True], ids=["strided", "page-major"])
def test_a_page_s_kv_is_copied_out_of_a_group_read_in_either_form(page_major):
    """A group read of 3 pages, kept as it is (the CPU's form) or page-major (CUDA's: each page
    one contiguous block): every page's K/V of every layer equal the read's rows, in storage of
    the page's own (one buffer a page where the layers' shapes agree, a copy each where they do
    not: MLA's K and V widths differ)."""
    from hybridcache.services.runtime.cache.policies import _by_page, _page_kv, _page_of

    g = torch.Generator().manual_seed(0)
    for kd, vd in ((8, 8), (12, 8)):
        reads = {i: (torch.randn(1, 2, 3 * P, kd, generator=g), torch.randn(1, 2, 3 * P, vd, generator=g))
                 for i in (3, 7)}
        held = {i: tuple(_by_page(t, P, page_major) for t in kv) for i, kv in reads.items()}
        assert all(t.dim() == (5 if page_major else 4) for kv in held.values() for t in kv)
        seen, kept = set(), []
        for page in range(3):
            got = _page_kv({i: tuple(_page_of(t, page * P, P) for t in kv) for i, kv in held.items()})
            kept.append(got)  # alive, so that no page's storage is another's freed one
            for i, (k, v) in got.items():
                assert torch.equal(k, reads[i][0][:, :, page * P : (page + 1) * P])
                assert torch.equal(v, reads[i][1][:, :, page * P : (page + 1) * P])
            own = {t.untyped_storage().data_ptr() for kv in got.values() for t in kv}
            assert len(own) == (1 if kd == vd else 4) and not own & seen
            seen |= own


def test_exact_replay_hit_gives_the_cacheless_answer(tiny_dir):
    ids = tokens(5 * P + 20, seed=1)
    cold = LLM(make_engine(tiny_dir, mode="full")).generate(request(ids, new=6))
    eng = make_engine(tiny_dir, prefix_policy="exact_replay")
    LLM(eng).generate(request(ids[: 4 * P + 30], new=1))
    warm = LLM(eng).generate(request(ids, new=6))
    assert warm.stats.prefix_reused_tokens == 4 * P
    assert warm.stats.prefix_policy == "exact_replay"
    assert warm.output_ids == cold.output_ids


def test_checkpoint_hits_only_at_its_boundaries(tiny_dir):
    eng = make_engine(tiny_dir, prefix_policy="checkpoint", checkpoint_every=2)
    ids = tokens(7 * P + 5, seed=2)
    LLM(eng).generate(request(ids))
    assert len(eng.pages) == 7
    for n in (P - 1, P + 3, 2 * P + 1, 3 * P + 10, 4 * P + 1, 7 * P + 2):
        res = LLM(eng).generate(request(ids[:n]))
        expected = ((n - 1) // (2 * P)) * 2 * P
        assert res.stats.prefix_reused_tokens == expected, n
    path = eng.pages.match(ids[: 6 * P], eng.page_policy.usable)
    assert len(path) == 6
    got = restore_state(eng.model, eng.page_policy, path)
    assert state_error(got, full_prefill(eng.model, ids[: 6 * P])) <= 1e-5


def test_suffix_replay_error_shrinks_as_more_anchors_replay(tiny_dir):
    """With A = 1 in every linear layer (per-token decay exp(-softplus(a + dt_bias)), about 0.3,
    in every head), replaying more anchors from a zero state brings the linear state closer to
    the true one; replaying every token of the prefix is exact."""
    eng = make_engine(tiny_dir, prefix_policy="suffix_replay", anchors_per_page=16)
    model = eng.model
    for layer in model.model.layers:
        if layer.kind == "linear_attention":
            layer.linear_attn.A_log.data.zero_()
    ids = tokens(4 * P, seed=3)
    LLM(eng).generate(request(ids + [1]))
    path = eng.pages.match(ids)
    assert len(path) == 4
    ref = full_prefill(model, ids)
    errors = []
    for k in (2, 4, 8, 16):
        policy = PrefixPolicy("suffix_replay", anchors_per_page=16, replay_anchors=k)
        got = restore_state(model, policy, path)
        errors.append(sum(rel(got.linear[i].ssm, ref.linear[i].ssm) for i in ref.linear) / len(ref.linear))
        # Attention K/V is cached per page, never approximated.
        assert max(rel(got.attn[i].k, ref.attn[i].k) for i in ref.attn) <= 1e-6
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.05 * errors[0], errors
    every_token = PrefixPolicy("suffix_replay", anchors_per_page=P, replay_anchors=4 * P)
    config = EngineConfig(mode="prefix", prefix_policy="suffix_replay", anchors_per_page=P)
    eng_all = Engine(model, eng.tokenizer, config)
    LLM(eng_all).generate(request(ids + [1]))
    got = restore_state(model, every_token, eng_all.pages.match(ids))
    assert state_error(got, ref) <= 1e-5


@pytest.mark.parametrize("policy", ["exact_replay", "checkpoint", "suffix_replay"])
def test_three_turn_conversation_reuses_each_previous_turn(tiny_dir, policy):
    eng = make_engine(tiny_dir, prefix_policy=policy, checkpoint_every=1, anchors_per_page=4)
    cold = make_engine(tiny_dir, mode="full") if policy == "exact_replay" else None
    prompt = tokens(110, seed=4)
    previous_run, previous_prompt = 0, []
    for turn in range(3):
        res = LLM(eng).generate(request(prompt, new=24))
        assert res.stats.prefix_reused_tokens == (min(previous_run, len(prompt) - 1) // P) * P, turn
        if turn:
            # The previous turn's answer is reused too, not only its prompt.
            assert res.stats.prefix_reused_tokens > len(previous_prompt), turn
        assert res.stats.linear_state_bytes > 0
        if cold is not None:
            assert res.output_ids == LLM(cold).generate(request(prompt, new=24)).output_ids, turn
        previous_run = len(prompt) + len(res.output_ids) - 1  # the last sampled token never ran
        previous_prompt = prompt
        prompt = prompt + res.output_ids + tokens(40, seed=10 + turn)


def test_policies_bytes_per_token_order(tiny_dir):
    ids = tokens(3 * P + 1, seed=6)
    per_token = {}
    for policy in ("checkpoint", "suffix_replay", "exact_replay"):
        eng = make_engine(tiny_dir, prefix_policy=policy, checkpoint_every=1)
        LLM(eng).generate(request(ids))
        per_token[policy] = LLM(eng).generate(request(ids)).stats.linear_state_bytes / (3 * P)
        assert per_token[policy] * 3 * P == eng.pages.linear_bytes
    assert per_token["suffix_replay"] < per_token["exact_replay"]
    assert per_token["suffix_replay"] < per_token["checkpoint"]


def test_pic_mode_caches_exact_pages_only(tiny_dir):
    """Pages after the first reused segment body are PIC-assembled (approximate): not in the tree."""
    system = tokens(P + 60, seed=7)
    req = {
        "system": system,
        "segments": [tokens(60, seed=8), tokens(50, seed=9)],
        "suffix": tokens(12, seed=10),
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
    }
    eng = make_engine(tiny_dir, mode="pic")
    first = LLM(eng).generate(req)
    # Exact region: the system prompt and the first segment's seam window (8 tokens).
    assert len(eng.pages) == (len(system) + 8) // P
    again = LLM(eng).generate(req)
    assert again.output_ids == first.output_ids
    prefix_only = make_engine(tiny_dir, mode="prefix")
    LLM(prefix_only).generate(req)
    assert len(prefix_only.pages) == (len(system) + 60 + 50 + 12 + 3) // P


# Tree mechanics (no model)


def payload(nbytes=64):
    t = torch.zeros(nbytes // 8, dtype=torch.float32)
    return PagePayload(attn={0: (t, t.clone())})


def test_eviction_never_frees_a_page_in_use():
    tree = PageTree(capacity_bytes=4 * 64, page_size=2)
    a = [1, 2, 3, 4, 5, 6]
    tip_a = tree.insert(a, lambda s: payload())
    assert tip_a is not None and len(tree) == 3
    # a is locked (insert returns its tip locked): b can only use the one free page.
    tip_b = tree.insert([9, 9, 8, 8, 7, 7], lambda s: payload())
    assert len(tree.match(a)) == 3
    assert tip_b is not None and tip_b.depth == 1
    assert tree.used_bytes <= tree.capacity_bytes
    # Nothing unreferenced is left to evict.
    assert tree.evict(10**6) == 0
    tree.unlock(tip_b)
    assert tree.evict(64) == 64 and len(tree.match(a)) == 3
    tree.unlock(tip_a)
    # Leaves go first: evicting one page of a takes its last page, and the path stays whole.
    assert tree.evict(64) == 64
    assert len(tree.match(a)) == 2


def test_eviction_is_least_recently_used_leaf_first():
    tree = PageTree(capacity_bytes=3 * 64, page_size=1)
    for seq in ([1], [2], [3]):
        tree.unlock(tree.insert(seq, lambda s: payload()))
    tree.match([1])  # [2] is now least recently used
    tree.unlock(tree.insert([4], lambda s: payload()))
    assert tree.match([2]) == [] and len(tree.match([1])) == 1 and len(tree.match([3])) == 1


def test_engine_requests_in_flight_keep_their_pages(tiny_dir):
    """A request not yet finished (prefilled, its pages locked until finish_prefix) holds its pages;
    a later request cannot evict them."""
    probe = make_engine(tiny_dir)
    ids_a, ids_b = tokens(3 * P + 5, seed=11), tokens(3 * P + 5, seed=12)
    LLM(probe).generate(request(ids_a))
    page_bytes = probe.pages.used_bytes // 3
    eng = make_engine(tiny_dir, prefix_cache_bytes=4 * page_bytes + 16)
    pre_a = eng.prefill(eng.parse_request(request(ids_a, new=2)))
    assert len(eng.pages.match(ids_a)) == 3
    llm = LLM(eng)
    llm.generate(request(ids_b))
    assert len(eng.pages.match(ids_a)) == 3  # a's pages survived while a was running
    assert len(eng.pages.match(ids_b)) == 1  # b got only the room left
    eng.finish_prefix(pre_a)  # a finishes: its pages are released
    llm.generate(request(ids_b + [3]))
    assert len(eng.pages.match(ids_b)) >= 2
    assert eng.pages.used_bytes <= eng.pages.capacity_bytes


def test_bad_policy_config_is_a_clear_error():
    with pytest.raises(ValueError, match="prefix_policy must be one of"):
        EngineConfig(prefix_policy="dense")
    with pytest.raises(ValueError, match="anchors_per_page"):
        EngineConfig(prefix_policy="suffix_replay", anchors_per_page=0)
    with pytest.raises(ValueError, match="checkpoint_every"):
        EngineConfig(checkpoint_every=0)


def test_cli_generate_takes_prefix_policy_flags(tiny_dir, tmp_path, capsys):
    import json

    from hybridcache.services.cli import main

    ids = tokens(2 * P + 9, seed=13)
    req_file = tmp_path / "reqs.json"
    req_file.write_text(json.dumps([request(ids), request(ids + [5])]))
    argv = ["generate", "--model", str(tiny_dir), "--request", str(req_file), "--mode", "prefix",
            "--prefix-policy", "suffix_replay", "--anchors-per-page", "8", "--replay-anchors", "16"]
    assert main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["stats"]["prefix_policy"] for x in lines] == ["suffix_replay", "suffix_replay"]
    assert lines[1]["stats"]["prefix_reused_tokens"] == 2 * P
    h = 64  # the tiny model's hidden size; one linear group entry per group, fp32 anchors
    groups = 2
    assert lines[1]["stats"]["linear_state_bytes"] == 2 * 8 * groups * h * 4
    assert main(argv[:-1] + ["0"]) == 2
    assert "replay_anchors must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["qwen3_next", "olmo_hybrid", "nemotron_h", "kimi_linear"])
def test_exact_replay_is_exact_for_every_family(arch, tmp_path):
    """Replay runs each family's own linear groups (Mamba2 / GDN / KDA layers, MLP-only layers between)."""
    from hybridcache.services.runtime.modelzoo import init_model_dir

    model_dir = init_model_dir(arch, "tiny", tmp_path / arch, seed=0, std=0.08)
    eng = make_engine(model_dir, prefix_policy="exact_replay", checkpoint_every=2)
    ids = tokens(3 * P + 5, seed=14)
    LLM(eng).generate(request(ids))
    path = eng.pages.match(ids, eng.page_policy.usable)
    assert len(path) == 3  # the third page restores by replaying from the checkpoint after page 2
    got = restore_state(eng.model, eng.page_policy, path)
    assert state_error(got, full_prefill(eng.model, ids[: 3 * P])) <= 1e-5


def test_pic_request_resumes_inside_a_segment_from_a_page_hit(tiny_dir):
    """A page hit that ends inside a segment: the rest of that segment runs live, later segments
    come from their entries — the same state as sending the hit tokens as a live system part."""
    system, doc1 = tokens(100, seed=15), tokens(200, seed=16)
    doc2, q = tokens(80, seed=17), tokens(10, seed=18)
    params = {"max_new_tokens": 1, "ignore_eos": True}
    prefix_eng = make_engine(tiny_dir, mode="prefix")
    # 4 pages of system + doc1
    LLM(prefix_eng).generate({"suffix": system + doc1 + [7], "sampling_params": params})
    pic = Engine(prefix_eng.model, prefix_eng.tokenizer, EngineConfig(mode="pic"), page_tree=prefix_eng.pages)
    req = {"system": system, "segments": [doc1, doc2], "suffix": q, "sampling_params": params}
    pre = pic.prefill(pic.parse_request(req))
    pic.finish_prefix(pre)
    assert pre.stats.prefix_reused_tokens == 4 * P
    assert [s.source for s in pre.stats.segments] == ["live", "built"]
    same = make_engine(tiny_dir, mode="pic")
    ref = same.prefill(same.parse_request({"system": system + doc1, "segments": [doc2], "suffix": q,
                                           "sampling_params": params}))
    assert rel(pre.logits, ref.logits) <= 1e-4


def peer_engine(model_dir, **kw):
    """The checkpoint policy as SGLang's mamba radix cache keeps states: a dense state every
    8,192 tokens (its chunked-prefill chunk: never inside these prompts) and where each finished
    request ended."""
    return make_engine(model_dir, prefix_policy="checkpoint", checkpoint_every=128, checkpoint_request_ends=True,
                       **kw)


def dense_state_bytes(model):
    return sum(t.numel() * t.element_size() for s in model.empty_state().linear.values() for t in (s.ssm, s.conv))


def tree_bytes(tree):
    """(all, linear) bytes of the pages reachable in `tree`, summed from their payloads."""
    total = linear = 0
    stack = [tree.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.payload is not None:
            total, linear = total + node.payload.nbytes, linear + node.payload.linear_nbytes
    return total, linear


# (prompt tokens, new tokens, where the request-end state is, whether the scheduler's batched plain
# prefill runs the prompt): the last page boundary reached in decode (the prompt needs no cut);
# in the prompt, from a prefill cut there (4 new tokens cannot reach the next boundary); at the
# prompt's last token but one, where the batched plain prefill's pass ends
@pytest.mark.parametrize("n, new, end, plain", [(100, 40, 2 * P, True), (150, 4, 2 * P, False),
                                                (2 * P + 1, 3, 2 * P, True)], ids=["decode", "prefill-cut", "plain"])
def test_request_end_state_resumes_the_next_turn_exactly(tiny_dir, n, new, end, plain):
    eng = peer_engine(tiny_dir)
    ids = tokens(n, seed=20)
    assert eng.plain_prefill_ok(eng.parse_request(request(ids, new=new))) == plain
    llm = LLM(eng)
    first = llm.generate(request(ids, new=new))
    assert llm.scheduler.plain_prefilled == plain
    ran = ids + first.output_ids[:-1]  # the last sampled token never ran
    path = eng.pages.match(ran, eng.page_policy.usable)
    assert len(path) * P == end
    assert state_error(restore_state(eng.model, eng.page_policy, path), full_prefill(eng.model, ran[:end])) <= 1e-5
    # the one dense state is counted in the tree's bytes, beside the pages' K/V
    assert eng.pages.linear_bytes == dense_state_bytes(eng.model)
    assert (eng.pages.used_bytes, eng.pages.linear_bytes) == tree_bytes(eng.pages)

    follow = ids + first.output_ids + tokens(20, seed=21)  # the next turn: history and a new message
    pre = eng.prefill(eng.parse_request(request(follow)))
    eng.finish_prefix(pre)
    assert pre.stats.prefix_reused_tokens == end
    cold = make_engine(tiny_dir, mode="full")
    ref = cold.prefill(cold.parse_request(request(follow)))
    assert rel(pre.logits, ref.logits) <= 1e-5

    # the grid alone (SGLang's chunk ends) keeps nothing inside these prompts: no hit
    grid = make_engine(tiny_dir, prefix_policy="checkpoint", checkpoint_every=128)
    LLM(grid).generate(request(ids, new=new))
    assert grid.prefill(grid.parse_request(request(follow))).stats.prefix_reused_tokens == 0
    assert grid.pages.linear_bytes == 0


def test_request_end_states_share_the_budget_and_its_eviction(tiny_dir):
    probe = make_engine(tiny_dir, prefix_policy="checkpoint", checkpoint_every=128)
    LLM(probe).generate(request(tokens(2 * P + 1, seed=22)))
    page = probe.pages.used_bytes // 2  # one page's K/V
    dense = dense_state_bytes(probe.model)
    a, b = tokens(100, seed=23), tokens(100, seed=24)  # each ends at 2 pages, its state in decode

    # one byte short of a's two pages and its state: a keeps its pages, not its state
    short = peer_engine(tiny_dir, prefix_cache_bytes=2 * page + dense - 1)
    out = LLM(short).generate(request(a, new=40)).output_ids
    assert len(short.pages) == 2 and short.pages.linear_bytes == 0
    assert short.prefill(short.parse_request(request(a + out + [5]))).stats.prefix_reused_tokens == 0

    eng = peer_engine(tiny_dir, prefix_cache_bytes=2 * page + dense)
    llm = LLM(eng)
    out_a = llm.generate(request(a, new=40)).output_ids
    assert eng.pages.used_bytes == eng.pages.capacity_bytes and eng.pages.linear_bytes == dense
    # b needs room: a's least recently used leaf goes, its state with it
    llm.generate(request(b, new=40))
    assert len(eng.pages.match(a + out_a)) < 2
    assert eng.pages.used_bytes <= eng.pages.capacity_bytes
    assert (eng.pages.used_bytes, eng.pages.linear_bytes) == tree_bytes(eng.pages)
    assert eng.pages.linear_bytes in (0, dense)


def test_request_end_checkpoints_are_a_checkpoint_setting():
    with pytest.raises(ValueError, match="checkpoint_request_ends"):
        PrefixPolicy("suffix_replay", request_end_checkpoints=True)
    assert EngineConfig(prefix_policy="checkpoint", checkpoint_request_ends=True).page_policy.request_end_checkpoints
    # the other policies ignore it, as they ignore each other's settings
    for other in ("exact_replay", "suffix_replay"):
        policy = EngineConfig(prefix_policy=other, checkpoint_request_ends=True).page_policy
        assert not policy.request_end_checkpoints and policy.request_end_position(3 * P) == 0


def test_a_walk_from_a_locked_page_equals_one_from_the_root():
    """PageTree.insert and match from `start` (a page of the prefix the caller holds locked) make
    and find the same pages, with the same reference counts, as walks from the root; a start that
    no longer hangs in this tree (or under this salt) is ignored."""
    ids = list(range(1, 4 * 16 + 1))
    made = []

    def make(a):
        made.append(a)
        return payload()

    ref, tree = PageTree(1 << 20, page_size=16), PageTree(1 << 20, page_size=16)
    tip_ref = ref.insert(ids[:32], make)
    tip = tree.insert(ids[:32], make)
    assert tip.depth == 2 and made == [0, 16, 0, 16]
    made.clear()
    deeper_ref = ref.insert(ids, make)
    deeper = tree.insert(ids, make, start=tip)
    assert made == [32, 48, 32, 48]  # each tree made only the new pages
    assert [n.tokens for n in tree.match(ids, start=tip)] == [n.tokens for n in ref.match(ids)]
    assert len(tree.match(ids[:40], start=tip)) == 2
    for a, b in zip(deeper_ref.path(), deeper.path()):
        assert (a.tokens, a.ref_count) == (b.tokens, b.ref_count)
    for t, node in ((ref, tip_ref), (ref, deeper_ref), (tree, tip), (tree, deeper)):
        t.unlock(node)
    assert all(n.ref_count == 0 for n in deeper.path())
    # a page of another tree, or of the unsalted root for a salted walk, is not a start
    made.clear()
    assert tree.insert(ids, make, start=deeper_ref).path()[-1].tokens == tuple(ids[48:64]) and made == []
    salted = tree.insert(ids[:16], make, salt="s", start=deeper)
    assert salted.depth == 1 and made == [0]


def test_a_recorder_s_rows_are_joined_as_it_decodes():
    """A request that decodes holds a layer's rows in a few tensors (joined every JOIN_CHUNKS
    steps, blocks of equal size joined in turn), not one tensor a token: each is an object the
    interpreter's full collections walk. The rows read back are the rows appended, in order,
    across a prefill chunk, hundreds of one-row steps and a drop_before."""
    from hybridcache.services.runtime.cache.policies import PageRecorder

    rec = PageRecorder(PrefixPolicy("exact_replay"), 0, [], (1, 3))
    g = torch.Generator().manual_seed(0)
    rows = {1: [], 3: []}

    def add(n):
        captured = {i: torch.randn(n + 2, 8, generator=g) for i in (1, 3)}  # a forward's rows, n of them taken
        rec.add_hidden(captured, n)
        for i in rows:
            rows[i].append(captured[i][:n])

    add(100)
    for step in range(1000):
        add(1)
        # a few blocks of decreasing size, then the chunks since the last join
        held = rec.hidden[1]
        assert len(held) <= PageRecorder.JOIN_CHUNKS + 11, step
        blocks = rec._blocks.get(1, 0)
        assert all(held[b].shape[0] > held[b + 1].shape[0] for b in range(blocks - 1))
    assert len(rec.hidden[3]) < 45
    for i in rows:
        assert torch.equal(rec._anchors(i), torch.cat(rows[i]))
    rec.drop_before(P * 8)  # pages up to 512 cached: the rows after them kept, one block
    for _ in range(70):
        add(1)
    for i in rows:
        assert torch.equal(rec._anchors(i), torch.cat(rows[i])[P * 8 :])
        assert len(rec.hidden[i]) <= PageRecorder.JOIN_CHUNKS + 2
