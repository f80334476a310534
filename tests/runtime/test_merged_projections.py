"""Projections that read the same input run as one GEMM (merge_weights / merged_linear): same
logits, no extra parameter memory, state_dict unchanged, and a safe fallback once a weight moves."""

import torch
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.models.common import merge_weights, merged_linear
from hybridcache.services.runtime.sequence import LiveRun
from torch import nn


def test_merge_weights_views_and_fallback():
    torch.manual_seed(0)
    a, b, c = nn.Linear(8, 5, bias=False), nn.Linear(8, 3, bias=False), nn.Linear(8, 7, bias=False)
    x = torch.randn(4, 8)
    want = [lin(x) for lin in (a, b, c)]
    merged = merge_weights(a, b, c)
    assert merged.shape == (15, 8)
    assert a.weight.data_ptr() == merged.data_ptr()
    assert b.weight.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    got = merged_linear(x, merged, (a, b, c))
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6)
    with torch.no_grad():  # loading a weight by name writes into the merged tensor
        b.weight.copy_(torch.ones(3, 8))
    assert torch.equal(merged[5:8], torch.ones(3, 8))
    b.weight = nn.Parameter(torch.zeros(3, 8))  # reassigned: no longer a view, each runs alone
    got = merged_linear(x, merged, (a, b, c))
    assert torch.equal(got[1], torch.zeros(4, 3)) and torch.allclose(got[2], want[2], atol=1e-6)
    assert merge_weights(nn.Linear(8, 2), nn.Linear(8, 2)) is None  # biases: not merged


def test_loaded_model_merges_and_keeps_its_logits(qwen35_dir, model_dirs):
    for arch, d in model_dirs.items():
        merged = load_model(d)
        plain = load_model(d)
        # undo the merge on `plain`: fresh tensors for every weight (the check then falls back)
        for m in plain.modules():
            if isinstance(m, nn.Linear):
                m.weight = nn.Parameter(m.weight.detach().clone())
        assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in plain.parameters())
        assert merged.state_dict().keys() == plain.state_dict().keys()
        ids = torch.randint(3, 200, (37,), generator=torch.Generator().manual_seed(1))
        lm, _ = merged.forward_layout(merged.empty_state(), [LiveRun(ids, 0)], "all")
        lp, _ = plain.forward_layout(plain.empty_state(), [LiveRun(ids, 0)], "all")
        # one GEMM sums in another order than several: fp32 rounding only (the transformers bound is 1e-4)
        assert (lm - lp).abs().max().item() < 1e-4, arch
        assert merged.merge_projections() > 0  # merging again is allowed (fresh views)
