"""benchmarks/results/SUMMARY.md and summary.json are what benchmarks/summarize_results.py writes
from the result files, and a new result file changes them."""

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import summarize_results as sr  # noqa: E402


def test_summary_is_current():
    stale = [p.name for p, text in sr.outputs().items() if not p.is_file() or p.read_text() != text]
    assert not stale, f"{stale} stale: run python benchmarks/summarize_results.py"


def test_check_mode_exits_1_when_stale(tmp_path, capsys):
    for p in sr.RESULTS.glob("*.json"):
        shutil.copy(p, tmp_path / p.name)
    assert sr.main(["--results", str(tmp_path)]) == 0
    assert sr.main(["--results", str(tmp_path), "--check"]) == 0
    (tmp_path / "SUMMARY.md").write_text("edited by hand\n")
    assert sr.main(["--results", str(tmp_path), "--check"]) == 1
    assert "SUMMARY.md" in capsys.readouterr().out


def test_a_newer_run_becomes_the_latest_and_the_older_its_history(tmp_path):
    for p in sr.RESULTS.glob("*.json"):
        shutil.copy(p, tmp_path / p.name)
    run = {"gpu": "NVIDIA H200", "commit": "abcdef1", "date": "2099-01-01 00:00 UTC", "command": "python x",
           "figures": {"pic_ttft_ms_32x1k_gpu_resident": 12.5}}
    (tmp_path / "gpu_bench_h200_abcdef1.json").write_text(json.dumps(run))
    before = next(f for f in sr.summary()["figures"] if f["name"].startswith("warm pic TTFT, 32 x 1k + 64, GPU"))
    after = next(f for f in sr.summary(tmp_path)["figures"] if f["name"] == before["name"])
    assert (after["value"], after["commit"], after["file"]) == (12.5, "abcdef1", "gpu_bench_h200_abcdef1.json")
    assert after["history"][:-1] == before["history"] and after["history"][-1]["commit"] == "abcdef1"
    # figures the new file lacks keep their latest value
    prefill = [f for f in sr.summary(tmp_path)["figures"] if f["name"] == "cold prefill, 32k tokens"]
    assert prefill[0]["file"] != "gpu_bench_h200_abcdef1.json"


def test_same_day_runs_follow_their_commit_order():
    readings = sr.readings(next(f for f in sr.FIGURES if f.path == "figures.qps_at_slo_pic"))
    same_day = [r.commit for r in readings if r.date == "2026-12-01"]
    assert same_day == ["0b4d660", "c4c3635", "538c710"]
    assert readings[-1].commit == "538c710"


def test_every_figure_names_its_machine_commit_date_and_command():
    for f in sr.summary()["figures"]:
        assert f["gpu"] and f["date"] and f["command"] and f["history"], f["name"]
        assert (sr.RESULTS / f["file"]).is_file()
