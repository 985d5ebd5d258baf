"""A rendezvous store that listens on loopback alone.

torch's `TCPStore` server binds every interface (`[::]`), whatever host it is given (checked
with torch 2.13, with libuv and without): a store without authentication, reachable from the
network, for a job that never leaves the machine. Given a socket already bound and listening
(`master_listen_fd`), it serves on that socket instead, so a socket bound to 127.0.0.1 keeps
the store on this machine.
"""

from __future__ import annotations

import socket
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

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK, 0))
    listener.listen(128)
    store = dist.TCPStore(LOOPBACK, listener.getsockname()[1], is_master=True, master_listen_fd=listener.fileno(),
                          **options)
    return LoopbackStore(store, listener)
