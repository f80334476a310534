"""The planned assembly's fold from address tables (models/assembly.py bind_tables, the linear
layers' planned_scan on the compose_states_table kernel, the runs' outputs read from the fold's
rows by run_outputs) and its spans' K/V written into the pages in one launch (spans_into_pages),
on CPU under Triton's interpreter: the kernels' path a GPU takes, against the exact eager pass over
the layout."""

import pytest
import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.models import assembly
from hybridcache.services.runtime.paged import extend_pages
from hybridcache.services.runtime.tokenizer import Tokenizer
from kernel_testing import device


@pytest.mark.skipif(device() != "cpu", reason="the GPU takes this path anyway (test_assembly_graphs_gpu.py)")
@pytest.mark.parametrize("entry_dtype", ["float32", "bfloat16"])
def test_the_fold_from_tables_equals_the_eager_pass(qwen35_dir, monkeypatch, entry_dtype):
    """bfloat16 entries: the fold reads the pass's own fp32 pairs beside them (runs of another
    dtype, compose_states_table's runs), their T rounded to bf16 as read."""
    cfg = EngineConfig(mode="pic", entry_state_dtype=entry_dtype)
    eng = Engine(load_model(qwen35_dir), Tokenizer.from_dir(qwen35_dir), cfg)
    gen = torch.Generator().manual_seed(4)

    def ids(n):
        return torch.randint(0, 250, (n,), generator=gen).tolist()

    job = eng.start_prefill(eng.parse_request({"system": ids(11), "segments": [ids(30), ids(19), ids(41)],
                                               "suffix": ids(13)}))
    ref_state = job.state.clone()
    ref_logits, ref_rec = eng.model.forward_layout(ref_state, job.layout, "last", job.snapshot_after)
    pool = eng.new_state_pool(1, 1024)
    pool.assign(job.state)
    extend_pages(job.state, job.layout[-1].end - job.state.length)
    monkeypatch.setattr(assembly, "tables_apply", lambda state: True)
    monkeypatch.setattr(assembly, "spans_fused", lambda pages: True)
    from hybridcache.kernels.ops.rope import triton as rope_triton

    fused = []
    real_fused = rope_triton.spans_into_pages
    monkeypatch.setattr(rope_triton, "spans_into_pages", lambda *a, **k: fused.append(1) or real_fused(*a, **k))
    plan = assembly.plan_assembly(eng.model, job.state, job.layout, job.snapshot_after)
    logits, rec = eng.model.forward_planned(job.state, plan)
    assert plan.tables and set(plan.span_T) == set(ref_state.linear)
    # the tables point at each span's T and S where they lie, 0 at the sub-runs' pairs
    layer = next(iter(ref_state.linear))
    spans = [p for p in plan.pairs if p[0] == "span"]
    got = plan.span_T[layer][: len(plan.pairs)].tolist()
    want = [plan.span_data(ref).linear[layer].T.data_ptr() if kind == "span" else 0 for kind, ref in plan.pairs]
    assert got == want and len(spans) == 3
    assert len(fused) == sum(layer.kind == "full_attention" for layer in eng.model.layers) > 0  # each fused
    # bf16 entries: the fold rounds the runs' T to bf16 where the exact pass keeps them in fp32
    tol = dict(rtol=2e-4, atol=2e-4) if entry_dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(logits, ref_logits, **tol)
    for i, s in ref_state.linear.items():
        torch.testing.assert_close(job.state.linear[i].ssm, s.ssm, **tol)
    for idx, by_layer in ref_rec.snapshots.items():
        for i, s in by_layer.items():
            torch.testing.assert_close(rec.snapshots[idx][i].ssm, s.ssm, **tol)
