"""Launching a job's segment on warm workers (launcher.warm_pool) with `launch_workers`'
contract: output lines and worker events streamed while it runs, stops at a step boundary by
signal and stop object, the hang watchdog, and a failed rank reported as such.

Why not torchrun's elastic agent: its restarts re-exec the worker program (fresh interpreters
importing torch and the trainer again: the seconds this exists to save), and a rendezvous for
a new world size still tears every worker down. Here the processes are the flow's own
children and outlive every segment of the run: a change of device count costs a new process
group and the model built again, not a new interpreter. A rank that dies takes its job's other
ranks out of their step (told at once, `WarmPool.tell_peer_failed`; gloo fails a collective
when the peer's connection closes; a peer that has not returned within PEER_GRACE_S is ended)
and is replaced by a fresh process before the next segment: only the dead rank pays for a new
interpreter, and the survivors keep their state for the next segment (trainer.checkpoint.live).
A hung job whose hang has a culprit (`launcher.processes.hang_suspects`) is handled the same:
the culprit is ended, its peers leave as a dead rank's do.

    pool = WarmPool(4)
    result = launch_warm(pool, spec, plan, on_line=print, on_event=print)
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from parashift.launcher.launch import STOP_GRACE_S, LaunchResult, RunningWorkers, WorkerOutput
from parashift.launcher.processes import hang_suspects
from parashift.launcher.warm_pool import FAILED_CLEAN_UP_S, LEFT_EXIT, WarmPool
from parashift.specs import JobSpec, environ
from parashift.specs.plan import Plan
from parashift.trainer.events import WorkerEvent

POLL_S = 0.02  # how soon a worker's event is relayed (the stop of a change waits on it)
# After a rank fails, how long its peers get to return by themselves (gloo fails their pending
# collective when the peer's connection closes) before they are ended (NCCL waits on): the
# peers that return stay warm.
PEER_GRACE_S = 5.0
# Not shortened once a returned peer holds the whole step (tried, 140d868, reverted): a 1 s grace
# ended a rank 0 still finishing the held step under load, and that step's loss (its event, its
# scalars) with it. What the grace still ends (1 of 100 kills under load): a peer whose gloo
# ring all-reduce waits on a send to the dead rank until the collective's timeout (seen with gdb
# in `UnboundBuffer::waitSend`); torch 2.13's `abort()` and `set_timeout()` do not interrupt it.


class _Tail:
    """New whole lines of a file another process is writing (it may not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path, self._handle, self._partial = path, None, ""

    def lines(self) -> list[str]:
        if self._handle is None:
            if not self.path.exists():
                return []
            self._handle = open(self.path, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by close()
        text = self._partial + self._handle.read()
        *whole, self._partial = text.split("\n")
        return whole

    def close(self) -> list[str]:
        rest = self.lines() + ([self._partial] if self._partial else [])
        if self._handle is not None:
            self._handle.close()
        return rest


def launch_warm(pool: WarmPool, spec: JobSpec, plan: Plan,
                on_line: Callable[[str], None] = lambda line: None,
                on_event: Callable[[WorkerEvent], None] = lambda event: None,
                until_step: int | None = None, extra_env: dict[str, str] | None = None,
                workers: RunningWorkers | None = None) -> LaunchResult:
    """Run the segment on the pool's first `plan.devices` workers until they return."""
    taken, started = pool.ensure(plan.devices)
    if taken:
        on_line(f"warm workers: {taken} spare process{'es' if taken > 1 else ''} took {'their' if taken > 1 else 'its'} place")
    if started:
        on_line(f"warm workers: {started} fresh process{'es' if started > 1 else ''} started")
    # What the flow put in its own environment for its workers (the lease token, a sample log)
    # reaches warm workers through each job's request: they were started before it was set.
    env = {**{k: v for k, v in os.environ.items() if k.startswith(environ.PREFIX)}, **(extra_env or {})}
    folder, ranks = pool._submit(spec, plan, until_step, env)
    segment = _WarmSegment(pool, ranks, folder, spec.training.hang_timeout_s,
                           workers if workers is not None else RunningWorkers(), on_line, on_event)
    return segment.watch()


class _WarmSegment:
    """One job on the pool's first ranks, watched until every rank has answered or died: their
    output relayed, a failure's peers told at once (and ended after PEER_GRACE_S), a silent
    job ended as hung."""

    def __init__(self, pool: WarmPool, ranks: list[subprocess.Popen[str]], folder: Path, hang_s: float | None,
                 workers: RunningWorkers, on_line: Callable[[str], None],
                 on_event: Callable[[WorkerEvent], None]) -> None:
        self.pool, self.ranks, self.hang_s, self.workers, self.on_line = pool, ranks, hang_s, workers, on_line
        self.result = LaunchResult(returncode=-1)
        workers._attach(os.getpid(), kill=lambda: pool.kill(range(len(ranks))))
        self.tails = [_Tail(folder / f"rank{r}.{kind}") for r in range(len(ranks)) for kind in ("out", "err")]
        self.codes: dict[int, int] = {}
        self.failed_at: float | None = None  # when a rank returned an error
        self.output = WorkerOutput(self.result, workers, on_line, on_event)

    def end_pending(self) -> None:
        self.pool.kill([r for r in range(len(self.ranks)) if r not in self.codes])

    def failed(self) -> None:
        """A rank failed: its peers leave their step now (they may wait on it in a collective)."""
        self.failed_at = time.monotonic()
        self.pool.tell_peer_failed([r for r in range(len(self.ranks)) if r not in self.codes])

    def drain(self, lines: list[str]) -> None:
        for line in lines:
            self.output(line)

    def answer(self, rank: int) -> None:
        """Rank `rank`'s process spoke: its job's exit code, or its death."""
        proc, result = self.ranks[rank], self.result
        said = self.pool.read_answer(proc)
        if said is not None:
            self.codes[rank] = said
            if said != 0 and self.failed_at is None:  # its peers may wait on it: a moment to end too
                self.failed()
                if result.failed_rank is None:
                    result.failed_rank = (rank, said)
            return
        code = proc.wait()  # the process died: its peers may wait for it in a collective
        self.codes[rank] = code
        if self.failed_at is None:
            self.failed()
        # A death is the cause; a peer that answered a failure first only saw its collective break.
        if result.hung_s is None and (result.failed_rank is None or not result.lost_ranks):
            result.failed_rank = (rank, code)
        result.lost_ranks.append(rank)  # its memory went with it (`LaunchResult.held_step`)
        # The pid it reported (a forked worker's client is another process, and the pool
        # learns the worker's own pid only from its first answer).
        pid = self.workers.reported_pid(rank) or self.pool.worker_pid(proc)
        if result.failed_rank == (rank, code):
            self.on_line(f"warm worker rank {rank} (pid {pid}) died "
                         f"({'signal ' + str(-code) if code < 0 else code}): another process (a spare, or a fresh "
                         "one) takes its place; its peers end their job or are ended")
        elif code == LEFT_EXIT:
            self.on_line(f"warm worker rank {rank} (pid {pid}) left after the failure: it could not let go of the "
                         f"job's process groups within {FAILED_CLEAN_UP_S:.0f} s (a collective to the dead rank still "
                         "pending); a fresh process takes its place, and what it held of the step went with it")

    def _answers(self, selector: selectors.BaseSelector) -> None:
        for key, _ in selector.select(POLL_S):
            selector.unregister(key.fileobj)
            self.answer(key.data)

    def _pending(self) -> bool:
        return len(self.codes) < len(self.ranks)

    def watch(self) -> LaunchResult:
        with selectors.DefaultSelector() as selector:
            for rank, proc in enumerate(self.ranks):
                selector.register(proc.stdout, selectors.EVENT_READ, rank)  # type: ignore[arg-type]
            try:
                while self._pending():
                    self._answers(selector)
                    for tail in self.tails:
                        self.drain(tail.lines())
                    self._watchdogs()
            except KeyboardInterrupt:  # asked to stop at once
                self.end_pending()
                raise
            except BaseException:  # e.g. the flow run cancelled: stop at a step boundary, briefly
                self.workers.request_stop()
                deadline = time.monotonic() + STOP_GRACE_S
                while self._pending() and time.monotonic() < deadline:
                    self._answers(selector)
                self.end_pending()
                raise
            finally:
                for tail in self.tails:
                    self.drain(tail.close())
                self.result.returncode = max(self.codes.values(), key=abs) if self.codes else -9
                self.workers._attach(None)
        return self.result

    def _hung(self, silent: float) -> None:
        """The job is hung: where some ranks stand out as what the others wait for (stopped,
        stuck in I/O, alone busy), only they are ended, as a rank that died: their peers'
        collectives break, and they leave with the last step they completed whole (a held step,
        as after a death). Else every rank that has not answered is ended."""
        self.result.hung_s = round(silent, 1)
        pending = [rank for rank in range(len(self.ranks)) if rank not in self.codes]
        # each rank's own pid, as the workers reported it (a forked worker's client is another
        # process, and the pool learns the worker's pid only when its job ends)
        started = self.result.start.pids if self.result.start is not None else []
        pids = {rank: started[rank] if rank < len(started) else self.pool.worker_pid(self.ranks[rank]) for rank in pending}
        suspects = hang_suspects(pids)
        self.result.hang_suspects = suspects
        if suspects and len(suspects) < len(pending):
            self.pool.kill(suspects)
            if self.failed_at is None:
                self.failed()  # the peers ended after PEER_GRACE_S where they do not leave
        else:
            self.end_pending()

    def _watchdogs(self) -> None:
        """A job silent for longer than its hang timeout is ended as hung; a failure's peers
        that have not returned within PEER_GRACE_S are ended."""
        silent = self.output.silent_s()
        if self.hang_s is not None and silent > self.hang_s and self.result.hung_s is None:
            self._hung(silent)
        if self.failed_at is not None and time.monotonic() - self.failed_at > PEER_GRACE_S and self._pending():
            self.failed_at = float("inf")
            self.end_pending()
