"""A Llama-2-style (SentencePiece) tokenizer directory, built from a corpus: metaspace
pieces, byte-fallback pieces `<0xNN>` as ordinary vocabulary entries, special tokens
written as AddedToken dicts, a named chat template and eos ids in
generation_config.json, as Llama-2 and Mistral checkpoints ship them. Written over a
generated checkpoint's own tokenizer, it makes a checkpoint whose tokenization is a
Llama's rather than byte-level BPE.

The config names no `tokenizer_class`: transformers then runs the pipeline
tokenizer.json describes, as pdserve does (its LlamaTokenizer class would rebuild the
pre-tokenizer its own way, without a word marker after special tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from pdserve.workers.model.checkpoint import TinyModelSpec, write_tiny_checkpoint
from pdserve.workers.model.tiny_tokenizer import generate_corpus

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
PIECES = 600  # learnt pieces, before the 256 byte-fallback ones
BOS, EOS = 1, 2


def write_llama_checkpoint(directory: Path, spec: TinyModelSpec) -> Path:
    """A generated checkpoint (`spec`'s vocabulary holds the tokenizer's) with the
    Llama-2-style tokenizer; `directory`."""
    write_tiny_checkpoint(directory, spec)
    write_llama_tokenizer(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(bos_token_id=BOS, eos_token_id=EOS)
    config_path.write_text(json.dumps(config, indent=2))
    return directory


def write_llama_tokenizer(directory: Path) -> Path:
    """Write the tokenizer files into `directory` (replacing any there); `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Sequence(
        [tokenizers.decoders.Metaspace(), tokenizers.decoders.ByteFallback()]
    )
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=PIECES, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    backend.train_from_iterator(generate_corpus(PIECES), trainer)
    # As Llama-2's tokenizer.json: the post-processor puts <s> before a prompt.
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    content = json.loads(backend.to_str())
    vocab = content["model"]["vocab"]
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    (directory / "tokenizer.json").write_text(json.dumps(content))
    config = {
        "bos_token": _added_token("<s>"),
        "eos_token": _added_token("</s>"),
        "unk_token": _added_token("<unk>"),
        "chat_template": [{"name": "default", "template": TEMPLATE}],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (directory / "special_tokens_map.json").unlink(missing_ok=True)
    return directory


def _added_token(content: str) -> dict[str, object]:
    return {
        "__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
        "rstrip": False, "single_word": False, "special": True,
    }  # fmt: skip
