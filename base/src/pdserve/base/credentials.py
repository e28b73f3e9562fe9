"""The pool's internal credential as a file: what the router and the workers present
to each other. In Kubernetes it is a Secret the operator makes; a local pool (and a
test) makes one per run with `write_new_credential`."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_new_credential(path: Path) -> str:
    """Make a random credential and write it to `path`, readable by its owner only."""
    credential = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(credential + "\n")
    return credential
