"""The model as the OpenAI API names it, on a worker and on the router.

vLLM's users name a model by its served name, or by the path it was loaded from
(vLLM's default served name is that path; load generators often send the model's
directory). Both are accepted here; `/v1/models` lists the served name, with the path
as its `root`, as vLLM does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pdserve.protocol.api_errors import APIError
from pdserve.protocol.response_models import ModelCard, ModelList


@dataclass(frozen=True)
class ServedModel:
    """The model a server answers for: its name, where it was loaded from, its context."""

    name: str
    role: str
    max_model_len: int | None
    path: str = ""

    def serves(self, requested: str) -> bool:
        """Whether a request naming `requested` is for this model."""
        if requested == self.name:
            return True
        if not self.path or not requested.strip():
            return False
        return _same_path(requested, self.path)

    def check(self, requested: str | None) -> None:
        """A 404 in OpenAI's shape unless `requested` (when given) names this model."""
        if requested is not None and not self.serves(requested):
            raise APIError(
                404, f"model {requested!r} is not served here; this server serves "
                f"{self.name!r}", "invalid_request_error", "model_not_found",
            )  # fmt: skip

    def card(self) -> ModelCard:
        """The model's entry in GET /v1/models."""
        return ModelCard(
            id=self.name,
            object="model",
            created=0,
            owned_by="pdserve",
            root=self.path or self.name,
            max_model_len=self.max_model_len,
        )

    def listing(self) -> dict[str, Any]:
        """The body of GET /v1/models."""
        return ModelList(object="list", data=[self.card()]).model_dump()


def _same_path(requested: str, path: str) -> bool:
    """The path as given, without trailing slashes, or the same absolute path."""
    if requested.rstrip("/") == path.rstrip("/"):
        return True
    return os.path.abspath(requested) == os.path.abspath(path)
