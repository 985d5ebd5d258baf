"""`python -m parashift.launcher.agent ARGS`: torchrun (`torch.distributed.run`, ARGS as its)
as parashift runs it: its rendezvous stores listen on the given address alone
(`launcher.loopback`), and its rendezvous events cost no source reading.

Why the second: torch's dynamic rendezvous names each event it records after the method that
records it, through `inspect.stack()` (twice per event), which reads the source file of every
frame on the stack. It does so before it asks whether anything listens for rendezvous events
(by default nothing does, and the event is dropped). Measured on the 2-core machine (torch
2.13, `bench.launch_overhead`): a 12-step tiny launch took 1.33-1.41 s and 1.43-1.48 s of the
machine's CPU with it, 0.81-0.90 s and 0.91-0.98 s with the same names read off the frames.
"""

from __future__ import annotations

import sys

from parashift.launcher.loopback import serve_on_given_address


def method_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up from this one (as torch's `get_method_name`
    gives it: 2 is the caller of the function that asks)."""
    try:
        return sys._getframe(depth).f_code.co_name  # frame 0 is this one, as inspect.stack()[0]
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def name_events_cheaply() -> None:
    """torch's rendezvous names its events with `method_name` instead of `inspect.stack()`."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = method_name


def main() -> None:
    serve_on_given_address()
    name_events_cheaply()
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
