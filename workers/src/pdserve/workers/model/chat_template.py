"""Rendering of Hugging Face chat templates (Jinja) without transformers.

The environment matches the one transformers renders templates in (sandboxed,
`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII text,
`raise_exception` and `strftime_now`), so a model's template gives the same prompt
here as there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template failed to render (bad messages, or the template raised)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat prompts must keep them as is.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
) -> str:
    """Render `template` for `messages`; special tokens are passed by name (bos_token...).

    Raises ChatTemplateError when the template cannot be rendered.
    """
    try:
        rendered: str = _compile(template).render(
            messages=[dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **special_tokens,
        )
    except TemplateError as error:
        raise ChatTemplateError(f"chat template failed: {error}") from error
    return rendered
