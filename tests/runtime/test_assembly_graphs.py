"""Graphs of planned assemblies (graphs.AssemblyGraphs) on CPU, through the eager double of a CUDA
graph (test_layout_graphs.EagerLayerGraph: capture runs the layer on the static buffers, replay
reruns it and writes its output into the tensor capture returned). A bucket is captured once; a
layout never seen before of the same bucket (other document lengths, another question length)
replays it with no new capture and answers as the exact eager pass over its layout; another
bucket is captured apart; a capture that fails leaves the bucket eager."""

import pytest
import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.graphs import AssemblyGraphs
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.models.assembly import plan_assembly
from hybridcache.services.runtime.paged import extend_pages
from hybridcache.services.runtime.tokenizer import Tokenizer
from test_layout_graphs import EagerLayerGraph, FailingCapture


def _ids(gen, n):
    return torch.randint(0, 250, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def eng(qwen35_dir):
    return Engine(load_model(qwen35_dir), Tokenizer.from_dir(qwen35_dir), EngineConfig(mode="pic"))


def _job(eng, gen, lengths, question, system=0):
    obj = {"system": _ids(gen, system), "segments": [_ids(gen, n) for n in lengths], "suffix": _ids(gen, question)}
    return eng.start_prefill(eng.parse_request(obj))


def _run(eng, graphs, pool, job):
    """(planned answer through `graphs` or eagerly, exact eager answer, plan) of one job."""
    model = eng.model
    ref_state = job.state.clone()
    ref = model.forward_layout(ref_state, job.layout, "last", job.snapshot_after)
    state = job.state
    slot = pool.assign(state)
    extend_pages(state, job.layout[-1].end - state.length)
    plan = plan_assembly(model, state, job.layout, job.snapshot_after, (), "last", run_tokens=8)
    out = graphs.run(state, plan)
    if out is None:
        out = model.forward_planned(state, plan)
    got = (out[0], {i: s.ssm.clone() for i, s in state.linear.items()}, out[1])
    pool.release(slot)
    return got, (ref[0], {i: s.ssm for i, s in ref_state.linear.items()}, ref[1]), plan


def _same(got, ref):
    torch.testing.assert_close(got[0], ref[0], rtol=2e-4, atol=2e-4)
    for i, s in ref[1].items():
        torch.testing.assert_close(got[1][i], s, rtol=2e-4, atol=2e-4)
    assert set(got[2].snapshots) == set(ref[2].snapshots)
    for idx, by_layer in ref[2].snapshots.items():
        for i, s in by_layer.items():
            torch.testing.assert_close(got[2].snapshots[idx][i].ssm, s.ssm, rtol=2e-4, atol=2e-4)


def test_unseen_layouts_replay_their_bucket_s_graphs(eng):
    graphs = AssemblyGraphs(eng.model, graph_factory=EagerLayerGraph)
    pool = eng.new_state_pool(1, 4096)
    gen = torch.Generator().manual_seed(1)
    layouts = [([30, 45, 17], 21), ([64, 20, 33], 21), ([25, 50, 90], 22), ([12, 80, 41], 23)]
    keys = []
    for lengths, q in layouts:
        got, ref, plan = _run(eng, graphs, pool, _job(eng, gen, lengths, q))
        _same(got, ref)
        keys.append(plan.key)
        eng.reset_caches()
    assert len(set(keys)) == 1
    # seen once eagerly, captured on the second layout, replayed by two layouts it never saw
    assert graphs.stats == {"captures": 1, "replays": 2, "eager": 1, "failures": 0}
    # another bucket: many more documents
    for _ in range(2):
        got, ref, plan = _run(eng, graphs, pool, _job(eng, gen, [20] * 12, 21))
        _same(got, ref)
        eng.reset_caches()
    assert plan.key != keys[0] and graphs.stats["captures"] == 2 and len(graphs) == 2
    # a kept graph holds nothing of the requests it ran (their entries may be evicted)
    assert all(not static["plan"].spans and not static["plan"]._pieces for static in graphs._graphs.values())


def test_a_bucket_that_cannot_be_captured_answers_eagerly(eng):
    graphs = AssemblyGraphs(eng.model, graph_factory=FailingCapture, capture_after=1)
    pool = eng.new_state_pool(1, 4096)
    gen = torch.Generator().manual_seed(2)
    for lengths in ([30, 45, 17], [40, 22, 19]):
        got, ref, _ = _run(eng, graphs, pool, _job(eng, gen, lengths, 21, system=9))
        _same(got, ref)
        eng.reset_caches()
    assert graphs.stats["failures"] == 1 and graphs.stats["captures"] == 0 and len(graphs) == 0
