"""benchmarks/assembler_host.py on the CPU: the served receiving code takes a batched build's
entries whole through the arena and the benchmark reports their host time; bad flags exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "assembler_host.py"


def _run(*args):
    # a process of its own: the benchmark replaces cuda_ipc's export and open for its whole process
    return subprocess.run([sys.executable, "-P", str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_it_receives_every_entry_through_the_arena_and_times_the_host(tmp_path):
    out = tmp_path / "a.json"
    r = _run("--entries", "5", "--layers", "8", "--requests", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert json.loads(r.stdout) == result
    shape, fig = result["shape"], result["figures"]
    # 8 layers of the 9B pattern: 6 linear (T, S, conv tail) and 2 attention (K, V)
    assert shape["tensors_per_request"] == 5 * 22 and shape["blocks_per_request"] == 5 * 8
    assert shape["slots_per_request"] == 8 and shape["sender_fallbacks"] == 0
    assert shape["messages_per_request"] == 5 + 5 * 8 + 5  # headers, layer blocks, seals
    assert len(fig["host_ms_all"]) == 3 and all(t > 0 for t in fig["host_ms_all"])
    assert abs(fig["host_us_per_tensor"] * 110 / 1e3 - fig["host_ms_per_request"]) < 0.01


def test_bad_flags_exit_2():
    r = _run("--entries", "0")
    assert r.returncode == 2 and "at least 1" in r.stderr
