"""tools/binding_probe.py: its prompts answer each question with the city of the fact about
the named person; bad arguments exit 2; a few training steps run and report."""

import json
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import binding_probe as bp  # noqa: E402


def test_answers_are_the_named_persons_cities():
    p = bp.Prompts(seed=3, people=5, name_tokens=2, filler=2)
    for _ in range(20):
        ids, answers = p.sample()
        facts = {}
        i = 0
        while ids[i] != bp.Q:
            name = tuple(ids[i : i + 2])
            assert ids[i + 2 : i + 4] == [bp.LIVES, bp.IN]
            facts[name] = ids[i + 4]
            i += 2 + 4 + 2  # name, lives in CITY ., filler
        assert len(facts) == 5
        for a in answers:
            assert ids[a] == bp.A and ids[a - 3] == bp.Q
            assert ids[a + 1] == facts[tuple(ids[a - 2 : a])]


def test_bad_arguments_exit_2(capsys):
    assert bp.main(["--people", "1"]) == 2
    assert "people" in capsys.readouterr().err
    assert bp.main(["--switch-step", "5", "--switch-at-accuracy", "0.9"]) == 2
    assert "not both" in capsys.readouterr().err


def test_a_few_steps_run_and_report(capsys):
    assert bp.main(["--steps", "2", "--every", "1", "--hidden", "16", "--batch", "2", "--threads", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in lines[:-1]] == [1, 2]
    assert lines[-1]["summary"]["final"] == lines[-2]  # the summary reports the last evaluation


class _Oracle(torch.nn.Module):
    """Logits that put all mass on the true next token (shifted by `miss` token ids)."""

    def __init__(self, x, miss=0):
        super().__init__()
        self.x, self.miss = x, miss

    def forward(self, input_ids):
        logits = torch.full((*input_ids.shape, bp.VOCAB), -30.0)
        nxt = torch.roll(self.x, -1, dims=1)
        logits.scatter_(2, ((nxt + self.miss) % bp.VOCAB)[..., None], 30.0)
        return types.SimpleNamespace(logits=logits)


def test_accuracy_scores_the_answer_positions():
    x, at = bp.Prompts(seed=1, people=4, name_tokens=1, filler=0).batch(3)
    nll, acc = bp.answer_nll_and_accuracy(_Oracle(x), x, at)
    assert acc == 1.0 and nll.item() < 1e-6
    _, acc = bp.answer_nll_and_accuracy(_Oracle(x, miss=1), x, at)
    assert acc == 0.0
