"""Binding probe: can the shipped QA model's architecture (Qwen3.5 hybrid, Gated DeltaNet + gated
attention, transformers' implementation) learn to answer "where does NAME live?" from facts in
its prompt, and after how many steps? A synthetic associative-recall task with no tokenizer: a
prompt is `people` facts "NAME lives in CITY ." (NAME of `name_tokens` tokens drawn from a small
set of syllables, optional random filler tokens after each fact), then four questions
"Q NAME A CITY ."; the loss is on the answer tokens only. Guessing among the prompt's cities gives
1 / people.

It isolates what the QA model (benchmarks/train_qa_model.py) must learn first: binding a
question to the fact about its entity, before tokenization, filler, documents and other
attributes. With `--switch-step S`, names have one token before step S and `--name-tokens` after
(a curriculum). Prints a JSON line per `--every` steps (loss, accuracy on 64 fresh prompts) and a
summary with the first step whose accuracy reached 0.9.

    python tools/binding_probe.py [--name-tokens 1] [--people 6] [--steps 3000] [--switch-step 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

SYLLABLES, CITIES, FILLER = 40, 60, 60
LIVES, IN, DOT, Q, A, PAD = range(6)
SYL0 = 6
CITY0 = SYL0 + SYLLABLES
FILL0 = CITY0 + CITIES
VOCAB = FILL0 + FILLER


class Prompts:
    """Seeded prompts of the probe task; `name_tokens` may change between draws."""

    def __init__(self, seed: int, people: int, name_tokens: int, filler: int):
        if not 2 <= people <= CITIES:
            raise ValueError(f"people must be in 2..{CITIES}")
        if name_tokens < 1 or SYLLABLES**name_tokens < people:
            raise ValueError("name_tokens must be >= 1 and give at least `people` distinct names")
        self.rng = random.Random(seed)
        self.people, self.name_tokens, self.filler = people, name_tokens, filler

    def sample(self) -> tuple[list[int], list[int]]:
        """(token ids, positions whose next token is an answer)."""
        r = self.rng
        names: set[tuple[int, ...]] = set()
        while len(names) < self.people:
            names.add(tuple(r.randrange(SYLLABLES) for _ in range(self.name_tokens)))
        order = list(names)
        cities = r.sample(range(CITIES), self.people)
        ids: list[int] = []
        for name, city in zip(order, cities):
            ids += [SYL0 + s for s in name] + [LIVES, IN, CITY0 + city, DOT]
            ids += [FILL0 + r.randrange(FILLER) for _ in range(self.filler)]
        answers = []
        for i in r.sample(range(self.people), min(4, self.people)):
            ids += [Q] + [SYL0 + s for s in order[i]] + [A]
            answers.append(len(ids) - 1)
            ids += [CITY0 + cities[i], DOT]
        return ids, answers

    def batch(self, n: int):
        rows = [self.sample() for _ in range(n)]
        width = max(len(ids) for ids, _ in rows)
        x = torch.full((n, width), PAD)
        at = torch.zeros(n, width, dtype=torch.bool)
        for i, (ids, answers) in enumerate(rows):
            x[i, : len(ids)] = torch.tensor(ids)
            at[i, answers] = True
        return x, at


def answer_nll_and_accuracy(model, x, at):
    logits = model(input_ids=x).logits.float()
    target = x[:, 1:][at[:, :-1]]
    pred = logits[:, :-1][at[:, :-1]]
    nll = torch.nn.functional.cross_entropy(pred, target)
    return nll, (pred.argmax(-1) == target).float().mean().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--name-tokens", type=int, default=1)
    ap.add_argument("--people", type=int, default=6)
    ap.add_argument("--filler", type=int, default=0, help="random filler tokens after each fact")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--switch-step", type=int, default=0, help="one-token names before this step")
    ap.add_argument(
        "--switch-at-accuracy",
        type=float,
        default=0.0,
        help="one-token names until an evaluation reaches this accuracy, then --name-tokens (a curriculum "
        "that advances once binding is learnt; the step it took is when one-token binding was learnt)",
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4, help="every 4th layer attention (index 3, 7, ...)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.modules.setdefault("fla", None)  # transformers' PyTorch gated delta rule, as train_qa_model.py on CPU
    from train_qa_model import build_model, model_config

    if args.switch_step and args.switch_at_accuracy:
        print("binding_probe: error: give --switch-step or --switch-at-accuracy, not both", file=sys.stderr)
        return 2
    if not 0.0 <= args.switch_at_accuracy <= 1.0:
        print("binding_probe: error: --switch-at-accuracy must be in [0, 1]", file=sys.stderr)
        return 2
    curriculum = args.switch_step > 1 or args.switch_at_accuracy > 0
    try:
        prompts = Prompts(args.seed, args.people, 1 if curriculum else args.name_tokens, args.filler)
        evals = Prompts(args.seed + 1, args.people, prompts.name_tokens, args.filler)
        Prompts(args.seed, args.people, args.name_tokens, args.filler)
    except ValueError as e:
        print(f"binding_probe: error: {e}", file=sys.stderr)
        return 2
    cfg = dict(model_config(args.hidden, args.layers, args.heads), vocab_size=VOCAB)
    model = build_model(args.seed, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    t0, reached, switched, log = time.time(), None, None, []
    for step in range(1, args.steps + 1):
        if step == args.switch_step:
            prompts.name_tokens = evals.name_tokens = args.name_tokens
            switched = step
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / 100)
        loss, _ = answer_nll_and_accuracy(model, *prompts.batch(args.batch))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.every == 0:
            with torch.no_grad():
                _, acc = answer_nll_and_accuracy(model, *evals.batch(64))
            row = {"step": step, "name_tokens": evals.name_tokens, "loss": round(loss.item(), 4),
                   "accuracy": round(acc, 3), "seconds": round(time.time() - t0, 1)}
            log.append(row)
            print(json.dumps(row), flush=True)
            if reached is None and acc >= 0.9 and evals.name_tokens == args.name_tokens and switched != step:
                reached = step
            if args.switch_at_accuracy and switched is None and acc >= args.switch_at_accuracy:
                prompts.name_tokens = evals.name_tokens = args.name_tokens
                switched = step
    print(json.dumps({"summary": {**vars(args), "guess": round(1 / args.people, 3),
                                  "switched_at_step": switched,
                                  "first_step_at_0.9": reached, "final": log[-1] if log else None}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
