"""Decode CUDA graphs (services/runtime/paged.py DecodeGraphs, a ModelRunner's) and paged decode attention on a GPU:
graph-replayed decode steps against eager ones over the same requests while requests join and
leave (logits, greedy tokens, the K/V in the pages); the scheduler with decode graphs on against
off (greedy outputs of concurrent requests) and the Triton kernel on the engine's path."""

import pytest
import torch
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime.config import ModelConfig
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.modelzoo import hf_config, random_init_
from hybridcache.services.runtime.runner import ModelRunner
from hybridcache.services.runtime.sequence import LiveRun

pytestmark = pytest.mark.gpu


def cuda_model(dtype, **over):
    raw = dict(hf_config("qwen3_5_text", "tiny"), **over)
    model = HybridLM(ModelConfig.from_dict(raw)).eval()
    random_init_(model, seed=1, std=0.08)
    model = model.to("cuda", dtype)
    model.merge_projections()
    return model


def runners(model, max_len):
    """An eager runner (decode graphs off) and a graphed one over the same model."""
    return {g: ModelRunner(model, RuntimeConfig(decode_cuda_graphs=g, max_model_len=max_len)) for g in (False, True)}


def prefilled(model, ids):
    s = model.empty_state()
    model.forward_layout(s, [LiveRun(ids, 0)], logits_for="none")
    return s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_decode_equals_eager_as_requests_join_and_leave(dtype):
    model = cuda_model(dtype)
    gen = torch.Generator().manual_seed(0)
    run = runners(model, 2048)
    pools = {g: run[g].new_state_pool(8, 4096) for g in run}
    slots, toks = {}, {}

    def join(r, n):
        ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen)
        slots[r] = {g: pools[g].assign(prefilled(model, ids)) for g in pools}
        toks[r] = int(ids[-1])

    for r, n in enumerate((15, 16, 200)):
        join(r, n)
    worst = 0.0
    for step in range(40):
        if step == 6:
            join(3, 31)
        if step == 10:
            for r in (4, 5, 6):
                join(r, 3 + 40 * (r - 3))
        if step == 20:  # two leave: the rows are no longer consecutive
            for r in (0, 4):
                for g, slot in slots.pop(r).items():
                    pools[g].release(slot)
        order = sorted(slots)
        out = {}
        for g in pools:
            out[g], _ = run[g].decode(pools[g], [slots[r][g] for r in order], [toks[r] for r in order])
        torch.cuda.synchronize()
        worst = max(worst, (out[True] - out[False]).abs().max().item())
        greedy = {g: out[g].argmax(-1).tolist() for g in out}
        assert greedy[True] == greedy[False], step
        for r, t in zip(order, greedy[False]):
            toks[r] = t
    assert run[False].decode_graphs(pools[False]) is None
    graphs = run[True].decode_graphs(pools[True])
    assert graphs.stats["captures"] >= 2 and graphs.stats["replays"] > 20, graphs.stats
    assert worst <= (1e-4 if dtype == torch.float32 else 3e-2), worst
    for pair in slots.values():
        for i in pools[False].kv.layers:
            a, b = pools[False].kv.read(pair[False], i)[0], pools[True].kv.read(pair[True], i)[0]
            assert (a.float() - b.float()).abs().max().item() <= (1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_decode_step_equals_a_live_pass_of_its_token(dtype, tol):
    """A decode step's attention layers write their keys (normalized, rotated) and values into the
    pages in one launch (backends.norm_rope_into_pages): each request's logits and new K/V row equal
    the eager live pass of that one token from the same prefilled state, which rotates and copies."""
    model = cuda_model(dtype, head_dim=64, num_attention_heads=6, num_key_value_heads=2)
    gen = torch.Generator().manual_seed(3)
    run = ModelRunner(model, RuntimeConfig(decode_cuda_graphs=False, max_model_len=1024))
    pool = run.new_state_pool(4, 4096)
    ids = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in (9, 130, 47)]
    slots = [pool.assign(prefilled(model, x)) for x in ids]
    toks = [int(t) for t in torch.randint(0, model.cfg.vocab_size, (3,), generator=gen)]
    logits, _ = run.decode(pool, slots, toks)
    for j, x in enumerate(ids):
        ref_state = prefilled(model, x)
        ref, _ = model.forward_layout(ref_state, [LiveRun(torch.tensor([toks[j]]), len(x))], logits_for="last")
        assert (logits[j] - ref).abs().max().item() <= tol * (1 + ref.abs().max().item()), j
        for i in pool.kv.layers:
            k, v = pool.kv.read(slots[j], i)
            assert k.shape[2] == len(x) + 1
            for got, want in ((k[:, :, -1].float(), ref_state.attn[i].k[:, :, -1].float()),
                              (v[:, :, -1].float(), ref_state.attn[i].v[:, :, -1].float())):
                assert (got - want).abs().max().item() <= tol * (1 + want.abs().max().item()), (j, i)


def test_engine_shape_head_dim_256_graphs():
    """Head dim 256 and 4 query heads a KV head, as the Qwen3.5-9B attention: graph decode equals eager."""
    model = cuda_model(torch.bfloat16, head_dim=256, num_attention_heads=8, num_key_value_heads=2)
    gen = torch.Generator().manual_seed(1)
    run = runners(model, 4096)
    pools = {g: run[g].new_state_pool(4, 8192) for g in run}
    ids = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in (1000, 17, 2500)]
    slots = {g: [pools[g].assign(prefilled(model, x)) for x in ids] for g in pools}
    toks = [int(x[-1]) for x in ids]
    for _ in range(12):
        out = {}
        for g in pools:
            out[g], _ = run[g].decode(pools[g], slots[g], toks)
        assert out[True].argmax(-1).tolist() == out[False].argmax(-1).tolist()
        assert (out[True] - out[False]).abs().max().item() <= 3e-2
        toks = out[False].argmax(-1).tolist()


def test_scheduler_with_decode_graphs_equals_without(qwen35_dir):
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.scheduler import Scheduler, SchedulerConfig
    from hybridcache.services.runtime.tokenizer import Tokenizer

    gen = torch.Generator().manual_seed(2)
    reqs = [{"system": torch.randint(0, 250, (5 + i,), generator=gen).tolist(),
             "segments": [torch.randint(0, 250, (40 + 9 * i,), generator=gen).tolist()],
             "suffix": torch.randint(0, 250, (6,), generator=gen).tolist(),
             "sampling_params": {"max_new_tokens": 10 + 7 * i, "ignore_eos": True}} for i in range(6)]
    reqs[2]["sampling_params"].update(ignore_eos=False, stop_token_ids=[7, 19])  # may stop on a token
    outs = {}
    # eager, graphs, and graphs with overlapped steps (the picks fed on the device)
    for graphs, overlap in ((False, False), (True, False), (True, True)):
        eng = Engine(load_model(qwen35_dir, "cuda", torch.float32), Tokenizer.from_dir(qwen35_dir),
                     EngineConfig(device="cuda", decode_cuda_graphs=graphs))
        sched = Scheduler(eng, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128, overlap=overlap))
        try:
            handles = [sched.add_request(eng.parse_request(r)) for r in reqs]
            outs[graphs, overlap] = [(h.result().output_ids, h.finish_reason) for h in handles]
        finally:
            sched.stop()
        if graphs:
            assert eng.runner.decode_graphs(sched.pool).stats["replays"] > 10
        assert (sched.overlapped_steps > 10) == overlap
    assert outs[True, False] == outs[False, False] == outs[True, True]
