"""Reading a live peer's held bytes straight from its memory when it runs on this machine: one
kernel copy (`process_vm_readv`, the "cross memory attach" MPI libraries use for large messages
between ranks of a node) instead of gloo's way over loopback TCP (a copy into the socket, one out
of it, and both ranks' CPU time). On the development machine one such read of 293 MB took
0.04 s into memory already touched; `bench.trace`'s scale-up restore went from 0.28 s to 0.19 s
(BENCHMARKS.md).

Only where it can work: same kernel (boot id) and same PID namespace (the holder's pid means the
same process), and the kernel allows it (same user; where Yama limits ptrace to ancestors, the
holder opens it with `allow_peers` while its state is read). Anything else (a seccomp profile
that refuses the call, a holder that died, a short read) is a False, and the caller moves those
bytes over the process group instead. The bytes read are checked against the checkpoint's
checksums like any other read.

Why not torch's shared-memory tensors: the held state is the training state itself, in ordinary
memory; moving it to shared memory would copy it at every stop.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.process_vm_readv  # noqa: B018 - Linux only
    except (OSError, AttributeError):
        return None
    return libc


@cache
def machine_key() -> str | None:
    """Equal for two processes exactly when one's pid names the other (same kernel, same PID
    namespace); None where that cannot be told (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def allow_peers(allowed: bool = True) -> None:
    """Let other processes of this user read this one's memory where Yama restricts that to
    ancestors (a no-op elsewhere), or (`allowed` False) take that back. A holder allows it only
    while the next segment's ranks read its state (`LivePeers.gather` to the exchange's end):
    any process of the same user could attach to it meanwhile."""
    libc = _libc()
    if libc is not None:
        libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY if allowed else 0, 0, 0, 0)


def read_from(pid: int, address: int, into: torch.Tensor) -> bool:
    """Copy `into.numel()` bytes at `address` of process `pid` into the contiguous uint8 tensor
    `into`; whether all of them arrived."""
    libc = _libc()
    if libc is None or not into.is_contiguous() or into.device.type != "cpu":
        return False
    done, total = 0, into.numel()
    base = into.data_ptr()
    while done < total:
        local = _IoVec(base + done, total - done)
        remote = _IoVec(address + done, total - done)
        got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            return False
        done += got
    return True
