"""`pdserve local -f pool.yaml` as a user runs it: it serves the manifest's model at the
router's URL, and Ctrl-C stops every process it started; a bad manifest is refused
with the field named."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import openai
import yaml

from pdserve.cli.main import pdserve_command
from pdserve.operator import api
from support.router import pool_manifest
from support.waiting import wait_until


def processes_mentioning(text: str) -> list[int]:
    """The ids of running processes whose command line holds `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in command and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def test_pdserve_local_serves_the_manifest_and_ctrl_c_stops_it_all(
    small_model_dir: Path, tmp_path: Path
) -> None:
    pool = pool_manifest(
        "by-hand", small_model_dir, prefill=None, routing={"buckets": [{"mode": "colocated"}]}
    )
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(yaml.safe_dump(api.dump(pool)))
    run_dir, port_file = tmp_path / "run", tmp_path / "router.port"
    command = pdserve_command(
        "local", "-f", str(manifest), "--port", "0", "--port-file", str(port_file),
        "--run-dir", str(run_dir),
    )  # fmt: skip
    with (tmp_path / "local.log").open("wb") as log:
        local = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(port_file.exists, 300, "the pool to serve")
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="small", prompt=[5, 6, 7], max_tokens=3)
        assert answer.usage is not None and answer.usage.completion_tokens == 3
        started = processes_mentioning(str(run_dir))
        assert len(started) == 2  # the decode worker and the router
        os.kill(local.pid, signal.SIGINT)
        assert local.wait(60) == 0
    finally:
        if local.poll() is None:
            local.kill()
    time.sleep(0.5)
    assert processes_mentioning(str(run_dir)) == []
    output = (tmp_path / "local.log").read_text()
    assert f"serving model small at {url}" in output and "stopped" in output


def test_pdserve_local_refuses_a_bad_manifest_naming_the_field(tmp_path: Path) -> None:
    manifest = tmp_path / "pool.yaml"
    bad = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "x"},
           "spec": {"model": {"name": "m", "path": "/m"}, "image": "i",
                    "decode": {"replicas": -1}}}  # fmt: skip
    manifest.write_text(yaml.safe_dump(bad))
    refused = subprocess.run(
        pdserve_command("local", "-f", str(manifest)), capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2
    assert "spec.decode.replicas" in refused.stderr
