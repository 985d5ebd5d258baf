"""Rendezvous stores that listen on the address they are given alone: loopback on one machine.

torch's `TCPStore` server binds every interface (`[::]`), whatever host it is given (checked
with torch 2.13, with libuv and without): a store without authentication, reachable from the
network, for a job that never leaves the machine. Given a socket already bound and listening
(`master_listen_fd`), it serves on that socket instead, so a socket bound to 127.0.0.1 keeps
the store on this machine.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from typing import Any

LOOPBACK = "127.0.0.1"


@dataclass
class LoopbackStore:
    """A TCPStore server and the socket it serves on (closing the socket would end the server)."""

    store: Any
    listener: socket.socket

    @property
    def port(self) -> int:
        return int(self.store.port)


def loopback_store(**options: Any) -> LoopbackStore:
    """A TCPStore server on 127.0.0.1 and a free port; `options` as TCPStore's."""
    import torch.distributed as dist

    listener = listener_on(LOOPBACK, 0)
    if listener is None:  # loopback is always this machine's
        raise OSError(f"cannot listen on {LOOPBACK}")
    store = dist.TCPStore(LOOPBACK, listener.getsockname()[1], is_master=True, master_listen_fd=listener.fileno(),
                          **options)
    return LoopbackStore(store, listener)


LOCAL_HOSTS = ("localhost", LOOPBACK, "::1")
ANY_HOSTS = ("", "0.0.0.0", "::")
_LISTENERS: list[socket.socket] = []  # sockets stores serve on: kept open for the process's life


def listener_on(host: str, port: int) -> socket.socket | None:
    """A socket listening on `host`'s address alone (127.0.0.1 for a local name), or None where
    that address is not this machine's (then the store listens as torch makes it)."""
    try:
        family, _, _, _, address = (socket.AF_INET, 0, 0, "", (LOOPBACK, port)) if host in LOCAL_HOSTS else \
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError as error:
        print(f"parashift: the rendezvous store listens on every interface: cannot bind {host}:{port} ({error})",
              file=sys.stderr)
        return None
    listener.listen(128)
    return listener


def serve_on_given_address() -> None:
    """From now on, a TCPStore server this process creates listens on the address of the host
    it is given alone: 127.0.0.1 on one machine, the node's address (PARASHIFT_NODE_ADDR)
    across nodes. For torchrun's agent (`launcher.agent`): its
    stores are made by torch.distributed.elastic, which takes `TCPStore` from
    `torch.distributed`: the class is replaced there and in every module of it already imported."""
    import torch.distributed as dist

    base = dist.TCPStore
    if getattr(base, "parashift_bound", False):
        return

    class BoundTCPStore(base):  # type: ignore[misc, valid-type]
        parashift_bound = True

        def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                     *args: Any, **kwargs: Any) -> None:
            given_fd = kwargs.get("master_listen_fd") is not None or bool(args[3:4])
            if is_master and host_name not in ANY_HOSTS and not given_fd:
                listener = listener_on(host_name, port)
                if listener is not None:
                    _LISTENERS.append(listener)  # an agent's stores live as long as it does
                    port, kwargs["master_listen_fd"] = listener.getsockname()[1], listener.fileno()
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    dist.TCPStore = BoundTCPStore  # type: ignore[misc]
    # A forked agent (launcher.forkserver) imported torch.distributed.run before: its modules
    # hold the class under their own names.
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(module, "TCPStore", None) is base:
            module.TCPStore = BoundTCPStore
