"""pdserve's container images for tests: built (or found in the cache) by
scripts/build-images.sh, run with the project's podman."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from support.tools import ROOT, container_tools

# The VM lacks CAP_SYS_RESOURCE: runc may not raise limits above the current ones.
ULIMITS = ("--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096")


def podman() -> Path:
    """The project's podman, or a skip where it cannot run (root is needed)."""
    if os.geteuid() != 0:
        pytest.skip("buildah and podman run as root here (root's image storage)")
    try:
        return container_tools() / "podman"
    except RuntimeError as error:
        pytest.skip(f"buildah and podman are not available: {error}")


def built_image(name: str) -> str:
    """The reference of image `name` (operator, worker), built if not cached."""
    tools = podman().parent
    result = subprocess.run(
        [str(ROOT / "scripts" / "build-images.sh"), name],
        capture_output=True, text=True, check=False,
        env={**os.environ, "PDSERVE_CONTAINER_TOOLS": str(tools)},
    )  # fmt: skip
    assert result.returncode == 0, f"building the {name} image failed:\n{result.stderr[-4000:]}"
    return result.stdout.strip().splitlines()[-1]


def run_in(image: str, *command: str, entrypoint: str | None = None) -> str:
    """Run a command in a fresh container of `image` (no network); its output."""
    options = ["--entrypoint", entrypoint] if entrypoint else []
    result = subprocess.run(
        [str(podman()), "run", "--rm", "--network", "none", *ULIMITS, *options, image, *command],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def inspect(image: str, template: str) -> str:
    """`podman image inspect --format TEMPLATE`."""
    result = subprocess.run(
        [str(podman()), "image", "inspect", "--format", template, image],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return result.stdout.strip()


def podman_run(image: str, name: str, mount: Path, options: Sequence[str] = ()) -> list[str]:
    """The command line that runs `image`'s entry point (append its arguments) on the
    host's network, as the image's user, with `mount` at the same path (given to that
    user) and the restrictions of the chart's securityContext."""
    return [
        str(podman()), "run", "--rm", "--name", name, "--network", "host", *ULIMITS,
        "--read-only", "--cap-drop", "all", "--security-opt", "no-new-privileges",
        "--volume", f"{mount}:{mount}:U", *options, image,
    ]  # fmt: skip


def remove_container(name: str) -> None:
    """Remove a container if it is still there."""
    subprocess.run([str(podman()), "rm", "--force", "--ignore", name], capture_output=True)
