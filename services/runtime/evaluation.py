"""Quality harness: exact-match accuracy of cached answers on the multi-document QA task.

Each run gets its own engine over one loaded model, its requests served by a scheduler
(llm.LLM, the combine worker's path), its caches emptied before every question:

    full     no cache
    prefix   exact prefix cache
    pic      prefix cache + position-independent segment entries, seam window w = 8
    pic_w0 / pic_w4 / pic_w16   the same with w = 0, 4, 16
    naive    pic (w = 8) composing without T (ablation)

Runs that cache first see a warm-up request: the same documents in another order after another
instruction. The question is then asked with the documents in a third order after the example's own
instruction, so every segment entry is reused at a new position after a new prefix.

Prefix-policy runs (not in the default set; `--runs` names them) measure how the page tree's
linear-state policies (cache/policies.py) restore a shared prefix: the warm-up asks another
question over the same instruction and documents in the same order, so the second request hits
the tree at the last page boundary (or checkpoint) inside the shared documents, the policy restores
the linear state there, and only the rest is prefilled:

    prefix_exact     exact_replay (anchors + checkpoint every 4 pages): exact
    prefix_ckpt      checkpoint every 4 pages: exact, hits only at checkpoints
    prefix_sr_k16    suffix_replay, r = 4 anchors per page, replay k = 16: approximate
    prefix_sr_k64    the same with k = 64
    prefix_sr_fp8    suffix_replay k = 64 with fp8 (e4m3) anchors

`pic_single` (also opt-in) is `pic` with the single-state entry policy: a reused segment keeps
only its own state S(body|0), dropping what came before it (composition with T = 0). Greedy
decoding up to the end of the line; an answer is right when it equals the gold span (case and
surrounding space ignored).

`--multi-turn` evaluates the prefix policies on conversations instead (`evaluate_multiturn`):
each turn's prompt is the history (earlier questions with their gold answers, as the model was
trained) plus a new question; branches leave the main line after one of its turns with other
questions (qa_data.conversation). Each run keeps one engine for the whole conversation, so every
request after the first resumes from the page tree at a page boundary that lies between the
checkpoint grid's positions (chosen so). Runs: `full` (no cache), `checkpoint` and `exact_replay`
(a dense checkpoint every --checkpoint-every pages; both exact), and `suffix_replay` at each replay
length of --replay-lengths with each anchor dtype of --anchor-dtypes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from hybridcache.services.config import (
    ANCHOR_DTYPES,
    ENGINE_SECTIONS,
    RuntimeConfig,
    add_config_flags,
    config_from_args,
)
from hybridcache.services.runtime.qa_data import (
    INSTRUCTIONS,
    Conversation,
    QAExample,
    QAGenerator,
    answer_text,
    conversation,
    normalize_answer,
    restore_point,
)

# run name -> (engine mode, seam window)
RUNS: dict[str, tuple[str, int]] = {
    "full": ("full", 8),
    "prefix": ("prefix", 8),
    "pic": ("pic", 8),
    "pic_w0": ("pic", 0),
    "pic_w4": ("pic", 4),
    "pic_w16": ("pic", 16),
    "naive": ("naive", 8),
}
# prefix-policy run name -> EngineConfig prefix settings (mode "prefix"; warm-up = another question)
PREFIX_POLICY_RUNS: dict[str, dict] = {
    "prefix_exact": dict(prefix_policy="exact_replay", checkpoint_every=4),
    "prefix_ckpt": dict(prefix_policy="checkpoint", checkpoint_every=4),
    "prefix_sr_k16": dict(prefix_policy="suffix_replay", anchors_per_page=4, replay_anchors=16),
    "prefix_sr_k64": dict(prefix_policy="suffix_replay", anchors_per_page=4, replay_anchors=64),
    "prefix_sr_fp8": dict(
        prefix_policy="suffix_replay", anchors_per_page=4, replay_anchors=64, anchor_dtype="float8_e4m3fn"
    ),
}
# pic with the single-state entry policy (a reused segment keeps only its own state; issue 8)
SINGLE_STATE_RUNS: dict[str, tuple[str, int]] = {"pic_single": ("pic", 8)}
ALL_RUNS = (*RUNS, *PREFIX_POLICY_RUNS, *SINGLE_STATE_RUNS)
WARM_QUESTION = "Which of these documents is the longest?"  # shares the prompt up to "Question: "


# RuntimeConfig fields a run name sets; `hybridcache eval` takes flags for the others.
RUN_FIELDS = ("mode", "seam_window", "prefix_policy", "checkpoint_every", "anchors_per_page", "replay_anchors",
              "anchor_dtype", "entry_policy")


def run_config(name: str, base: RuntimeConfig | None = None) -> RuntimeConfig:
    """The config of a run name (RUNS, PREFIX_POLICY_RUNS or SINGLE_STATE_RUNS): `base` (its fields
    but RUN_FIELDS) with the run's settings."""
    base = base or RuntimeConfig()
    base = replace(base, **{f: getattr(RuntimeConfig, f) for f in RUN_FIELDS})
    if name in PREFIX_POLICY_RUNS:
        return replace(base, mode="prefix", **PREFIX_POLICY_RUNS[name])
    if name in SINGLE_STATE_RUNS:
        mode, w = SINGLE_STATE_RUNS[name]
        return replace(base, mode=mode, seam_window=w, entry_policy="single_state")
    mode, w = RUNS[name]
    return replace(base, mode=mode, seam_window=w)
DEFAULT_SEED = 0  # the fixed test set; another seed draws a fresh set from the test split


@dataclass
class RunScore:
    correct: int = 0
    n: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    wrong: list[dict] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    def to_dict(self) -> dict:
        reused = self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"accuracy": round(self.accuracy, 4), "n": self.n, "reused_token_fraction": round(reused, 4)}


def eval_examples(
    limit: int, seed: int = DEFAULT_SEED, hops: int | None = None, min_docs: int = 8, max_docs: int = 16
) -> list[QAExample]:
    """The first `limit` test-split questions drawn with `seed` (1-hop and 2-hop mixed unless `hops`)."""
    if limit <= 0:
        raise ValueError("limit must be positive")
    if hops not in (None, 1, 2):
        raise ValueError(f"hops must be 1 or 2, got {hops}")
    gen = QAGenerator("test", seed, min_docs, max_docs)
    return list(gen.examples(limit, hops))


def _orders(ex: QAExample, rng: random.Random) -> tuple[list[int], list[int], str]:
    """Warm-up order, asking order (both shuffled, different when possible) and warm-up instruction."""
    n = len(ex.documents)
    warm = list(range(n))
    rng.shuffle(warm)
    ask = list(warm)
    while n > 1 and ask == warm:
        rng.shuffle(ask)
    other = rng.choice([i for i in INSTRUCTIONS if i != ex.instruction])
    return warm, ask, other + "\n\n"


def evaluate(
    model_dir: str | Path,
    limit: int = 100,
    seed: int = DEFAULT_SEED,
    hops: int | None = None,
    runs: list[str] | None = None,
    device: str = "cpu",
    dtype=None,
    min_docs: int = 8,
    max_docs: int = 16,
    progress: bool = True,
    base: RuntimeConfig | None = None,
) -> dict[str, RunScore]:
    """Scores of each run; `base` gives the runs their settings but RUN_FIELDS."""
    import torch
    from hybridcache.services.runtime.engine import Engine
    from hybridcache.services.runtime.llm import LLM
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.tokenizer import Tokenizer
    from tqdm import tqdm

    runs = list(RUNS) if runs is None else runs
    unknown = [r for r in runs if r not in ALL_RUNS]
    if unknown:
        raise ValueError(f"unknown run(s) {', '.join(unknown)}; known: {', '.join(ALL_RUNS)}")
    model = load_model(model_dir, device, dtype or torch.float32)
    tokenizer = Tokenizer.from_dir(model_dir)
    examples = eval_examples(limit, seed, hops, min_docs, max_docs)
    orders = [_orders(ex, random.Random(f"{seed}:{i}")) for i, ex in enumerate(examples)]
    scores = {r: RunScore() for r in runs}

    bar = tqdm(
        total=len(examples) * len(runs), desc="eval", unit="answer", disable=not progress, file=sys.stderr
    )
    for r in runs:
        # One engine and scheduler a run (the path a combine worker serves with), one run at a time
        # (each scheduler holds its pool of running requests' states).
        with LLM(Engine(model, tokenizer, run_config(r, base))) as llm:
            engine = llm.engine
            for ex, (warm, ask, warm_system) in zip(examples, orders):
                # Empty caches for every question: its documents are its own, so nothing carries
                # over, and the eval holds one question's entries at a time.
                engine.reset_caches()
                if r in PREFIX_POLICY_RUNS:
                    llm.generate(replace(ex, question=WARM_QUESTION).request(max_new_tokens=1, order=ask))
                elif engine.config.uses_prefix_cache:
                    llm.generate(ex.request(max_new_tokens=1, system=warm_system, order=warm))
                res = llm.generate(ex.request(order=ask))
                sc = scores[r]
                sc.n += 1
                sc.prompt_tokens += res.stats.prompt_tokens
                sc.reused_tokens += res.stats.reused_tokens
                if normalize_answer(res.text) == normalize_answer(ex.answer):
                    sc.correct += 1
                elif len(sc.wrong) < 5:
                    sc.wrong.append({"question": ex.question, "answer": ex.answer, "got": res.text})
                bar.update(1)
            engine.reset_caches()
        bar.set_postfix({r: f"{s.accuracy:.2f}" for r, s in scores.items() if r in ("full", "pic", "naive") and s.n})
    bar.close()
    return scores


# suffix_replay k swept by --multi-turn; k = 1 (one anchor: almost none of the history) is the control
# that says whether the answers depend on the restored state at all
REPLAY_LENGTHS = (1, 16, 32, 64, 128, 256)
MULTITURN_ANCHOR_DTYPES = ("bfloat16", "float8_e4m3fn")
_DTYPE_TAGS = {"model": "model", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}


def multiturn_runs(replay_lengths=REPLAY_LENGTHS, anchor_dtypes=MULTITURN_ANCHOR_DTYPES) -> dict[str, dict]:
    """Run name -> the RuntimeConfig fields it sets: full recompute, the two exact policies, and
    suffix_replay at each replay length k (anchors replayed per group) with each anchor dtype."""
    runs: dict[str, dict] = {
        "full": dict(mode="full"),
        "checkpoint": dict(mode="prefix", prefix_policy="checkpoint"),
        "exact_replay": dict(mode="prefix", prefix_policy="exact_replay"),
    }
    for dt in anchor_dtypes:
        for k in replay_lengths:
            runs[f"suffix_replay_k{k}_{_DTYPE_TAGS[dt]}"] = dict(
                mode="prefix", prefix_policy="suffix_replay", replay_anchors=k, anchor_dtype=dt)
    return runs


def eval_conversations(
    limit: int, encode, seed: int = DEFAULT_SEED, hops: int | None = None, min_docs: int = 8, max_docs: int = 16,
    turns: int = 6, branches: int = 2, branch_turns: int = 2, grid_pages: int = 4,
) -> list[Conversation]:
    """The first `limit` test-split conversations drawn with `seed` (qa_data.conversation)."""
    if limit <= 0:
        raise ValueError("limit must be positive")
    gen = QAGenerator("test", seed, min_docs, max_docs)
    return [conversation(gen, encode, turns, branches, branch_turns, hops, grid_pages=grid_pages)
            for _ in range(limit)]


@dataclass
class TurnResult:
    """One request of a conversation as one run answered it."""

    conversation: int
    turn: int
    line: int
    correct: bool
    text: str
    prompt_tokens: int
    restored_tokens: int  # where the engine resumed (0: nothing cached was used)
    expected_restore: int | None  # the page boundary qa_data.restore_point predicts
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # log p of each output token as sampled
    # relative error of the restored linear state (S of every linear layer, averaged) against the
    # exact state at the same page boundary; None where the run restores exactly or did not resume
    state_rel_err: float | None = None
    restore_ms: float = 0.0  # the engine's time to rebuild the state of its page-tree hit


@dataclass
class MultiTurnScore:
    turns: list[TurnResult] = field(default_factory=list)

    def resumed(self) -> list[TurnResult]:
        """Every request but each conversation's first (the only ones a cache can serve)."""
        return [t for t in self.turns if t.turn > 0]

    def to_dict(self, full: MultiTurnScore | None, grid: int) -> dict:
        res = self.resumed()
        hits = [t for t in res if t.restored_tokens > 0]
        out = {
            "n": len(self.turns),
            "n_resumed": len(res),
            "em": round(sum(t.correct for t in self.turns) / max(1, len(self.turns)), 4),
            "em_resumed": round(sum(t.correct for t in res) / max(1, len(res)), 4),
            "hits": len(hits),
            "restored_tokens_mean": round(sum(t.restored_tokens for t in res) / max(1, len(res)), 1),
            "recomputed_tokens_mean": round(
                sum(t.prompt_tokens - t.restored_tokens for t in res) / max(1, len(res)), 1),
            # hits at a page boundary that is not a checkpoint-grid position
            "hits_between_grid_positions": sum(t.restored_tokens % grid != 0 for t in hits),
            "hits_at_predicted_page": sum(t.restored_tokens == t.expected_restore for t in hits),
            "restore_ms_mean": round(sum(t.restore_ms for t in hits) / max(1, len(hits)), 2),
        }
        if full is not None:
            ref = {(t.conversation, t.turn): t for t in full.turns}
            same = [t.text.strip() == ref[t.conversation, t.turn].text.strip() for t in res]
            out["agreement_with_full_resumed"] = round(sum(same) / max(1, len(same)), 4)
            # where the answer is full recompute's, how far each of its tokens' log p moved: a
            # measure of the restored state that exact match cannot give once every answer agrees
            diffs = [abs(a - b) for t in res if t.output_ids == ref[t.conversation, t.turn].output_ids
                     for a, b in zip(t.logprobs, ref[t.conversation, t.turn].logprobs)]
            out["answer_logprob_abs_diff_mean"] = float(f"{sum(diffs) / len(diffs):.3g}") if diffs else None
            out["answer_logprob_abs_diff_max"] = float(f"{max(diffs):.3g}") if diffs else None
            full_em = full.to_dict(None, grid)["em_resumed"]
            out["em_resumed_vs_full"] = round(out["em_resumed"] / full_em, 4) if full_em else None
        errs = [t.state_rel_err for t in res if t.state_rel_err is not None]
        if errs:
            out["linear_state_rel_err_mean"] = float(f"{sum(errs) / len(errs):.3g}")
            out["linear_state_rel_err_max"] = float(f"{max(errs):.3g}")
        return out


def evaluate_multiturn(
    model_dir: str | Path,
    limit: int = 8,
    seed: int = DEFAULT_SEED,
    hops: int | None = None,
    runs: dict[str, dict] | None = None,
    device: str = "cpu",
    dtype=None,
    min_docs: int = 8,
    max_docs: int = 16,
    turns: int = 6,
    branches: int = 2,
    branch_turns: int = 2,
    progress: bool = True,
    base: RuntimeConfig | None = None,
) -> tuple[dict[str, MultiTurnScore], list[Conversation]]:
    """Each run's answers to every turn of `limit` conversations: one engine and scheduler (an LLM,
    the path a combine worker serves with) per run and conversation, its requests sent in order
    (each finished request's pages, prompt and answer, are in the page tree when the next one
    arrives). `base` gives the runs their settings but RUN_FIELDS (its checkpoint_every and
    anchors_per_page included: the grid is its)."""
    import torch
    from hybridcache.services.runtime.engine import Engine
    from hybridcache.services.runtime.llm import LLM
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.scheduler import SchedulerConfig, kv_bytes_per_token
    from hybridcache.services.runtime.tokenizer import Tokenizer
    from tqdm import tqdm

    base = base or RuntimeConfig()
    runs = multiturn_runs() if runs is None else runs
    model = load_model(model_dir, device, dtype or torch.float32)
    tokenizer = Tokenizer.from_dir(model_dir)
    # one request at a time: a pool with room for one long prompt, not the worker's default budget
    limit_tokens = base.max_model_len or model.cfg.max_position_embeddings
    scheduling = SchedulerConfig(max_num_seqs=1, kv_cache_bytes=kv_bytes_per_token(model) * (limit_tokens + 512))
    encode = tokenizer.encode
    fixed = {f: getattr(RuntimeConfig, f) for f in RUN_FIELDS if f not in ("checkpoint_every", "anchors_per_page")}
    configs = {r: replace(base, **dict(fixed, **fields)) for r, fields in runs.items()}
    convs = eval_conversations(limit, encode, seed, hops, min_docs, max_docs, turns, branches, branch_turns,
                               grid_pages=base.checkpoint_every)
    page = base.page_policy.page_size
    scores = {r: MultiTurnScore() for r in runs}
    bar = tqdm(total=sum(len(c.turns) for c in convs) * len(runs), desc="eval --multi-turn", unit="answer",
               disable=not progress, file=sys.stderr)
    # the exact states that suffix_replay's restored ones are measured against: restored from a tree
    # of exact_replay pages of the same conversation (its own, or built for the purpose)
    exact_config = replace(base, **dict(fixed, mode="prefix", prefix_policy="exact_replay"))
    for c, conv in enumerate(convs):
        prompts = [conv.prompt_ids(t, encode) for t in range(len(conv.turns))]
        answers = [encode(answer_text(turn.example.answer)) for turn in conv.turns]
        expected = [restore_point(prompts, answers, t, page) if t else 0 for t in range(len(conv.turns))]
        exact = None  # an Engine whose tree holds this conversation's exact_replay pages
        for r in runs:
            engine = Engine(model, tokenizer, configs[r])
            approximate = engine.page_policy.name == "suffix_replay"
            if approximate and exact is None:
                exact = Engine(model, tokenizer, exact_config)
                with LLM(exact, scheduling) as llm:
                    llm.generate([conv.request(t, encode) for t in range(len(conv.turns))])
            with LLM(engine, scheduling) as llm:
                for t, turn in enumerate(conv.turns):
                    req = conv.request(t, encode)
                    req["sampling_params"]["logprobs"] = 0
                    res = llm.generate(req)
                    if res.prompt_ids != prompts[t]:
                        raise RuntimeError("the engine tokenized a turn other than the conversation did")
                    p = res.stats.prefix_reused_tokens
                    err = _state_error(model, engine, exact, prompts[t][:p]) if approximate and p else None
                    scores[r].turns.append(TurnResult(
                        c, t, turn.line, normalize_answer(res.text) == normalize_answer(turn.example.answer),
                        res.text, res.stats.prompt_tokens, p, expected[t], res.output_ids,
                        [lp for lp, _ in res.logprobs or []], err, res.stats.prefix_restore_ms))
                    bar.update(1)
            if configs[r].prefix_policy == "exact_replay" and configs[r].mode == "prefix":
                exact = engine
        bar.set_postfix({r: f"{scores[r].to_dict(None, 1)['em']:.2f}" for r in list(runs)[:3]})
    bar.close()
    return scores, convs


def _state_error(model, engine, exact, prefix: list[int]) -> float:
    """Mean over linear layers of ||S - S_exact|| / ||S_exact|| for the state `engine`'s policy
    restores after `prefix` (whole pages, all in its tree) against the one `exact`'s restores."""
    from hybridcache.services.runtime.cache import restore_state

    got = restore_state(model, engine.page_policy, engine.pages.match(prefix))
    ref = restore_state(model, exact.page_policy, exact.pages.match(prefix))
    if got.length != len(prefix) or ref.length != len(prefix):
        raise RuntimeError("a page of the restored prefix is missing from a tree")
    errs = [((got.linear[i].ssm.float() - s.ssm.float()).norm() / s.ssm.float().norm().clamp_min(1e-30)).item()
            for i, s in ref.linear.items()]
    return sum(errs) / len(errs)


def multiturn_json(scores: dict[str, MultiTurnScore], grid: int) -> dict:
    full = scores.get("full")
    return {r: s.to_dict(full if r != "full" else None, grid) for r, s in scores.items()}


def multiturn_figures(results: dict, replay_anchors: int, anchor_dtype: str = "float8_e4m3fn") -> dict:
    """Flat figures: each run's exact-match rate over resumed turns against full recompute's, its
    agreement with full recompute's answers, and for suffix_replay the restored state's error and
    the answers' log p shift; the named `suffix_replay_em_vs_full_multiturn` at `replay_anchors`
    and `anchor_dtype`; per anchor dtype, the smallest replay length above the k = 1 control whose
    rate ratio and agreement both reach 0.99 (None: none did), and whether the control itself
    stays below that (if not, exact match does not tell replay lengths apart on this model)."""
    figures: dict = {}
    smallest: dict[str, int | None] = {}
    for name, r in results.items():
        if "em_resumed_vs_full" not in r:
            continue
        figures[f"{name}_em_vs_full_multiturn"] = r["em_resumed_vs_full"]
        figures[f"{name}_agreement_with_full_multiturn"] = r["agreement_with_full_resumed"]
        if not name.startswith("suffix_replay_k"):
            continue
        figures[f"{name}_linear_state_rel_err"] = r.get("linear_state_rel_err_mean")
        figures[f"{name}_answer_logprob_abs_diff"] = r.get("answer_logprob_abs_diff_mean")
        k, tag = name.removeprefix("suffix_replay_k").split("_")
        ok = (r["em_resumed_vs_full"] or 0) >= 0.99 and r["agreement_with_full_resumed"] >= 0.99
        if int(k) == 1:
            figures[f"suffix_replay_{tag}_control_k1_discriminates"] = not ok
            continue
        smallest.setdefault(tag, None)
        if ok and (smallest[tag] is None or int(k) < smallest[tag]):
            smallest[tag] = int(k)
    for tag, k in smallest.items():
        figures[f"suffix_replay_{tag}_smallest_replay_length_at_0.99"] = k
    if "full" in results:
        figures["full_em_multiturn"] = results["full"]["em_resumed"]
    key = f"suffix_replay_k{replay_anchors}_{_DTYPE_TAGS[anchor_dtype]}"
    figures["default_replay_anchors"] = replay_anchors
    if key in results:
        figures["suffix_replay_em_vs_full_multiturn"] = results[key]["em_resumed_vs_full"]
        figures["suffix_replay_agreement_with_full_multiturn"] = results[key]["agreement_with_full_resumed"]
        figures["suffix_replay_linear_state_rel_err_multiturn"] = results[key].get("linear_state_rel_err_mean")
    return figures


def format_multiturn_table(results: dict) -> str:
    lines = [f"{'run':<26}{'EM':>7}{'EM resumed':>12}{'vs full':>9}{'agree':>8}{'hits':>6}{'off grid':>9}"
             f"{'restored':>10}{'state err':>11}{'|dlogp|':>10}"]

    def fmt(v, spec):
        return "" if v is None else format(v, spec)

    for r, d in results.items():
        lines.append(
            f"{r:<26}{100 * d['em']:>6.1f}%{100 * d['em_resumed']:>11.1f}%"
            f"{fmt(d.get('em_resumed_vs_full'), '.3f'):>9}{fmt(d.get('agreement_with_full_resumed'), '.3f'):>8}"
            f"{d['hits']:>6}{d['hits_between_grid_positions']:>9}{d['restored_tokens_mean']:>10.0f}"
            f"{fmt(d.get('linear_state_rel_err_mean'), '.3f'):>11}"
            f"{fmt(d.get('answer_logprob_abs_diff_mean'), '.1e'):>10}"
        )
    return "\n".join(lines)


def results_json(scores: dict[str, RunScore]) -> dict:
    return {r: s.to_dict() for r, s in scores.items()}


def format_table(scores: dict[str, RunScore]) -> str:
    full = scores.get("full")
    lines = [f"{'run':<14}{'mode':<8}{'w':>4}{'accuracy':>10}{'n':>6}{'vs full':>9}{'reused':>8}"]
    for r, s in scores.items():
        mode, w = RUNS.get(r) or SINGLE_STATE_RUNS.get(r) or ("prefix", "-")
        delta = f"{100 * (s.accuracy - full.accuracy):+.1f}" if full is not None and r != "full" else ""
        reused = s.to_dict()["reused_token_fraction"]
        lines.append(
            f"{r:<14}{mode:<8}{w:>4}{100 * s.accuracy:>9.1f}%{s.n:>6}{delta:>9}{100 * reused:>7.0f}%"
        )
    return "\n".join(lines)


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _run_list(text: str) -> list[str]:
    runs = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in runs if r not in ALL_RUNS]
    if bad or not runs:
        raise argparse.ArgumentTypeError(
            f"unknown run(s) {', '.join(bad) or text!r}; known: {', '.join(ALL_RUNS)}"
        )
    return runs


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return out


def _anchor_dtypes(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in ("model", *ANCHOR_DTYPES)]
    if bad or not out:
        raise argparse.ArgumentTypeError(
            f"unknown anchor dtype(s) {', '.join(bad) or text!r}; known: model, {', '.join(ANCHOR_DTYPES)}")
    return out


def add_eval_flags(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--model", help="model directory (HF format); default: the embedded default model")
    sp.add_argument("--limit", type=_positive, default=None,
                    help="questions (default 200); with --multi-turn, conversations (default 8)")
    sp.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help=f"draw the questions from the test split with this seed (default {DEFAULT_SEED})",
    )
    sp.add_argument(
        "--hops", type=int, choices=[1, 2], help="only 1-hop or only 2-hop questions (default both)"
    )
    sp.add_argument(
        "--runs",
        type=_run_list,
        default=None,
        help=f"comma list of {','.join(ALL_RUNS)} (default: {','.join(RUNS)}); not with --multi-turn",
    )
    sp.add_argument("--multi-turn", action="store_true",
                    help="conversations with branches: full recompute, checkpoint, exact_replay and suffix_replay "
                    "at each --replay-lengths and --anchor-dtypes, one engine per run and conversation")
    sp.add_argument("--turns", type=_positive, default=6, help="--multi-turn: turns of the main line (default 6)")
    sp.add_argument("--branches", type=int, default=2, help="--multi-turn: branches off the main line (default 2)")
    sp.add_argument("--branch-turns", type=_positive, default=2, help="--multi-turn: turns of a branch (default 2)")
    # string defaults: argparse passes them through `type` too
    sp.add_argument("--replay-lengths", type=_ints, default=",".join(map(str, REPLAY_LENGTHS)),
                    help="--multi-turn: suffix_replay replay lengths k (anchors replayed per group)")
    sp.add_argument("--anchor-dtypes", type=_anchor_dtypes, default=",".join(MULTITURN_ANCHOR_DTYPES),
                    help="--multi-turn: suffix_replay anchor dtypes")
    # its own dest: config_from_args reads the RuntimeConfig field names off the namespace
    sp.add_argument("--anchors-per-page", dest="multi_turn_anchors_per_page", type=_positive, default=None,
                    help="--multi-turn: suffix_replay anchors kept per page, r (default: the engine's, 4)")
    sp.add_argument("--min-docs", type=_positive, default=8)
    sp.add_argument("--max-docs", type=_positive, default=16)
    sp.add_argument("--output", help="write the JSON results here")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(sp, exclude=RUN_FIELDS, sections=ENGINE_SECTIONS)  # the runs set the others


def cmd_eval(args) -> int:
    """`hybridcache eval`: prints the table, then the JSON {run: {accuracy, n, ...}}; writes --output.
    Bad input (model directory, flags) prints one line and returns 2."""
    try:
        return _eval(args)
    except (ValueError, FileNotFoundError) as e:  # ModelLoadError and RequestError are ValueErrors
        print(
            f"hybridcache: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr
        )
        return 2


def _eval(args) -> int:
    if not 2 <= args.min_docs <= args.max_docs:
        raise ValueError("need 2 <= --min-docs <= --max-docs")
    if args.multi_turn and args.runs is not None:
        raise ValueError("--runs names single-turn runs; --multi-turn takes --replay-lengths and --anchor-dtypes")
    if args.branches < 0 or (args.multi_turn and args.turns < 2):
        raise ValueError("--multi-turn needs --turns >= 2 and --branches >= 0")
    if args.model:
        model_dir = Path(args.model)
    else:
        from hybridcache.services.runtime.modelzoo import default_model_dir

        model_dir = default_model_dir()
    config = config_from_args(args)
    if config.tensor_parallel_size > 1:
        # the eval loads the model once in this process and runs an engine per run over it: a split
        # model's ranks are processes of their own, with a runner per engine
        raise ValueError("hybridcache eval runs on one device: --tensor-parallel-size must be 1")
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda given but no CUDA device is available")
    if args.multi_turn:
        return _eval_multiturn(args, model_dir, config)
    scores = evaluate(
        model_dir,
        args.limit or 200,
        args.seed,
        args.hops,
        args.runs or list(RUNS),
        config.device,
        config.torch_dtype,
        min_docs=args.min_docs,
        max_docs=args.max_docs,
        progress=not args.no_progress,
        base=config,
    )
    result = results_json(scores)
    print(f"model {model_dir}, {args.limit or 200} test questions, seed {args.seed}, hops {args.hops or '1+2'}")
    print(format_table(scores))
    print(json.dumps(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _eval_multiturn(args, model_dir: Path, config: RuntimeConfig) -> int:
    import datetime
    import os
    import platform
    import subprocess
    import time

    import torch

    limit = args.limit or 8
    if args.multi_turn_anchors_per_page is not None:
        config = replace(config, anchors_per_page=args.multi_turn_anchors_per_page)
    runs = multiturn_runs(args.replay_lengths, args.anchor_dtypes)
    started = time.perf_counter()
    scores, convs = evaluate_multiturn(
        model_dir, limit, args.seed, args.hops, runs, config.device, config.torch_dtype,
        args.min_docs, args.max_docs, args.turns, args.branches, args.branch_turns,
        progress=not args.no_progress, base=config)
    grid = config.page_policy.checkpoint_tokens
    results = multiturn_json(scores, grid)
    anchor = config.anchor_dtype if config.anchor_dtype != "model" else args.anchor_dtypes[-1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    out = {
        "benchmark": "hybridcache eval --multi-turn",
        "model": str(model_dir),
        "machine": "cpu" if config.device == "cpu" else config.device,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host": platform.node(),
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "hybridcache eval " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["eval"] else sys.argv[1:]),
        "wall_s": round(time.perf_counter() - started, 1),
        "config": {"conversations": limit, "seed": args.seed, "hops": args.hops, "turns": args.turns,
                   "branches": args.branches, "branch_turns": args.branch_turns,
                   "requests": sum(len(c.turns) for c in convs),
                   "page_tokens": config.page_policy.page_size, "checkpoint_grid_tokens": grid,
                   "anchors_per_page": config.anchors_per_page, "replay_lengths": args.replay_lengths,
                   "anchor_dtypes": args.anchor_dtypes, "dtype": config.dtype,
                   "default_replay_anchors": config.replay_anchors},
        "figures": multiturn_figures(results, config.replay_anchors, anchor),
        "results": results,
    }
    print(f"model {model_dir}, {limit} test conversations ({out['config']['requests']} requests), seed {args.seed}, "
          f"hops {args.hops or '1+2'}, checkpoint grid {grid} tokens")
    print(format_multiturn_table(results))
    print(json.dumps(out["figures"]))
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridcache eval", description=__doc__.splitlines()[0], allow_abbrev=False)
    add_eval_flags(p)
    return cmd_eval(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
