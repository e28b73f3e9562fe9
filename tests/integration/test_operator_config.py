"""`pdserve operator` without a usable cluster configuration exits at once with status 2
and says what to fix, instead of retrying its start-up forever."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.base.process import pdserve_command

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
# Far longer than a start needs: an operator that retries instead never ends.
EXIT_TIMEOUT = 120.0

NO_CONTEXT = {"apiVersion": "v1", "kind": "Config", "clusters": [], "users": []}


def run_operator(
    home: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`pdserve operator ARGS` with HOME=home, no $KUBECONFIG and not in a pod, plus `env`."""
    outside = ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
    environment = {k: v for k, v in os.environ.items() if k not in outside}
    environment.update(HOME=str(home), **(env or {}))
    command = pdserve_command("operator", "--metrics-port", "0", *args)
    return subprocess.run(
        command, env=environment, cwd=home, capture_output=True, text=True, timeout=EXIT_TIMEOUT
    )


def refused(result: subprocess.CompletedProcess[str], *phrases: str) -> None:
    """The operator exited with status 2, one clear line on stderr naming `phrases`."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("pdserve operator: "), line
    for phrase in phrases:
        assert phrase in line, line


def test_no_configuration_at_all_names_every_way_to_give_one(tmp_path: Path) -> None:
    refused(
        run_operator(tmp_path),
        "no cluster configuration found",
        "--kubeconfig",
        "$KUBECONFIG",
        "in a pod",
    )


def test_a_missing_kubeconfig_file(tmp_path: Path) -> None:
    refused(run_operator(tmp_path, "--kubeconfig", "absent.yaml"), "absent.yaml: no such file")


def test_a_kubeconfig_that_is_not_yaml(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("clusters: [\n")
    refused(
        run_operator(tmp_path, "--kubeconfig", "broken.yaml"),
        "cannot use --kubeconfig broken.yaml",
        "fix it",
    )


def test_a_kubeconfig_from_the_environment_without_a_context(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text(yaml.safe_dump(NO_CONTEXT))
    refused(
        run_operator(tmp_path, env={"KUBECONFIG": str(tmp_path / "empty.yaml")}),
        "cannot use $KUBECONFIG=",
        "current-context",
    )


def test_a_broken_default_kubeconfig(tmp_path: Path) -> None:
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text("users: {\n")
    refused(run_operator(tmp_path), f"cannot use {tmp_path / '.kube' / 'config'}")


@pytest.mark.skipif(SERVICE_ACCOUNT_TOKEN.exists(), reason="runs inside a pod")
def test_a_pod_without_a_service_account_token(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    refused(run_operator(tmp_path, env=env), "cannot use the pod's service account")
