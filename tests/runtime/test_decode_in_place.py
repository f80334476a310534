"""A decode step advances the linear states in their pool slots in place (paged.eager_step: a
one-token conv update and one recurrence step through the slot indices): for every linear family
the step serves, its logits and the states it leaves equal the gather/scatter reference step's,
while requests join and leave (slots out of order, a freed slot taken again)."""

import pytest
import torch
from hybridcache.services.runtime.models.registry import build_model, config_from_dict
from hybridcache.services.runtime.modelzoo import hf_config, random_init_
from hybridcache.services.runtime.paged import StatePool, eager_step
from hybridcache.services.runtime.sequence import LiveRun

# one architecture per linear family (and Qwen3-Next's packed projections)
FAMILIES = {
    "qwen3_5_text": "gated delta rule",
    "qwen3_next": "gated delta rule, packed projections",
    "olmo_hybrid": "gated delta rule, beta x 2",
    "kimi_linear": "KDA",
    "nemotron_h": "Mamba2",
    "bamba": "Mamba2",
    "minimax": "lightning attention",
}


def tiny_model(arch):
    model = build_model(config_from_dict(hf_config(arch, "tiny")))
    random_init_(model, seed=1, std=0.08)
    return model.eval()


def run_requests(model, step, steps=7, slots=4):
    """Drive a pool through joins and leaves with `step(pool, slots, host, max_pages)`; returns the
    logits of every step and the pool. Request lengths cross no special case on purpose: 1, 5, 17, 3."""
    gen = torch.Generator().manual_seed(5)
    pool = StatePool(model.empty_state(), slots, 4096, 1024)
    running = {}  # request -> (slot, next token)

    def join(r, n):
        s = model.empty_state()
        ids = torch.randint(0, 250, (n,), generator=gen)
        model.forward_layout(s, [LiveRun(ids, 0)], logits_for="none")
        running[r] = (pool.assign(s), int(torch.randint(0, 250, (1,), generator=gen)))

    join(0, 1)
    join(1, 5)
    join(2, 17)
    out = []
    for t in range(steps):
        if t == 2:  # request 1 leaves: the batch's slots are no longer consecutive
            pool.release(running.pop(1)[0])
        if t == 4:  # a new request takes the freed slot, after the others
            join(3, 3)
        order = sorted(running, key=lambda r: -running[r][0])  # slots out of order in the batch
        slots_of = [running[r][0] for r in order]
        host, max_pages = pool.step_inputs(slots_of, [running[r][1] for r in order])
        logits, _ = step(pool, slots_of, host, max_pages)
        out.append(logits)
        for b, r in enumerate(order):
            running[r] = (running[r][0], int(logits[b].argmax()))
    return out, pool


@pytest.mark.parametrize("arch", list(FAMILIES), ids=list(FAMILIES))
def test_in_place_step_equals_gather_scatter(arch):
    model = tiny_model(arch)

    def in_place(pool, slots, host, max_pages):
        return eager_step(model, pool, slots, host, max_pages)

    def gather_scatter(pool, slots, host, max_pages):
        return eager_step(model, pool, slots, host, max_pages, in_place=False)

    with torch.no_grad():
        got, pool = run_requests(model, in_place)
        ref, ref_pool = run_requests(model, gather_scatter)
    assert pool.ssm, f"{arch} has linear layers"
    for a, b in zip(got, ref):
        assert a.abs().max() > 1e-3
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    live = [s for s in range(pool.slots) if s not in pool.free]
    assert len(live) == 3
    for i in pool.ssm:
        assert pool.ssm[i][live].abs().max() > 0
        torch.testing.assert_close(pool.ssm[i][live], ref_pool.ssm[i][live], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool.conv[i][live], ref_pool.conv[i][live], rtol=1e-4, atol=1e-5)
