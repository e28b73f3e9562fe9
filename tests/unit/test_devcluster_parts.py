"""The dev cluster's parts that need no Kubernetes binaries: TLS material, kwok
stages, node readiness and process clean-up."""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from pdserve.devcluster.certs import make_pki
from pdserve.devcluster.kwok_stages import write_stages
from pdserve.devcluster.nodes import gpu_node, node_schedulable
from pdserve.devcluster.processes import ManagedProcess


def test_client_certificate_authenticates_to_the_serving_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path, {"admin": "kubernetes-admin"})
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(pki.serving.cert, pki.serving.key)
    server_ctx.load_verify_locations(pki.ca.cert)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
    client_ctx.load_cert_chain(pki.clients["admin"].cert, pki.clients["admin"].key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: list[object] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            seen.append(tls.getpeercert())

    thread = threading.Thread(target=serve)
    thread.start()
    # The name the kubeconfig uses (127.0.0.1) must match the certificate.
    with (
        socket.create_connection(("127.0.0.1", port)) as raw,
        client_ctx.wrap_socket(raw, server_hostname="127.0.0.1"),
    ):
        pass
    thread.join(5)
    listener.close()
    subject = dict(pair[0] for pair in seen[0]["subject"])  # type: ignore[index]
    assert subject == {"commonName": "kubernetes-admin", "organizationName": "system:masters"}


def test_serving_certificate_names_the_in_cluster_service(tmp_path: Path) -> None:
    pki = make_pki(tmp_path, {})
    cert = x509.load_pem_x509_certificate(pki.serving.cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kubernetes.default.svc" in names.get_values_for_type(x509.DNSName)
    assert oct(pki.ca.key.stat().st_mode & 0o777) == "0o600"


def test_kwok_stages_cover_node_and_pod_life(tmp_path: Path) -> None:
    documents = list(yaml.safe_load_all(write_stages(tmp_path / "stages.yaml").read_text()))
    assert all(d["kind"] == "Stage" for d in documents)
    names = {d["metadata"]["name"] for d in documents}
    assert names == {
        "node-initialize",
        "node-heartbeat",
        "pod-ready",
        "pod-complete",
        "pod-delete",
    }


def test_new_node_is_schedulable_only_when_ready_and_untainted() -> None:
    node = gpu_node("n1", gpus=8)
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert not node_schedulable(node)
    node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    node["spec"] = {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}
    assert not node_schedulable(node)
    node["spec"] = {}
    assert node_schedulable(node)


def _dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie is dead; only its parent's reaping is left


def _wait_dead(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _dead(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_children_die_when_the_owner_is_killed(tmp_path: Path) -> None:
    owner_code = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from pdserve.devcluster.processes import ManagedProcess
        child = ManagedProcess("sleeper", ["sleep", "300"], Path(sys.argv[1]))
        child.start()
        print(child.pid, flush=True)
        time.sleep(300)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_code, str(tmp_path / "log")], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    child_pid = int(owner.stdout.readline())
    assert not _dead(child_pid)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert _wait_dead(child_pid)


def test_stop_kills_a_process_group_that_ignores_sigterm(tmp_path: Path) -> None:
    stubborn = ManagedProcess(
        "stubborn", ["sh", "-c", "trap '' TERM; sleep 300 & wait"], tmp_path / "log"
    )
    stubborn.start()
    time.sleep(0.2)
    began = time.monotonic()
    stubborn.stop(timeout=0.5)
    assert time.monotonic() - began < 5
    assert not stubborn.running()
