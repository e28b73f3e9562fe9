"""Which weights a worker serves, as a short digest that two workers can compare.

KV computed by one set of weights is meaningless to another, even when every shape
agrees (two fine-tunes of one base model; old and new weights during a rolling
update). The digest covers config.json and, for each safetensors file, its name,
size and header (tensor names, dtypes, shapes, offsets) plus evenly spaced samples of
its data: cheap for a checkpoint of any size (a few hundred kilobytes read), and
different for weights that differ beyond a handful of values.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from pathlib import Path

from pdserve.workers.engine.config import ConfigError
from pdserve.workers.engine.model import safetensors_files

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 4096
DIGEST_CHARS = 16  # 64 bits: names a checkpoint among a pool's, not against an adversary
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def weights_digest(model_dir: Path) -> str:
    """The digest of the checkpoint in `model_dir` (hex). ConfigError when its files
    are not safetensors."""
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in safetensors_files(model_dir):
        _fingerprint(path, digest.update)
    return digest.hexdigest()[:DIGEST_CHARS]


def _fingerprint(path: Path, update: Callable[[bytes], object]) -> None:
    size = path.stat().st_size
    update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise ConfigError(f"{path} is not a safetensors file: too short")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(_MAX_HEADER_BYTES, size - 8):
            raise ConfigError(f"{path} is not a safetensors file: bad header length")
        update(file.read(header_bytes))
        start = 8 + header_bytes
        for offset in _sample_offsets(start, size):
            file.seek(offset)
            update(file.read(SAMPLE_BYTES))


def _sample_offsets(start: int, end: int) -> list[int]:
    """Where to read samples of the data section [start, end): all of it when small,
    else evenly spaced, the first at its start and the last at its end."""
    span = end - start - SAMPLE_BYTES
    if span <= 0:
        return [start]
    last = SAMPLES_PER_FILE - 1
    return [start + span * index // last for index in range(SAMPLES_PER_FILE)]
