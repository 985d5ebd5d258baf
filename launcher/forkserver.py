"""A forkserver for worker processes: one interpreter that has imported torch and the trainer
once, and forks a worker for each request, instead of each worker starting an interpreter
that imports them again (2.9 s of CPU a worker on the 2-core CI machine, against about 0.1 s
for a fork).

torchrun still launches every worker: its worker program is `parashift.launcher.forked`, a
small interpreter without torch that asks this server for the real worker, passes it its
stdin, stdout and stderr (SCM_RIGHTS), its environment, working directory and arguments, then
forwards signals to it and exits as it exits. So torchrun's rendezvous, its failure summary
and its signals work as with any worker, and `python -m <module>` is what the forked process
runs. A request the server cannot serve exactly (its environment differs in a variable read at
interpreter start-up, the server is gone) is answered by the client exec'ing the module
itself: never a worker in another interpreter's conditions.

Why not the standard library's forkserver (`multiprocessing`): it re-imports the parent's
`__main__` in each child, which breaks scripts without a main guard and imports Prefect again
in a flow run; and its children are `multiprocessing.Process` objects of one parent, where
torchrun needs a process of its own (exit status, signals) for each worker.

The server is single-threaded (a fork copies only the calling thread: no lock can be left
held) and its children are in sessions of their own. It runs detached, shared by every launcher
on the machine that asks for its start-up environment (`launcher.forkservers` finds or starts
it), until told to stop or idle for `LINGER_S`; it then exits once its children have. A client
whose connection closes takes its worker with it (SIGKILL to the worker and everything below
it): whatever ends the client (torchrun tearing its workers down, `kill -9`) ends the worker.

Besides a worker's request, a connection may ask `{"ping": true}` (its pid, and with
`"files": true` the files whose change makes it stale) or `{"stop": true}`.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import random
import runpy
import select
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parashift.launcher.processes import kill_tree
from parashift.specs import environ

SOCKET_ENV = environ.FORKSERVER
PID_ENV = environ.FORKSERVER_PID
# Set to 0 to start every worker as an interpreter of its own (the forkserver's fallback).
ENABLE_ENV = environ.FORK_WORKERS

# Variables read after start-up, per launch: they may differ between the server and a worker.
# Any other variable that differs makes the client exec the module instead (GLIBC_TUNABLES,
# OMP_NUM_THREADS, PYTHON*, LD_* and the like take effect only when an interpreter starts).
LATE_NAMES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                        "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        SOCKET_ENV, PID_ENV})
LATE_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "NCCL_", "GLOO_", environ.PREFIX, "AWS_", "PREFECT_", "PYTEST_")

MAX_MESSAGE = 1 << 20  # a request: the environment and arguments, as JSON
# How long a server serving nobody waits for its next request before it exits: long enough to
# outlive the gap between a job's flow runs or two `parashift run`s, short enough not to hold
# its memory (~350 MB) long after the last.
LINGER_S = 300.0


def startup_environment(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` an interpreter reads when it starts (or torch when it is imported)."""
    return {k: v for k, v in env.items() if k not in LATE_NAMES and not k.startswith(LATE_PREFIXES)}


def environment_differences(server: dict[str, str], request: dict[str, str]) -> list[str]:
    """The start-up variables on which a request's environment differs from the server's."""
    a, b = startup_environment(server), startup_environment(request)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def available() -> bool:
    """Whether workers may be forked here: Linux pidfds (kernel 5.3+) and not switched off."""
    return os.environ.get(ENABLE_ENV, "1") != "0" and hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


def registry_paths(socket_path: str) -> tuple[Path, Path]:
    """The pointer and lock files of the environment a server at `socket_path` serves: its
    socket is `<folder>/<key>-<token>`, the others `<folder>/<key>.json` and `.lock`
    (`launcher.forkservers` reads and writes them)."""
    where = Path(socket_path).parent
    key = Path(socket_path).name.split("-")[0]
    return where / f"{key}.json", where / f"{key}.lock"


def read_pointer(pointer: Path) -> tuple[str, int] | None:
    """The socket path and pid of the server a pointer file names (None: none, or unreadable)."""
    try:
        data = json.loads(pointer.read_text())
        return str(data["path"]), int(data["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_pointer(pointer: Path, path: str, pid: int) -> None:
    """Name the server at `path` in one step (readers never see half a file)."""
    staging = pointer.with_suffix(f".{os.getpid()}")
    staging.write_text(json.dumps({"path": path, "pid": pid}))
    staging.replace(pointer)


def loaded_files() -> dict[str, list[int]]:
    """The files whose change makes this server stale (mtime in ns, size): every parashift
    module it imported, and each top-level package's own (an upgrade rewrites them)."""
    files = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and (name.startswith("parashift") or "." not in name):
            with contextlib.suppress(OSError):
                stat = os.stat(path)
                files[path] = [stat.st_mtime_ns, stat.st_size]
    return files


# --- the server -----------------------------------------------------------------------------


@dataclass
class _Child:
    pid: int
    client: socket.socket
    pidfd: int
    client_gone: bool = False


def import_what_jobs_use() -> None:
    """The imports a warm worker exists to have done: the trainer's, and those a job would
    otherwise make on its first run in this process. torch.nn.init's first call imports
    torch._dynamo (through torch._refs' wrappers), the model is built from its family's module,
    storage opens local files through fsspec: ~1 s on this 2-core machine, paid by each spare at
    the change that takes it in while the other ranks wait for it. The `hf` family is left out:
    its `transformers` import is for `hf` jobs only."""
    import fsspec.implementations.chained  # noqa: F401
    import fsspec.implementations.local  # noqa: F401
    import parashift.trainer.worker  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.tensor.debug  # noqa: F401 - `forget_meshes` at a job's clean-up: 0.035 s at a worker's first change
    import torch.utils.tensorboard  # noqa: F401 - rank 0's metrics writer (trainer.scalars), 0.17 s
    from parashift.models import FAMILIES, family

    # Newer torch imports it at the optimizer's first step (record_function); torch 2.11 has no such module.
    with contextlib.suppress(ModuleNotFoundError):
        import torch.profiler._cupti_monitor  # noqa: F401

    for name in FAMILIES:
        if name != "hf":
            family(name)


def _prepare() -> None:
    """What a worker would import first, then out of every collection: a collection in a child
    would otherwise touch, and so copy, every page the imports made."""
    import gc

    import torch.distributed.run  # noqa: F401 - torchrun's agent is forked from here too

    import_what_jobs_use()
    gc.collect()
    gc.freeze()


def cuda_loaded(pid: int) -> bool:
    """Whether process `pid` has NVIDIA's driver library mapped: it loads when CUDA initialises
    (importing torch does not load it), and a process forked after that cannot use CUDA."""
    try:
        return "/libcuda.so" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _listen(path: str) -> socket.socket:
    """Listen at `path`, which appears only once the server accepts (clients wait for it)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    staging = f"{path}~"  # the token makes `path` this server's alone
    listener.bind(staging)
    listener.listen(128)
    os.rename(staging, path)
    return listener


def serve(path: str, linger_s: float = LINGER_S) -> None:
    """Serve at `path` until stopped, or idle for `linger_s`, then exit once every worker forked
    here has."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the workers' stop, not for this
    started_with = dict(os.environ)
    _prepare()
    if cuda_loaded(os.getpid()):  # never listening: each client starts its worker as an interpreter of its own
        print("parashift.launcher.forkserver: its imports initialised CUDA, which breaks a forked worker's; "
              "not serving", file=sys.stderr, flush=True)
        return
    # What the imports put in the environment (torch sets TORCHINDUCTOR_CACHE_DIR), as they would
    # have in the worker's own interpreter.
    imports_set = {k: v for k, v in os.environ.items() if started_with.get(k) != v}
    _Server(path, linger_s, started_with, imports_set).run()


class _Server:
    """The server's loop: requests in, forked workers out, their ends back to their clients."""

    def __init__(self, path: str, linger_s: float, started_with: dict[str, str], imports_set: dict[str, str]) -> None:
        self.path, self.linger_s = path, linger_s
        self.started_with, self.imports_set = started_with, imports_set
        self.files = loaded_files()  # before listening: what a launcher checks it against
        self.listener = _listen(path)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.children: dict[int, _Child] = {}
        self.requests: list[socket.socket] = []
        self.accepting = True
        self.last_request = time.monotonic()

    def run(self) -> None:
        while self.accepting or self.children:
            idle = self.accepting and not self.children and not self.requests
            timeout = max(0.0, self.last_request + self.linger_s - time.monotonic()) if idle else None
            events = self.selector.select(timeout)
            if idle and not events and not self._retire():
                self.last_request = time.monotonic() - self.linger_s + 1.0  # try again in a second
            for key, _ in events:
                self._handle(key.data)
        self.selector.close()

    def _handle(self, what: Any) -> None:
        if what == "accept":
            if self.accepting:  # else a stop came first in this round: the listener is closed
                client, _ = self.listener.accept()
                self.requests.append(client)
                self.selector.register(client, selectors.EVENT_READ, ("request", client))
                self.last_request = time.monotonic()
        elif what[0] == "request":
            client = what[1]
            self.selector.unregister(client)
            self.requests.remove(client)
            self._request(client)
        elif what[0] == "client":  # a client sends nothing after its request: this is its end
            child = self.children.get(what[1])
            if child is not None and not child.client_gone:  # else its worker's exit came first in this round
                self.selector.unregister(child.client)
                child.client_gone = True
                _end(child.pid)
        elif what[0] == "exit":
            child = self.children.pop(what[1])
            self.selector.unregister(child.pidfd)
            _, status = os.waitpid(child.pid, 0)
            os.close(child.pidfd)
            if not child.client_gone:
                self.selector.unregister(child.client)
                with contextlib.suppress(OSError):
                    child.client.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            child.client.close()

    def _request(self, client: socket.socket) -> None:
        """A worker to fork, or a launcher's question: is it alive (and on which code), or stop."""
        try:
            message, fds, _, _ = socket.recv_fds(client, MAX_MESSAGE, 3)
            request = json.loads(message)
        except (OSError, ValueError):
            client.close()
            return
        if "ping" in request or "stop" in request:
            for fd in fds:
                os.close(fd)
            reply: dict[str, Any] = {"pid": os.getpid()}
            if request.get("files"):
                reply["files"] = self.files
            with contextlib.suppress(OSError):
                client.send(json.dumps(reply).encode())
            client.close()
            if "stop" in request:
                self._stop_accepting()
            return
        child = self._fork(request, fds, client)
        if child is not None:
            self.children[child.pid] = child
            self.selector.register(child.pidfd, selectors.EVENT_READ, ("exit", child.pid))
            self.selector.register(client, selectors.EVENT_READ, ("client", child.pid))

    def _fork(self, request: dict[str, Any], fds: list[int], client: socket.socket) -> _Child | None:
        """Fork the requested worker (its _Child), or tell the client why not (None)."""
        try:
            if len(fds) != 3:
                raise ValueError(f"{len(fds)} file descriptors instead of stdin, stdout and stderr")
            # A variable the imports set is the same whether the request carries it or not (a forked
            # torchrun's workers inherit it from their agent); another value of it is a difference.
            differences = environment_differences({**self.started_with, **self.imports_set},
                                                  {**self.imports_set, **request["env"]})
            if differences:
                client.send(json.dumps({"refused": f"start-up environment differs: {', '.join(differences)}"}).encode())
                client.close()
                return None
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                inherited = [self.listener, *self.requests, *(c.client for c in self.children.values())]
                request["env"] = {**self.imports_set, **request["env"]}
                _run_child(request, fds, client, inherited, [c.pidfd for c in self.children.values()], self.selector)
            client.send(json.dumps({"pid": pid}).encode())
            return _Child(pid=pid, client=client, pidfd=os.pidfd_open(pid))
        except (OSError, ValueError, KeyError) as error:
            with contextlib.suppress(OSError):
                client.send(json.dumps({"refused": f"{type(error).__name__}: {error}"}).encode())
            client.close()
            return None
        finally:
            for fd in fds:
                os.close(fd)

    def _retire(self) -> bool:
        """Stop accepting after `linger_s` without a request, unless a launcher holds this
        environment's lock (it may be asking this server a question: never waited for) or a
        connection waits. Its pointer goes with it, where it still names this server."""
        pointer, lock = registry_paths(self.path)
        with open(lock, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            if select.select([self.listener], [], [], 0)[0]:
                return False
            named = read_pointer(pointer)
            if named is not None and named[0] == self.path:
                pointer.unlink(missing_ok=True)
            self._stop_accepting()
            return True

    def _stop_accepting(self) -> None:
        if self.accepting:
            self.accepting = False
            self.selector.unregister(self.listener)
            self.listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _end(pid: int) -> None:
    """SIGKILL a forked process and everything it started: its session's group, and processes
    in sessions of their own (a forked torchrun's worker clients, whose end ends their workers)."""
    kill_tree(pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _run_child(request: dict[str, Any], fds: list[int], client: socket.socket, sockets: list[socket.socket],
               pidfds: list[int], selector: selectors.BaseSelector) -> None:
    """In the forked process: become the worker `python -m <module> <args>` would have been,
    then exit with its status. Never returns."""
    code = 1
    try:
        os.setsid()
        selector.close()  # closes this copy of the epoll descriptor; the server's registrations stay
        for sock in [client, *sockets]:
            os.close(sock.detach())
        for fd in pidfds:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        random.seed()  # each process its own stream, as a fresh interpreter has
        atexit._clear()  # the server's exit functions are not this worker's
        sys.argv = [request["module"], *request["argv"]]
        code = _run_module(request["module"])
    except BaseException:  # noqa: BLE001 - whatever happens here, this process must not return to the server's loop
        with contextlib.suppress(BaseException):
            _print_exception()
    finally:
        os._exit(code)


def _print_exception() -> None:
    """The exception being handled, as the interpreter prints an uncaught one, in one write:
    ranks that fail at the same moment share a pipe, and a traceback written line by line
    interleaves with theirs (the run log gathers each traceback into one record)."""
    text = traceback.format_exc().encode(errors="replace")
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    while text:
        text = text[os.write(2, text):]


def _run_module(module: str) -> int:
    """`python -m module` in this process: its exit status, after the interpreter's own
    shutdown steps (non-daemon threads joined, exit functions run, streams flushed)."""
    import threading

    code = 0
    # As in a fresh interpreter, the module runs as __main__ only (the server imported it to have
    # its imports done): no second copy under its own name, no warning from runpy about one.
    sys.modules.pop(module, None)
    package, _, name = module.rpartition(".")
    if package in sys.modules and hasattr(sys.modules[package], name):
        delattr(sys.modules[package], name)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        _print_exception()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        _print_exception()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:  # as an uncaught KeyboardInterrupt ends an interpreter: by the signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code & 0xFF


def main(argv: list[str]) -> None:
    """`python -m parashift.launcher.forkserver SOCKET [LINGER_S]`: print the server's pid and
    return at once, the server running on detached (a session of its own, its output in the
    starter's stderr): it outlives whoever started it (`launcher.forkservers`)."""
    pid = os.fork()  # before any import that starts a thread
    if pid:
        print(pid, flush=True)
        os._exit(0)
    os.setsid()
    os.dup2(2, 1)  # the starter reads only the pid from the pipe: the server's output goes with its stderr
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    serve(argv[0], float(argv[1]) if len(argv) > 1 else LINGER_S)


if __name__ == "__main__":
    main(sys.argv[1:])
