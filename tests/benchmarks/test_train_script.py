"""benchmarks/train_qa_model.py: the curricula and the chunk length of the pure-torch scan."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_qa_model.py"


@pytest.fixture(scope="module")
def train():
    sys.modules.setdefault("fla", None)  # keep transformers on its pure-torch path
    spec = importlib.util.spec_from_file_location("train_qa_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_document_curriculum_ramps_to_the_evaluated_range(train):
    assert train.curriculum_docs(0.0, 0.3, 8, 16) == (2, 3)
    mid = train.curriculum_docs(0.15, 0.3, 8, 16)
    assert 2 < mid[0] < 8 and 3 < mid[1] < 16 and mid[0] <= mid[1]
    assert train.curriculum_docs(0.3, 0.3, 8, 16) == (8, 16)
    assert train.curriculum_docs(0.9, 0.3, 8, 16) == (8, 16)
    assert train.curriculum_docs(0.0, 0.0, 8, 16) == (8, 16)  # off


def test_filler_curriculum(train):
    assert train.curriculum_filler(0.1, (0.2, 0.6)) == 0.0
    assert train.curriculum_filler(0.4, (0.2, 0.6)) == pytest.approx(0.5)
    assert train.curriculum_filler(0.6, (0.2, 0.6)) == 1.0
    assert train.curriculum_filler(0.0, (0.0, 0.0)) == 1.0  # off


def test_filler_share_changes_documents_not_questions():
    from hybridcache.services.runtime.qa_data import QAGenerator

    full, bare = QAGenerator("train", 3), QAGenerator("train", 3)
    bare.filler = 0.0
    for _ in range(5):
        a, b = full.example(), bare.example()
        assert (a.question, a.answer, a.gold) == (b.question, b.answer, b.gold)
        assert sum(map(len, b.documents)) < sum(map(len, a.documents))
        for doc in b.documents:  # every fact sentence of a filler-free document is in the full one
            title = doc.split("\n")[0]
            match = next(d for d in a.documents if d.startswith(title + "\n"))
            assert all(s.strip(". \n") in match for s in doc.split("\n")[1].split(". ") if s.strip())


def test_longer_gdn_chunks_give_the_same_outputs_and_gradients(train):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    saved = mq.torch_chunk_gated_delta_rule
    try:
        torch.manual_seed(0)
        model = train.build_model(0)
        x = torch.randint(0, train.VOCAB_SIZE, (2, 300))
        got = {}
        for chunk in (64, 256):
            train.set_gdn_chunk(chunk)
            model.zero_grad()
            out = model(input_ids=x).logits
            out.float().pow(2).mean().backward()
            got[chunk] = (out.detach(), model.model.layers[0].linear_attn.A_log.grad.clone())
        assert (got[64][0] - got[256][0]).abs().max().item() <= 1e-4
        g64, g256 = got[64][1], got[256][1]
        assert g64.abs().max().item() > 0
        assert (g64 - g256).abs().max().item() <= 1e-3 * g64.abs().max().item()
    finally:
        mq.torch_chunk_gated_delta_rule = saved


def test_model_config_defaults_are_the_shipped_model_and_proxies_resize_it(train, tmp_path):
    assert train.model_config() == train.MODEL_CONFIG
    cfg = train.model_config(64, 4, 2)
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["linear_key_head_dim"], cfg["num_key_value_heads"]) == (
        64,
        32,
        32,
        1,
    )
    model = train.build_model(0, cfg)
    assert len(model.model.layers) == 4 and model.config.hidden_size == 64
    assert model(input_ids=torch.randint(0, train.VOCAB_SIZE, (1, 20))).logits.shape == (
        1,
        20,
        train.VOCAB_SIZE,
    )
    tok = train.Tokenizer.from_str(
        '{"version":"1.0","model":{"type":"BPE","vocab":{},"merges":[]},"added_tokens":[],"normalizer":null,'
        '"pre_tokenizer":null,"post_processor":null,"decoder":null,"truncation":null,"padding":null}'
    )
    train.save_model(model, tok, tmp_path, cfg)
    import json

    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 4
    with pytest.raises(ValueError):
        train.model_config(100, 4, 3)


def test_answer_weight_scales_only_the_answer_term(train):
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 11)
    ids = torch.randint(0, 11, (1, 6))
    valid = torch.ones(1, 6, dtype=torch.bool)
    ans = torch.tensor([[0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    l4, lm4, qa4 = train.loss_fn(logits, ids, valid, ans)
    l1, lm1, qa1 = train.loss_fn(logits, ids, valid, ans, 1.0)
    assert torch.allclose(lm4, lm1) and torch.allclose(qa4, qa1)
    assert torch.allclose(l4, lm4 + train.ANSWER_WEIGHT * qa4) and torch.allclose(l1, lm1 + qa1)


def test_short_names_are_one_syllable_words_distinct_within_a_prompt():
    from hybridcache.services.runtime.qa_data import _SYLLABLES, QAGenerator

    gen = QAGenerator("train", 5, 8, 12)
    gen.short_names = True
    for _ in range(10):
        ex = gen.prompt(4)
        titles = [d.split("\n")[0].removeprefix("Document: ") for d in ex[0].documents]
        people = [t for t in titles if len(t.split()) == 2 and t.split()[1].lower() in _SYLLABLES]
        assert len(people) >= 5
        for t in people:
            assert all(w.lower() in _SYLLABLES for w in t.split())
        surnames = [t.split()[1] for t in people]
        assert len(set(surnames)) == len(surnames)  # surname-only facts stay unambiguous
        for e in ex:  # the answer is still in its gold document
            assert e.answer.removeprefix("the ") in ex[0].documents[e.gold[-1]]


def test_stream_trains_on_short_names_until_the_switch(train):
    from hybridcache.services.runtime.qa_data import _ORG_KINDS
    from tokenizers import Tokenizer

    kinds = {w for k in _ORG_KINDS for w in k.split()}
    tok = train.train_tokenizer(n_prompts=20)
    stream = train.PromptStream(tok.to_str(), 0, 4, 5, 2, short_names_until=0.5)
    it = iter(stream)

    def longest_title_word():
        ids, _ = next(it)
        text = Tokenizer.from_str(tok.to_str()).decode(ids)
        titles = [line.removeprefix("Document: ") for line in text.split("\n") if line.startswith("Document: ")]
        return max(len(w) for t in titles for w in t.split() if w not in kinds)

    stream.progress.value = 0.2
    assert max(longest_title_word() for _ in range(3)) <= 4  # one syllable: at most 4 letters
    stream.progress.value = 0.6
    assert max(longest_title_word() for _ in range(3)) > 4
    # the adaptive curriculum ends the stage early (--short-names-accuracy)
    stream.progress.value = 0.2
    stream.short_names_done.value = 1
    assert max(longest_title_word() for _ in range(3)) > 4


def test_short_names_accuracy_needs_the_short_name_stage(train, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--out", str(tmp_path), "--steps", "1", "--short-names-accuracy", "0.9"])
    assert e.value.code == 2
    assert "--short-names-until" in capsys.readouterr().err


def test_long_memory_pins_decays_through_training(train):
    """--long-memory: the last heads of every GDN layer decay by exactly 1 - 1/L a token, for any
    input, and stay so after optimizer steps (gradients dropped, AdamW's weight decay undone)."""
    torch.manual_seed(0)
    model = train.build_model(0, train.model_config(hidden=64, layers=4, heads=4))
    pins = train.long_memory_heads(model, [32, 256])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randint(0, train.VOCAB_SIZE, (2, 40))
    before = model.model.layers[0].linear_attn.A_log.detach().clone()
    for _ in range(3):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        train.pin_long_memory(pins)
        opt.step()
        train.pin_long_memory(pins)
    for layer in model.model.layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is None:
            continue
        h = torch.randn(5, 64)
        a = gdn.in_proj_a(h)  # [tokens, heads]
        g = -gdn.A_log.exp() * torch.nn.functional.softplus(a + gdn.dt_bias)
        memory = 1.0 / (1.0 - g.exp())
        assert torch.allclose(memory[:, 2], torch.full((5,), 32.0), rtol=1e-4)
        assert torch.allclose(memory[:, 3], torch.full((5,), 256.0), rtol=1e-3)
        assert memory[:, 0].std() > 0  # the other heads stay data-dependent
    assert not torch.equal(model.model.layers[0].linear_attn.A_log[:2], before[:2])  # and keep learning


def test_long_memory_rejects_bad_lengths(train, tmp_path, capsys):
    for bad in ("32,x", "1", "2,3,4,5,6"):
        with pytest.raises(SystemExit) as e:
            train.main(["--out", str(tmp_path), "--steps", "1", "--hidden", "64", "--long-memory", bad, "--val", "0"])
        assert e.value.code == 2, bad
        assert "--long-memory" in capsys.readouterr().err
