"""scripts/device_suite.sh refuses bad usage with exit 2 and a message before touching anything."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args, tmp_path):
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_suite.sh"), *args],
        cwd=tmp_path,  # no .whl/ here: nothing is installed
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")},
        timeout=60,
    )


def test_usage_and_unknown_stage_exit_2(tmp_path):
    r = _run(tmp_path=tmp_path)
    assert r.returncode == 2 and "usage:" in r.stderr
    r = _run("abc123", "bench", "nope", tmp_path=tmp_path)
    assert r.returncode == 2 and "unknown stage nope" in r.stderr
    assert not (tmp_path / "out").exists()  # refused before any set-up or stage ran
