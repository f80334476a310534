"""MoE blocks of every MoE family (qwen3_5_moe, qwen3_next, kimi_linear, minimax) on the CPU, fp32:
the block's output equals transformers' own block on the same weights (tokens routed to every
expert, and to all but two), with the grouped-GEMM path and with the per-expert loop; greedy
generation equals transformers' on a checkpoint written by save_pretrained; a decode step issues
the same ops whatever the routing (no host synchronisation, so it can run from a CUDA graph)."""

import dataclasses
import importlib

import pytest
import torch
import transformers
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.models import kimi_linear, minimax, qwen3_hybrid
from hybridcache.services.runtime.models.registry import config_from_dict
from hybridcache.services.runtime.modelzoo import hf_config, init_model_dir
from hybridcache.services.runtime.sequence import LiveRun
from moe_testing import prefilled_pool, routing_twins
from torch.utils._python_dispatch import TorchDispatchMode

E, DEAD = 8, (3, 7)  # experts of the block tests; the two no token reaches (one in each kimi group)

# arch -> (config overrides for 8 experts, our block, transformers' module and block class)
FAMILIES = {
    "qwen3_5_moe_text": ({"num_experts": E}, qwen3_hybrid.SparseMoE, "qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock"),
    "qwen3_next": ({"num_experts": E}, qwen3_hybrid.SparseMoE, "qwen3_next", "Qwen3NextSparseMoeBlock"),
    "kimi_linear": ({"num_experts": E}, kimi_linear.MoE, "kimi_linear", "KimiLinearMoE"),
    "minimax": ({"num_local_experts": E}, minimax.MiniMaxMoE, "minimax", "MiniMaxSparseMoeBlock"),
}
PATHS = ("grouped_mm", "loop")


def moe_dispatch(path):
    return backends.dispatching(dataclasses.replace(backends.current_dispatch(), moe=path))


def blocks(arch, seed=0):
    """Our MoE block and transformers' with the same random weights (fp32)."""
    over, ours_cls, module, name = FAMILIES[arch]
    raw = hf_config(arch, "tiny", over)
    ours = ours_cls(config_from_dict(raw)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for b in ours.buffers():  # kimi's score-correction bias
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    raw = dict(raw)
    hf_cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    theirs = cls(hf_cfg).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


def inputs(ours, some_dead: bool, n=64, seed=1):
    """x [1, n, h]. some_dead: channel 0 of every token set to 10 and the router's weight on it
    to +1 for the live experts and -1 for the DEAD ones, so that those score far below every other
    and no token chooses them (the other channels spread the tokens over the live experts)."""
    gen = torch.Generator().manual_seed(seed)
    h = ours.gate.weight.shape[1]
    x = torch.randn(1, n, h, generator=gen)
    if some_dead:
        x[..., 0] = 10.0
        with torch.no_grad():
            w = ours.gate.weight
            w[:, 0] = 1.0
            w[list(DEAD), 0] = -1.0
            for b in ours.buffers():
                b.zero_()
    return x


def routed_experts(block, x):
    """The experts the block's tokens were routed to (recorded from its Experts' arguments)."""
    seen = []
    handle = block.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[1]))
    try:
        with torch.no_grad():
            block(x)
    finally:
        handle.remove()
    return set(torch.cat([t.reshape(-1) for t in seen]).tolist())


@pytest.mark.parametrize("some_dead", [False, True], ids=["all-experts", "two-unused"])
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_block_equals_transformers(arch, some_dead):
    ours, theirs = blocks(arch)
    x = inputs(ours, some_dead)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert routed_experts(ours, x) == set(range(E)) - (set(DEAD) if some_dead else set())
    with torch.no_grad():
        ref = theirs(x)
        assert ref.abs().max().item() > 1e-2
        for path in PATHS:
            with moe_dispatch(path):
                assert backends.moe_path(x, ours.experts.gate_up_proj, ours.experts.down_proj) == path
                got = ours(x)
            assert (got - ref).abs().max().item() <= 1e-5, path


def test_auto_path_on_cpu_is_the_grouped_gemm_and_reference_the_loop():
    ours, _ = blocks("qwen3_5_moe_text")
    x, gu, d = torch.zeros(3, 64), ours.experts.gate_up_proj, ours.experts.down_proj
    assert backends.moe_path(x, gu, d) == "grouped_mm"
    ref = dataclasses.replace(backends.current_dispatch(), kernels="reference")
    with backends.dispatching(ref):
        assert backends.moe_path(x, gu, d) == "loop"
    with pytest.raises(ValueError, match="moe must be one of"):
        backends.OpDispatch(moe="dense")


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def decode_ops(model, prompts, tokens):
    """The aten ops of one decode step of the prompts' requests (through a runner's pool, as the
    scheduler steps them), and the experts it routed to."""
    from hybridcache.services.runtime.runner import ModelRunner

    runner = ModelRunner(model, dispatch=backends.current_dispatch())  # the MoE path moe_dispatch forces
    pool, slots = prefilled_pool(runner, model, prompts)
    layer = next(m for m in model.modules() if isinstance(m, qwen3_hybrid.SparseMoE))
    seen = []
    handle = layer.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[1]))
    try:
        with OpCounter() as counter:
            runner.decode(pool, slots, tokens)
    finally:
        handle.remove()
    return counter.ops, set(seen[-1].reshape(-1).tolist())


@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_decode_step_ops_do_not_depend_on_the_routing(path, tmp_path):
    """Two models alike but for their routers: one sends every token to the same two experts (zero
    router: all scores tie), the other spreads them over most of 16. The grouped path's step issues
    the same ops in both; the loop's does not (the test would see a routing-dependent path)."""
    spread, narrow, prompts, tokens = routing_twins(tmp_path, (5, 9, 3, 12, 7, 4, 8, 6))
    with moe_dispatch(path):
        ops_spread, routed_spread = decode_ops(spread, prompts, tokens)
        ops_narrow, routed_narrow = decode_ops(narrow, prompts, tokens)
    assert len(routed_narrow) == 2 and len(routed_spread) >= 8
    assert len(ops_spread) > 100
    if path == "grouped_mm":
        assert ops_spread == ops_narrow
        assert "aten._grouped_mm" in ops_spread
    else:
        assert len(ops_spread) > len(ops_narrow)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_greedy_generation_equals_transformers_from_save_pretrained(arch, tmp_path):
    """32 greedy tokens of transformers' model and of ours, both loaded from the directory that
    transformers' save_pretrained wrote."""
    src = init_model_dir(arch, "tiny", tmp_path / "src", seed=1, std=0.08)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    saved = tmp_path / "saved"
    hf.save_pretrained(saved)
    (saved / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    hf = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 24:].tolist()
    engine = Engine.from_dir(saved, config=EngineConfig(mode="full"))
    greedy = {"max_new_tokens": 32, "ignore_eos": True}
    res = LLM(engine).generate({"suffix": ids[0].tolist(), "sampling_params": greedy})
    assert len(ref) == 32
    assert res.output_ids == ref


class RerunGraph:
    """A CUDA graph's stand-in on the CPU: capture keeps the step, replay runs it again."""

    def __init__(self, mempool, device):
        self.fn = None

    def capture(self, fn, reset=None):
        self.fn = fn
        return None, {}

    def replay(self):
        return self.fn()


def test_padded_graph_step_of_a_moe_model_equals_the_eager_step(tmp_path):
    """Decode graphs' static-buffer path on a MoE model (paged.DecodeGraphs, a re-running graph
    standing in for CUDA): a step padded to its bucket (padding rows routed like any token) gives
    each request the eager step's logits."""
    from hybridcache.services.runtime.paged import DecodeGraphs, StatePool, decode_step

    path = init_model_dir("qwen3_5_moe_text", "tiny", tmp_path / "m", seed=1, std=0.3,
                          overrides={"num_experts": 16, "num_experts_per_tok": 4})
    model = load_model(path)
    gen = torch.Generator().manual_seed(2)
    pools = [StatePool(model.empty_state(), 4, 1024, 256) for _ in range(2)]
    graphs = DecodeGraphs(model, pools[1], sizes=(1, 2, 4), graph_factory=RerunGraph)
    slots = [[], []]
    for n in (9, 20, 4):
        ids = torch.randint(0, 250, (n,), generator=gen)
        for pool, rows in zip(pools, slots):
            s = model.empty_state()
            model.forward_layout(s, [LiveRun(ids, 0)], logits_for="none")
            rows.append(pool.assign(s))
    for _ in range(4):
        toks = torch.randint(0, 250, (3,), generator=gen).tolist()
        want, _ = decode_step(model, pools[0], slots[0], toks)
        host, _ = pools[1].step_inputs(slots[1], toks)
        got, _ = graphs.run(host)
        # a padded batch is a GEMM of another shape: equal up to fp32 rounding, the same greedy tokens
        assert want.abs().max().item() > 1.0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert graphs.stats["replays"] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_top_k_is_the_renormalised_top_k_of_the_whole_softmax(dtype):
    """The router's shortcut (models/common.softmax_top_k): the k largest logits, weighted by the
    softmax of those k alone, are the top k of the row's softmax renormalised over them."""
    from hybridcache.services.runtime.models.common import softmax_top_k

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(257, 64, generator=gen) * 4).to(dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    want_w, want_i = torch.topk(probs, 8, dim=-1)
    got_w, got_i = softmax_top_k(logits, 8, True, torch.float)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w / want_w.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    plain_w, plain_i = softmax_top_k(logits, 8, False, dtype)
    assert torch.equal(plain_i, want_i) and plain_w.dtype == dtype
    torch.testing.assert_close(plain_w, want_w.to(dtype), rtol=0, atol=0)
