"""The operator's name for itself, as kopf records it (its identity).

kopf would make one from the user name in the password database, which a container
running as a numeric user without an entry there (the image's 65532, or whatever
runAsUser says) does not have: the operator would fail at start. In a pod the name
comes from the downward API (POD_NAME); elsewhere from the host and process.
"""

from __future__ import annotations

import os
import socket
from typing import NewType

# kopf's own type (a NewType of str, not exported by kopf).
Identity = NewType("Identity", str)


def own_identity() -> Identity:
    """The pod's name where the chart sets POD_NAME, else host/pid."""
    pod = os.environ.get("POD_NAME")
    if pod:
        return Identity(pod)
    return Identity(f"pdserve-operator@{socket.gethostname()}/{os.getpid()}")
