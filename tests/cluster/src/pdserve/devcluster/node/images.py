"""Images in the node's containerd without a registry: the pause image made here from
the node's own `pause` binary, and images from the machine's podman storage (what
`make images` builds), imported once and kept with containerd's store."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from collections.abc import Sequence
from pathlib import Path


def _tar_member(archive: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    archive.addfile(info, io.BytesIO(data))


def pause_archive(binary: Path, reference: str, out: Path) -> Path:
    """A docker-archive of one layer holding `binary` as /pause, tagged `reference`."""
    layer_buffer = io.BytesIO()
    with tarfile.open(fileobj=layer_buffer, mode="w") as layer:
        _tar_member(layer, "pause", binary.read_bytes(), 0o755)
    layer_bytes = layer_buffer.getvalue()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {
            "type": "layers",
            "diff_ids": [f"sha256:{hashlib.sha256(layer_bytes).hexdigest()}"],
        },
    }
    manifest = [{"Config": "config.json", "RepoTags": [reference], "Layers": ["layer.tar"]}]
    with tarfile.open(out, mode="w") as archive:
        _tar_member(archive, "layer.tar", layer_bytes)
        _tar_member(archive, "config.json", json.dumps(config).encode())
        _tar_member(archive, "manifest.json", json.dumps(manifest).encode())
    return out


class ImageStore:
    """The node's containerd image store (namespace k8s.io), through `ctr`."""

    def __init__(self, ctr: Sequence[str], marks: Path) -> None:
        self._ctr = list(ctr)
        self._marks = marks  # what was imported from where: image reference -> source id
        marks.mkdir(parents=True, exist_ok=True)

    def names(self) -> set[str]:
        """The references containerd holds."""
        out = subprocess.run(
            [*self._ctr, "images", "ls", "-q"], capture_output=True, text=True, check=True
        )
        return set(out.stdout.split())

    def import_archive(self, archive: Path) -> None:
        """Import a docker or OCI archive (unpacked for the kubelet's snapshotter)."""
        subprocess.run(
            [*self._ctr, "images", "import", "--platform", "linux/amd64", str(archive)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip

    def load_from_podman(self, tools: Path, reference: str, scratch: Path) -> bool:
        """Import `reference` from the local image storage (`tools`: the folder of the
        project's podman, buildah and policy.json) unless this very image (by its id)
        is already there; True when it was imported now."""
        image_id = subprocess.run(
            [str(tools / "podman"), "image", "inspect", "--format", "{{.Id}}", reference],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        mark = self._marks / hashlib.sha256(reference.encode()).hexdigest()
        if reference in self.names() and mark.exists() and mark.read_text() == image_id:
            return False
        archive = scratch / "image.tar"
        try:
            # buildah, not `podman save`: it takes the signature policy of the tools.
            subprocess.run(
                [str(tools / "buildah"), "push", "--signature-policy", str(tools / "policy.json"),
                 reference, f"docker-archive:{archive}:{reference}"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            self.import_archive(archive)
        finally:
            archive.unlink(missing_ok=True)
        mark.write_text(image_id)
        return True
