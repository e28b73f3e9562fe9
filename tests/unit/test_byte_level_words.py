"""Byte-level BPE tokenizers encode ASCII text a word at a time, each word's ids
remembered: always the `tokenizers` library's own ids, and the library's pipeline for
whatever that would not reproduce."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from pathlib import Path

import pytest
import tokenizers

from pdserve.protocol import prompts
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


def test_texts_of_many_new_parts_get_the_librarys_ids(backend: tokenizers.Tokenizer) -> None:
    """A long single-spaced text of parts never seen (a new prompt), then texts that
    repeat some of them with new ones among them, parts repeated within a text, a
    space at either end, parts longer than MAX_WORD_CHARS: their new parts go to the
    library in one call, and the ids are the library's, with and without special
    tokens; those parts are remembered."""
    printable = [piece for piece in PIECES if piece.isprintable() and " " not in piece]
    draw = random.Random(2)
    pool = ["".join(draw.choices(printable, k=draw.randint(1, 5))) for _ in range(3000)]
    pool.append("z" * (byte_level_words.MAX_WORD_CHARS + 7))
    words = ByteLevelWords.of(backend)
    assert words is not None
    texts = [" ".join(pool[:1500]), " ".join(pool[1000:2500]) + " ", " " + " ".join(pool)]
    texts += [" ".join(draw.choices(pool, k=draw.randint(1, 40))) for _ in range(200)]
    for text in texts:
        for special in (True, False):
            expected = backend.encode(text, add_special_tokens=special).ids
            assert words.encode(text, special) == expected, (text[:80], special)
    remembered = [part for part in pool if len(part) <= byte_level_words.MAX_WORD_CHARS]
    assert set(remembered) <= set(words._after)
    assert pool[-1] not in words._after


def test_inline_only_defers_texts_of_many_new_parts(backend: tokenizers.Tokenizer) -> None:
    """With `inline_only`, a text with BATCH_NEW_PARTS new parts or more answers None
    (its caller takes it to a thread) and leaves nothing remembered; with fewer new
    parts, or once encoded, the library's ids."""
    words = ByteLevelWords.of(backend)
    assert words is not None
    new = [f"part{n}x" for n in range(byte_level_words.BATCH_NEW_PARTS)]
    text = "lead " + " ".join(new)
    assert words.encode(text, True, inline_only=True) is None
    assert not words._after
    few = "lead " + " ".join(new[:-1])
    assert words.encode(few, True, inline_only=True) == backend.encode(few).ids
    assert words.encode(text, True) == backend.encode(text).ids
    plain = backend.encode(text, add_special_tokens=False).ids
    assert words.encode(text, False, inline_only=True) == plain


def test_the_tokenizer_encodes_inline_where_it_is_cheap(model_dir: Path) -> None:
    """`Tokenizer.encode_inline` gives `encode`'s ids, but None for a text of many new
    words; a text not for the word path (not ASCII) is encoded as by `encode`."""
    tokenizer = Tokenizer.from_dir(model_dir)
    text = " ".join(f"w{n}q" for n in range(50))
    assert tokenizer.encode_inline(text) is None
    assert tokenizer.encode(text) == tokenizer._backend.encode(text).ids
    assert tokenizer.encode_inline(text) == tokenizer.encode(text)
    other = "café " + text
    assert tokenizer.encode_inline(other) == tokenizer._backend.encode(other).ids


def test_prompts_of_many_new_words_are_tokenized_off_the_event_loop(model_dir: Path) -> None:
    """The router's and worker's `encode`: a prompt of many new words is tokenized on a
    thread, then the same prompt (remembered) and a short one on the loop's own
    thread; the library's ids every time."""
    tokenizer = Tokenizer.from_dir(model_dir)
    threads: list[int] = []
    plain_encode = tokenizer.encode

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.get_ident())
        return plain_encode(text, add_special_tokens)

    tokenizer.encode = encode  # type: ignore[method-assign]
    text = " ".join(f"n{n}ew" for n in range(400))

    async def three() -> list[list[int]]:
        return [await prompts.encode(tokenizer, t, True) for t in (text, text, "short one")]

    loop_thread = threading.get_ident()  # asyncio.run runs the loop on this thread
    found = asyncio.run(three())
    backend = tokenizer._backend
    assert found == [backend.encode(t).ids for t in (text, text, "short one")]
    assert len(threads) == 1 and threads[0] != loop_thread  # only the first, on a thread
