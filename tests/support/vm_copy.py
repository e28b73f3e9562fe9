"""What two processes of one host can do at best: the sender's bytes copied into the
receiver's memory by one kernel copy, `process_vm_writev` (what UCX's cma transport
does), called through ctypes. The baseline the KV transfer benchmark measures NIXL
against, with the same descriptors."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence

IOV_MAX = 1024  # iovecs one call takes (Linux)


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = [
    ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
    ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong,
]  # fmt: skip


def write_into(pid: int, pieces: Sequence[tuple[int, int, int]]) -> int:
    """Copy (local address, remote address, length) pieces into process `pid`, up to
    IOV_MAX at a time; returns the bytes written (OSError on failure or a short copy)."""
    written = 0
    for start in range(0, len(pieces), IOV_MAX):
        batch = pieces[start : start + IOV_MAX]
        local = (_IOVec * len(batch))(*[_IOVec(src, length) for src, _, length in batch])
        remote = (_IOVec * len(batch))(*[_IOVec(dst, length) for _, dst, length in batch])
        done = _libc.process_vm_writev(pid, local, len(batch), remote, len(batch), 0)
        if done < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"process_vm_writev into {pid}: {os.strerror(error)}")
        if done != sum(length for *_, length in batch):
            raise OSError(f"process_vm_writev into {pid}: short copy of {done} bytes")
        written += done
    return written
