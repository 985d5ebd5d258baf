"""One node's share of a segment (on one node: all of it), whoever asks: the job's own launch
task (`tasks.launch`) and each node's launcher of a job across nodes (`flows/node.py`).

    tail = OutputTail(relay)
    result = launch_segment(spec, plan, warm=pool, on_line=tail, on_event=print)
    if result.returncode:
        print(failure_reason(result, tail.lines))

The path is chosen here alone: warm workers where the caller keeps a pool for the job (one
node only), else torchrun (`node`: this node's part of a launch across nodes). The reason a
launch failed names the rank that died first, not the peers whose collectives broke after it.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable

from parashift.launcher.launch import LaunchResult, NodeRendezvous, RunningWorkers, launch_workers
from parashift.launcher.warm_launch import launch_warm
from parashift.launcher.warm_pool import WarmPool
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.events import WorkerEvent

# A line's relayed prefixes ("[rank0]: ", a node's "[a] ") before what the worker wrote.
_PREFIXES = re.compile(r"^(?:\[[^\]]*\]:?\s?)+")
_TRACEBACK = "Traceback (most recent call last):"
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?::|\s*$)")  # "ValueError: ...", "MemoryError"
# torchrun's summary of a failed worker: "rank : 1 (local_rank: 1)" and "exitcode : -9 (pid: 123)"
_FAILED_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXIT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?")
# torchrun ending a worker itself once another failed: "Sending process 123 closing signal SIGTERM"
_CLOSED = re.compile(r"Sending process (\d+) closing signal (SIG[A-Z0-9]+)")


def launch_segment(spec: JobSpec, plan: Plan, *, until_step: int | None = None, warm: WarmPool | None = None,
                   node: NodeRendezvous | None = None, on_line: Callable[[str], None] = lambda line: None,
                   on_event: Callable[[WorkerEvent], None] = lambda event: None,
                   extra_env: dict[str, str] | None = None, workers: RunningWorkers | None = None) -> LaunchResult:
    """Run the workers of `plan` (with `node`: this node's share) until they return: on the
    warm pool `warm` where given, else through torchrun. Output lines go to `on_line`, worker
    events to `on_event`; `workers` follows the processes (its `request_stop` stops them at a
    step boundary)."""
    if warm is not None:
        if node is not None:
            raise ValueError("warm workers serve jobs on one node; a launch across nodes runs torchrun on each")
        return launch_warm(warm, spec, plan, on_line=on_line, on_event=on_event, until_step=until_step,
                           extra_env=extra_env, workers=workers)
    return launch_workers(spec, plan, on_line=on_line, on_event=on_event, until_step=until_step, extra_env=extra_env,
                          workers=workers, node=node)


class OutputTail:
    """The workers' output lines, each passed on to `relay`, the last `keep` kept (torchrun's
    failure summary is at the end: what `failure_reason` reads). `prefix`: each kept line's."""

    def __init__(self, relay: Callable[[str], None], keep: int = 200, prefix: str = "") -> None:
        self.relay, self.keep, self.prefix = relay, keep, prefix
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(self.prefix + line)
        del self.lines[:-self.keep]
        self.relay(line)


def failure_reason(result: LaunchResult, lines: list[str]) -> str:
    """What killed the segment: the hang's suspects, the warm worker the launcher saw die, or
    the rank that brought torchrun down (`root_cause`), with its signal or first exception."""
    if result.hung_s is not None:
        suspects = "; ".join(f"rank {rank} {why}" for rank, why in sorted(result.hang_suspects.items()))
        return f"workers reported nothing for {result.hung_s:.0f} s (hung; ended by the launcher)" + \
            (f": {suspects}" if suspects else "")
    if result.failed_rank is not None:  # warm workers: the launcher saw the rank die itself
        rank, code = result.failed_rank
        return f"rank {rank} {_how(code, lines)} (a warm worker; another process takes its place)"
    found = root_cause(lines, result.first_exited)
    if found is not None:
        rank, code = found
        return f"rank {rank} {_how(code, lines)} (torchrun exited with {result.returncode})"
    return f"workers exited with code {result.returncode}"


def _how(code: int, lines: list[str]) -> str:
    if code < 0:
        return f"killed by signal {-code}"
    raised = first_exception(lines)
    return f"exited with code {code}" + (f": {raised}" if raised else "")


def first_exception(lines: list[str]) -> str | None:
    """The exception line of the first Python traceback in the workers' output (torchrun's own
    ChildFailedError aside): the error a rank raised first, which its peers' broken collectives
    follow. A run that failed on a MemoryError in every rank said only "exited with code 1"."""
    inside = False
    for line in lines:
        text = _PREFIXES.sub("", line)
        if _TRACEBACK in text:
            inside = True
        elif inside and _EXCEPTION.match(text):
            inside = False
            if "ChildFailedError" not in text:
                return text.strip()[:300]
    return None


def root_cause(lines: list[str], first_exited: list[int] | None = None) -> tuple[int, int] | None:
    """(rank, exit code) of the rank that brought a torchrun launch down, from its failure
    summary. torchrun's "Root Cause" is only the failure it happened to list first: when one
    rank is killed, its peers' collectives break ("Connection reset by peer") and they exit 1
    within the same poll, and torchrun may name one of them; then it ends the rest with
    SIGTERM and lists those too. So, by the evidence each failure carries:
    1. a rank torchrun ended itself (its "Sending process N closing signal SIGTERM" line) is a
       consequence, not the cause, unless it died by a signal torchrun did not send it: then
       its end was on its way when torchrun closed it (seen under load: the killed rank, its
       forked client not yet ended, was sent SIGTERM after a peer it broke had exited, and
       ended by SIGKILL);
    2. among the others, one killed by a signal (the OOM killer, a user, the node) is the cause,
       since no exception of a peer kills a rank by a signal;
    3. between equals, the launcher's own order of exits (`first_exited`, launcher.launch.ExitOrder)
       decides, then torchrun's root cause, then the order listed.
    The order of exits alone misled under load: a killed rank, descheduled in the kernel while
    it ended, was seen gone after the peer it broke."""
    failures: list[tuple[int, int, int]] = []  # (rank, exit code, pid)
    closed: dict[int, set[int]] = {}  # pid -> the signals torchrun itself sent it while closing
    rank: int | None = None
    root_at: int | None = None
    for line in lines:
        text = _PREFIXES.sub("", line)
        if "Root Cause" in text:
            root_at = len(failures)
        if (m := _CLOSED.search(text)) is not None:
            sig = getattr(signal.Signals, m.group(2), None)
            closed.setdefault(int(m.group(1)), set()).add(sig.value if sig is not None else 0)
        elif (m := _FAILED_RANK.match(text)) is not None:
            rank = int(m.group(1))
        elif (m := _EXIT_CODE.match(text)) is not None and rank is not None:
            failures.append((rank, int(m.group(1)), int(m.group(2) or -1)))
            rank = None
    if not failures:
        return None
    root = failures[root_at] if root_at is not None and root_at < len(failures) else None

    def ended_by_torchrun(failure: tuple[int, int, int]) -> bool:
        _, code, pid = failure
        return pid in closed and not (code < 0 and -code not in closed[pid])

    candidates = [f for f in failures if not ended_by_torchrun(f)] or failures
    candidates = [f for f in candidates if f[1] < 0] or candidates
    first = [f for f in candidates if f[0] in (first_exited or [])]
    if first:
        candidates = first
    chosen = root if root in candidates else candidates[0]
    return chosen[0], chosen[1]
