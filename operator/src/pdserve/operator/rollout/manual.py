"""Manual commands by annotation (pure): `pdserve.dev/rollout: promote|abort` on a
pool acts once per change of its value.

The operator records the value it acted on in `pdserve.dev/rollout-acted`, so a value
left in place is not applied again (nor to the next rollout). To give the same
command again, remove the annotation, let the operator see it gone (it then removes
its record), and set it again. A value set while no rollout is in progress is
recorded and does nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.operator.rollout.decision import Manual

ANNOTATION = "pdserve.dev/rollout"
ACTED_ANNOTATION = "pdserve.dev/rollout-acted"
COMMANDS: dict[str, Manual] = {"promote": "promote", "abort": "abort"}


@dataclass(frozen=True)
class Pending:
    """What the annotations ask for: the command to act on (None: none), and the
    record to write once it is acted on (`changed` False: the record stays)."""

    command: Manual | None
    record: str | None
    changed: bool
    invalid: str | None = None  # a value that is no command, to warn about once


def pending(annotations: Mapping[str, str], acted: str | None = None) -> Pending:
    """The command the pool's annotations hold that was not acted on yet; `acted` is
    the record as the operator last wrote it (the pool may not show it yet)."""
    value = annotations.get(ANNOTATION)
    record = acted if acted is not None else annotations.get(ACTED_ANNOTATION)
    if value == record:
        return Pending(None, record, changed=False)
    if value is None:
        return Pending(None, None, changed=True)  # removed: forget the record
    command = COMMANDS.get(value.strip().lower())
    invalid = None if command is not None else value
    return Pending(command, value, changed=True, invalid=invalid)
