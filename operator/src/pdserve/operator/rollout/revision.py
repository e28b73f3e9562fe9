"""Revisions: the name of what a role's workers run.

A revision is named by a digest of everything that makes a worker behave differently
(its command line, image, environment, resources), never of how many run, so scaling
a role keeps its revision and any other change makes a new one."""

from __future__ import annotations

import hashlib
import json

from pdserve.operator.api import Role

DIGEST_CHARS = 10


def revision_name(role: Role, content: object) -> str:
    """`<role>-<digest>` of `content` (JSON-serialisable; key order does not matter):
    a DNS label, usable as a label value and in a Deployment's name."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return f"{role}-{hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]}"
