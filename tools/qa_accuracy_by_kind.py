"""Teacher-forced exact match of a model written by train_qa_model.py, per question kind (which
attribute of which entity type is asked): shows whether a model answers by binding the question to
its entity or by guessing among the prompt's values of the asked kind. Prints one JSON object.

    python tools/qa_accuracy_by_kind.py MODEL_DIR [--n 300] [--seed 1] [--min-docs 4] [--max-docs 6]
        [--filler 0] [--distinct-initials]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# question opening -> kind; "*" marks facts that name a person by surname only
KINDS = (
    ("Where does", "person city"),
    ("What is the occupation", "person occupation*"),
    ("What is the favourite colour", "person colour"),
    ("In which year", "person birth year"),
    ("Which instrument", "person instrument*"),
    ("Who employs", "person employer*"),
    ("Where is the", "organisation city"),
    ("When was the", "organisation year"),
    ("What does the", "organisation goods"),
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--n", type=int, default=300, help="1-hop validation questions")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-docs", type=int, default=4)
    ap.add_argument("--max-docs", type=int, default=6)
    ap.add_argument("--filler", type=float, default=0.0)
    ap.add_argument("--distinct-initials", action="store_true")
    args = ap.parse_args(argv)
    d = Path(args.model_dir)
    if not (d / "model.safetensors").is_file():
        print(f"qa_accuracy_by_kind: error: no model.safetensors in {d}", file=sys.stderr)
        return 2
    import train_qa_model as t
    from hybridcache.services.runtime.qa_data import QAGenerator
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    torch.set_num_threads(1)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    model = t.build_model(0, json.loads((d / "config.json").read_text()))
    model.load_state_dict(load_file(str(d / "model.safetensors")))
    model.eval()
    gen = QAGenerator("val", args.seed, args.min_docs, args.max_docs)
    gen.filler = args.filler
    gen.distinct_initials = args.distinct_initials
    right, total = collections.Counter(), collections.Counter()
    with torch.no_grad():
        for _ in range(args.n):
            ex = gen.example(1)
            kind = next(k for opening, k in KINDS if ex.question.startswith(opening))
            ids, ans = t.encode_prompt(tok, [ex])
            x = torch.tensor([ids])
            pred = model(input_ids=x).logits[0][:-1].argmax(-1)
            m = torch.tensor(ans[1:], dtype=torch.bool)
            right[kind] += bool((pred[m] == x[0, 1:][m]).all())
            total[kind] += 1
    used = sys.argv[1:] if argv is None else argv
    by_kind = {k: {"right": right[k], "n": total[k], "accuracy": round(right[k] / total[k], 3)} for k in total}
    out = {
        "command": "python tools/qa_accuracy_by_kind.py " + " ".join(used),
        "by_kind": by_kind,
        "all": round(sum(right.values()) / max(1, sum(total.values())), 3),
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
