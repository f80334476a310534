"""tools/profile_chunks.py on CPU at the tiny preset: every call of a long prompt's chunks timed,
the end of each chunk timed alone (finish_ms, one a chunk, in a call of its own but for the last
chunk's), the profiled call a deep chunk's first run of layers or its end."""

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
    assert res["chunks"] == len(calls)
    chunks = {}
    for context, ms in calls:  # a chunk's calls share its context
        chunks.setdefault(context, []).append(ms)
    chunks = list(chunks.values())
    # four runs of layers a chunk, then its end in a call of its own, but for the prompt's last
    # chunk, whose last run of layers ends it
    assert len(chunks) >= 3 and all(len(c) == 5 for c in chunks[:-1]) and len(chunks[-1]) == 4
    assert len(res["finish_ms"]) == len(chunks) and all(ms >= 0 for ms in res["finish_ms"])
    assert all(end <= c[-1] for end, c in zip(res["finish_ms"], chunks))
    assert res["profiled_chunk"]["by_host_time"]
