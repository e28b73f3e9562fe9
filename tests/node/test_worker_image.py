"""The workers' container image (prefill, decode and router in one): non-root, and its
router runs the compiled build of its hot modules, built in the image's build stage
from the very sources the image carries, with no compiler left in the image."""

from __future__ import annotations

import pytest

from support.images import built_image, inspect, run_in


@pytest.fixture(scope="module")
def image() -> str:
    return built_image("worker")


def test_the_router_in_the_image_runs_its_compiled_modules(image: str) -> None:
    build = run_in(
        image, "-c",
        "from pdserve import native; from pdserve.workers.compiled import build_in_use; "
        "print(len(native.built()), build_in_use())",
        entrypoint="python3",
    )  # fmt: skip
    modules, _, named = build.strip().partition(" ")
    assert int(modules) > 0
    assert named == f"compiled ({modules} modules)"
    # The compiler stayed in the build stage.
    assert (
        run_in(image, "-c", "import shutil; print(shutil.which('cc'))", entrypoint="python3")
        == "None\n"
    )
    assert inspect(image, "{{.Config.User}}") == "65532:65532"
