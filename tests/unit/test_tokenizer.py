"""The engine's tokenizer and streaming detokenizer, checked against transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from transformers import AutoTokenizer

from pdserve.workers.model.checkpoint import TinyModelSpec, write_tiny_checkpoint
from pdserve.workers.model.tokenizer import IncrementalDetokenizer, Tokenizer
from support.llama_tokenizer import write_llama_tokenizer

SPEC = TinyModelSpec(
    layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=1024, max_position=4096
)

ASCII_TEXT = "Hello world! The prefill worker streams 42 tokens, then stops."
MULTIBYTE_TEXT = "Café naïve 😀🚀 — 你好，世界! こんにちは 🤖👍🏽 Ωμέγα ∑ x² ✨"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  Say hi in 中文 😀  "},
    {"role": "assistant", "content": "你好"},
    {"role": "user", "content": "Again <b>please</b>."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tok") / "model"
    write_tiny_checkpoint(directory, SPEC)
    return directory


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _stream(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids or [])
    deltas = [detokenizer.add(token_id) for token_id in ids]
    return [*deltas, detokenizer.flush()]


def test_libraries_load_the_written_tokenizer(model_dir: Path, tokenizer: Tokenizer) -> None:
    backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(model_dir)
    assert backend.get_vocab_size() == tokenizer.vocab_size == len(reference) == SPEC.vocab
    for text in (ASCII_TEXT, MULTIBYTE_TEXT):
        assert tokenizer.encode(text) == reference(text).input_ids
        assert (
            tokenizer.encode(text, add_special_tokens=False)
            == reference(text, add_special_tokens=False).input_ids
        )


def test_special_tokens_are_inside_the_vocabulary(tokenizer: Tokenizer) -> None:
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
    names += ["<|end_header_id|>", "<|eot_id|>"]
    ids = [tokenizer.token_to_id(name) for name in names]
    assert all(i is not None and 0 <= i < SPEC.vocab for i in ids)
    assert tokenizer.bos_id == ids[0]
    assert tokenizer.eos_ids == {ids[1], ids[4]}
    assert tokenizer.encode("hi")[0] == tokenizer.bos_id


@pytest.mark.parametrize("text", [ASCII_TEXT, MULTIBYTE_TEXT])
def test_encode_decode_roundtrip(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text
    with_specials = tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False)
    assert with_specials == "<|begin_of_text|>" + text


def test_every_token_id_decodes(tokenizer: Tokenizer) -> None:
    for token_id in range(SPEC.vocab):
        assert isinstance(tokenizer.decode([token_id]), str)


def test_streamed_deltas_add_up_to_the_full_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == MULTIBYTE_TEXT
    # No delta shows a half character, and the split ones are held back, not lost.
    assert not any("\ufffd" in delta for delta in deltas)
    assert any(delta == "" for delta in deltas[:-1])


def test_streaming_after_a_prompt_emits_only_new_text(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Question: 你好?")
    ids = tokenizer.encode(" Answer: 世界 🚀", add_special_tokens=False)
    assert "".join(_stream(tokenizer, ids, prompt)) == " Answer: 世界 🚀"


def test_random_token_ids_stream_like_a_full_decode(tokenizer: Tokenizer) -> None:
    # What a load generator's random prompts and a random model's output look like:
    # byte tokens that never form whole characters must still come out at the end.
    ids = [(i * 7919) % SPEC.vocab for i in range(300)]
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_chat_template_matches_transformers(model_dir: Path, tokenizer: Tokenizer) -> None:
    reference = AutoTokenizer.from_pretrained(model_dir)
    for add_generation_prompt in (True, False):
        ours = tokenizer.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
        theirs = reference.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
    prompt = tokenizer.apply_chat_template(CHAT[:2])
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


# Features other models' templates use: loop controls, namespaces, tojson on
# non-ASCII text, whitespace control by trim_blocks and lstrip_blocks, raise_exception.
_CHATML_TEMPLATE = """{%- set ns = namespace(system='none') -%}
{% for m in messages %}
    {% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}
    {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
<|im_start|>{{ m['role'] }}
{{ m['content'] | tojson }}{% if loop.last %} (last){% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant [{{ ns.system }}]
{% endif %}"""


def test_other_chat_templates_render_as_in_transformers(model_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": _CHATML_TEMPLATE})
    )
    ours = Tokenizer.from_dir(tmp_path).apply_chat_template(CHAT)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    theirs = reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"Again <b>please</b>."' in ours and "[You are terse.]" in ours
    with pytest.raises(ValueError, match="bad role"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece-style model directory (Llama-2 and Mistral): metaspace pieces,
    special tokens written as AddedToken dicts, named chat templates, eos ids in
    generation_config.json."""
    return write_llama_tokenizer(tmp_path_factory.mktemp("sentencepiece"))


def test_sentencepiece_style_directory(sentencepiece_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(sentencepiece_dir)
    assert tokenizer.bos_id == 1 and tokenizer.eos_ids == {2, 7}
    text = "the model answers 你好 quickly"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # Decoding piece by piece would drop the spaces SentencePiece keeps in the pieces.
    assert "".join(_stream(tokenizer, ids)) == text
    assert (
        "".join(_stream(tokenizer, ids[3:], ids[:3]))
        == tokenizer.decode(ids)[len(tokenizer.decode(ids[:3])) :]
    )
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<s>[user] hi</s>[assistant] "


def test_token_bytes_add_up_to_the_text(tokenizer: Tokenizer, sentencepiece_dir: Path) -> None:
    # Byte-level BPE: tokens that split a character hold part of its bytes.
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(token) for token in ids]
    assert b"".join(pieces) == MULTIBYTE_TEXT.encode()
    assert any(piece.decode("utf-8", "replace") == "\ufffd" for piece in pieces)
    # SentencePiece: the word marker stands for a space, <0xNN> pieces for a byte.
    pieced = Tokenizer.from_dir(sentencepiece_dir)
    text = "the model answers 你好 quickly"
    ids = pieced.encode(text, add_special_tokens=False)
    assert b"".join(pieced.token_bytes(token) for token in ids).lstrip(b" ") == text.encode()
    assert pieced.token_bytes(pieced.token_to_id("<0xE4>") or 0) == b"\xe4"
    assert pieced.token_bytes(1) == b"<s>"  # a special token is its text


# Prompts a router and a worker tokenize: unicode, whitespace runs, special tokens
# written in the text, control characters, an empty prompt, a long one.
_CORPUS = [
    ASCII_TEXT,
    MULTIBYTE_TEXT,
    "",
    " ",
    "   leading and trailing   ",
    "tabs\tand\t\tnew\nlines\n\n\nand\r\nreturns",
    "runs of spaces:          end",
    "<|begin_of_text|>a prompt that writes its own special tokens<|eot_id|>",
    "<s>[user] hi</s>[assistant] ",
    "zero\u200bwidth, combining e\u0301, nbsp\u00a0here, rtl \u05e9\u05dc\u05d5\u05dd",
    "emoji sequences 👩‍👩‍👧‍👦 🏳️‍🌈 and flags 🇯🇵",
    "control \x00\x01\x7f characters",
    "numbers 3.14159 1,000,000 0x1F 1e-9 and punctuation !?…—«»",
    " ".join(f"word{i}" for i in range(2000)),
]


@pytest.mark.parametrize("fixture", ["tokenizer", "sentencepiece"])
def test_encode_gives_the_libraries_own_ids(
    fixture: str, tokenizer: Tokenizer, sentencepiece_dir: Path
) -> None:
    """The ids `encode` gives (by the library's fast path, without offsets) are the
    library's plain `encode`'s, on every prompt of the corpus and on chat prompts."""
    ours = tokenizer if fixture == "tokenizer" else Tokenizer.from_dir(sentencepiece_dir)
    backend = ours._backend
    chats = [ours.apply_chat_template(CHAT), ours.apply_chat_template(CHAT, False)]
    for text in [*_CORPUS, *chats]:
        for special in (True, False):
            expected = backend.encode(text, add_special_tokens=special).ids
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)


def test_encode_stays_on_the_calling_thread(model_dir: Path) -> None:
    """A prompt is tokenized where it is asked for: no thread pool is started (its
    hand-off would add a wait for another thread to every request)."""
    script = (
        "import os, sys\n"
        "from pdserve.workers.model.tokenizer import Tokenizer\n"
        "tokenizer = Tokenizer.from_dir(sys.argv[1])\n"
        "for n in range(20):\n"
        "    tokenizer.encode(f'a prompt of a few words {n}')\n"
        "print(len(os.listdir('/proc/self/task')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(model_dir)], env=env, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "1"
