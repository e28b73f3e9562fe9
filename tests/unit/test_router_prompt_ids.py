"""The router's token ids added to the client's body: the rest of the body unchanged,
the router's ids the ones a parser keeps."""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from pdserve.protocol.headers import PROMPT_TOKEN_IDS_FIELD
from pdserve.workers.model.tokenizer import Tokenizer
from pdserve.workers.router.prompt_ids import with_prompt_ids


def test_the_ids_are_one_more_field_and_the_rest_is_the_clients() -> None:
    body = b'{"prompt": "hi", "echo": true}  \n'
    spliced = with_prompt_ids(body, [1, 2, 3])
    assert spliced is not None
    assert json.loads(spliced) == {"prompt": "hi", "echo": True, PROMPT_TOKEN_IDS_FIELD: [1, 2, 3]}
    assert json.loads(with_prompt_ids(b"{ }", [7]) or b"") == {PROMPT_TOKEN_IDS_FIELD: [7]}


def test_a_clients_field_of_that_name_is_overridden() -> None:
    body = json.dumps({"prompt": "hi", PROMPT_TOKEN_IDS_FIELD: [9, 9]}).encode()
    spliced = with_prompt_ids(body, [1])
    assert spliced is not None
    for parse in (json.loads, orjson.loads):
        assert parse(spliced)[PROMPT_TOKEN_IDS_FIELD] == [1]


def test_a_body_that_does_not_end_as_an_object_gets_no_ids() -> None:
    assert with_prompt_ids(b'["hi"]', [1]) is None
    assert with_prompt_ids(b"", [1]) is None


def test_the_fingerprint_names_what_decides_the_ids(small_model_dir: Path, tmp_path: Path) -> None:
    same = Tokenizer.from_dir(small_model_dir).fingerprint
    assert Tokenizer.from_dir(small_model_dir).fingerprint == same
    copy = tmp_path / "model"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (small_model_dir / name).is_file():
            (copy / name).write_bytes((small_model_dir / name).read_bytes())
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(copy).fingerprint != same
