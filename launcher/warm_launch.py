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
from parashift.launcher.warm_pool import WarmPool
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.events import WorkerEvent

POLL_S = 0.05
# After a rank fails, how long its peers get to return by themselves (gloo fails their pending
# collective when the peer's connection closes) before they are ended (NCCL waits on): the
# peers that return stay warm.
PEER_GRACE_S = 5.0


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
    env = {**{k: v for k, v in os.environ.items() if k.startswith("PARASHIFT_")}, **(extra_env or {})}
    folder, ranks = pool._submit(spec, plan, until_step, env)
    result = LaunchResult(returncode=-1)
    workers = workers if workers is not None else RunningWorkers()
    workers._attach(os.getpid(), kill=lambda: pool.kill(range(plan.devices)))
    tails = [_Tail(folder / f"rank{r}.{kind}") for r in range(plan.devices) for kind in ("out", "err")]
    codes: dict[int, int] = {}
    failed_at: list[float] = []  # when a rank returned an error
    hang_s = spec.training.hang_timeout_s

    def end_pending() -> None:
        pool.kill([r for r in range(len(ranks)) if r not in codes])

    def failed() -> None:
        """A rank failed: its peers leave their step now (they may wait on it in a collective)."""
        failed_at.append(time.monotonic())
        pool.tell_peer_failed([r for r in range(len(ranks)) if r not in codes])

    output = WorkerOutput(result, workers, on_line, on_event)

    def drain(lines: list[str]) -> None:
        for line in lines:
            output(line)

    died: list[int] = []  # ranks whose process died (not answered)

    def answer(rank: int, proc: subprocess.Popen[str]) -> None:
        said = pool.read_answer(proc)
        if said is not None:
            codes[rank] = said
            if codes[rank] != 0 and not failed_at:  # its peers may wait on it: a moment to end too
                failed()
                if result.failed_rank is None:
                    result.failed_rank = (rank, codes[rank])
            return
        code = proc.wait()  # the process died: its peers may wait for it in a collective
        codes[rank] = code
        if not failed_at:
            failed()
        # A death is the cause; a peer that answered a failure first only saw its collective break.
        if result.hung_s is None and (result.failed_rank is None or not died):
            result.failed_rank = (rank, code)
        died.append(rank)
        if result.failed_rank == (rank, code):
            on_line(f"warm worker rank {rank} (pid {pool.worker_pid(proc)}) died ({'signal ' + str(-code) if code < 0 else code}): "
                    "another process (a spare, or a fresh one) takes its place; its peers end their job or are ended")

    with selectors.DefaultSelector() as selector:
        for rank, proc in enumerate(ranks):
            selector.register(proc.stdout, selectors.EVENT_READ, rank)  # type: ignore[arg-type]
        try:
            while len(codes) < len(ranks):
                for key, _ in selector.select(POLL_S):
                    selector.unregister(key.fileobj)
                    answer(key.data, ranks[key.data])
                for tail in tails:
                    drain(tail.lines())
                silent = output.silent_s()
                if hang_s is not None and silent > hang_s and result.hung_s is None:
                    result.hung_s = round(silent, 1)
                    end_pending()
                if failed_at and time.monotonic() - failed_at[0] > PEER_GRACE_S and len(codes) < len(ranks):
                    failed_at[0] = float("inf")
                    end_pending()
        except KeyboardInterrupt:  # asked to stop at once
            end_pending()
            raise
        except BaseException:  # e.g. the flow run cancelled: stop at a step boundary, briefly
            workers.request_stop()
            deadline = time.monotonic() + STOP_GRACE_S
            while len(codes) < len(ranks) and time.monotonic() < deadline:
                for key, _ in selector.select(POLL_S):
                    selector.unregister(key.fileobj)
                    answer(key.data, ranks[key.data])
            end_pending()
            raise
        finally:
            for tail in tails:
                drain(tail.close())
            result.returncode = max(codes.values(), key=abs) if codes else -9
            workers._attach(None)
    return result
