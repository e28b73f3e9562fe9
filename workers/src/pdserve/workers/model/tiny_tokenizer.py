"""A small byte-level BPE tokenizer for generated test checkpoints.

The tokenizer is trained on a corpus generated here from a fixed seed, so the same
vocabulary size always gives the same tokenizer files, byte for byte. Byte-level BPE
covers every byte, so any text encodes, and every token id decodes. The special
tokens follow the Llama-3 names and sit at the top of the vocabulary, as they do
there.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    START_HEADER_TOKEN,
    END_HEADER_TOKEN,
    EOT_TOKEN,
)

# 256 byte symbols plus the special tokens, with room for some merges.
MIN_VOCAB_SIZE = 512

# Llama-3 layout: a header per message, the content trimmed, an end-of-turn token.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{{- message['content'] | trim -}}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

# The corpus does not depend on the model seed: checkpoints that differ only in their
# weights share one tokenizer.
_CORPUS_SEED = 20240611

_COMMON_TEXT = (
    "the of and to in is was it for on with as at by that this from be are or an not "
    "have has had but what all were when we there can more if no out so said up one "
    "about into than them some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off "
    "come since against go came right used take three model token request server cache "
    "prefill decode latency stream batch chunk queue worker router pool length prompt "
    "answer question hello thanks please help explain write story code data value error"
)
_COMMON_WORDS = tuple(_COMMON_TEXT.split())

_ONSET_TEXT = "b c d f g h j k l m n p r s t v w y z ch sh th st tr br pl gr cl fr sp"
_ONSETS = tuple(_ONSET_TEXT.split())
_VOWEL_TEXT = "a e i o u a e i o ai ea ou io ie oo"
_VOWELS = tuple(_VOWEL_TEXT.split())
_CODAS = ["", "", "", "n", "s", "r", "t", "l", "nd", "ng", "st", "ck"]
_PUNCTUATION = [".", ".", ".", ",", ",", "?", "!", ";", ":"]

# A few scripts beyond ASCII, so that multi-byte characters get merges of their own
# and others stay split over several byte tokens (what streaming must handle).
_CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年"
_KANA = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよ"
_CYRILLIC = "привет мир модель токен запрос ответ данные"
_GREEK = "καλημέρα κόσμε μοντέλο"
_ACCENTED = "café naïve über façade señor déjà vu crème brûlée"
_EMOJI = "😀😂🙂🚀🔥✨👍🎉❤️🤖"


@dataclass(frozen=True)
class _Vocabulary:
    """The words a generated corpus draws from."""

    words: tuple[str, ...]
    cumulative_weights: tuple[float, ...]


def _pseudo_word(rng: random.Random) -> str:
    syllables = rng.randint(1, 4)
    body = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
    return body + rng.choice(_CODAS)


def _vocabulary(rng: random.Random, size: int) -> _Vocabulary:
    """Common English words first, then enough pseudo-words to fill `size`."""
    words = list(_COMMON_WORDS)
    seen = set(words)
    while len(words) < size:
        word = _pseudo_word(rng)
        if word not in seen:
            seen.add(word)
            words.append(word)
    # Zipf-like frequencies, as in natural text; cumulative, so sampling is a bisection.
    weights = (1.0 / (rank + 1) for rank in range(len(words)))
    return _Vocabulary(tuple(words), tuple(itertools.accumulate(weights)))


def _sentence(rng: random.Random, vocabulary: _Vocabulary) -> str:
    count = rng.randint(4, 18)
    words = rng.choices(vocabulary.words, cum_weights=vocabulary.cumulative_weights, k=count)
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10_000)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(_PUNCTUATION)


def _foreign_snippet(rng: random.Random) -> str:
    script = rng.choice((_CJK, _KANA, _CYRILLIC, _GREEK, _ACCENTED, _EMOJI))
    start = rng.randrange(len(script))
    return script[start : start + rng.randint(2, 12)]


def _code_snippet(rng: random.Random, vocabulary: _Vocabulary) -> str:
    name, arg = rng.choices(vocabulary.words[:400], k=2)
    return f"def {name}({arg}):\n    return {arg} + {rng.randint(0, 99)}\n"


def generate_corpus(vocab_size: int) -> Iterator[str]:
    """Paragraphs of a deterministic corpus large enough for `vocab_size` tokens."""
    rng = random.Random(_CORPUS_SEED)
    vocabulary = _vocabulary(rng, size=vocab_size)
    # Every word appears at least once, so that merges can run up to the full size.
    for start in range(0, len(vocabulary.words), 64):
        yield " ".join(vocabulary.words[start : start + 64]) + "\n"
    for _ in range(max(200, vocab_size // 4)):
        parts = [_sentence(rng, vocabulary) for _ in range(rng.randint(2, 8))]
        if rng.random() < 0.3:
            parts.append(_foreign_snippet(rng))
        if rng.random() < 0.1:
            parts.append("\n" + _code_snippet(rng, vocabulary))
        yield " ".join(parts) + "\n\n"


def special_token_id(vocab_size: int, token: str) -> int:
    """Id of one of SPECIAL_TOKENS: they fill the top of the vocabulary, in order."""
    return vocab_size - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(token)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer with exactly `vocab_size` tokens.

    Raises ValueError when `vocab_size` is below MIN_VOCAB_SIZE.
    """
    # Imported here: the command line imports this module for its constants alone.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(vocab_size), trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    if tokenizer.get_vocab_size() != vocab_size:
        # The corpus grows with the vocabulary, so this is a bug, not a user error.
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    bos_id = special_token_id(vocab_size, BOS_TOKEN)
    if tokenizer.token_to_id(BOS_TOKEN) != bos_id:
        raise RuntimeError("special tokens are not at the top of the vocabulary")
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A:0",
                pair=f"{BOS_TOKEN} $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def _write_json(path: Path, content: object) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(directory: Path, vocab_size: int, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=False)
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        directory / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN},
    )
