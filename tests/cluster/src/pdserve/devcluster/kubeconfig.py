"""Kubeconfig files for the dev cluster's clients (the user and each component)."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

from pdserve.devcluster.certs import KeyPair

CONTEXT = "pdserve-devcluster"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode("ascii")


def write_kubeconfig(path: Path, server: str, ca_cert: Path, client: KeyPair, user: str) -> Path:
    """Write a kubeconfig for `server` with embedded CA and client certificate.

    The data is embedded (not referenced by path) so the file stays usable when
    copied, e.g. into a container or another shell's KUBECONFIG.
    """
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CONTEXT,
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_cert)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(client.cert),
                    "client-key-data": _b64(client.key),
                },
            }
        ],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user}}],
        "current-context": CONTEXT,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
