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


def test_a_replay_lends_its_kept_states_until_its_graphs_run_again(eng):
    """A replay leaves the part-chain states where its graphs wrote them (no copy before the first
    token): the Recording is borrowed, its snapshots view the graphs' outputs; the engine copies
    them when it keeps the chains, and keeps none once the graphs have run again (they hold
    another request's states then)."""
    graphs = AssemblyGraphs(eng.model, graph_factory=EagerLayerGraph)
    pool = eng.new_state_pool(1, 4096)
    gen = torch.Generator().manual_seed(3)
    kept = []
    for lengths in ([30, 45, 17], [64, 20, 33], [25, 50, 90], [12, 80, 41]):
        job = _job(eng, gen, lengths, 21)
        state = job.state
        slot = pool.assign(state)
        extend_pages(state, job.layout[-1].end - state.length)
        plan = plan_assembly(eng.model, state, job.layout, job.snapshot_after, (), "last", run_tokens=8)
        out = graphs.run(state, plan) or eng.model.forward_planned(state, plan)
        rec = out[1]
        idx = next(iter(rec.snapshots))
        layer, snap = next(iter(rec.snapshots[idx].items()))
        kept.append((rec, snap.ssm.clone(), snap))
        if graphs.stats["replays"] == 0:  # eager, or the capture's own eager answer: fresh tensors
            assert rec.borrowed is None
        else:
            assert rec.borrowed is not None and rec.borrowed()
            static = next(iter(graphs._graphs.values()))
            outs = [t for k, v in static["rec"].scratch.items() if isinstance(k, tuple) for t in v]
            assert any(snap.ssm.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in outs)
            # the engine keeps the chains as copies while the graphs have not run again
            job.chain = [(i, job.layout[i].end, rec.snapshots[i]) for i in sorted(rec.snapshots) if i in job.boundary]
            assert job.chain
            job.borrowed = rec.borrowed
            before = len(eng.prefixes)
            eng._keep_chains(job)
            assert len(eng.prefixes) > before and job.borrowed is None
            stored = eng.prefixes.get(job.keys[job.boundary[job.chain[0][0]]])
            assert all(s.ssm.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                       for s in stored.linear.values() for t in outs)
        pool.release(slot)
        eng.reset_caches()
    assert graphs.stats["replays"] == 2
    # the first replay's recording is stale after the second (a CUDA graph writes the same memory
    # again; the eager double here writes new tensors, so only the count tells)
    first_replayed = kept[2][0]
    assert not first_replayed.borrowed()
    job = _job(eng, gen, [30, 45, 17], 21)
    job.chain, job.borrowed = [(0, 1, kept[2][0].snapshots[next(iter(kept[2][0].snapshots))])], first_replayed.borrowed
    before = len(eng.prefixes)
    eng._keep_chains(job)
    assert len(eng.prefixes) == before  # not kept
