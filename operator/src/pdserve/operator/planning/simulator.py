"""The workers' simulator as a child process (`pdserve simulate`): one scenario per
line in, its figures as one JSON line out. A candidate pool is described to it as the
operator describes a pool to its processes: the routing table and each role's
`pdserve worker` arguments, rendered by `render`."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.base.process import pdserve_command
from pdserve.operator import api, render
from pdserve.operator.planning.candidates import Candidate

PORT = render.PORT
# Where the simulated workers run: a node each (pods of a ServingPool), or all on one
# machine like the profiled one, with the router and the clients (`pdserve local`).
PLACEMENTS = ("node-per-worker", "one-host")


class PlanError(RuntimeError):
    """The plan cannot go on; the message says why."""


def scenario_line(
    pool: str,
    candidate: Candidate,
    percentiles: Sequence[float],
    buckets: Sequence[int],
    placement: str = PLACEMENTS[0],
) -> str:
    """A candidate as `pdserve simulate` reads it: each worker named by a URL of its
    own, every role's arguments as the operator renders them for its pods, on the
    machines `placement` says."""
    spec = candidate.spec
    urls = {
        "decode": [f"http://decode-{i}.plan:{PORT}" for i in range(candidate.decode)],
        "prefill": [f"http://prefill-{i}.plan:{PORT}" for i in range(candidate.prefill)],
    }
    wiring = render.Wiring(
        host="0.0.0.0", port=PORT, credential_file="/pdserve/credential",
        prefill_peers=tuple(urls["prefill"]),
    )  # fmt: skip
    roles: tuple[api.Role, ...] = ("prefill", "decode") if spec.prefill else ("decode",)
    workers = {role: render.worker_args(pool, spec, role, wiring)[1:] for role in roles}
    discovery = {"kind": "static", **urls}
    table = render.routing_table(pool, "default", spec, discovery)
    scenario = {
        "name": candidate.name,
        "routing": json.loads(render.routing_json(table)),  # the bytes a pool is given
        "workers": workers,
        "percentiles": list(percentiles),
        "buckets": list(buckets),
        "placement": placement,
    }
    return json.dumps(scenario)


class Simulator:
    """A `pdserve simulate` process for the whole plan (the traffic is built once)."""

    def __init__(self, profile: Path, traffic_args: Sequence[str]) -> None:
        command = pdserve_command("simulate", "--profile", str(profile), *traffic_args)
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def run(self, line: str) -> dict[str, Any]:
        """The figures of one scenario; PlanError if the simulator refuses it or stops."""
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(line + "\n")
            process.stdin.flush()
        except BrokenPipeError:
            pass  # it stopped: the answer below says so
        answer = process.stdout.readline()
        if not answer:
            code = process.wait()
            raise PlanError(f"the simulator stopped (exit code {code}); see its message above")
        result: dict[str, Any] = json.loads(answer)
        if "error" in result:
            raise PlanError(f"the simulator refused a candidate: {result['error']}")
        return result

    def close(self) -> None:
        """End the simulator."""
        process = self._process
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def __enter__(self) -> Simulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
