"""Byte-level BPE tokenizers encode ASCII text a word at a time, each word's ids
remembered: always the `tokenizers` library's own ids, and the library's pipeline for
whatever that would not reproduce."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import tokenizers

from pdserve.workers.model import byte_level_words
from pdserve.workers.model.byte_level_words import ByteLevelWords
from pdserve.workers.model.checkpoint import TinyModelSpec, write_tiny_checkpoint
from pdserve.workers.model.tokenizer import Tokenizer
from support.llama_tokenizer import write_llama_tokenizer

SPEC = TinyModelSpec(
    layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=1024, max_position=4096
)
# Pieces the pre-tokenizer's pattern treats apart: contractions (any case), runs of
# spaces before a word or the end, digits, punctuation, every ASCII character.
PIECES = [
    "the", "The", "'s", "'S", "'ll", "'LL", "don't", "we're", "  ", "   ", "\n\n", " \t",
    "\r\n", "123", "4567", "a1b2", "!!", "?!.", "--", "x", " y", "\x0b", "\x1c", "\x7f",
    *map(chr, range(128)),
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("words") / "model"
    write_tiny_checkpoint(directory, SPEC)
    return directory


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def random_texts(count: int, seed: int = 0) -> list[str]:
    draw = random.Random(seed)
    return ["".join(draw.choices(PIECES, k=draw.randint(0, 24))) for _ in range(count)]


def test_ascii_texts_get_the_librarys_ids(backend: tokenizers.Tokenizer) -> None:
    """On random ASCII texts, with and without special tokens, and again once their
    words are remembered: the library's ids."""
    words = ByteLevelWords.of(backend)
    assert words is not None
    texts = random_texts(3000)
    for _ in range(2):
        for text in texts:
            for special in (True, False):
                expected = backend.encode(text, add_special_tokens=special).ids
                assert words.encode(text, special) == expected, (text, special)


def test_single_spaced_texts_get_the_librarys_ids(backend: tokenizers.Tokenizer) -> None:
    """Texts whose only white space is single spaces (as most prompts are) are looked up
    by their parts between the spaces: a space at either end, parts of letters, digits
    and punctuation mixed, contractions, parts seen before in another place; with and
    without special tokens, and again once the parts are remembered: the library's ids."""
    words = ByteLevelWords.of(backend)
    assert words is not None
    printable = [piece for piece in PIECES if piece.isprintable() and " " not in piece]
    draw = random.Random(1)
    texts = ["", " ", "a ", " a", "a b", " 's", "x 'll y", "it's 3.14, isn't it?"]
    for _ in range(3000):
        parts = ["".join(draw.choices(printable, k=draw.randint(1, 4))) for _ in range(8)]
        text = " ".join(parts[: draw.randint(1, 8)])
        texts.append(draw.choice(["", " "]) + text + draw.choice(["", " "]))
    for _ in range(2):
        for text in texts:
            for special in (True, False):
                expected = backend.encode(text, add_special_tokens=special).ids
                assert words.encode(text, special) == expected, (text, special)
    assert words._after and words._first  # the parts were looked up


def test_the_tokenizer_encodes_by_words_where_it_can(model_dir: Path) -> None:
    """`Tokenizer.encode` takes the word path for ASCII text, the library's for the
    rest (not ASCII, holding an added token's text, long): the same ids either way."""
    tokenizer = Tokenizer.from_dir(model_dir)
    backend, words = tokenizer._backend, tokenizer._words
    assert words is not None
    special = json.loads(backend.to_str())["added_tokens"][0]["content"]
    for text in ["plain words 42", "café", f"a {special} b", "x" * 20_000]:
        ours = tokenizer.encode(text)
        assert ours == backend.encode(text).ids
        taken = words.encode(text, True) is not None
        assert taken == (text == "plain words 42"), text


def test_other_pipelines_are_the_librarys(backend: tokenizers.Tokenizer, tmp_path: Path) -> None:
    """SentencePiece-style tokenizers, a pre-tokenizer that adds a prefix space, a
    normalizer or BPE dropout: no word encoder."""
    sentencepiece = write_llama_tokenizer(tmp_path / "sentencepiece")
    assert ByteLevelWords.of(Tokenizer.from_dir(sentencepiece)._backend) is None
    config = json.loads(backend.to_str())
    for change in (
        {"pre_tokenizer": {**config["pre_tokenizer"], "add_prefix_space": True}},
        {"normalizer": {"type": "NFC"}},
        {"model": {**config["model"], "dropout": 0.1}},
    ):
        changed = tokenizers.Tokenizer.from_str(json.dumps({**config, **change}))
        assert ByteLevelWords.of(changed) is None, change


def test_words_remembered_are_bounded(
    backend: tokenizers.Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At most MAX_WORDS words are remembered, none longer than MAX_WORD_CHARS; the ids
    stay the library's."""
    monkeypatch.setattr(byte_level_words, "MAX_WORDS", 50)
    words = ByteLevelWords.of(backend)
    assert words is not None
    for n in range(400):
        text = f"word{n} w{n}x {'a' * (byte_level_words.MAX_WORD_CHARS + n)}"
        assert words.encode(text, True) == backend.encode(text).ids
        assert len(words._words) <= 50
    assert all(len(word) <= byte_level_words.MAX_WORD_CHARS for word in words._words)
