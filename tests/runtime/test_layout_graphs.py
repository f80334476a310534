"""The CUDA-graph layer of the live pass (services/runtime/graphs.py) on CPU.

CUDA graphs need a GPU (tests/kernels/test_cuda_graphs.py runs them there). Here a layer's "graph"
is an eager double: capture runs the layer once on the static buffers, replay runs it again and
writes its output into the tensor capture returned, as a CUDA graph's replay rewrites the memory
it captured. That exercises everything of graphs.py but the capture itself: the shape key, the
static buffers and the binding of each request into them, the eager answer of the capturing
request, the check replay, the cloning of state and recordings out, fallbacks and eviction.
"""

import pytest
import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.cache import SegmentEntry
from hybridcache.services.runtime.cache.host_tier import stage, to_host
from hybridcache.services.runtime.config import ModelConfig
from hybridcache.services.runtime.graphs import (
    GraphUnsupported,
    LayoutGraphs,
    clone_out,
    find_patch_sites,
    layout_key,
)
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.modelzoo import hf_config, random_init_
from hybridcache.services.runtime.sequence import CachedSpan, LiveRun

SEAM = 4


class EagerLayerGraph:
    """CPU double of graphs.CudaLayerGraph (module docstring)."""

    def __init__(self, pool, device):
        self.replays = 0

    def capture(self, fn, reset=None):
        self.fn, self.reset = fn, reset
        self.out = fn()
        return self.out

    def replay(self):
        self.replays += 1
        self.reset()
        self.out.copy_(self.fn())


class FailingCapture(EagerLayerGraph):
    def capture(self, fn, reset=None):
        raise RuntimeError("operation not permitted when stream is capturing")


class DriftingReplay(EagerLayerGraph):
    """A replay whose output is off: the check replay must catch it."""

    def replay(self):
        super().replay()
        self.out.add_(0.5)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_dict(hf_config("qwen3_5_text", "tiny"))
    m = HybridLM(cfg).eval()
    random_init_(m, seed=3, std=0.08)
    return m


def entries_of(model, segs):
    out = []
    for seg in segs:
        layout = [LiveRun(seg[:SEAM], 0), LiveRun(seg[SEAM:], SEAM, record="entry")]
        _, rec = model.forward_layout(model.empty_state(), layout, "none")
        out.append(rec.entries[1])
    return out


def request(model, seed, lengths=(37, 50, 29), question=9):
    gen = torch.Generator().manual_seed(seed)
    segs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in lengths]
    q = torch.randint(0, model.cfg.vocab_size, (question,), generator=gen)
    return segs, entries_of(model, segs), q


def pic_layout(segs, datas, question, start=0):
    layout, pos = [], start
    for seg, data in zip(segs, datas):
        layout += [LiveRun(seg[:SEAM], pos), CachedSpan(data, pos + SEAM)]
        pos += seg.numel()
    layout.append(LiveRun(question, pos))
    return layout


def eager(model, state, layout, **kw):
    return model.forward_layout(state, layout, "last", **kw)


def assert_same_state(a, b, tol=1e-5):
    assert a.length == b.length
    for i in b.linear:
        torch.testing.assert_close(a.linear[i].ssm, b.linear[i].ssm, atol=tol, rtol=tol)
        torch.testing.assert_close(a.linear[i].conv, b.linear[i].conv, atol=tol, rtol=tol)
    for i in b.attn:
        torch.testing.assert_close(a.attn[i].k, b.attn[i].k, atol=tol, rtol=tol)
        torch.testing.assert_close(a.attn[i].v, b.attn[i].v, atol=tol, rtol=tol)


def test_replays_of_a_shape_answer_each_request_as_the_eager_forward(model):
    graphs = LayoutGraphs(model, capture_after=1, graph_factory=EagerLayerGraph)
    snaps = {1, 3}
    hidden = (0, 2)
    for seed in (1, 2, 3):  # one capture, then two requests with other tokens and entries
        segs, datas, q = request(model, seed)
        ref_state = model.empty_state()
        ref_logits, ref_rec = eager(
            model, ref_state, pic_layout(segs, datas, q), snapshot_after=snaps, capture_hidden=hidden
        )
        state = model.empty_state()
        logits, rec = graphs.run(state, pic_layout(segs, datas, q), "last", snaps, hidden)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        assert_same_state(state, ref_state)
        assert set(rec.snapshots) == set(ref_rec.snapshots) == snaps
        for idx in snaps:
            for lay, s in ref_rec.snapshots[idx].items():
                torch.testing.assert_close(rec.snapshots[idx][lay].ssm, s.ssm, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(rec.snapshots[idx][lay].conv, s.conv, atol=1e-5, rtol=1e-5)
        for i in hidden:
            torch.testing.assert_close(rec.hidden[i], ref_rec.hidden[i], atol=1e-5, rtol=1e-5)
    assert graphs.stats["captures"] == 1 and graphs.stats["replays"] == 2 and graphs.stats["failures"] == 0
    # what a request keeps is its own: the next replay must not change it
    kept = logits.clone(), state.linear[0].ssm.clone()
    segs, datas, q = request(model, 9)
    graphs.run(model.empty_state(), pic_layout(segs, datas, q), "last", snaps, hidden)
    assert torch.equal(kept[0], logits) and torch.equal(kept[1], state.linear[0].ssm)


def test_a_shape_is_captured_on_its_nth_sighting_and_other_shapes_run_eagerly(model):
    graphs = LayoutGraphs(model, capture_after=2, graph_factory=EagerLayerGraph)
    segs, datas, q = request(model, 1)
    assert graphs.run(model.empty_state(), pic_layout(segs, datas, q), "last", (), ()) is None
    assert graphs.run(model.empty_state(), pic_layout(segs, datas, q), "last", (), ()) is not None
    assert len(graphs) == 1
    # another segment length, another shape: first sighting again
    segs2, datas2, q2 = request(model, 1, lengths=(37, 51, 29))
    assert graphs.run(model.empty_state(), pic_layout(segs2, datas2, q2), "last", (), ()) is None
    # no cached span, or a run that records an entry: never captured
    assert layout_key(model.empty_state(), [LiveRun(q, 0)], "last", (), ()) is None
    rec_layout = [LiveRun(segs[0][:SEAM], 0), LiveRun(segs[0][SEAM:], SEAM, record="entry")]
    assert layout_key(model.empty_state(), rec_layout, "none", (), ()) is None


def test_shape_key_tells_apart_what_changes_the_kernels(model):
    from hybridcache.services.runtime import backends

    segs, datas, q = request(model, 1)
    state = model.empty_state()
    base = layout_key(state, pic_layout(segs, datas, q), "last", (), ())
    assert base == layout_key(state, pic_layout(*request(model, 2)), "last", (), ())  # other tokens, same shape
    assert base != layout_key(state, pic_layout(segs, datas, q, start=0)[:-1] + [LiveRun(q[:-1], 104)], "last", (), ())
    assert base != layout_key(state, pic_layout(segs, datas, q), "all", (), ())
    assert base != layout_key(state, pic_layout(segs, datas, q), "last", {1}, ())
    naive = [CachedSpan(p.data, p.start, False) if isinstance(p, CachedSpan) else p for p in pic_layout(segs, datas, q)]
    assert base != layout_key(state, naive, "last", (), ())
    for other in (backends.OpDispatch(kernels="reference"), backends.OpDispatch(sdpa_backends="flash,math")):
        with backends.dispatching(other):
            assert base != layout_key(state, pic_layout(segs, datas, q), "last", (), ())
    assert base == layout_key(state, pic_layout(segs, datas, q), "last", (), ())


def test_a_request_whose_tensors_do_not_fit_runs_eagerly(model):
    graphs = LayoutGraphs(model, capture_after=1, graph_factory=EagerLayerGraph)
    segs, datas, q = request(model, 1)
    graphs.run(model.empty_state(), pic_layout(segs, datas, q), "last", (), ())
    segs, datas, q = request(model, 2)
    # the key reads each span's first layers only; a later layer in another dtype must not bind
    last_linear = max(datas[1].linear)
    span = datas[1].linear[last_linear]
    datas[1].linear[last_linear] = type(span)(span.T.double(), span.S, span.conv_tail)
    state = model.empty_state()
    assert graphs.run(state, pic_layout(segs, datas, q), "last", (), ()) is None
    assert state.length == 0 and state.attn[min(state.attn)].k.shape[2] == 0  # untouched
    with pytest.raises(GraphUnsupported):
        next(iter(graphs._graphs.values())).bind(last_linear, state, pic_layout(segs, datas, q), None)


@pytest.mark.parametrize("factory", [FailingCapture, DriftingReplay], ids=["capture-fails", "replay-differs"])
def test_a_shape_that_cannot_be_captured_answers_eagerly_and_stays_eager(model, factory):
    graphs = LayoutGraphs(model, capture_after=1, graph_factory=factory)
    segs, datas, q = request(model, 1)
    ref_state = model.empty_state()
    ref_logits, _ = eager(model, ref_state, pic_layout(segs, datas, q))
    state = model.empty_state()
    logits, _ = graphs.run(state, pic_layout(segs, datas, q), "last", (), ())
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)  # the eager answer stands
    assert_same_state(state, ref_state)
    assert graphs.stats["failures"] == 1 and len(graphs) == 0 and len(graphs.failed) == 1
    assert graphs.run(model.empty_state(), pic_layout(segs, datas, q), "last", (), ()) is None


def test_a_shape_from_a_prefix_state_and_host_staged_entries(model):
    """A layout that starts after a restored prefix (the entering state is an input too), with its
    entries staged from the host tier (ArrivingLayers: bound layer by layer)."""
    graphs = LayoutGraphs(model, capture_after=1, graph_factory=EagerLayerGraph)
    gen = torch.Generator().manual_seed(5)
    for seed in (1, 2):
        prefix = torch.randint(0, model.cfg.vocab_size, (21,), generator=gen)
        start = model.empty_state()
        model.forward_layout(start, [LiveRun(prefix, 0)], "none")
        segs, datas, q = request(model, seed)
        hosted = stage(
            [to_host(SegmentEntry(f"e{seed}{i}", len(s), d, 0.0)) for i, (s, d) in enumerate(zip(segs, datas))], "cpu"
        )
        ref_state = start.clone()
        ref_logits, _ = eager(model, ref_state, pic_layout(segs, datas, q, start=21))
        state = start.clone()
        logits, _ = graphs.run(state, pic_layout(segs, hosted, q, start=21), "last", (), ())
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        assert_same_state(state, ref_state)
    assert graphs.stats["replays"] == 1


def test_least_recently_used_shape_is_dropped(model):
    graphs = LayoutGraphs(model, max_graphs=1, capture_after=1, graph_factory=EagerLayerGraph)
    a, b = request(model, 1), request(model, 2, lengths=(40, 40))
    graphs.run(model.empty_state(), pic_layout(*a), "last", (), ())
    graphs.run(model.empty_state(), pic_layout(*b), "last", (), ())
    assert len(graphs) == 1 and graphs.stats["captures"] == 2
    key_b = layout_key(model.empty_state(), pic_layout(*b), "last", (), ())
    assert list(graphs._graphs) == [key_b]


def test_clone_out_copies_views_of_one_storage_as_one_block():
    base = torch.arange(60.0).view(5, 12)
    views = [base[1], base[3], base[4, 2:7]]
    lone = torch.ones(3)
    out = clone_out([*views, lone, torch.empty(0)])
    for o, v in zip(out, [*views, lone]):
        assert torch.equal(o, v)
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()  # one copy
    assert out[0].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    base.zero_()
    assert out[1][0].item() == 36.0 and out[4].numel() == 0


def test_host_constants_are_device_tensors_filled_once_after_the_capture():
    arena = backends.HostConstants()
    a, b = torch.arange(5), torch.tensor([[1.5, 2.5]])
    with arena.measuring():
        assert arena.to_device(a, "cpu") is None and arena.to_device(b, "cpu") is None
    assert [tuple(t.shape) for t in arena.slots] == [(5,), (1, 2)]
    with arena.serving():
        sa = arena.to_device(a, "cpu")
        assert sa is arena.slots[0]
        sb = arena.to_device(b + 1, "cpu")
    assert torch.equal(sa, a) and torch.equal(sb, b + 1)  # filled on leaving the capture
    with pytest.raises(RuntimeError, match="differs from its eager run"):
        with arena.serving():
            arena.to_device(b, "cpu")
    with pytest.raises(RuntimeError, match="made 1 host copies, its eager run 2"):
        with arena.serving():
            arena.to_device(a, "cpu")


def test_graphs_are_off_on_cpu(model):
    from hybridcache.services.runtime.runner import ModelRunner

    runner = ModelRunner(model)
    assert runner.layout_graphs is None and not runner.graphs_apply  # a CPU model: the eager forward
    moe = HybridLM(ModelConfig.from_dict(hf_config("qwen3_5_moe_text", "tiny")))
    assert moe.cuda_graphs and model.cuda_graphs  # MoE blocks have no host sync (tests/runtime/test_moe.py)


def test_patch_sites_are_the_table_entries_holding_a_buffer_address():
    tables = [torch.tensor([7, 1 << 41, 3, (1 << 41) + 4096]), torch.tensor([0.5, 2.0]), torch.tensor([[1 << 41, 9]])]
    sites = find_patch_sites(tables, {1 << 41: ("span0", "T"), (1 << 41) + 4096: ("span0", "S"), 123: ("x",)})
    assert sites == {("span0", "T"): [(0, 1), (2, 0)], ("span0", "S"): [(0, 3)]}


def test_on_cpu_spans_are_bound_by_copies(model):
    """Without CUDA the pass makes no host constants, so no address table can be patched: T and S
    are copied into the static buffers (the GPU test checks patched binding)."""
    graphs = LayoutGraphs(model, capture_after=1, graph_factory=EagerLayerGraph)
    graphs.run(model.empty_state(), pic_layout(*request(model, 1)), "last", (), ())
    static = next(iter(graphs._graphs.values()))
    assert not static.patched and static.patch_sites() is None


def test_patched_binding_rewrites_the_tables_to_the_request_s_t_and_s(model):
    """The mechanics of patched binding, on tables made here (on a GPU the fold's address tables are
    the captured pass's host constants): sites found for every span T and S, the static T and S
    dropped, each request's addresses written in; a tensor that does not fit is refused first."""
    graphs = LayoutGraphs(model, capture_after=1, graph_factory=EagerLayerGraph)
    graphs.run(model.empty_state(), pic_layout(*request(model, 1)), "last", (), ())
    static = next(iter(graphs._graphs.values()))
    layers = sorted(static.spans[0][1].linear)
    rows = [[7, d.linear[lay].T.data_ptr(), 3, d.linear[lay].S.data_ptr()] for _, d in static.spans for lay in layers]
    static.arena.values = [torch.tensor(r) for r in rows]
    static.arena.slots = [torch.zeros(4, dtype=torch.int64) for _ in rows]
    sites = static.patch_sites()
    assert sites is not None and len(sites) == 2 * len(static.spans) * len(layers)
    static.plan_patching(sites)
    static.drop_static_transitions()
    assert static.patched and all(s.T is None and s.S is None for _, d in static.spans for s in d.linear.values())
    segs, datas, q = request(model, 2)
    layout = pic_layout(segs, datas, q)
    static.patch_tables(layout)
    n = 0
    for data in datas:
        for lay in layers:
            want = [7, data.linear[lay].T.data_ptr(), 3, data.linear[lay].S.data_ptr()]
            assert static.arena.slots[n].tolist() == want
            n += 1
    span = datas[0].linear[layers[0]]
    datas[0].linear[layers[0]] = type(span)(span.T.transpose(-1, -2), span.S, span.conv_tail)  # not contiguous
    with pytest.raises(GraphUnsupported, match="contiguous: False"):
        static.patch_tables(pic_layout(segs, datas, q))


def test_cuda_graphs_flag_reaches_the_runner(monkeypatch, qwen35_dir):
    """--cuda-graphs off -> EngineConfig.cuda_graphs -> the engine's runner runs its model eagerly
    (it holds no graphs); the flag is forwarded to the services `hybridcache up` starts."""
    import argparse

    from hybridcache.services.config import add_config_flags, config_args, config_from_args
    from hybridcache.services.runtime.engine import Engine, EngineConfig

    ap = argparse.ArgumentParser()
    add_config_flags(ap)
    off = config_from_args(ap.parse_args(["--cuda-graphs", "off"]))
    assert off.cuda_graphs is False
    assert config_from_args(ap.parse_args([])).cuda_graphs is True
    forwarded = config_args(off, "scatter")
    assert forwarded[forwarded.index("--cuda-graphs") + 1] == "off"
    # a model that would be captured (as on a GPU): the device stands in
    monkeypatch.setattr(HybridLM, "device", property(lambda self: torch.device("cuda")))
    eng = Engine.from_dir(qwen35_dir, config=EngineConfig(cuda_graphs=True))
    assert eng.runner.layout_graphs is not None and eng.runner.decode_graphs_on
    assert Engine(eng.model, eng.tokenizer, off).runner.layout_graphs is None
    # the references on a CUDA model: no graphs of either kind
    reference = Engine(eng.model, eng.tokenizer, EngineConfig(kernels="reference")).runner
    assert reference.layout_graphs is None and not reference.decode_graphs_on
    # --cuda-graph-shapes bounds the shapes kept
    shapes = Engine(eng.model, eng.tokenizer, config_from_args(ap.parse_args(["--cuda-graph-shapes", "2"])))
    assert shapes.runner.layout_graphs.max_graphs == 2
    assert eng.runner.layout_graphs.max_graphs == 4  # each runner its own graphs
    with pytest.raises(ValueError, match="cuda_graph_shapes"):
        config_from_args(ap.parse_args(["--cuda-graph-shapes", "0"]))
