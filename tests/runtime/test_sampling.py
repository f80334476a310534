"""Decoding: greedy, seeded sampling, top-k/top-p, stop strings and stop ids."""

import pytest
import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.sampling import RequestError, SamplingParams, sample_token

REQ = {"segments": [list(range(30, 100))], "suffix": [7, 8, 9]}


def gen(engine, **sp):
    return LLM(engine).generate(dict(REQ, sampling_params=dict({"max_new_tokens": 12, "ignore_eos": True}, **sp)))


def test_seeded_sampling_is_reproducible(qwen35_dir):
    eng = Engine.from_dir(qwen35_dir, config=EngineConfig())
    a = gen(eng, temperature=1.0, seed=1).output_ids
    assert a == gen(eng, temperature=1.0, seed=1).output_ids
    others = {tuple(gen(eng, temperature=1.0, seed=s).output_ids) for s in range(2, 6)}
    assert len(others | {tuple(a)}) > 1
    assert gen(eng, temperature=1.0, top_k=1, seed=3).output_ids == gen(eng).output_ids


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0, 1.0])
    g = torch.Generator().manual_seed(0)
    picks = {sample_token(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert picks == {1, 2}
    picks = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.3), g) for _ in range(200)}
    assert picks == {1}


def test_stop_string_and_stop_ids(qwen35_dir):
    eng = Engine.from_dir(qwen35_dir, config=EngineConfig())
    base = gen(eng)
    assert base.finish_reason == "length" and len(base.output_ids) == 12
    # a stop string taken from the middle of the greedy text truncates there
    text = base.text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2] not in text[: i + 1])
    res = gen(eng, stop=[stop])
    assert res.finish_reason == "stop" and res.text == text[: text.index(stop)]
    res = gen(eng, stop_token_ids=[base.output_ids[3]])
    first = base.output_ids.index(base.output_ids[3])
    assert res.finish_reason == "stop" and res.output_ids == base.output_ids[:first]


def test_streamed_deltas_add_up_to_the_text(qwen35_dir):
    eng = Engine.from_dir(qwen35_dir, config=EngineConfig())
    req = eng.parse_request(dict(REQ, sampling_params={"max_new_tokens": 10, "ignore_eos": True}))
    with LLM(eng) as llm:
        g = llm.scheduler.add_request(req)
        deltas = [d for _, d in g]
    assert "".join(deltas) == eng.tokenizer.decode(g.output_ids) and len(g.output_ids) == 10
    assert g.prefill.stats.ttft_ms > 0


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_k=12, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.5, top_p=0.9, min_p=0.02, top_k=30),
]


def _logits(rows, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_batched_masks_and_probabilities_equal_the_reference():
    """Every row of one batched sampling_probs (mixed parameters, a greedy row among them) has the
    support and the probabilities of its request's plain reference."""
    from hybridcache.services.runtime.sampling import reference_probs, sampling_probs

    params = CASES + [SamplingParams(temperature=0.0, top_k=3)]
    logits = _logits(len(params))
    probs = sampling_probs(logits, params)
    for b, p in enumerate(params[:-1]):
        ref = reference_probs(logits[b], p)
        assert torch.equal(probs[b] > 0, ref > 0), p
        assert torch.allclose(probs[b], ref, atol=1e-6), p
    assert (probs[1] > 0).sum() < 50 and (probs[2] > 0).sum() == 5  # the masks cut something


@pytest.mark.parametrize("case", range(len(CASES)))
def test_device_sampler_draws_the_reference_distribution(case):
    """20k seeded draws of `sample` (one batch of 20k rows of the same logits) follow the reference
    distribution: no token outside its support, and Pearson's chi-square within 6 sigma of its
    degrees of freedom."""
    from hybridcache.services.runtime.sampling import reference_probs, sample

    params = CASES[case]
    logits = _logits(1, seed=case)[0]
    ref = reference_probs(logits, params)
    n = 20000
    torch.manual_seed(case)
    picks = sample(logits.expand(n, -1), [params] * n, [None] * n)
    counts = torch.bincount(picks, minlength=logits.numel()).double()
    support = ref > 0
    assert counts[~support].sum() == 0
    expected = ref[support].double() * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    df = int(support.sum()) - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)


def test_seeded_rows_draw_the_same_whatever_the_batch():
    """A row with its own generator picks the same tokens alone or beside other rows (seeded and
    not), step after step; another seed picks differently."""
    from hybridcache.services.runtime.sampling import sample

    logits = _logits(4, seed=9)
    p = SamplingParams(temperature=1.0, top_p=0.9)

    def draws(seed, batch):
        g = torch.Generator().manual_seed(seed)
        others = [torch.Generator().manual_seed(99), None, None][: batch - 1]
        out = []
        for _ in range(30):
            rows = [logits[0]] + [logits[1 + i] for i in range(batch - 1)]
            out.append(int(sample(torch.stack(rows), [p] * batch, [g] + others)[0]))
        return out

    alone = draws(5, 1)
    assert draws(5, 3) == alone == draws(5, 2)
    assert draws(6, 1) != alone


def test_min_p_is_a_sampling_parameter():
    assert SamplingParams.from_dict({"min_p": 0.1}).min_p == 0.1
    with pytest.raises(RequestError, match="min_p"):
        SamplingParams.from_dict({"min_p": 1.5})


def test_settings_table_rows_are_aligned_for_every_batch_size():
    """The sampling kernels take the table's rows as pointers, and Triton compiles a kernel per
    pointer alignment: every row starts 16 bytes aligned whatever B, and holds the rows' values."""
    from hybridcache.services.runtime.sampling import settings_table

    for B in range(1, 10):
        params = [SamplingParams(temperature=0.5 + b, top_p=0.9, min_p=0.01 * b, top_k=b) for b in range(B)]
        table = settings_table(params, [p.top_k for p in params], torch.device("cpu"))
        assert table.shape == (4, B)
        assert all(table[i].data_ptr() % 16 == 0 for i in range(4)), B
        assert table[0].tolist() == pytest.approx([0.5 + b for b in range(B)])
        assert table[2].tolist() == pytest.approx([0.01 * b for b in range(B)])
        assert table[3].tolist() == [float(b) for b in range(B)]
