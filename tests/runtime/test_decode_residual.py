"""A decode step leaves each Qwen3.5 / Qwen3-Next layer's MLP output for the next layer to add
with its input norm (DecoderLayer.defers_residual, LayoutLM.forward_decode): the logits and the
captured entering streams equal those of the step that adds the residual in every layer, dense and
MoE, with hidden layers captured (suffix_replay's anchors) in the middle of the stack."""

import pytest
import torch
from hybridcache.services.runtime.models.qwen3_hybrid import DecoderLayer
from hybridcache.services.runtime.paged import StatePool, eager_step
from hybridcache.services.runtime.sequence import LiveRun
from test_decode_in_place import tiny_model


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_deferred_residual_equals_the_added_one(arch, monkeypatch):
    model = tiny_model(arch)
    assert all(getattr(layer, "defers_residual", False) for layer in model.layers)
    capture = (1, len(model.layers) - 1)

    def run():
        gen = torch.Generator().manual_seed(3)
        pool = StatePool(model.empty_state(), 3, 4096, 1024)
        slots = []
        for n in (4, 9):
            s = model.empty_state()
            model.forward_layout(s, [LiveRun(torch.randint(0, 250, (n,), generator=gen), 0)], logits_for="none")
            slots.append(pool.assign(s))
        out = []
        tokens = [7, 11]
        for _ in range(3):
            host, max_pages = pool.step_inputs(slots, tokens)
            logits, hidden = eager_step(model, pool, slots, host, max_pages, capture)
            out.append((logits, hidden))
            tokens = logits.argmax(-1).tolist()
        return out

    deferred = run()
    monkeypatch.setattr(DecoderLayer, "defers_residual", False)
    added = run()
    for (l1, h1), (l2, h2) in zip(deferred, added):
        assert torch.equal(l1, l2)
        assert h1.keys() == h2.keys() == set(capture)
        for i in capture:
            assert torch.equal(h1[i], h2[i])
