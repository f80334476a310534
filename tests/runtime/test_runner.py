"""ModelRunner (services/runtime/runner.py) on its own, without an Engine (fp32, CPU, tiny random
models): a layout's forward equals the full forward of transformers' implementation, a batched
cold build equals single builds, a decode step through its pool equals the model's own forward of
each token; staging, the op choice and the graph dispatch of its forward."""

import pytest
import torch
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime import backends
from hybridcache.services.runtime import runner as runner_mod
from hybridcache.services.runtime.cache import SegmentEntry
from hybridcache.services.runtime.cache.host_tier import is_host, to_host
from hybridcache.services.runtime.graphs import LayoutGraphs
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.modelzoo import init_model_dir
from hybridcache.services.runtime.runner import ModelRunner
from hybridcache.services.runtime.sequence import CachedSpan, LiveRun
from transformers import AutoModelForCausalLM

SEAM = 4
# Gated DeltaNet (qwen3.5), KDA with MLA (kimi_linear), SSD (nemotron_h): three mixers
ARCHS = ["qwen3_5_text", "kimi_linear", "nemotron_h"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runner_models")
    return {arch: init_model_dir(arch, "tiny", root / arch, seed=1, std=0.08) for arch in ARCHS}


def make_runner(path, **kw) -> ModelRunner:
    return ModelRunner(load_model(path), RuntimeConfig(seam_window=SEAM, **kw))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_same_span(a, b, tol=1e-5):
    assert (a.num_tokens, a.local_start) == (b.num_tokens, b.local_start)
    assert set(a.linear) == set(b.linear) and set(a.attn) == set(b.attn)
    for i, s in b.linear.items():
        for name in ("T", "S", "conv_tail"):
            want, got = getattr(s, name), getattr(a.linear[i], name)
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=f"layer {i} {name}")
    for i, s in b.attn.items():
        torch.testing.assert_close(a.attn[i].k, s.k, atol=tol, rtol=tol)
        torch.testing.assert_close(a.attn[i].v, s.v, atol=tol, rtol=tol)


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_forward_equals_the_full_forward_of_transformers(arch, dirs):
    """A segment at position 0 folded in from its entry (seam live, body cached), then the rest as
    live runs split at a boundary: the live tokens' logits are transformers' logits of the whole
    sequence (the entry of a segment that starts the prompt is exact), and the state after it
    decodes the next token as transformers does."""
    runner = make_runner(dirs[arch])
    seg, rest = tokens(23, 1), tokens(17, 2)
    ids = torch.tensor(seg + rest)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(dirs[arch], dtype=torch.float32).eval()
        want = ref(ids[None]).logits[0]
    data, seconds = runner.build_span(seg)
    assert data.num_tokens == len(seg) - SEAM and seconds > 0
    t = torch.tensor(rest)
    n = len(seg)
    layout = [LiveRun(ids[:SEAM], 0), CachedSpan(data, SEAM), LiveRun(t[:9], n), LiveRun(t[9:], n + 9)]
    state = runner.empty_state()
    logits, rec = runner.forward(state, layout, "all", snapshot_after={2})
    assert state.length == len(ids)
    live = list(range(SEAM)) + list(range(n, len(ids)))
    assert (logits - want[live]).abs().max().item() <= 1e-4
    assert set(rec.snapshots) == {2}
    # one decode step through the runner's pool from that state: the next token's logits
    nxt = 7
    with torch.no_grad():
        want_next = ref(torch.tensor(seg + rest + [nxt])[None]).logits[0, -1]
    pool = runner.new_state_pool(2, 256)
    slot = pool.assign(state)
    got, _ = runner.decode(pool, [slot], [nxt])
    assert (got[0] - want_next).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_build_equals_single_builds(arch, dirs):
    """Segments of several lengths, cut into more than one batch by a small token budget: every
    span equals its own standalone build, in the order asked, and on_layer reports each batch's
    every stateful layer once, with data whose layer is final."""
    runner = make_runner(dirs[arch], entry_batch_tokens=64)
    segs = [tokens(n, 10 + n) for n in (21, 9, 30, 13, 17)]
    singles = [runner.build_span(s)[0] for s in segs]
    seen = []

    def on_layer(indices, layer, datas):
        seen.append((tuple(indices), layer))
        for i, d in zip(indices, datas):
            if layer in d.linear:
                got, want = d.linear[layer].S, singles[i].linear[layer].S
            else:
                got, want = d.attn[layer].k, singles[i].attn[layer].k
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    for hook in (None, on_layer):
        built = runner.build_spans(segs, hook)
        assert len(built) == len(segs)
        for (data, seconds), want in zip(built, singles):
            assert seconds > 0
            assert_same_span(data, want)
    batches = runner_mod.entry_batches([len(s) for s in segs], 64)
    assert len(batches) > 1
    kinds = ("linear_attention", "full_attention")
    stateful = [i for i, layer in enumerate(runner.model.layers) if layer.kind in kinds]
    assert sorted(seen) == sorted((tuple(b), i) for b in batches for i in stateful)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_steps_through_the_pool_equal_the_models_forward(arch, dirs):
    """Three requests of other lengths decode four steps together in the runner's pool, one of them
    leaving after two: each step's logits equal each request's own one-token forward."""
    runner = make_runner(dirs[arch])
    model = runner.model
    prompts = [tokens(n, 30 + n) for n in (5, 19, 12)]
    refs, slots = [], []
    pool = runner.new_state_pool(4, 512)
    assert pool.slots == 4
    for p in prompts:
        ref, mine = model.empty_state(), model.empty_state()
        model.forward_layout(ref, [LiveRun(torch.tensor(p), 0)], "none")
        runner.forward(mine, [LiveRun(torch.tensor(p), 0)], "none")
        refs.append(ref)
        slots.append(pool.assign(mine))
    gen = torch.Generator().manual_seed(5)
    active = [0, 1, 2]
    for step in range(4):
        toks = torch.randint(3, 200, (len(active),), generator=gen).tolist()
        got, _ = runner.decode(pool, [slots[r] for r in active], toks)
        for b, r in enumerate(active):
            want, _ = model.forward_layout(refs[r], [LiveRun(torch.tensor([toks[b]]), refs[r].length)], "last")
            assert (got[b] - want).abs().max().item() <= 1e-4, (step, r)
        if step == 1:
            pool.release(slots[1])
            active = [0, 2]


def test_staged_host_entries_answer_as_the_device_ones(dirs):
    runner = make_runner(dirs["qwen3_5_text"])
    segs = [tokens(n, 50 + n) for n in (20, 26)]
    datas = [d for d, _ in runner.build_spans(segs)]
    hosted = [to_host(SegmentEntry(f"k{i}", len(s), d, 0.0)) for i, (s, d) in enumerate(zip(segs, datas))]
    assert all(is_host(e) for e in hosted)
    staged = runner.stage(hosted)

    def answer(spans):
        layout, pos = [], 0
        for seg, data in zip(segs, spans):
            layout += [LiveRun(torch.tensor(seg[:SEAM]), pos), CachedSpan(data, pos + SEAM)]
            pos += len(seg)
        layout.append(LiveRun(torch.tensor(tokens(6, 9)), pos))
        return runner.forward(runner.empty_state(), layout, "last")[0]

    torch.testing.assert_close(answer(staged), answer(datas), atol=0, rtol=0)


def test_the_config_chooses_ops_and_graphs_once(dirs, monkeypatch):
    """The runner's op choice holds for its own calls only (entered per call, not made the
    process's); its graphs are its fields, the model holds none; a second runner over the same model
    with other settings changes nothing of the first."""
    model = load_model(dirs["qwen3_5_text"])
    attributes = set(vars(model))
    runner = ModelRunner(model, RuntimeConfig(kernels="reference", sdpa_backends="math", cuda_graph_shapes=3,
                                              max_model_len=300))
    assert runner.dispatch == backends.OpDispatch("reference", "math")
    assert backends.current_dispatch() == backends.OpDispatch()  # building it chose nothing for the process
    seen = []
    real = model.forward_layout

    def spy(*a, **k):
        seen.append(backends.current_dispatch())
        return real(*a, **k)

    monkeypatch.setattr(model, "forward_layout", spy)
    runner.forward(model.empty_state(), [LiveRun(torch.tensor(tokens(5, 1)), 0)], "last")
    other = ModelRunner(model, RuntimeConfig())
    other.forward(model.empty_state(), [LiveRun(torch.tensor(tokens(5, 1)), 0)], "last")
    assert seen == [backends.OpDispatch("reference", "math"), backends.OpDispatch()]
    assert backends.current_dispatch() == backends.OpDispatch()
    # on the CPU neither kind of graph applies; the model carries no execution state
    assert runner.layout_graphs is None and not runner.decode_graphs_on and runner.graph_stats == {}
    assert set(vars(model)) - {"forward_layout"} == attributes
    # the pool's block tables are as wide as the config's longest sequence needs (19 pages of 16)
    assert runner.max_len == 300
    assert runner.new_state_pool(2, 10_000).kv.table.shape[1] == 19 + 1


def test_a_runner_s_op_choice_is_its_thread_s(dirs, monkeypatch):
    """Two runners of other op choices over one model, called from two threads at once: every
    forward sees its own runner's choice."""
    import threading

    model = load_model(dirs["qwen3_5_text"])
    runners = [ModelRunner(model, RuntimeConfig(sdpa_backends=b)) for b in ("math", "flash,math")]
    seen: list[tuple[int, str]] = []
    real = model.forward_layout

    def spy(*a, **k):
        seen.append((threading.get_ident(), backends.current_dispatch().sdpa_backends))
        return real(*a, **k)

    monkeypatch.setattr(model, "forward_layout", spy)
    barrier = threading.Barrier(2)
    idents = {}

    def work(k):
        idents[threading.get_ident()] = runners[k].dispatch.sdpa_backends
        barrier.wait()
        for _ in range(5):
            runners[k].forward(model.empty_state(), [LiveRun(torch.tensor(tokens(6, k)), 0)], "last")

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 10 and all(choice == idents[ident] for ident, choice in seen)


class EagerLayerGraph:
    """CPU double of graphs.CudaLayerGraph: capture runs the layer, replay runs it again into the
    tensor capture returned (tests/runtime/test_layout_graphs.py has the same double)."""

    def __init__(self, pool, device):
        pass

    def capture(self, fn, reset=None):
        self.fn, self.reset = fn, reset
        self.out = fn()
        return self.out

    def replay(self):
        self.reset()
        self.out.copy_(self.fn())


def test_forward_runs_assemblies_from_the_layout_graphs(dirs):
    """Where graphs apply (a CUDA model; here the runner is handed a graph cache), the runner's forward of
    an assembly is captured once and then replayed, with the eager forward's answers; a plain
    prefill (no cached span) runs eagerly."""
    runner = make_runner(dirs["qwen3_5_text"])
    model = runner.model
    cache = runner.layout_graphs = LayoutGraphs(model, capture_after=1, graph_factory=EagerLayerGraph)
    for seed in (1, 2, 3):
        segs = [tokens(n, seed * 10 + n) for n in (19, 24)]
        datas = [d for d, _ in runner.build_spans(segs)]
        layout, pos = [], 0
        for seg, data in zip(segs, datas):
            layout += [LiveRun(torch.tensor(seg[:SEAM]), pos), CachedSpan(data, pos + SEAM)]
            pos += len(seg)
        layout.append(LiveRun(torch.tensor(tokens(5, seed)), pos))
        want_state, state = model.empty_state(), model.empty_state()
        want, _ = model.forward_layout(want_state, layout, "last")
        got, _ = runner.forward(state, layout, "last")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for i in want_state.linear:
            torch.testing.assert_close(state.linear[i].ssm, want_state.linear[i].ssm, atol=1e-5, rtol=1e-5)
    assert cache.stats["captures"] == 1 and cache.stats["replays"] == 2 and not cache.failed
    runner.forward(model.empty_state(), [LiveRun(torch.tensor(tokens(9, 4)), 0)], "none")
    assert cache.stats["replays"] == 2 and cache.stats["captures"] == 1
