"""Planned assemblies (services/runtime/models/assembly.py) on CPU: the bucketed pass over a
layout's plan (sub-runs of the seam's length, counts padded to buckets, indices as device data,
the K/V in the request's pages) equals the exact eager pass over the layout (logits, linear
states, K/V, the states kept for the prefix caches, captured hidden states), and layouts that
differ only in their documents' lengths, or in a few tokens, share one plan key."""

import pytest
import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.models.assembly import bucket, plan_assembly
from hybridcache.services.runtime.paged import extend_pages
from hybridcache.services.runtime.tokenizer import Tokenizer


def _engine(path, **cfg):
    return Engine(load_model(path), Tokenizer.from_dir(path), EngineConfig(**cfg))


def _ids(gen, n):
    return torch.randint(0, 250, (n,), generator=gen).tolist()


def _request(gen, lengths, question=21, system=0):
    return {"system": _ids(gen, system), "segments": [_ids(gen, n) for n in lengths], "suffix": _ids(gen, question)}


def _planned_and_eager(eng, obj, capture=()):
    """(plan, planned logits/state/rec, eager logits/state/rec) of one request's assembly."""
    job = eng.start_prefill(eng.parse_request(obj))
    model = eng.model
    ref_state = job.state.clone()
    ref_logits, ref_rec = model.forward_layout(ref_state, job.layout, "last", job.snapshot_after, capture)
    pool = eng.new_state_pool(2, 4096)
    state = job.state
    pool.assign(state)
    extend_pages(state, job.layout[-1].end - state.length)
    plan = plan_assembly(model, state, job.layout, job.snapshot_after, capture, "last", run_tokens=8)
    assert plan is not None
    logits, rec = model.forward_planned(state, plan)
    return plan, (logits, state, rec), (ref_logits, ref_state, ref_rec), job


def _close(a, b, tol=2e-4):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("system", [0, 20])
def test_planned_pass_equals_the_eager_pass(qwen35_dir, system):
    """Three cached segments, their seams, a question of three sub-runs (and a live system prompt
    before the first seam: runs after runs), the states kept after each part, hidden states."""
    eng = _engine(qwen35_dir, mode="pic")
    gen = torch.Generator().manual_seed(1)
    capture = (0, 2)
    plan, (logits, state, rec), (ref_logits, ref_state, ref_rec), _ = _planned_and_eager(
        eng, _request(gen, [30, 45, 17], question=21, system=system), capture)
    assert plan.real["n"] < plan.n or plan.real["m"] < plan.m  # padding was exercised
    _close(logits, ref_logits)
    for i, s in ref_state.linear.items():
        _close(state.linear[i].ssm, s.ssm)
        _close(state.linear[i].conv, s.conv)
    for i, a in ref_state.attn.items():
        _close(state.attn[i].k, a.k, 1e-5)
        _close(state.attn[i].v, a.v, 1e-5)
    assert state.length == ref_state.length
    assert set(rec.snapshots) == set(ref_rec.snapshots) and rec.snapshots
    for idx, by_layer in ref_rec.snapshots.items():
        for i, s in by_layer.items():
            _close(rec.snapshots[idx][i].ssm, s.ssm)
            _close(rec.snapshots[idx][i].conv, s.conv)
    for i in capture:
        assert rec.hidden[i].shape == ref_rec.hidden[i].shape
        _close(rec.hidden[i], ref_rec.hidden[i])


def test_layouts_of_other_document_lengths_share_a_key(qwen35_dir):
    """The key holds the bucketed live structure only: documents of other lengths, and a question a
    few tokens longer, plan alike; many more documents do not."""
    eng = _engine(qwen35_dir, mode="pic")
    gen = torch.Generator().manual_seed(2)
    keys = []
    for lengths, q in [([30, 45, 17], 21), ([60, 12, 33], 21), ([25, 25, 90], 23)]:
        plan, got, ref, _ = _planned_and_eager(eng, _request(gen, lengths, question=q))
        _close(got[0], ref[0])
        keys.append(plan.key)
    assert keys[0] == keys[1] == keys[2]
    plan, *_ = _planned_and_eager(eng, _request(gen, [20] * 12, question=21))
    assert plan.key != keys[0]


def test_layouts_that_do_not_plan(qwen35_dir):
    eng = _engine(qwen35_dir, mode="pic")
    gen = torch.Generator().manual_seed(3)
    job = eng.start_prefill(eng.parse_request(_request(gen, [30, 40])))
    model = eng.model
    # contiguous K/V (not in pages)
    assert plan_assembly(model, job.state, job.layout, job.snapshot_after) is None
    pool = eng.new_state_pool(1, 1024)
    pool.assign(job.state)
    extend_pages(job.state, job.layout[-1].end - job.state.length)
    assert plan_assembly(model, job.state, job.layout, job.snapshot_after, logits_for="all") is None
    assert plan_assembly(model, job.state, job.layout, job.snapshot_after) is not None
    # no cached span: a plain prompt
    plain = eng.start_prefill(eng.parse_request({"suffix": _ids(gen, 40)}))
    pool.release(0)
    pool.assign(plain.state)
    extend_pages(plain.state, 40)
    assert plan_assembly(model, plain.state, plain.layout) is None


def test_bucket():
    assert [bucket(n) for n in (1, 8, 9, 16, 17, 33, 320, 321, 1000)] == [8, 8, 9, 16, 18, 36, 320, 352, 1024]
    for n in range(1, 5000):
        b = bucket(n)
        assert b >= n and (n <= 8 or b <= n * 1.125 + 1)
