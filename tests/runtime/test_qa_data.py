"""The QA generator: deterministic, well-formed prompts, answers found in the gold documents,
and test documents never drawn for training."""

import pytest
from hybridcache.services.runtime.qa_data import (
    QAGenerator,
    normalize_answer,
    split_of,
)


def _names(doc: str) -> str:
    return doc.split("\n", 1)[0].removeprefix("Document: ")


def test_same_seed_same_examples_other_seed_differs():
    a = [QAGenerator("test", 3).example() for _ in range(1)] + list(QAGenerator("test", 3).examples(3))
    b = [QAGenerator("test", 3).example() for _ in range(1)] + list(QAGenerator("test", 3).examples(3))
    c = list(QAGenerator("test", 4).examples(3))
    assert a == b
    assert a[1:] != c


@pytest.mark.parametrize("hops", [1, 2])
def test_examples_are_well_formed(hops):
    gen = QAGenerator("val", 0, min_docs=8, max_docs=16)
    for ex in gen.examples(20, hops):
        assert ex.hops == hops
        assert 8 <= len(ex.documents) <= 16
        assert len(ex.gold) == hops
        titles = [_names(d) for d in ex.documents]
        assert len(set(titles)) == len(titles)
        # the asked-about entity is named in the question and the answer is in the last gold document
        assert titles[ex.gold[0]] in ex.question
        assert ex.answer.removeprefix("the ") in ex.documents[ex.gold[-1]]
        if hops == 2:
            # the bridge: the person's document names the organisation whose document holds the city
            assert titles[ex.gold[1]] in ex.documents[ex.gold[0]]
        req = ex.request()
        assert req["segments"] == list(ex.documents)
        assert req["suffix"].startswith("Question: ") and req["suffix"].endswith("Answer:")


def test_document_lengths_in_tokens():
    """100-400 tokens per document with the shipped tokenizer (when it is present)."""
    from hybridcache.services.runtime.modelzoo import SHIPPED_MODEL
    from hybridcache.services.runtime.tokenizer import Tokenizer

    if not (SHIPPED_MODEL / "tokenizer.json").is_file():
        pytest.skip("no shipped model")
    tok = Tokenizer.from_dir(SHIPPED_MODEL)
    lengths = [len(tok.encode(d)) for ex in QAGenerator("test", 1).examples(10) for d in ex.documents]
    assert 100 <= min(lengths) and max(lengths) <= 400


def test_splits_are_disjoint_by_entity():
    seen = {}
    for split in ("train", "test"):
        names = set()
        for ex in QAGenerator(split, 0).examples(30):
            names |= {_names(d) for d in ex.documents}
        assert all(split_of(n) == split for n in names)
        seen[split] = names
    assert not seen["train"] & seen["test"]
    test_docs = {d for ex in QAGenerator("test", 0).examples(20) for d in ex.documents}
    train_docs = {d for ex in QAGenerator("train", 0).examples(200) for d in ex.documents}
    assert not test_docs & train_docs


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="split"):
        QAGenerator("dev")
    with pytest.raises(ValueError, match="min_docs"):
        QAGenerator("test", 0, min_docs=9, max_docs=8)
    with pytest.raises(ValueError, match="hops"):
        QAGenerator("test", 0).example(3)


def test_normalize_answer():
    assert normalize_answer("  Tarnholm.\n") == "tarnholm"
    assert normalize_answer("the  Kavos Mills") == normalize_answer("The Kavos Mills")
    assert normalize_answer("Tarnholm") != normalize_answer("Lowmere")
