"""This machine's forkservers (`launcher.forkserver`): the one that serves an environment, found
or started.

A forkserver costs an interpreter importing torch and the trainer (3.3 s of CPU on the 2-core CI
machine). Each process that launched workers used to start one of its own and close it at exit:
every `parashift run`, every node's flow run, every benchmark's part. A server is now shared by
every launcher of the same user on the machine that asks for the same start-up environment (the
same interpreter, the same variables read at start-up), and lingers `LINGER_S` after its last
request, as a build tool's daemon does: a job's next flow run, or the next `parashift run`,
forks its workers from it at once.

One folder holds them (`folder()`, this user's alone): for each environment a pointer file
`<key>.json` naming the server (its pid and socket), a lock file under which the pointer is read
and written, and the servers' own log. A server whose preloaded code changed on disk since it
started (a checkout edited, a package upgraded) is stale: the next launcher stops it and starts
another, so a worker never runs yesterday's code.

    server = find_or_start(worker_env("cpu"))
    env = {**worker_env("cpu"), **server.env()}   # torchrun ... -m parashift.launcher.forked <module> <args>
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parashift.launcher.forkserver import (
    LINGER_S,
    MAX_MESSAGE,
    PID_ENV,
    SOCKET_ENV,
    read_pointer,
    registry_paths,
    startup_environment,
    write_pointer,
)
from parashift.launcher.processes import kill_tree, running
from parashift.specs import environ

FOLDER_ENV = environ.FORKSERVER_DIR
# The longest path a Unix socket may have on Linux (sun_path's 108 bytes, its terminating NUL).
MAX_SOCKET_PATH = 107
# How long a launcher waits for a server's answer to a question (it answers between forks).
ASK_TIMEOUT_S = 10.0


def folder() -> Path:
    """Where this user's forkservers listen: PARASHIFT_FORKSERVER_DIR, else a folder in
    $XDG_RUNTIME_DIR or the temporary directory. It must be this user's alone: a server runs
    whatever module a client that can reach its socket asks for."""
    configured = os.environ.get(FOLDER_ENV)
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    path = Path(configured) if configured else base / f"parashift-forkservers-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    stat = path.stat()
    if stat.st_uid != os.getuid() or stat.st_mode & 0o077:
        raise PermissionError(f"{path}: a forkserver folder must be this user's alone (mode 700), "
                              f"not {oct(stat.st_mode & 0o777)} of uid {stat.st_uid}")
    return path


def environment_key(env: dict[str, str]) -> str:
    """What a server serves: this interpreter and the start-up part of `env`."""
    text = json.dumps([sys.executable, startup_environment(env)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Forkserver:
    """A running forkserver: where it listens and its pid."""

    path: str
    pid: int

    def env(self) -> dict[str, str]:
        """What a client needs to find this server."""
        return {SOCKET_ENV: self.path, PID_ENV: str(self.pid)}

    def running(self) -> bool:
        """Whether its process runs (serving, importing, or finishing its workers after a stop)."""
        return _is_server(self.pid, self.path)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask it to take no more requests (once it listens, if it is still importing; at most
        `timeout_s`): it exits once the workers it forked have, and they run on to their end.
        Its pointer goes, under the lock, so that no launcher takes a stopped server for one
        still importing: the next one for its environment starts another."""
        pointer, lock = registry_paths(self.path)
        with _locked(lock):
            deadline = time.monotonic() + timeout_s
            while _is_server(self.pid, self.path) and time.monotonic() < deadline:
                if ask(self.path, {"stop": True}) is not None:
                    break
                time.sleep(0.02)
            if _read(pointer) == self:
                pointer.unlink()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop it and wait for it to exit: SIGKILL to it and every worker below it after
        `timeout_s` (only for a server none but the caller uses: a test's own)."""
        self.stop(timeout_s)
        deadline = time.monotonic() + timeout_s
        while _is_server(self.pid, self.path) or _exiting(self.pid):
            if time.monotonic() > deadline:
                if _is_server(self.pid, self.path):  # an exiting pid is ended already
                    kill_tree(self.pid)
                break
            time.sleep(0.02)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def ask(path: str, question: dict[str, Any]) -> dict[str, Any] | None:
    """A server's answer to `question` (None: it is not listening, or did not answer)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(ASK_TIMEOUT_S)
        try:
            sock.connect(path)
            sock.send(json.dumps(question).encode())
            return json.loads(sock.recv(MAX_MESSAGE) or b"null")
        except (OSError, ValueError):
            return None


def find_or_start(env: dict[str, str], where: Path | None = None, linger_s: float = LINGER_S) -> Forkserver:
    """The forkserver for `env`'s start-up environment in `where` (default `folder()`): the
    one running there if its code is current, else one started now (idle for `linger_s`, it
    exits). Starting costs nothing here: the server imports in the background and its first
    clients wait for it."""
    where = where or folder()
    path = str(where / f"{environment_key(env)}-{secrets.token_hex(3)}")  # if one is started
    if len(os.fsencode(path)) + 1 > MAX_SOCKET_PATH:  # + 1: the server binds `path~` first
        raise ValueError(f"{where}: a forkserver folder's path must be under {MAX_SOCKET_PATH - 25} bytes "
                         f"(a Unix socket's is at most {MAX_SOCKET_PATH}); set {FOLDER_ENV} to a shorter one")
    pointer, lock = registry_paths(path)
    with _locked(lock):
        server = _read(pointer)
        if server is not None and _is_server(server.pid, server.path):
            if not os.path.exists(server.path):
                return server  # still importing: started moments ago, with today's code
            reply = ask(server.path, {"ping": True, "files": True})
            if reply is not None and reply.get("pid") == server.pid and not stale(reply.get("files", {})):
                return server
            ask(server.path, {"stop": True})  # stale (or wedged): its running workers go on until they end
        server = _start(env, path, linger_s)
        write_pointer(pointer, server.path, server.pid)
        return server


def stop_all(where: Path) -> None:
    """Close every server in `where` (a test session's own folder, at its end)."""
    for pointer in where.glob("*.json"):
        server = _read(pointer)
        if server is not None:
            server.close()
        pointer.unlink(missing_ok=True)


def stale(files: dict[str, list[int]]) -> bool:
    """Whether any file a server imported before serving changed since (`forkserver.loaded_files`)."""
    for path, (mtime_ns, size) in files.items():
        try:
            stat = os.stat(path)
        except OSError:
            return True
        if (stat.st_mtime_ns, stat.st_size) != (mtime_ns, size):
            return True
    return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _read(pointer: Path) -> Forkserver | None:
    named = read_pointer(pointer)
    return Forkserver(path=named[0], pid=named[1]) if named is not None else None


def _exiting(pid: int) -> bool:
    """Whether `pid` is tearing itself down: not yet a zombie, its command line already gone
    (a server's pid until it has exited: `close` returned there, and a client that looked a
    moment later still found the server running)."""
    try:
        return running(pid) and Path(f"/proc/{pid}/cmdline").read_bytes() == b""
    except OSError:
        return False


def _is_server(pid: int, path: str) -> bool:
    """Whether `pid` is the forkserver listening at `path` (not a process that took its pid)."""
    try:
        return running(pid) and path.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _start(env: dict[str, str], path: str, linger_s: float) -> Forkserver:
    """A server started in the background, detached from this process: it outlives it. Its
    output goes to `<key>.log` beside its socket."""
    log_path = registry_paths(path)[0].with_suffix(".log")
    with open(log_path, "ab") as log:
        starter = subprocess.Popen([sys.executable, "-m", "parashift.launcher.forkserver", path, str(linger_s)],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env,
                                   start_new_session=True)
    assert starter.stdout is not None
    pid = int(starter.stdout.readline() or 0)
    starter.wait()
    if not pid:
        raise RuntimeError(f"the forkserver did not start (its log: {log_path})")
    return Forkserver(path=path, pid=pid)
