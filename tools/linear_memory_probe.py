"""How much a QA model's linear layers carry from one document to the next (issue 7's `naive` check).

For questions of the QA task's test split it builds every document's segment entry with the
engine's own `build_entry` (seam window live, body recorded) and reports, per linear layer, the
spectral norm of the body's transition T (max over heads): the factor by which whatever state came
before the document can still reach past it. Then it compares the last prompt token's logits of `full` with:
  pic          entries composed with T (the engine's pic),
  naive        entries added without T (S_end = S_start + S(body|0)),
  zero_state   pic, then every linear layer's recurrent state zeroed before the question: what the
               question can answer with no linear memory of the documents at all.
Prints JSON (figures per layer and per run).

    python tools/linear_memory_probe.py [--model models/default] [--questions 12] [--hops 1]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.evaluation import _orders, eval_examples
from hybridcache.services.runtime.modelzoo import default_model_dir
from hybridcache.services.runtime.sequence import CachedSpan, LiveRun


def cached_layout(system, segs, entries, seam: int, use_t: bool):
    """System live, then each segment's seam live and its body cached; returns (layout, end)."""
    out, pos = [LiveRun(system, 0)], system.numel()
    for seg, e in zip(segs, entries):
        out += [LiveRun(seg[:seam], pos), CachedSpan(e, pos + seam, use_transition=use_t)]
        pos += seg.numel()
    return out, pos


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    p.add_argument("--questions", type=int, default=12)
    p.add_argument("--hops", type=int, default=1, choices=(1, 2))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seam-window", type=int, default=8)
    args = p.parse_args(argv)
    if args.questions < 1:
        p.error("--questions must be positive")
    model_dir = Path(args.model) if args.model else default_model_dir()
    engine = Engine.from_dir(model_dir, config=EngineConfig(seam_window=args.seam_window))
    model, w = engine.model, args.seam_window
    norms: dict[int, list[float]] = {}
    runs = {
        name: {"top1_agree": 0, "rel_logit_diff": 0.0, "answer_logprob_shift": 0.0}
        for name in ("pic", "naive", "zero_state")
    }
    examples = eval_examples(args.questions, args.seed, args.hops)
    with torch.no_grad():
        for i, ex in enumerate(examples):
            _, ask, _ = _orders(ex, random.Random(f"{args.seed}:{i}"))
            req = engine.parse_request(ex.request(order=ask))
            system = torch.tensor(req.system_ids)
            segs = [torch.tensor(s) for s in req.segment_ids]
            question = torch.tensor(req.suffix_ids)
            answer_tok = engine.tokenizer.encode(" " + ex.answer)[0]
            ids = torch.cat([system, *segs, question])
            full, _ = model.forward_layout(model.empty_state(), [LiveRun(ids, 0)], "last")
            full = full.float().flatten()
            entries = [engine.build_entry(s).data for s in req.segment_ids]
            for e in entries:
                for layer, s in e.linear.items():
                    norms.setdefault(layer, []).append(torch.linalg.matrix_norm(s.T.float(), ord=2).max().item())

            got = {}
            for name, use_t in (("pic", True), ("naive", False)):
                lay, pos = cached_layout(system, segs, entries, w, use_t)
                lo, _ = model.forward_layout(model.empty_state(), lay + [LiveRun(question, pos)], "last")
                got[name] = lo.float().flatten()
            lay, pos = cached_layout(system, segs, entries, w, True)
            state = model.empty_state()
            model.forward_layout(state, lay, "none")
            for s in state.linear.values():
                s.ssm.zero_()
            lo, _ = model.forward_layout(state, [LiveRun(question, pos)], "last")
            got["zero_state"] = lo.float().flatten()
            ref_lp = torch.log_softmax(full, -1)[answer_tok]
            for name, lo in got.items():
                r = runs[name]
                r["top1_agree"] += int(lo.argmax() == full.argmax())
                r["rel_logit_diff"] += float((lo - full).norm() / full.norm())
                r["answer_logprob_shift"] += float(torch.log_softmax(lo, -1)[answer_tok] - ref_lp)
    n = len(examples)
    for r in runs.values():
        r["top1_agree"] = f"{r['top1_agree']}/{n}"
        r["rel_logit_diff"] = round(r["rel_logit_diff"] / n, 6)
        r["answer_logprob_shift"] = float(f"{r['answer_logprob_shift'] / n:.3g}")
    layers = {
        str(layer): {
            "median": round(sorted(v)[len(v) // 2], 6),
            "max": round(max(v), 6),
            "documents": len(v),
        }
        for layer, v in sorted(norms.items())
    }
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = ""
    print(
        json.dumps(
            {
                "benchmark": "linear_memory_probe",
                "model": str(model_dir),
                "commit": commit,
                "date": time.strftime("%Y-%m-%d"),
                "command": "python tools/linear_memory_probe.py "
                + " ".join(argv if argv is not None else sys.argv[1:]),
                "questions": n,
                "hops": args.hops,
                "T_spectral_norm_after_one_document": layers,
                "last_token_vs_full": runs,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
