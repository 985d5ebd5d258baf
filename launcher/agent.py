"""`python -m parashift.launcher.agent ARGS`: torchrun (`torch.distributed.run`, ARGS as its)
as parashift runs it: its rendezvous stores listen on the given address alone
(`launcher.loopback`), its rendezvous events cost no source reading, and a one-node
(`--standalone`) rendezvous joins without a random wait.

Why the second: torch's dynamic rendezvous names each event it records after the method that
records it, through `inspect.stack()` (twice per event), which reads the source file of every
frame on the stack. It does so before it asks whether anything listens for rendezvous events
(by default nothing does, and the event is dropped). Measured on the 2-core machine (torch
2.13, `bench.launch_overhead`): a 12-step tiny launch took 1.33-1.41 s and 1.43-1.48 s of the
machine's CPU with it, 0.81-0.90 s and 0.91-0.98 s with the same names read off the frames;
0.63 s without the join's random wait too.
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


def join_without_jitter() -> None:
    """torch's dynamic rendezvous sleeps a random 0-0.3 s before its first join, to spread
    nodes that join at once over time: one node has no one to spread from (0.15 s of every
    standalone launch on average). Only its random waits go; its fixed ones (a poll's) stay."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    wait = dynamic_rendezvous._delay

    def delay(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):
            wait(seconds)

    dynamic_rendezvous._delay = delay


def main() -> None:
    serve_on_given_address()
    name_events_cheaply()
    if "--standalone" in sys.argv[1:]:  # across nodes: a static rendezvous, torch's own waits
        join_without_jitter()
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
