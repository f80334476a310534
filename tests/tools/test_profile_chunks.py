"""tools/profile_chunks.py on CPU at the tiny preset: every call of a long prompt's chunks timed,
the end of each chunk timed alone (finish_ms, one a chunk), the profiled call the first or the last
of a deep chunk's runs of layers."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import profile_chunks  # noqa: E402


@pytest.mark.parametrize("part", ["first", "last"])
def test_chunks_and_their_ends_are_timed(capsys, part):
    assert profile_chunks.main(["--preset", "tiny", "--tokens", "1200", "--budget", "128", "--modes", "pic",
                                "--layer-parts", "4", "--profile-part", part, "--top", "5"]) == 0
    res = json.loads(capsys.readouterr().out)["pic"]
    calls = res["chunk_ms"]
    assert res["chunks"] == len(calls) and len(calls) % 4 == 0
    # one end a chunk, each inside the call that ran it
    assert len(res["finish_ms"]) == len(calls) // 4 and all(ms >= 0 for ms in res["finish_ms"])
    assert all(end <= calls[4 * i + 3][1] for i, end in enumerate(res["finish_ms"]))
    assert res["profiled_chunk"]["by_host_time"]
