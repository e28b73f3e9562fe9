"""CPU time a process has used, from /proc (benchmarks' cost figures)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from support.background import Background


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU time of process `pid` so far (None where /proc is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float | None:
    """CPU time all of the machine's cores have spent busy since boot (not idle or
    waiting for I/O), from /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in first[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuSampler(Background):
    """Samples, every `interval_s` on a thread of its own, the CPU time of named
    processes and of the whole machine, one JSON line per sample (wall time, machine
    busy seconds, seconds per name) to `path`: what ran beside a worker's steps."""

    def __init__(self, pids: dict[str, int], path: Path, interval_s: float = 0.05) -> None:
        super().__init__("cpu-sampler")
        self.pids, self.path, self.interval_s = dict(pids), path, interval_s

    def run(self) -> None:
        with self.path.open("w") as out:
            while not self.stopping.wait(self.interval_s):
                sample = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
                line = {"t": time.time(), "machine": machine_busy_seconds(), **sample}
                out.write(json.dumps(line) + "\n")
