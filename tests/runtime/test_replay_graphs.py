"""suffix_replay restores from graphs (graphs.ReplayGraphs, the runner's where CUDA graphs apply):
on the CPU with a stand-in graph whose replay reruns the captured pass over the static buffers,
the restores before, at and after a key's capture all give the eager restore's state; a capture
that fails leaves the key eager with the same answers; groups replay from zero whatever state the
static buffers were left in."""

import random

import pytest
import torch
from hybridcache.services.runtime.cache import PrefixPolicy
from hybridcache.services.runtime.cache.policies import restore_pages
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.graphs import ReplayGraphs
from hybridcache.services.runtime.llm import LLM

P = 64


class RerunGraph:
    """capture keeps the pass; replay runs it again over the static buffers and returns its outputs."""

    def __init__(self, mempool, device):
        self.fn = None

    def capture(self, fn, reset=None):
        self.fn = fn
        return None

    def replay(self):
        return self.fn()


class FailingGraph(RerunGraph):
    def capture(self, fn, reset=None):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """A tiny model whose page tree holds two prompts' pages with fp8 anchors, and their paths."""
    from hybridcache.services.runtime.modelzoo import init_model_dir

    path = init_model_dir("qwen3_5_text", "tiny", tmp_path_factory.mktemp("replay") / "m", seed=0, std=0.08)
    eng = Engine.from_dir(path, config=EngineConfig(mode="prefix", prefix_policy="suffix_replay", anchors_per_page=4,
                                                    anchor_dtype="float8_e4m3fn"))
    prompts = []
    for seed in (1, 2):
        rng = random.Random(seed)
        ids = [rng.randrange(5, 250) for _ in range(4 * P)]
        LLM(eng).generate({"suffix": ids + [1], "sampling_params": {"max_new_tokens": 1}})
        prompts.append(eng.pages.match(ids))
    policy = PrefixPolicy("suffix_replay", anchors_per_page=4, replay_anchors=16, anchor_dtype="float8_e4m3fn")
    return eng.model, policy, [[n.payload for n in p] for p in prompts]


def _equal(a, b):
    assert set(a.linear) == set(b.linear)
    for i in a.linear:
        assert torch.equal(a.linear[i].ssm, b.linear[i].ssm) and torch.equal(a.linear[i].conv, b.linear[i].conv), i


def test_restores_before_at_and_after_the_capture_equal_the_eager_restore(cached):
    model, policy, paths = cached
    groups = len(model.linear_groups())
    graphs = ReplayGraphs(model, graph_factory=RerunGraph)
    for n, pages in enumerate(paths * 2):  # eager, captured (its eager run), replayed, replayed
        _equal(restore_pages(model, policy, pages, graphs.run), restore_pages(model, policy, pages))
        assert graphs.stats["captures"] == (0 if n == 0 else groups), n
    assert graphs.stats["eager"] == groups and graphs.stats["replays"] == 2 * groups and not graphs.failed
    assert len(graphs) == groups


def test_a_failed_capture_leaves_the_key_eager_and_the_answers_right(cached):
    model, policy, paths = cached
    graphs = ReplayGraphs(model, graph_factory=FailingGraph)
    for pages in paths * 2:
        _equal(restore_pages(model, policy, pages, graphs.run), restore_pages(model, policy, pages))
    groups = len(model.linear_groups())
    assert len(graphs.failed) == groups and graphs.stats["captures"] == 0 and graphs.stats["replays"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_runners_suffix_replay_restores_replay_graphs_and_equal_eager(dtype):
    """On a GPU, the runner's restores: the first of a key eager, the second captured (CUDA graph
    of the group's replay), then replayed; each state equal to an eager runner's restore of the
    same pages (bitwise in fp32, the same kernels; within bf16 rounding)."""
    from hybridcache.services.config import RuntimeConfig
    from hybridcache.services.runtime.runner import ModelRunner

    eng = Engine.from_dir(_tiny(), device="cuda", dtype=dtype, config=EngineConfig(
        mode="prefix", prefix_policy="suffix_replay", anchors_per_page=4, anchor_dtype="float8_e4m3fn"))
    paths = []
    for seed in (1, 2):
        rng = random.Random(seed)
        ids = [rng.randrange(5, 250) for _ in range(4 * P)]
        LLM(eng).generate({"suffix": ids + [1], "sampling_params": {"max_new_tokens": 1}})
        paths.append([n.payload for n in eng.pages.match(ids)])
    policy = PrefixPolicy("suffix_replay", anchors_per_page=4, replay_anchors=16, anchor_dtype="float8_e4m3fn")
    graphed = ModelRunner(eng.model, RuntimeConfig(cuda_graphs=True))
    eager = ModelRunner(eng.model, RuntimeConfig(cuda_graphs=False))
    assert graphed.replay_graphs is not None and eager.replay_graphs is None
    for pages in paths * 2:
        got, want = graphed.restore_state(policy, pages), eager.restore_state(policy, pages)
        tol = 0 if dtype == torch.float32 else 2e-2
        for i in want.linear:
            torch.testing.assert_close(got.linear[i].ssm, want.linear[i].ssm, rtol=tol, atol=tol)
    stats = graphed.replay_graphs.stats
    groups = len(eng.model.linear_groups())
    assert not graphed.replay_graphs.failed, graphed.replay_graphs.failed
    assert stats["captures"] == groups and stats["replays"] == 2 * groups, stats


def _tiny():
    import tempfile

    from hybridcache.services.runtime.modelzoo import init_model_dir

    return init_model_dir("qwen3_5_text", "tiny", tempfile.mkdtemp() + "/m", seed=0, std=0.08)
