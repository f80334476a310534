"""`hybridcache eval --multi-turn`: the conversations' construction (every request after the first
resumes at a page boundary between the checkpoint grid's positions, whatever the model answered),
and a small run through the engine's page tree that resumes exactly there."""

import json

import pytest
from hybridcache.services.runtime.evaluation import (
    eval_conversations,
    evaluate_multiturn,
    main,
    multiturn_figures,
    multiturn_json,
    multiturn_runs,
)
from hybridcache.services.runtime.modelzoo import SHIPPED_MODEL
from hybridcache.services.runtime.qa_data import answer_text, restore_bounds, restore_point

needs_model = pytest.mark.skipif(
    not (SHIPPED_MODEL / "model.safetensors").is_file(),
    reason="models/default is not shipped in this checkout",
)
P, GRID = 64, 4 * 64


@pytest.fixture(scope="module")
def encode():
    from hybridcache.services.runtime.tokenizer import Tokenizer

    if not (SHIPPED_MODEL / "tokenizer.json").is_file():
        pytest.skip("models/default is not shipped in this checkout")
    return Tokenizer.from_dir(SHIPPED_MODEL).encode


def _prompts(conv, encode):
    prompts = [conv.prompt_ids(t, encode) for t in range(len(conv.turns))]
    answers = [encode(answer_text(turn.example.answer)) for turn in conv.turns]
    return prompts, answers


@pytest.mark.parametrize("seed", [0, 1])
def test_every_resumed_request_falls_between_grid_positions(encode, seed):
    convs = eval_conversations(3, encode, seed=seed, hops=1, turns=5, branches=2, branch_turns=2)
    for conv in convs:
        assert [t.line for t in conv.turns] == [0] * 5 + [1, 1, 2, 2]
        prompts, answers = _prompts(conv, encode)
        for t, turn in enumerate(conv.turns):
            # every turn's prompt is its parent's prompt, the parent's gold answer, and a new question
            if turn.parent is not None:
                parent = prompts[turn.parent] + answers[turn.parent]
                assert prompts[t][: len(parent)] == parent
                assert len(prompts[t]) > len(parent)
            if t == 0:
                assert turn.parent is None
                continue
            lo, hi = restore_bounds(prompts, answers, t)
            p = restore_point(prompts, answers, t, P)
            # whatever the model answered before, a page cache resumes at the same page boundary,
            # strictly between two positions of the checkpoint grid
            assert p is not None and lo // P == hi // P == p // P
            assert 0 < p < len(prompts[t]) and p % GRID != 0, (t, p)
        # a branch's first turn leaves the request before it: it shares only part of it
        for t, turn in enumerate(conv.turns):
            if turn.line and conv.turns[t - 1].line != turn.line:
                assert conv.turns[turn.parent].line == 0
                assert prompts[t][: len(prompts[t - 1])] != prompts[t - 1]
    # the construction is fixed by the seed
    again = eval_conversations(3, encode, seed=seed, hops=1, turns=5, branches=2, branch_turns=2)
    assert again == convs


def test_bad_conversation_shapes_are_refused(encode):
    with pytest.raises(ValueError, match="turns >= 2"):
        eval_conversations(1, encode, turns=1)
    with pytest.raises(ValueError, match="limit"):
        eval_conversations(0, encode)


@needs_model
def test_engine_resumes_where_the_construction_says():
    """Each run keeps one engine for the conversation: exact_replay and suffix_replay resume every
    request at the predicted off-grid page boundary, checkpoint falls back to the grid below it,
    and the exact policies answer as full recompute does."""
    runs = multiturn_runs((16,), ("float8_e4m3fn",))
    scores, convs = evaluate_multiturn(SHIPPED_MODEL, limit=1, seed=2, hops=1, runs=runs, min_docs=2, max_docs=2,
                                       turns=2, branches=1, branch_turns=1, progress=False)
    assert set(scores) == {"full", "checkpoint", "exact_replay", "suffix_replay_k16_fp8"}
    assert len(convs) == 1 and len(scores["full"].turns) == 3
    for t in scores["full"].turns:
        assert t.restored_tokens == 0
    for name in ("exact_replay", "suffix_replay_k16_fp8"):
        res = scores[name].resumed()
        assert len(res) == 2
        for t in res:
            assert t.restored_tokens == t.expected_restore and t.restored_tokens % GRID != 0, (name, t)
    for t in scores["checkpoint"].resumed():
        assert t.restored_tokens == t.expected_restore // GRID * GRID < t.expected_restore
    results = multiturn_json(scores, GRID)
    for name in ("checkpoint", "exact_replay"):
        assert results[name]["agreement_with_full_resumed"] == 1.0, results
    assert results["suffix_replay_k16_fp8"]["hits_between_grid_positions"] == 2
    # suffix_replay's restored state measured against the exact one at the same page: approximate,
    # and the exact policies' answers keep full recompute's log p
    sr = results["suffix_replay_k16_fp8"]
    assert 0 < sr["linear_state_rel_err_mean"] <= sr["linear_state_rel_err_max"] < 1.5
    assert "linear_state_rel_err_mean" not in results["exact_replay"]
    assert results["exact_replay"]["answer_logprob_abs_diff_max"] < 1e-4
    assert results["checkpoint"]["hits_between_grid_positions"] == 0
    figures = multiturn_figures(results, 16)
    assert figures["suffix_replay_em_vs_full_multiturn"] == results["suffix_replay_k16_fp8"]["em_resumed_vs_full"]


@needs_model
def test_cli_multi_turn_writes_the_record(tmp_path, capsys):
    out = tmp_path / "mt.json"
    code = main(["--model", str(SHIPPED_MODEL), "--multi-turn", "--limit", "1", "--min-docs", "2", "--max-docs", "2",
                 "--turns", "2", "--branches", "1", "--branch-turns", "1", "--replay-lengths", "16",
                 "--anchor-dtypes", "bfloat16", "--anchors-per-page", "8", "--no-progress", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    rec = json.loads(out.read_text())
    assert set(rec["results"]) == {"full", "checkpoint", "exact_replay", "suffix_replay_k16_bf16"}
    assert rec["config"]["requests"] == 3 and rec["config"]["checkpoint_grid_tokens"] == GRID
    assert rec["config"]["anchors_per_page"] == 8
    assert rec["results"]["suffix_replay_k16_bf16"]["hits"] == 2
    assert {"commit", "date", "machine", "command", "figures"} <= set(rec)


@pytest.mark.parametrize("args, message", [
    (["--multi-turn", "--runs", "full"], "--runs names single-turn runs"),
    (["--multi-turn", "--replay-lengths", "16,x"], "comma list of positive integers"),
    (["--multi-turn", "--anchor-dtypes", "int4"], "unknown anchor dtype"),
    (["--multi-turn", "--turns", "1"], "--turns >= 2"),
], ids=["runs", "lengths", "dtype", "turns"])
def test_cli_multi_turn_bad_input_exits_2(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        code = main(["--model", "/nonexistent", *args])
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
