"""tools/profile_mixed.py on CPU at the tiny preset: streams decode while a long prompt prefills in
layer parts; every step of the prefill is timed and told apart by what it ran of the chunk."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import profile_mixed  # noqa: E402


def test_steps_are_told_apart_by_what_they_ran(capsys):
    parts, streams = 3, 2
    assert profile_mixed.main(["--preset", "tiny", "--streams", str(streams), "--long-tokens", "900",
                               "--budget", "64", "--layer-parts", str(parts), "--steady-steps", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = {k: v["n"] for k, v in out["step_ms_by_kind"].items()}
    # the first step admits the prompt and runs its first chunk's first run of layers; every chunk
    # after starts with a "first" step; each chunk but the last ends in a step of its own (streams
    # decode), and the last chunk's last run of layers gives the first token
    assert kinds["start"] == 1 and kinds["last"] == 1
    chunks = kinds["first"] + 1
    assert kinds["end"] == chunks - 1
    assert kinds["part"] == chunks * (parts - 1) - 1  # the last chunk's last run is the "last" step
    assert out["steps"] == sum(kinds.values()) == out["during_step_ms"]["n"]
    assert set(out["step_ms_by_run"]) == {str(r) for r in range(parts)}
    assert out["steady_step_ms"]["n"] == 10
    # every stream got a token each step while the prompt prefilled
    assert out["during_gap_ms"]["n"] >= streams * (out["steps"] - 2)
    assert 0 < out["during_gap_ms"]["p50"] <= out["during_gap_ms"]["p99"]
    slow = out["slowest_steps"]
    assert slow and all(a["ms"] >= b["ms"] for a, b in zip(slow, slow[1:]))
    assert out["itl_p99_during_vs_steady_p50"] > 0


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        profile_mixed.main(["--preset", "tiny", "--layer-parts", "0"])
    assert e.value.code == 2
