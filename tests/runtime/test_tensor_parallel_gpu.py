"""Tensor parallelism over NCCL: two GPUs, one rank each (`pytest -m gpu`, needs 2 GPUs).

TP = 2 `full` logits and a pic request (cold, then reordered after another prefix) equal TP = 1
on one GPU, tiny fp32 models; on CUDA the ops are fla-core's and the project's Triton kernels, so
the tolerance is that of the GPU family tests, not the CPU test's 1e-5.
"""

import functools

import pytest
import torch
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime.engine import Engine
from hybridcache.services.runtime.modelzoo import init_model_dir
from hybridcache.services.runtime.sequence import LiveRun
from hybridcache.services.runtime.tensor_parallel import ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
ARCHS = ["qwen3_5_text", "qwen3_next", "nemotron_h", "kimi_linear", "minimax"]


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_gpu")
    dirs = {a: str(init_model_dir(a, "tiny", root / a, seed=1, std=0.08)) for a in ARCHS}
    cfg = RuntimeConfig(device="cuda", mode="pic", cuda_graphs=False)
    g = ranks.start(2, functools.partial(ranks.build_runners, {a: (p, cfg) for a, p in dirs.items()}), device="cuda")
    engines = {a: ranks.engine_of(g, dirs[a], a) for a in ARCHS}
    yield dirs, cfg, g, engines
    g.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_over_nccl_equals_tp1(arch, setup):
    dirs, cfg, g, engines = setup
    ref = Engine.from_dir(dirs[arch], device="cuda", config=cfg)
    tp2 = engines[arch]
    ids = torch.randint(0, 256, (97,), generator=torch.Generator().manual_seed(3))
    a, _ = ref.model.forward_layout(ref.model.empty_state(), [LiveRun(ids, 0)], logits_for="all")
    b, _ = tp2.runner.forward(tp2.runner.empty_state(), [LiveRun(ids, 0)], logits_for="all")
    assert _rel(b, a) < 2e-3
    gen = torch.Generator().manual_seed(5)
    segs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 70, 33)]
    for system, order in (([1, 2, 3], [0, 1, 2]), ([9, 8], [2, 0, 1])):
        obj = {"system": system, "segments": [segs[i] for i in order], "suffix": [7, 7, 7]}
        pr, pt = ref.prefill(ref.parse_request(obj)), tp2.prefill(tp2.parse_request(obj))
        assert _rel(pt.logits, pr.logits) < 2e-3
        assert [s.source for s in pt.stats.segments] == [s.source for s in pr.stats.segments]
        ref.finish_prefix(pr)
        tp2.finish_prefix(pt)


def test_entry_slices_travel_as_one_bundle_over_nccl_ranks(setup):
    """A scatter worker's ranks' slices gathered on rank 0 (cuda:0) equal the TP = 1 entry; cut and
    handed back out, each rank folds its own slice in: the TP = 1 logits, nothing rebuilt."""
    from hybridcache.services.runtime.tensor_parallel.entries import gather_entries, scatter_entries, unbundle

    dirs, cfg, g, engines = setup
    eng = engines["qwen3_5_text"]
    tp1 = Engine.from_dir(dirs["qwen3_5_text"], device="cuda", config=cfg)
    gen = torch.Generator().manual_seed(11)
    segs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (70, 45)]
    bundles = gather_entries(g, eng.build_entries(segs))
    for b, seg in zip(bundles, segs):
        ref = tp1.build_entry(seg)
        assert b.data.linear[0].S.device == torch.device("cuda", 0)
        for i, s in ref.data.linear.items():
            assert _rel(b.data.linear[i].S.reshape(s.S.shape), s.S) < 2e-3
    req = {"system": [3, 4, 5], "segments": segs, "suffix": [7, 8, 9]}
    mine = scatter_entries(g, [unbundle(b, 2) for b in bundles])
    pre = eng.prefill(eng.parse_request(req), pinned={e.key: e for e in mine})
    eng.finish_prefix(pre)
    want = tp1.prefill(tp1.parse_request(req))
    assert [s.source for s in pre.stats.segments] == ["entry", "entry"] and pre.stats.built_tokens == 0
    assert _rel(pre.logits, want.logits) < 2e-3
