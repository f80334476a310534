"""Detokenization of a request's output (scheduler.TextStream, Tokenizer.decoder): incremental,
at a constant cost a token, and the same text as decoding the whole output."""

from __future__ import annotations

import random
import types

import pytest
from hybridcache.services.runtime.modelzoo import default_model_dir
from hybridcache.services.runtime.sampling import SamplingParams
from hybridcache.services.runtime.scheduler import TextStream
from hybridcache.services.runtime.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


def _ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def test_decoder_joins_to_the_whole_decode(tokenizer):
    """Random ids of the whole vocabulary (special tokens and byte pieces that split characters
    included): the increments joined are decode(ids) but for an incomplete character at the end,
    which decode shows as replacement characters."""
    vocab = tokenizer.tok.get_vocab_size(with_added_tokens=True)
    rng = random.Random(0)
    tails = 0
    for _ in range(400):
        ids = _ids(rng, vocab, rng.randrange(1, 80))
        step = tokenizer.decoder()
        joined = "".join(step(i) for i in ids)
        whole = tokenizer.decode(ids)
        assert whole.startswith(joined)
        assert set(whole[len(joined):]) <= {REPLACEMENT}
        tails += len(whole) > len(joined)
    assert tails > 0  # the case an incremental decode must hold back did come up


def _engine(tokenizer, eos=()):
    return types.SimpleNamespace(tokenizer=tokenizer, eos_ids=set(eos))


@pytest.mark.parametrize("stop", [(), ("ab", "the")])
def test_text_stream_emits_the_decoded_output_without_decoding_it_again(tokenizer, monkeypatch, stop):
    """The deltas of push() and flush() are the whole output's text (up to a stop string), and no
    token decodes the output so far again (a cost that grew with the output: O(n^2) a request)."""
    vocab = tokenizer.tok.get_vocab_size(with_added_tokens=True)
    rng = random.Random(1)
    calls, decode = [], Tokenizer.decode

    def counted(self, ids):
        calls.append(len(ids))
        return decode(self, ids)

    for trial in range(30):
        ids = _ids(rng, vocab, 400)
        stream = TextStream(_engine(tokenizer), SamplingParams(max_new_tokens=len(ids), stop=stop, ignore_eos=True))
        calls.clear()
        monkeypatch.setattr(Tokenizer, "decode", counted)
        out, done = [], False
        for i in ids:
            events, done = stream.push(i)
            out += events
            if done:
                break
        assert not calls, "a token decoded the whole output again"
        if stream.finish_reason == "length":
            out += stream.flush()
        monkeypatch.undo()
        text = "".join(d for _, d in out)
        whole = tokenizer.decode(stream.output_ids)
        cut = min((whole.find(s) for s in stop if s in whole), default=-1)
        assert text == (whole[:cut] if cut >= 0 else whole), trial
        assert [t for t, _ in out if t >= 0] == stream.output_ids
