"""A one-machine job listens on loopback alone: on warm workers, the pool's rendezvous store and
the workers' gloo sockets; under torchrun (forked from the forkserver or not), its agent's two
stores too (launcher.loopback, launcher.agent). Read from /proc/net/tcp and tcp6 while the job trains."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jobs import tiny_spec, warm_pool
from parashift.launcher.forkserver import read_pointer
from parashift.launcher.forkservers import stop_all
from parashift.launcher.launch import launch_workers
from parashift.launcher.loopback import listener_on
from parashift.specs.plan import Plan

LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net writes them


def listening() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket on this machine."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].split(":")
                out[int(fields[9])] = (address, int(port, 16))
    return out


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def sockets_of(pids: set[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        except OSError:
            continue
    return inodes


def listeners_while(run: Callable[[], Any], forkservers: Path | None = None) -> tuple[Any, dict[int, tuple[str, int]]]:
    """`run()`'s result, and every listening socket this process and its descendants held
    meanwhile; with `forkservers`, the descendants of the forkservers in that folder too (a
    forked process is the server's child, not this one's)."""
    done = threading.Event()
    seen: dict[int, tuple[str, int]] = {}

    def servers() -> set[int]:
        pointers = forkservers.glob("*.json") if forkservers is not None else []
        return {named[1] for named in map(read_pointer, pointers) if named is not None}

    def watch() -> None:
        while not done.is_set():
            mine = sockets_of(set().union(*map(descendants, servers() | {os.getpid()})) | {os.getpid()})
            seen.update({inode: where for inode, where in listening().items() if inode in mine})
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        return run(), seen
    finally:
        done.set()
        watcher.join()


def test_a_warm_job_listens_on_loopback_alone(tmp_path: Path) -> None:
    pool = warm_pool()
    spec = tiny_spec("loopback", f"file://{tmp_path}/store", training={"steps": 60, "checkpoint_every": 30})
    result, seen = listeners_while(lambda: pool.run(spec, Plan.data_parallel(2)))
    assert result.returncode == 0, pool.output(0)[-3000:]
    store_port = pool._rendezvous_port()
    assert any(port == store_port for _, port in seen.values()), "the pool's store was seen listening"
    exposed = {where for where in seen.values() if where[0] not in LOOPBACK}
    assert not exposed, f"listening beyond loopback: {exposed}"


@pytest.mark.parametrize("forked", [False, True], ids=["torchrun", "forked-torchrun"])
def test_a_torchrun_job_listens_on_loopback_alone(tmp_path: Path, forked: bool, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """Forked: the agent and its workers are forked by a forkserver of the test's own (the
    session's serves other tests' processes too)."""
    forkservers = None
    if forked:
        forkservers = tmp_path_factory.mktemp("fs")  # short: a Unix socket's path is at most 107 bytes
        monkeypatch.setenv("PARASHIFT_FORKSERVER_DIR", str(forkservers))
    else:
        monkeypatch.setenv("PARASHIFT_FORK_WORKERS", "0")  # interpreters of their own
    spec = tiny_spec("torchrun", f"file://{tmp_path}/store", training={"steps": 30, "checkpoint_every": 30})
    try:
        result, seen = listeners_while(lambda: launch_workers(spec, Plan.data_parallel(2)), forkservers)
    finally:
        if forkservers is not None:
            stop_all(forkservers)
    assert result.returncode == 0
    assert len(seen) >= 2, f"the agent's stores were seen: {seen}"
    exposed = {where for where in seen.values() if where[0] not in LOOPBACK}
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_a_store_listens_on_the_address_it_is_given_or_says_why_not(capsys: pytest.CaptureFixture[str]) -> None:
    """Across nodes the first node's store is given that node's address (PARASHIFT_NODE_ADDR):
    it listens there alone; an address that is not this machine's leaves torch's default, said."""
    here = listener_on("127.0.0.1", 0)
    assert here is not None and here.getsockname()[0] == "127.0.0.1"
    assert listener_on("localhost", 0).getsockname()[0] == "127.0.0.1"  # type: ignore[union-attr]
    assert listener_on("192.0.2.1", 0) is None  # TEST-NET-1: never this machine's
    assert "cannot bind 192.0.2.1" in capsys.readouterr().err
