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

from parashift.specs import environ


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


def starter_env() -> dict[str, str]:
    """What a process started here needs to end with this one even if this one dies first
    (`end_with_parent`)."""
    return {environ.LAUNCHER_PID: str(os.getpid())}


def end_with_parent(poll_s: float = 0.5) -> None:
    """End this process (SIGKILL) once the process that started it has died. A worker whose
    launcher (the flow's warm pool, torchrun) was killed must not train on unseen: it holds
    devices and memory a rerun of the job needs, for as long as its segment would have run.
    Why a thread polling the parent's pid, not prctl(PR_SET_PDEATHSIG): that signal follows
    the parent *thread* that started the child, and a flow starts its workers from a task's
    thread, which may end long before the flow does.
    A starter that names itself (`starter_env`) is checked against too: a process whose starter
    died before this ran (a flow killed while its pool spawned) was already the init process's
    child, and watched that forever (seen: three warm workers orphaned 45 minutes)."""
    parent = os.getppid()
    named = os.environ.pop(environ.LAUNCHER_PID, None)  # not passed on to what this process starts
    if named is not None and int(named) != parent:
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parashift-parent-watch", daemon=True).start()


# /proc states that say a process cannot be in its collective: what its peers wait for.
_STUCK_STATES = {"T": "was stopped (SIGSTOP, or a debugger)", "t": "was stopped by a debugger",
                 "D": "was in uninterruptible I/O (a disk, a network file system, a driver)",
                 "Z": "had exited", "X": "had exited"}


def _cpu_s(pid: int) -> float | None:
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else None


def hang_suspects(pids: dict[int, int], window_s: float = 0.5) -> dict[int, str]:
    """Of a hung job's ranks ({rank: pid}), those its peers are likely waiting for, and why:
    a process stopped, in uninterruptible I/O or gone, or (over `window_s`) the only ones
    keeping a core busy while the rest sleep in their collective (a loop; work that never
    reaches it). Empty where no rank stands out (a deadlock where every rank sleeps): the
    watchdog then names none rather than guess."""
    suspects: dict[int, str] = {}
    for rank, pid in pids.items():
        fields = _stat_fields(pid)
        if fields is None:
            suspects[rank] = "was gone"
        elif fields[0] in _STUCK_STATES:
            suspects[rank] = _STUCK_STATES[fields[0]]
    if suspects:
        return suspects
    before = {rank: _cpu_s(pid) for rank, pid in pids.items()}
    time.sleep(window_s)
    busy = {rank: (after - was) / window_s for rank, pid in pids.items()
            if (was := before[rank]) is not None and (after := _cpu_s(pid)) is not None}
    # busy: a fifth of a core at least (the machine may be loaded); asleep: a twentieth at most
    hot = {rank for rank, share in busy.items() if share >= 0.2}
    if hot and len(hot) < len(busy) and all(busy[rank] < 0.05 for rank in busy.keys() - hot):
        return {rank: f"kept {busy[rank]:.0%} of a core busy while its peers waited" for rank in sorted(hot)}
    return {}
