"""Encoding ASCII text with a byte-level BPE tokenizer a word at a time, each word's
ids remembered: the ids the `tokenizers` library gives, for a fraction of its work.

The library runs a whole pipeline per text (added tokens split out, the normalizer,
the pre-tokenizer cutting words with GPT-2's pattern, the BPE model on each word, the
post-processor adding special tokens, an Encoding with offsets), which costs a router
tens of microseconds on every short prompt. BPE never merges across the words the
pre-tokenizer cut, so a text's ids are its words' ids in order: those of a word seen
before are looked up; a new word goes through the library's own BPE model once. A text
whose only white space is single spaces (most prompts) is looked up by its parts
between the spaces, a part's ids remembered as a word's are, without cutting it into
words at all. A text with many new parts (a prompt never seen, or its new tail) has
them encoded by the library in one call, which leaves Python's lock while it works:
one at a time, from Python, each new part's words cost ~6x the library's own time for
a text of new words (the Mooncake replay's cold 9,000-token prompt: 824 ms against 143
ms in one call, at nice 19 on a loaded machine). `encode(..., inline_only=True)`
answers None for such a text, so that a caller can take it to a thread (the router
does: its loop serves other requests while the library works).

Only where that is exactly the library's result: a tokenizer.json with no normalizer,
the ByteLevel pre-tokenizer with GPT-2's pattern and no added prefix space, a BPE model
without dropout, no truncation or padding, and a post-processor that adds the same
special tokens around every text; and only ASCII text holding no added token's text
(a word's letters, digits and spaces are then the same in every Unicode version the
library's regular expressions and this module's could disagree on). Anything else is
the library's to encode (`encode` answers None)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from itertools import chain
from typing import Any

import tokenizers

# GPT-2's pre-tokenizer pattern, as the ByteLevel pre-tokenizer applies it, on ASCII:
# letters are [A-Za-z], digits [0-9] and white space the six characters Unicode calls
# so (\s in Python's `re` would also take \x1c-\x1f, which are no white space there).
_SPACE = r"\t\n\x0b\x0c\r "
_WORDS = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_SPACE}A-Za-z0-9]+"
    rf"|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"
)
# Texts longer than this are the library's (which leaves Python's lock to other
# threads while it works: long prompts are tokenized on a thread).
MAX_TEXT_CHARS = 16 * 1024
# Words remembered (the table is emptied when full) and the longest remembered.
MAX_WORDS = 1 << 15
MAX_WORD_CHARS = 64
# A text with at least this many new parts has them encoded in one library call
# (fewer: each through the BPE model, cheaper than the call's own cost).
BATCH_NEW_PARTS = 4
# Texts whose ids the library's and this module's must agree on when a tokenizer is
# taken on (a check of the assumptions above on the tokenizer at hand).
_PROBES = (
    "",
    " ",
    "Hello world! It's 2024, they'll say: \"x-1\" isn't 3.14...",
    "  two  spaces\tand\ttabs\n\nnew lines \r\n  end  ",
    "".join(chr(c) for c in range(128)),
)


def byte_chars() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte as the printable character standing
    for it in the vocabulary (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


# An ASCII word's characters are its bytes: str.translate maps them to the alphabet.
_ASCII_TO_ALPHABET = {byte: char for byte, char in byte_chars().items() if byte < 128}


class ByteLevelWords:
    """A byte-level BPE tokenizer's ids for ASCII text, a word at a time (see module)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        added: re.Pattern[str] | None,
        specials: tuple[list[int], list[int]],
    ) -> None:
        self._backend = backend  # the library's pipeline: many new parts in one call
        self._model = backend.model  # the library's BPE model: a word's tokens
        self._added = added  # any added token's text
        self._prefix, self._suffix = specials  # what add_special_tokens adds
        self._words: dict[str, list[int]] = {}
        # The ids of the space-separated parts of single-spaced texts: a text's first
        # part, and a part after a space (the space's ids with it).
        self._first: dict[str, list[int]] = {}
        self._after: dict[str, list[int]] = {}

    @classmethod
    def of(cls, backend: tokenizers.Tokenizer) -> ByteLevelWords | None:
        """The word encoder of `backend`; None where it would not give the library's ids."""
        config = json.loads(backend.to_str())
        if not _supported(config):
            return None
        added = [token["content"] for token in config.get("added_tokens") or ()]
        pattern = re.compile("|".join(map(re.escape, added))) if added else None
        specials = _specials(backend)
        if specials is None:
            return None
        words = cls(backend, pattern, specials)
        for text in _PROBES:
            for special in (True, False):
                expected = backend.encode(text, add_special_tokens=special).ids
                if words.encode(text, special) != expected:
                    return None
        for table in (words._words, words._first, words._after):
            table.clear()
        return words

    def handles(self, text: str) -> bool:
        """Whether `text` is this encoder's to encode (else the library's)."""
        if not text.isascii() or len(text) > MAX_TEXT_CHARS:
            return False
        return self._added is None or self._added.search(text) is None

    def encode(
        self, text: str, add_special_tokens: bool, inline_only: bool = False
    ) -> list[int] | None:
        """The ids of `text`; None when it is not this encoder's to encode (see
        `handles`), or, with `inline_only`, when a single-spaced text has so many new
        parts that they go to the library in one call (`encode` without it makes it)."""
        if not self.handles(text):
            return None
        if text.isprintable() and "  " not in text:
            found = self._single_spaced(text, inline_only)
            if found is None:
                return None
            pieces = found
        else:
            pieces = self._ids(_WORDS.findall(text))
        # Joined in C: a loop over the pieces in Python cost more than the lookups.
        tokens = chain.from_iterable(pieces)
        if add_special_tokens:
            return [*self._prefix, *tokens, *self._suffix]
        return list(tokens)

    def _single_spaced(self, text: str, inline_only: bool) -> list[list[int]] | None:
        """The ids of a text whose only white space is single spaces, by its parts
        between the spaces (None: `inline_only` and BATCH_NEW_PARTS new). No word of
        the pattern spans a space there but as its first character (a space, then
        letters, digits or other characters; at the text's end, the space alone), so
        each part after a space, the space with it, has the same words wherever it
        stands: looked up as a whole, without the pattern's scan."""
        first, *rest = text.split(" ")
        after = self._after
        # Looked up in C; a miss is None, and no part's ids are empty (`all` tests
        # each for truth, no comparison).
        found = list(map(after.get, rest))
        # Counted in C: a text with a few new parts (a prompt's new tail) makes no list.
        if not all(found) and found.count(None) >= BATCH_NEW_PARTS:
            if inline_only:
                return None
            missing = [part for part, ids in zip(rest, found, strict=True) if ids is None]
            new = self._new_parts(missing)
            found = [ids or new[part] for ids, part in zip(found, rest, strict=True)]
        while not all(found):  # a few new parts, each found by a search in C
            at = found.index(None)
            found[at] = self._part(rest[at], " ", after)
        head = self._first.get(first)
        if head is None:
            head = self._part(first, "", self._first)
        found.insert(0, head)
        return found  # type: ignore[return-value]  # no miss is left

    def _new_parts(self, parts: list[str]) -> dict[str, list[int]]:
        """The ids of new parts that follow a space (`parts`), the space's with them:
        each part with its space encoded by the library, all in one call (its
        pre-tokenizer cuts the same words as the pattern, its BPE model gives them
        their ids; no special tokens). Remembered as `_part` remembers them."""
        unique = list(dict.fromkeys(parts))
        encoded = self._backend.encode_batch_fast(
            [" " + part for part in unique], add_special_tokens=False
        )
        found = {part: encoding.ids for part, encoding in zip(unique, encoded, strict=True)}
        after = self._after
        for part, ids in found.items():
            if len(part) <= MAX_WORD_CHARS:
                if len(after) >= MAX_WORDS:
                    after.clear()
                after[part] = ids
        return found

    def _part(self, part: str, space: str, table: dict[str, list[int]]) -> list[int]:
        ids = list(chain.from_iterable(self._ids(_WORDS.findall(space + part))))
        if len(part) <= MAX_WORD_CHARS:
            if len(table) >= MAX_WORDS:
                table.clear()
            table[part] = ids
        return ids

    def _ids(self, words: list[str]) -> list[list[int]]:
        """Each word's ids: looked up (a miss is None, no word's ids are empty); a new
        word's from the library's BPE model."""
        found = list(map(self._words.get, words))
        if not all(found):  # new words (one, as a rule)
            found = [ids or self._word(word) for ids, word in zip(found, words, strict=True)]
        return found  # type: ignore[return-value]  # no miss is left

    def _word(self, word: str) -> list[int]:
        ids = [token.id for token in self._model.tokenize(word.translate(_ASCII_TO_ALPHABET))]
        if len(word) <= MAX_WORD_CHARS:
            if len(self._words) >= MAX_WORDS:
                self._words.clear()
            self._words[word] = ids
        return ids


def _supported(config: Mapping[str, Any]) -> bool:
    """Whether a tokenizer.json's pipeline is the one this module reproduces."""
    pre = config.get("pre_tokenizer") or {}
    model = config.get("model") or {}
    return (
        config.get("normalizer") is None
        and config.get("truncation") is None
        and config.get("padding") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True) is True
        and pre.get("add_prefix_space") is False
        and model.get("type") == "BPE"
        and model.get("dropout") is None
        and _fixed_specials(config.get("post_processor"))
    )


def _fixed_specials(processor: Any) -> bool:
    """Whether a post-processor adds the same tokens around every single text (or none)."""
    if processor is None:
        return True
    kind = processor.get("type")
    if kind == "Sequence":
        return all(_fixed_specials(part) for part in processor.get("processors") or ())
    return kind in ("ByteLevel", "TemplateProcessing")


def _specials(backend: tokenizers.Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids add_special_tokens puts before and after a text's own."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return None
