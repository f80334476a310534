"""Tokenizer: a `tokenizers` tokenizer.json, plus the byte-level one written for random-weight models."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_byte_tokenizer() -> HFTokenizer:
    """Byte-level BPE with no merges: ids 0-255 are bytes, then the special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _byte_of(ch: str) -> int:
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256+.
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    inverse = {c: b for b, c in table.items()}
    return inverse[ch]


# texts longer than this many characters are tokenized without holding the GIL (encode_with_offsets)
LONG_TEXT_CHARS = 8192


class Tokenizer:
    """Thin wrapper: encode/decode without special-token surprises, and the vocabulary size."""

    def __init__(self, tok: HFTokenizer):
        self.tok = tok

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        f = Path(path) / "tokenizer.json"
        if not f.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        return cls(HFTokenizer.from_file(str(f)))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token string of the vocabulary (added tokens included). A
        byte-level token string has one character per byte it stands for, so no token covers more
        characters of text than this: a text of more than n * max_token_chars characters has more
        than n tokens."""
        return max(map(len, self.tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str) -> list[int]:
        return self.encode_with_offsets(text).ids

    def encode_with_offsets(self, text: str, add_special_tokens: bool = False):
        """The `tokenizers` Encoding of text: .ids and .offsets (character spans of each token).
        A long text goes through encode_batch, which lets go of the GIL while it runs (encode holds
        it: 100 ms of 100k characters during which no other thread of the process, the router's
        event loop included, runs); the same ids and offsets."""
        if len(text) > LONG_TEXT_CHARS:
            return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def decoder(self) -> Callable[[int], str]:
        """An incremental decode of one output: feed it each new id, it answers the text that id
        completes ("" while a character's bytes are still coming). Joined, the answers are
        decode(ids) up to any incomplete character at the end, at a constant cost a token
        (tokenizers' DecodeStream) where decoding the whole output again grows with its length."""
        stream, tok = DecodeStream(skip_special_tokens=True), self.tok

        def step(token_id: int) -> str:
            return stream.step(tok, token_id) or ""

        return step

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)
