"""`python -m parashift.launcher.forked <module> <args>`: run `python -m <module> <args>` as a
process forked by this node's forkserver (`launcher.forkserver`), standing in for it towards
whoever started this one (torchrun): its stdio are the worker's, signals sent here are passed
on, and this process ends as the worker ended (its exit code, or killed by the same signal).
Without a forkserver that can serve it, this process becomes the worker itself (exec).

Imports no torch: it starts in about 50 ms.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time

from parashift.launcher.forkserver import MAX_MESSAGE, PID_ENV, SOCKET_ENV, read_pointer, registry_paths
from parashift.launcher.processes import end_with_parent, running

# How long a client waits for its forkserver to finish its imports and listen (it started with
# the launch, beside torchrun): beyond this the worker starts as an interpreter of its own.
WAIT_FOR_SERVER_S = 120.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _exec(module: str, args: list[str], why: str | None) -> None:
    if why:
        print(f"parashift.launcher.forked: {why}; starting {module} as an interpreter of its own", file=sys.stderr)
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def _connect(path: str, server_pid: int) -> socket.socket | str:
    """A connection to the server, or why there is none."""
    deadline = time.monotonic() + WAIT_FOR_SERVER_S
    pointer, _ = registry_paths(path)
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
        if not running(server_pid):
            return f"forkserver {server_pid} is gone"
        named = read_pointer(pointer)  # a server is named from its start until it stops (before it listens, too)
        if named is None or named[0] != path:  # stopped after the launcher chose it (launcher.forkservers)
            return f"forkserver {server_pid} was stopped"
        if time.monotonic() > deadline:
            return f"forkserver {server_pid} did not listen within {WAIT_FOR_SERVER_S:.0f} s"
        time.sleep(0.01)


def _end_as(code: int) -> None:
    """Exit with `code`: a negative one by the same signal, as the worker was ended."""
    if code < 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)  # the signal is on its way
    os._exit(code & 0xFF)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m parashift.launcher.forked <module> [args...]")
    module, args = argv[0], argv[1:]
    # This process ends with its launcher, and its worker with it (the server kills the worker
    # of a closed connection). Watched from the start: a launcher that dies while this waits for
    # its forkserver hands it to the init process, whose death it would wait for instead.
    end_with_parent()
    path, server_pid = os.environ.get(SOCKET_ENV), os.environ.get(PID_ENV)
    if not path or not server_pid:
        _exec(module, args, None)
    connected = _connect(path, int(server_pid))  # type: ignore[arg-type]
    if isinstance(connected, str):
        _exec(module, args, connected)
    sock = connected
    assert isinstance(sock, socket.socket)
    # Signals are forwarded from before the request: one that arrives before the worker exists
    # waits for it, rather than ending this process by its default action.
    worker: list[int] = []
    early: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if not worker:
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(worker[0], signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    request = {"module": module, "argv": args, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    reply = json.loads(sock.recv(MAX_MESSAGE) or b'{"refused": "the forkserver closed the connection"}')
    if "refused" in reply:
        sock.close()
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        if early:  # asked to end before any worker existed
            _end_as(-early[0])
        _exec(module, args, f"the forkserver refused ({reply['refused']})")
    with contextlib.suppress(ProcessLookupError):  # else it has ended already: its status is on its way
        worker.append(os.pidfd_open(reply["pid"]))
    while early:
        forward(early.pop(0), None)
    ended = sock.recv(MAX_MESSAGE)
    if not ended:  # the server died with the worker still running: it must not run on unseen
        forward(signal.SIGKILL, None)
        print("parashift.launcher.forked: the forkserver ended before the worker", file=sys.stderr)
        _end_as(1)
    _end_as(int(json.loads(ended)["exit"]))


if __name__ == "__main__":
    main(sys.argv[1:])
