"""The serving engine's tokenizer: Hugging Face tokenizer.json, without transformers.

Works for any model directory with a tokenizer.json (Llama, Qwen2, Mistral and the
checkpoints `pdserve model init` writes); tokenizer_config.json, when present, gives
the special tokens and the chat template.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from pdserve.workers.model.byte_level_words import ByteLevelWords, byte_chars
from pdserve.workers.model.chat_template import render_chat_template

# One text per call: the library's thread pool would only add a hand-off to another
# thread (and a wait for it to be scheduled) to every prompt. Read at each call; a
# value the user set wins.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# End-of-turn tokens of chat models: generation stops on them as on eos.
_END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class TokenizerSettings:
    """What tokenizer_config.json and the model's configs say about the tokenizer."""

    special_tokens: Mapping[str, str]
    chat_template: str | None
    extra_eos_ids: frozenset[int]


class Tokenizer:
    """Encode, decode and chat-format text for one model."""

    def __init__(self, backend: tokenizers.Tokenizer, settings: TokenizerSettings) -> None:
        """Wrap a loaded `tokenizers.Tokenizer`; most callers use `from_dir`."""
        self._backend = backend
        self._settings = settings
        self.bos_id: int | None = self._token_id(settings.special_tokens.get("bos_token"))
        self.eos_ids: frozenset[int] = self._collect_eos_ids()
        serialized = backend.to_str()
        self._byte_level = _is_byte_level(json.loads(serialized).get("decoder"))
        self._token_bytes: dict[int, bytes] = {}
        self.fingerprint = _fingerprint(serialized, settings)
        # ASCII prompts a word at a time, where that gives the library's ids.
        self._words = ByteLevelWords.of(backend)

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        """Load tokenizer.json and the configs next to it from a model directory."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        return cls(backend, _read_settings(directory))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's own end-of-sequence id (one of `eos_ids`)."""
        return self._token_id(self._settings.special_tokens.get("eos_token"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens as the model's post-processor adds them.

        A prompt rendered by `apply_chat_template` already holds its special tokens:
        encode it with add_special_tokens=False.
        """
        if self._words is not None:
            by_words = self._words.encode(text, add_special_tokens)
            if by_words is not None:
                return by_words
        # The fast path computes no character offsets, which nothing here reads: the
        # same ids for a fifth less CPU (a router tokenizes every request).
        encoding = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding[0].ids
        return ids

    def encode_inline(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """`encode`'s ids, or None where they need the library's work on many new words
        (which leaves Python's lock while it works: worth a thread, so that an event
        loop serves others meanwhile). Ids already remembered cost microseconds."""
        words = self._words
        if words is not None and words.handles(text):
            return words.encode(text, add_special_tokens, inline_only=True)
        return self.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form a whole character come out as U+FFFD."""
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_string(self, token_id: int) -> str | None:
        """A token's own form in the vocabulary (e.g. `Ġthe`), None for an unknown id."""
        token: str | None = self._backend.id_to_token(token_id)
        return token

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, alone: part of a character for tokens that
        split one (what text decoding would show as U+FFFD), a word's leading space
        included. Special tokens stand for their text."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            token = self.token_string(token_id) or ""
            cached = self._token_bytes[token_id] = (
                _byte_level_bytes(token) if self._byte_level else _piece_bytes(token)
            )
        return cached

    def token_to_id(self, token: str) -> int | None:
        """Id of a token by its text form, or None if the vocabulary lacks it."""
        token_id: int | None = self._backend.token_to_id(token)
        return token_id

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` ({"role", "content"} dicts) with the model's chat template.

        Raises ValueError when the model has no chat template or it fails to render.
        """
        if self._settings.chat_template is None:
            raise ValueError("this model has no chat template")
        return render_chat_template(
            self._settings.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self._settings.special_tokens,
        )

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.token_to_id(token)

    def _collect_eos_ids(self) -> frozenset[int]:
        names = [self._settings.special_tokens.get("eos_token"), *_END_OF_TURN_TOKENS]
        ids = {self._token_id(name) for name in names}
        return frozenset(i for i in ids if i is not None) | self._settings.extra_eos_ids


def _fingerprint(serialized: str, settings: TokenizerSettings) -> str:
    """What decides a prompt's token ids, digested: the tokenizer itself, its special
    tokens and chat template. Two processes whose fingerprints are equal turn every
    prompt into the same ids."""
    digest = hashlib.sha256(serialized.encode())
    described = {
        "special_tokens": dict(sorted(settings.special_tokens.items())),
        "chat_template": settings.chat_template,
    }
    digest.update(json.dumps(described, sort_keys=True).encode())
    return digest.hexdigest()[:32]


_BYTE_OF_CHAR = {char: byte for byte, char in byte_chars().items()}
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _is_byte_level(decoder: Any) -> bool:
    """Whether a tokenizer.json decoder (possibly a Sequence) decodes byte-level BPE."""
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "Sequence":
        return any(_is_byte_level(part) for part in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


def _byte_level_bytes(token: str) -> bytes:
    if all(char in _BYTE_OF_CHAR for char in token):
        return bytes(_BYTE_OF_CHAR[char] for char in token)
    return token.encode("utf-8")  # an added token, written as plain text


def _piece_bytes(token: str) -> bytes:
    """SentencePiece-style: `<0xNN>` byte pieces, `▁` for a space."""
    match = _BYTE_PIECE.match(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    content = json.loads(path.read_text(encoding="utf-8"))
    return content if isinstance(content, dict) else {}


def _token_text(value: object) -> str | None:
    """A special token as configs write it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the "default" one is for plain chat.
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    if isinstance(template, str):
        return template
    # Newer checkpoints keep the template in a file of its own.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return _read_json(directory / "chat_template.json").get("chat_template")


def _config_eos_ids(*configs: Mapping[str, Any]) -> frozenset[int]:
    ids: set[int] = set()
    for config in configs:
        value = config.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(i for i in value if isinstance(i, int))
    return frozenset(ids)


def _read_settings(directory: Path) -> TokenizerSettings:
    config = _read_json(directory / "tokenizer_config.json")
    special_map = _read_json(directory / "special_tokens_map.json")
    special_tokens: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        text = _token_text(config.get(key, special_map.get(key)))
        if text is not None:
            special_tokens[key] = text
    extra_eos_ids = _config_eos_ids(
        _read_json(directory / "generation_config.json"), _read_json(directory / "config.json")
    )
    return TokenizerSettings(special_tokens, _chat_template(directory, config), extra_eos_ids)


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, one token at a time.

    Decoding each token alone is wrong in two ways: a character whose UTF-8 bytes are
    split over tokens would come out as U+FFFD, and SentencePiece-style tokenizers
    drop a word's leading space when it starts the decoded text. So each step decodes
    a short window of recent tokens and emits what the new token added, holding the
    text back while it ends in an incomplete character. Call `flush` at the end to
    release anything still held.
    """

    # Tokens of prompt context kept in the window, as a prefix for the first outputs.
    _CONTEXT_TOKENS = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """Start after `prompt_ids`, which give context but are never emitted."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self._CONTEXT_TOKENS :])
        # Text of ids[prefix:read] has been emitted (or belongs to the prompt);
        # ids[read:] is pending.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (may be empty)."""
        self._ids.append(token_id)
        delta, complete = self._pending_text()
        if not delta or not complete:
            return ""
        self._advance()
        return delta

    def flush(self) -> str:
        """Release held-back text at the end of generation (incomplete bytes as U+FFFD)."""
        delta, _ = self._pending_text()
        self._advance()
        return delta

    def _pending_text(self) -> tuple[str, bool]:
        """Text of the pending tokens, and whether it ends with a whole character."""
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(emitted):
            return "", False
        return window[len(emitted) :], not window.endswith("\ufffd")

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Only the window is ever decoded again: drop what lies before it.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
