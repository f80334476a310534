"""The small-batch MoE path (backends "pairs": kernels/ops/moe/triton.py pair_experts and
softmax_top_k): the pair-major kernels against the per-expert loop plus the shared expert's
reference (naive.py) on odd shapes, fp32 on the CPU under Triton's interpreter; the routing kernel
against models/common.softmax_top_k; every MoE family's block on the path against the loop; a
decode step on the path issues the same ops and launches whatever the routing; on a GPU (bf16, the
Qwen3.5-35B-A3B expert shape) the path equals the sorted fused-MoE kernel with no host sync."""

import dataclasses

import pytest
import torch
from hybridcache.kernels.ops.moe import SharedExpert, naive_experts, naive_shared_expert
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.models import common, kimi_linear, minimax, qwen3_hybrid
from hybridcache.services.runtime.models.registry import config_from_dict
from hybridcache.services.runtime.modelzoo import hf_config
from kernel_testing import (
    PairConfig,
    device,
    fused_experts,
    pair_experts,
    rel_rms,
    router_top_k,
    softmax_top_k,
)

SMALL = PairConfig(gate_up_n=8, gate_up_k=16, down_n=8, down_k=16)  # several tiles, masked tails
SMALL_ONCE = dataclasses.replace(SMALL, reduce_once=True)  # one reduction across the tile at the end
# one tile a program at the tiny models' widths: fewer programs for the interpreter to run
WIDE = PairConfig(gate_up_n=64, gate_up_k=64, down_n=64, down_k=64)


@pytest.fixture
def wide_tiles(monkeypatch):
    """pair_experts' default tiles WIDE (the interpreter's time goes by programs)."""
    import hybridcache.kernels.ops.moe.triton as moe_triton

    monkeypatch.setattr(moe_triton, "PAIR_CONFIG", WIDE)


def problem(E, h, inter, n, k, inter_s=0, gated=True, same=False, dtype=torch.float32, seed=0):
    """x [n, h], gate_up [E, 2I, h], down [E, h, I], top_i / top_w [n, k] (k distinct experts a
    token; with `same` every token the same k), and a shared expert of Is channels (0: none)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randperm(E, generator=g)[:k]
    top_i = torch.stack([first if same else torch.randperm(E, generator=g)[:k] for _ in range(n)])
    top_w = torch.softmax(torch.randn(n, k, generator=g), -1)
    x = torch.randn(n, h, generator=g)
    gate_up = torch.randn(E, 2 * inter, h, generator=g) / h**0.5
    down = torch.randn(E, h, inter, generator=g) / inter**0.5
    dev = device()
    shared = None
    if inter_s:
        gate, up = (torch.randn(inter_s, h, generator=g) / h**0.5 for _ in range(2))
        sdown = torch.randn(h, inter_s, generator=g) / inter_s**0.5
        logit = torch.randn(1, h, generator=g) / h**0.5 if gated else None
        shared = SharedExpert(*(t.to(dev, dtype) if t is not None else None for t in (gate, up, sdown, logit)))
    return [t.to(dev, dtype) for t in (x, gate_up, down)] + [top_i.to(dev), top_w.to(dev, dtype), shared]


@pytest.mark.parametrize("E,h,inter,n,k,inter_s,gated,same,cfg", [
    (7, 45, 22, 1, 1, 0, False, False, SMALL),
    (7, 45, 22, 5, 3, 17, True, False, SMALL),
    (9, 33, 20, 2, 8, 12, False, False, SMALL),
    (9, 21, 20, 9, 2, 0, False, False, PairConfig()),
    (5, 40, 24, 4, 2, 24, True, True, SMALL),
    (6, 19, 9, 3, 4, 30, True, False, PairConfig()),
    (7, 45, 22, 5, 3, 17, True, False, SMALL_ONCE),
    (6, 19, 9, 3, 4, 30, True, True, PairConfig(reduce_once=True)),
], ids=["E7-h45-I22-n1-k1", "E7-h45-I22-n5-k3-gated", "E9-h33-I20-n2-k8-ungated", "E9-h21-I20-n9-k2-default",
        "E5-h40-I24-n4-k2-same", "E6-h19-I9-n3-k4-Is30-default", "E7-h45-I22-n5-k3-gated-reduce-once",
        "E6-h19-I9-n3-k4-Is30-same-reduce-once"])
def test_pair_kernels_equal_the_loop(E, h, inter, n, k, inter_s, gated, same, cfg):
    """Odd widths (masked tails of several tiles, or of one default tile), E not a power of two,
    tokens that share experts (all of them the same k in one case), a shared expert wider or
    narrower than the routed ones."""
    x, gu, d, ti, tw, shared = problem(E, h, inter, n, k, inter_s, gated, same)
    ref = naive_experts(x, gu, d, ti, tw)
    if shared is not None:
        ref = ref + naive_shared_expert(x, shared)
    got = pair_experts(x, gu, d, ti, tw, shared, cfg)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    # the routing weights and the shared expert both matter
    assert rel_rms(pair_experts(x, gu, d, ti, tw.flip(-1) * 2, shared, SMALL), ref) > 1e-2
    if shared is not None:
        assert rel_rms(pair_experts(x, gu, d, ti, tw, None, SMALL), ref) > 1e-2


def test_pair_kernels_reject_shapes_that_do_not_fit():
    x, gu, d, ti, tw, shared = problem(4, 16, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="do not fit"):
        pair_experts(x, gu, d[:, :-1], ti, tw)
    with pytest.raises(ValueError, match="shared expert"):
        pair_experts(x, gu, d, ti, tw, dataclasses.replace(shared, down=shared.down[:, :-1]))
    assert pair_experts(x[:0], gu, d, ti[:0], tw[:0]).shape == (0, 16)


@pytest.mark.parametrize("E,n,k", [(13, 1, 1), (13, 9, 4), (60, 5, 8), (256, 3, 8)],
                         ids=["E13-n1-k1", "E13-n9-k4", "E60-n5-k8", "E256-n3-k8"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
def test_routing_kernel_equals_softmax_top_k(E, n, k, renormalize):
    """Random fp32 logits, and logits exact in bf16 (multiples of 1/8, distinct: ties may go either
    way in torch's top-k)."""
    gen = torch.Generator().manual_seed(E + n)
    for dtype in (torch.float32, torch.bfloat16):
        if dtype == torch.float32:
            logits = torch.randn(n, E, generator=gen) * 3
        else:
            logits = torch.stack([torch.randperm(E, generator=gen) - E / 2 for _ in range(n)]) / 8
        logits = logits.to(device(), dtype)
        want_w, want_i = common.softmax_top_k(logits, k, renormalize, torch.float32)
        got_w, got_i = softmax_top_k(logits, k, renormalize, torch.float32)
        assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
        assert torch.equal(got_i, want_i), dtype
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
        # weights in the routed dtype, through the models' entry point
        got_w, got_i = common.softmax_top_k(logits, k, renormalize, dtype, fused=True)
        assert got_w.dtype == dtype and torch.equal(got_i, want_i)
    if renormalize:
        torch.testing.assert_close(got_w.float().sum(-1), torch.ones(n, device=device()), rtol=1e-2, atol=0)


def test_routing_kernel_breaks_ties_towards_the_lower_expert():
    """Equal logits (a zero router) pick the lowest indices, each once."""
    w, i = softmax_top_k(torch.zeros(2, 10, device=device()), 3, True, torch.float32)
    assert i.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3, device=device()))
    with pytest.raises(ValueError, match="top-11 of 10"):
        softmax_top_k(torch.zeros(2, 10), 11, True, torch.float32)


@pytest.mark.parametrize("E,h,n,k", [(13, 45, 1, 1), (60, 33, 5, 8), (256, 2048, 3, 8), (9, 1500, 2, 4)],
                         ids=["E13-h45-n1-k1", "E60-h33-n5-k8", "E256-h2048-n3-k8", "E9-h1500-n2-k4"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
def test_router_top_k_equals_the_router_then_softmax_top_k(E, h, n, k, renormalize):
    """The router's product and its top-k in one launch (E not a multiple of the rows a program,
    h not of the columns a step) equal the linear layer then softmax_top_k in fp32; in bf16 the
    logits are the fp32 product rounded once, so the experts picked are the top k of those logits
    up to bf16 ties. Launched twice with one set of counts: the first launch leaves them zeroed."""
    gen = torch.Generator().manual_seed(E + h)
    x = torch.randn(n, h, generator=gen).to(device())
    w = (torch.randn(E, h, generator=gen) / h**0.5).to(device())
    counts = torch.zeros(64, dtype=torch.int32, device=device())
    want_w, want_i = common.softmax_top_k(torch.nn.functional.linear(x, w), k, renormalize, torch.float32)
    for _ in range(2):
        got_w, got_i = router_top_k(x, w, k, renormalize, torch.float32, counts)
        assert torch.equal(got_i, want_i) and not counts.any()
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    xb, wb = x.bfloat16(), w.bfloat16()
    logits = torch.nn.functional.linear(xb.float(), wb.float()).bfloat16().float()
    got_w, got_i = router_top_k(xb, wb, k, renormalize, torch.bfloat16, counts)
    assert got_w.dtype == torch.bfloat16
    assert top_k_of(logits, got_i, logits.abs().max().item() * 2**-7)
    assert not top_k_of(logits, got_i.flip(1), 0.0) or k == 1  # descending order checked


def test_router_top_k_rejects_what_does_not_fit():
    x, w = torch.zeros(2, 8, device=device()), torch.zeros(5, 8, device=device())
    with pytest.raises(ValueError, match="does not fit"):
        router_top_k(x, w[:, :-1], 2, True, torch.float32)
    with pytest.raises(ValueError, match="top-6 of 5"):
        router_top_k(x, w, 6, True, torch.float32)
    with pytest.raises(ValueError, match="zeroed counts"):
        router_top_k(x, w, 2, True, torch.float32, torch.zeros(1, dtype=torch.int32, device=device()))
    w_i = router_top_k(x, w, 2, True, torch.float32)[1]
    assert w_i.tolist() == [[0, 1]] * 2  # a zero router: ties to the lowest experts


def moe_dispatch(path):
    return backends.dispatching(dataclasses.replace(backends.current_dispatch(), moe=path))


FAMILIES = {
    "qwen3_5_moe_text": ({"num_experts": 6}, qwen3_hybrid.SparseMoE),
    "qwen3_next": ({"num_experts": 6, "norm_topk_prob": False}, qwen3_hybrid.SparseMoE),
    "kimi_linear": ({"num_experts": 6}, kimi_linear.MoE),
    "minimax": ({"num_local_experts": 6}, minimax.MiniMaxMoE),
}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_block_on_the_pair_path_equals_the_loop(arch, wide_tiles):
    """The MoE block of each family with its experts, router and shared expert on the pair path
    (forced: on CUDA "auto" takes it up to MOE_PAIR_MAX pairs) equals its per-expert loop (which
    tests/runtime/test_moe.py holds to transformers' block)."""
    over, cls = FAMILIES[arch]
    block = cls(config_from_dict(hf_config(arch, "tiny", over))).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for b in block.buffers():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
        x = torch.randn(1, 5, block.gate.weight.shape[1], generator=gen)
        with moe_dispatch("loop"):
            ref = block(x)
        with moe_dispatch("pairs"):
            got = block(x)
    scale = ref.abs().max().item()
    assert scale > 1e-2
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, scale)  # fp32 rounding of outputs up to ~40


def test_auto_takes_the_pair_path_for_few_pairs_on_cuda_only():
    x, gu, d = torch.zeros(8, 16), torch.zeros(4, 16, 16), torch.zeros(4, 16, 8)
    assert backends.moe_path(x, gu, d, 8) != "pairs"  # the CPU keeps its reference paths
    if torch.cuda.is_available():
        xc, guc, dc = (t.cuda() for t in (x, gu, d))
        assert backends.moe_path(xc, guc, dc, 8) == "pairs"  # 64 pairs
        assert backends.moe_path(torch.zeros(32, 16, device="cuda"), guc, dc, 8) == "pairs"  # 256 pairs
        assert backends.moe_path(torch.zeros(33, 16, device="cuda"), guc, dc, 8) == "triton"


def decode_launches(model, prompts, tokens):
    """The aten ops and Triton launches (by name, in order) of one decode step of the prompts'
    requests on the pair path, through a runner's pool; the interpreter's own torch ops inside a launch are not
    counted (on a GPU they are one kernel). Also the experts the step routed to."""
    from hybridcache.services.runtime.runner import ModelRunner
    from moe_testing import prefilled_pool
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    # prefill on the CPU's own path, the step on the pair path (the runner enters its dispatch)
    runner = ModelRunner(model, dispatch=dataclasses.replace(backends.current_dispatch(), moe="pairs"))
    pool, slots = prefilled_pool(runner, model, prompts)
    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    real = InterpretedFunction.run

    def run(self, *a, **k):
        ops.append("triton." + self.fn.__name__)
        with _disable_current_modes():
            return real(self, *a, **k)

    layer = next(m for m in model.modules() if isinstance(m, qwen3_hybrid.SparseMoE))
    seen = []
    handle = layer.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[1]))
    InterpretedFunction.run = run
    try:
        with Count():
            runner.decode(pool, slots, tokens)
    finally:
        InterpretedFunction.run = real
        handle.remove()
    return ops, set(seen[-1].reshape(-1).tolist())


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's launches (CPU)")
def test_decode_step_on_the_pair_path_does_not_depend_on_the_routing(tmp_path, wide_tiles):
    """Two models alike but for their routers: one sends every token to the same two experts (a
    zero router: all logits tie), the other spreads them over most of 16. On the pair path a decode
    step issues the same ops and launches in both: per MoE layer one launch of the router and its
    top-k and the two pair launches, no GEMM of the router, no top-k and no sort."""
    from moe_testing import routing_twins

    spread, narrow, prompts, tokens = routing_twins(tmp_path, (5, 9, 3, 7))
    ops_spread, routed_spread = decode_launches(spread, prompts, tokens)
    ops_narrow, routed_narrow = decode_launches(narrow, prompts, tokens)
    assert routed_narrow == {0, 1} and len(routed_spread) >= 5
    assert ops_spread == ops_narrow
    moe_layers = sum(isinstance(m, qwen3_hybrid.SparseMoE) for m in spread.modules())
    for name in ("triton.router_top_k_kernel", "triton.moe_pair_gate_up_kernel", "triton.moe_pair_down_kernel"):
        assert ops_spread.count(name) == moe_layers, name
    assert "triton.softmax_top_k_kernel" not in ops_spread
    assert not any(op in ops_spread for op in ("aten.sort", "aten.topk", "aten.searchsorted"))
    # the router's product runs inside router_top_k: the step's matrix products are the dense layers'
    products = ("aten.mm", "aten.addmm", "aten.linear", "aten.matmul", "aten.bmm")
    unfused = ops_spread.copy()
    try:
        common.FUSED_ROUTER = False
        unfused, _ = decode_launches(spread, prompts, tokens)
    finally:
        common.FUSED_ROUTER = True
    assert (sum(unfused.count(op) for op in products) - sum(ops_spread.count(op) for op in products)
            == moe_layers)
    assert unfused.count("triton.softmax_top_k_kernel") == moe_layers


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4, 8])
def test_pair_path_equals_the_sorted_kernel_bf16_gpu_without_host_sync(n):
    """The Qwen3.5-35B-A3B expert shape (256 experts, top-8, h = 2048, I = 512, a gated shared
    expert of 512) in bf16: the pair kernels equal the sorted fused-MoE kernel (plus the shared
    expert's reference) within bf16 rounding, the routing kernel equals torch's top-k, and neither
    synchronises the host."""
    x, gu, d, ti, tw, shared = problem(256, 2048, 512, n, 8, 512, True, dtype=torch.bfloat16)
    ref = fused_experts(x, gu, d, ti, tw) + naive_shared_expert(x, shared)
    exact = naive_experts(x.float(), gu.float(), d.float(), ti, tw.float()) + naive_shared_expert(
        x.float(), SharedExpert(*(t.float() for t in (shared.gate, shared.up, shared.down, shared.gate_logit))))
    # distinct logits, exact in bf16 (ties may go either way in torch's top-k)
    logits = (torch.stack([torch.randperm(256) for _ in range(n)]) - 128).div(8).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = pair_experts(x, gu, d, ti, tw, shared)
        got_w, got_i = softmax_top_k(logits, 8, True, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_rms(got, ref) < 1e-2
    # fp32 inside, one rounding: at least as close to the fp32 result as the sorted path
    assert rel_rms(got, exact) <= rel_rms(ref, exact) * 1.05
    want_w, want_i = common.softmax_top_k(logits, 8, True, torch.bfloat16)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=1e-2, atol=1e-3)


def top_k_of(logits, picked_i, tol):
    """Whether picked_i [n, k] are the k largest of logits [n, E] in descending order, up to tol."""
    picked = logits.gather(1, picked_i)
    rest = logits.scatter(1, picked_i, float("-inf"))
    return bool((picked.min(1).values >= rest.max(1).values - tol).all()
                and (picked[:, :-1] >= picked[:, 1:] - tol).all() and picked_i.unique(dim=1).shape == picked_i.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8])
def test_router_top_k_replays_in_a_cuda_graph_gpu(n):
    """The Qwen3.5-35B-A3B router (256 x 2048, top-8, bf16) captured in a CUDA graph and replayed
    on 300 fresh inputs: every replay picks the top 8 of its own logits (the fp32 product rounded
    to bf16; one bf16 step of slack), so no launch reads a logit another program of it had not yet
    stored and every launch leaves its counts zeroed for the next; no host synchronisation."""
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(256, 2048, generator=gen) / 2048**0.5).to("cuda", torch.bfloat16)
    x = torch.zeros(n, 2048, device="cuda", dtype=torch.bfloat16)
    counts = torch.zeros(64, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        router_top_k(x, w, 8, True, torch.bfloat16, counts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        top_w, top_i = router_top_k(x, w, 8, True, torch.bfloat16, counts)
    inputs = torch.randn(300, n, 2048, generator=gen).to("cuda", torch.bfloat16)
    picks = torch.empty(300, n, 8, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for r in range(300):
            x.copy_(inputs[r])
            graph.replay()
            picks[r].copy_(top_i)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    logits = torch.einsum("rnh,eh->rne", inputs.float(), w.float()).bfloat16().float()
    for r in range(300):
        assert top_k_of(logits[r], picks[r], logits[r].abs().max().item() * 2**-7), r
    assert not counts.any()
    want_w = torch.softmax(logits[-1].gather(1, picks[-1]), -1)
    torch.testing.assert_close(top_w.float(), want_w, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("n", [1, 3])
def test_default_tiles_by_token_count(n):
    """Without a config pair_experts takes the tiles of its token count (one token, or more), both
    summing once at the end, and equals the loop; a pinned PAIR_CONFIG overrides both."""
    import hybridcache.kernels.ops.moe.triton as moe_triton

    want = moe_triton.ONE_TOKEN_PAIRS if n == 1 else moe_triton.FEW_TOKEN_PAIRS
    assert moe_triton.pair_config(n) == want and want.reduce_once
    x, gu, d, ti, tw, shared = problem(6, 19, 9, n, 4, 30, True, False)
    ref = naive_experts(x, gu, d, ti, tw) + naive_shared_expert(x, shared)
    got = pair_experts(x, gu, d, ti, tw, shared)
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    try:
        moe_triton.PAIR_CONFIG = SMALL
        assert moe_triton.pair_config(n) == SMALL
    finally:
        moe_triton.PAIR_CONFIG = None
