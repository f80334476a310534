"""The engine's fast-kernel dispatch, run on CPU under the Triton interpreter: a pic assembly whose
linear layers fold spans and runs with the Triton compose kernel (reading the entries and the runs'
pairs in place through an address table, every intermediate state out) and
warm their convs with the Triton causal conv gives the reference path's logits and states."""

import random

import pytest
import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from kernel_testing import rel_rms


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA path runs for real on a GPU")
def test_pic_assembly_with_fast_kernels_equals_reference(qwen35_dir, monkeypatch):
    rng = random.Random(3)
    req = {
        "system": [5, 6, 7],
        "segments": [[rng.randrange(0, 256) for _ in range(n)] for n in (30, 45, 38)],
        "suffix": [9, 9, 9, 9],
        "sampling_params": {"max_new_tokens": 1},
    }
    from hybridcache.kernels.ops.transition import compose_triton

    calls = []
    real = compose_triton.compose_states_blocks
    monkeypatch.setattr(
        compose_triton, "compose_states_blocks", lambda *a, **k: calls.append(k.get("output_all")) or real(*a, **k)
    )
    # the other fused kernels of the CUDA path, counted as they run
    from hybridcache.kernels.ops.activation import triton as act
    from hybridcache.kernels.ops.attention import triton as attn
    from hybridcache.kernels.ops.gated_delta_rule import gates
    from hybridcache.kernels.ops.norm import triton as norm
    from hybridcache.kernels.ops.rope import triton as rope

    used = set()

    def counted(fn, name):
        def run(*a, **k):
            used.add(name)
            return fn(*a, **k)

        return run

    fused = (
        (gates, "gdn_gates"),
        (norm, "l2norm_heads"),
        (norm, "add_rms_norm"),
        (rope, "norm_rope_tokens"),
        (rope, "rope_heads"),
        (act, "silu_mul"),
        (act, "sigmoid_gate_heads"),
        (attn, "live_attention"),
    )
    for mod, name in fused:
        monkeypatch.setattr(mod, name, counted(getattr(mod, name), name))
    results = []
    for fast in (False, True):
        monkeypatch.setattr(backends, "use_fast_kernels", lambda t, fast=fast: fast)
        eng = Engine.from_dir(qwen35_dir, config=EngineConfig(mode="pic", seam_window=4))
        LLM(eng).generate(dict(req, system=[1]))  # warm the entries after another prefix
        results.append(eng.prefill(eng.parse_request(req)))
    ref, fast = results
    # the fold really ran in the Triton kernel over the entries in place, with every state out
    assert calls and all(calls)
    assert used == {name for _, name in fused}
    assert all(s.hit for s in fast.stats.segments)
    assert rel_rms(fast.logits, ref.logits) < 1e-5
    for i in ref.state.linear:
        assert rel_rms(fast.state.linear[i].ssm, ref.state.linear[i].ssm) < 1e-5
