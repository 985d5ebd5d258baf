"""Process trees from /proc (Linux): who started whom, so that what a launcher started can be
ended with everything it started in turn, and nothing else. Stdlib only: the forkserver and its
clients use it as well as the launcher."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: state, parent, ... (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int | None:
    """`pid`'s parent (None: no such process)."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def running(pid: int) -> bool:
    """Whether `pid` exists and has not exited (a zombie waiting to be reaped has)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), from /proc parent links."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (parent := parent_of(int(proc.name))) is not None:
            children.setdefault(parent, []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process this process started and everything below it (torchrun puts each
    worker in a session of its own, so its process group does not reach them)."""
    for victim in [*reversed(descendants(pid)), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def end_with_parent(poll_s: float = 0.5) -> None:
    """End this process (SIGKILL) once the process that started it has died. A worker whose
    launcher (the flow's warm pool, torchrun) was killed must not train on unseen: it holds
    devices and memory a rerun of the job needs, for as long as its segment would have run.
    Why a thread polling the parent's pid, not prctl(PR_SET_PDEATHSIG): that signal follows
    the parent *thread* that started the child, and a flow starts its workers from a task's
    thread, which may end long before the flow does."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parashift-parent-watch", daemon=True).start()
