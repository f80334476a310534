"""The cuda_ipc arena between two processes on one GPU (marked gpu: the device machine runs
them): entries of the Qwen3.5-9B 8-layer shape sent as a scatter worker sends a batched build
arrive equal to what was sent, the receiver maps the sender's arena on the first request and
opens no IPC handle on the later ones, the sender writes every layer into a released slot of
the same arena (no fallback to fresh buffers), at a measured bandwidth
(benchmarks/transport_loopback.py --cuda-ipc is the same run as a benchmark)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench():
    # imported by name, so that the spawned sender process finds its function (spawn passes sys.path)
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("transport_loopback")


@pytest.mark.gpu
def test_arena_round_trip_reuse_and_no_opens_after_the_first_request():
    bench = _bench()
    entries, requests = 16, 4
    run = bench.cuda_ipc_loopback(entries=entries, requests=requests, arena_mib=512)
    fig = bench.ipc_figures(run)
    print(f"cuda_ipc arena: {fig}")
    assert run["verified"] == [True, True] and fig["entries_equal_sent"]
    assert fig["ipc_opens_per_request"] == [1] + [0] * (requests - 1)
    layers = bench.LINEAR + bench.ATTN
    assert fig["slots_per_request"] == [layers] * requests  # one slot (one copy) per layer of the build
    assert all(r["blocks"] == entries * layers for r in run["requests"])
    assert fig["sender_fallbacks"] == 0 and fig["arenas_created"] == 1
    assert all(t["slots"] == layers and t["exports"] == 0 for t in run["sender"]["transport"])
    assert fig["scatter_to_combine_gb_per_s"] >= 50


@pytest.mark.gpu
def test_without_an_arena_the_fresh_buffers_still_arrive():
    bench = _bench()
    run = bench.cuda_ipc_loopback(entries=4, requests=2, arena_mib=0)
    fig = bench.ipc_figures(run)
    assert fig["entries_equal_sent"] and fig["arenas_created"] == 0
    assert all(opens == bench.LINEAR + bench.ATTN for opens in fig["ipc_opens_per_request"])
