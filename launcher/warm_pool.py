"""Warm workers: long-lived processes, torch and the trainer imported once, that run one job
after another, each in a process group of its own.

A launch through torchrun pays, every time, for a fresh interpreter importing torch and the
trainer (3-4 s), torchrun's own start (6-9 s for an empty job on the 2-core CI machine), the
first functional collective importing torch._dynamo (2-12 s) and, for the `hf` family,
transformers (about 10 s of CPU). A job run here pays none of it again: each pool process runs
`trainer.worker.main` with torchrun's environment variables set for the job (rank, world size,
a rendezvous of its own: a key prefix of the pool's one store), its output written to files
in the job's folder, and the process group torn down after it.

What a job here shares with the jobs before it in the same process is the interpreter: module
state that is not reset between jobs (caches keyed by name, e.g. a Hugging Face checkpoint
opened from the same path) carries over. Jobs that are meant to end a process (a worker killed
with SIGKILL, a hung collective) belong to `launcher.launch`, not here: a job that does not end
within its timeout takes the pool down with it, and the pool starts afresh.

    pool = WarmPool(4)
    result = pool.run(spec, plan, until_step=7)   # a launcher.launch.LaunchResult
    pool.close()
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from parashift.launcher.forkserver import import_what_jobs_use
from parashift.launcher.launch import LaunchResult, PlanNotExecutable, forkserver_env, worker_env
from parashift.launcher.processes import end_with_parent, starter_env
from parashift.models.plans import job_plan_refusals
from parashift.specs import JobSpec, environ
from parashift.specs.loader import resolve_model
from parashift.specs.plan import Plan
from parashift.trainer import events as worker_events
from parashift.trainer.control import PEER_FAILED_SIGNAL, PeerFailed, on_peer_failed

# How long one job may run before the pool is presumed stuck (a collective waiting for a rank
# that failed) and started afresh.
JOB_TIMEOUT_S = 900.0

# A failed job's clean-up runs before its answer, and may take this long. Its collectives broke,
# and torch may keep the job's process groups past it (`trainer.mesh.release_leftover_groups`);
# dropping a gloo group joins its threads, and one still sending to the dead peer (a ring
# all-reduce's `waitSend`; once in ~1,000 warm kills under load, 2026-12-07) ends only at the
# collective's timeout. Such a process would take the next job and hold it up: it leaves
# instead, with LEFT_EXIT (its memory, and what it held of the step, go with it).
FAILED_CLEAN_UP_S = 2.0
LEFT_EXIT = 86


class WarmPool:
    """`size` warm worker processes; jobs of up to `size` ranks run on the first ranks of it.
    `spares` more wait idle, booted ahead of time: a rank that died, or one a bigger job
    adds, takes a spare (its interpreter already up) and a new spare boots behind it."""

    def __init__(self, size: int, kind: str = "cpu", spares: int = 0) -> None:
        self.size, self.kind, self.spares = size, kind, spares
        self.root = Path(tempfile.mkdtemp(prefix="parashift-warm-"))
        self._jobs = 0
        self._procs: list[subprocess.Popen[str]] = []
        self._spares: list[subprocess.Popen[str]] = []
        self._worker_pids: dict[int, int] = {}  # by process started: the pid that runs its jobs
        self._store: Any = None  # the jobs' rendezvous (`_rendezvous_port`)
        # The last job run here: its id, plan and the processes that ran its ranks (`_keep_the_holders`).
        self._last: tuple[str, Plan, list[subprocess.Popen[str]]] | None = None
        self._start()

    def _rendezvous_port(self) -> int:
        """The port of the pool's rendezvous store: one TCPStore served from this process for
        the pool's life, each job under a key prefix of its own (`PARASHIFT_STORE_PREFIX`).
        Why not torchrun's way, rank 0 serving a store on a fresh port per job: the other ranks
        often arrive first, are refused, and torch's connect backs off (0.4-0.7 s measured
        in a third of the changes on the 2-core VM) before it tries again."""
        if self._store is None:
            from parashift.launcher.loopback import loopback_store

            self._store = loopback_store(wait_for_workers=False)  # on loopback alone (launcher.loopback)
        return int(self._store.port)

    def _spawn(self) -> subprocess.Popen[str]:
        """A warm worker: forked by this process's forkserver where it can (the process started
        here is then its client, `launcher.forked`), else an interpreter of its own."""
        env = worker_env(self.kind)
        server = forkserver_env(self.kind, env)
        serve = ["parashift.launcher.warm_pool", "--serve"]
        command = [sys.executable, "-m", *(["parashift.launcher.forked", *serve] if server else serve)]
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                env={**env, **server, **starter_env()}, start_new_session=True)

    def read_answer(self, proc: subprocess.Popen[str]) -> int | None:
        """A job's exit status from the worker that ran it (its pid recorded); None if it died
        (its output ended)."""
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            return None
        said = json.loads(line)
        self._worker_pids[proc.pid] = int(said["pid"])
        return int(said["rc"])

    def _start(self) -> None:
        self._procs = [self._spawn() for _ in range(self.size)]
        self._spares = [self._spawn() for _ in range(self.spares)]

    def _fresh(self) -> tuple[subprocess.Popen[str], bool]:
        """A live spare if there is one (True), else a process started now (False)."""
        while self._spares:
            spare = self._spares.pop(0)
            if spare.poll() is None:
                return spare, True
        return self._spawn(), False

    def ensure(self, size: int) -> tuple[int, int]:
        """At least `size` live workers: the dead replaced and more added where a job needs
        more, from the spares first, else started now (a fresh interpreter the job waits
        for); the spares topped up behind them. Returns (taken from spares, started now)."""
        taken = started = 0
        # The live first: a job's first ranks are the processes that may hold its state (the
        # survivors of a failure: `trainer.checkpoint.live`); replacements go after them.
        live = [proc for proc in self._procs if proc.poll() is None]
        size, self._procs = max(size, len(self._procs)), live
        while len(self._procs) < size:
            proc, spare = self._fresh()
            self._procs.append(proc)
            taken, started = taken + spare, started + (not spare)
        self._spares = [p for p in self._spares if p.poll() is None]
        while len(self._spares) < self.spares:
            self._spares.append(self._spawn())
        self.size = max(self.size, size)
        return taken, started

    def pids(self, count: int) -> list[int]:
        """The processes that ran the first `count` ranks' last jobs (each worker's own pid: a
        forked worker's client is another process)."""
        return [self.worker_pid(proc) for proc in self._procs[:count]]

    def worker_pid(self, proc: subprocess.Popen[str]) -> int:
        """The pid that runs `proc`'s jobs, known once it answered one (else the one started)."""
        return self._worker_pids.get(proc.pid, proc.pid)

    def tell_peer_failed(self, ranks: Iterable[int]) -> None:
        """Tell these workers that a peer of their job died: they leave the step under way at
        once (`trainer.control.PeerFailed`) instead of at its next collective."""
        for proc in (self._procs[r] for r in ranks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.worker_pid(proc), PEER_FAILED_SIGNAL)

    def kill(self, ranks: Iterable[int]) -> None:
        """SIGKILL these workers (a job's ranks that must not wait on a dead peer); `ensure`
        replaces them before the next job."""
        for proc in (self._procs[r] for r in ranks):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)

    def close(self) -> None:
        every = self._procs + self._spares
        for proc in every:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # type: ignore[union-attr]
        for proc in every:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        self._procs, self._spares = [], []
        self._store = None  # its server stops with it
        shutil.rmtree(self.root, ignore_errors=True)  # the jobs' folders: specs, plans, outputs

    def restart(self) -> None:
        self._worker_pids.clear()
        for proc in self._procs + self._spares:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()
        self._start()

    def _submit(self, spec: JobSpec, plan: Plan, until_step: int | None,
                extra_env: dict[str, str] | None) -> tuple[Path, list[subprocess.Popen[str]]]:
        """Hand the job to the first `plan.devices` workers: its folder, and those workers."""
        spec = resolve_model(spec)
        refusals = job_plan_refusals(plan, spec)
        if refusals:
            raise PlanNotExecutable(f"plan {plan.mesh} cannot run on {spec.job_id}: " + "; ".join(refusals))
        if plan.devices > self.size:
            raise ValueError(f"plan for {plan.devices} devices on a warm pool of {self.size}")
        self._jobs += 1
        folder = self.root / f"job{self._jobs:04d}"
        folder.mkdir()
        (folder / "spec.json").write_text(spec.model_dump_json())
        (folder / "plan.json").write_text(plan.model_dump_json())
        argv = ["--spec", str(folder / "spec.json"), "--plan", str(folder / "plan.json")]
        if until_step is not None:
            argv += ["--until-step", str(until_step)]
        request = {"folder": str(folder), "world": plan.devices, "port": self._rendezvous_port(),
                   "prefix": f"{folder.name}/", "argv": argv, "env": dict(extra_env or {})}
        self._keep_the_holders(spec, plan)
        ranks = self._procs[: plan.devices]
        self._last = (spec.job_id, plan, ranks)
        for rank, proc in enumerate(ranks):
            proc.stdin.write(json.dumps({**request, "rank": rank}) + "\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        return folder, ranks

    def _keep_the_holders(self, spec: JobSpec, plan: Plan) -> None:
        """Where the job runs on fewer ranks than its last segment, the processes it keeps
        first are those whose held state covers the most of its step (`ptc.Layout.
        covering_ranks`): what they do not hold is read from storage. After pp 2 x dp 2, the
        first two ranks held stage 0 twice and stage 1 came from storage; one of each stage
        holds all of it."""
        last = self._last
        if last is None or last[0] != spec.job_id or plan.devices >= last[1].devices:
            return
        from parashift.trainer.layout import state_layout  # torch, only where a job shrinks

        _, previous, procs = last
        order = [procs[r] for r in state_layout(previous, spec.model).covering_ranks(plan.devices)]
        first = [proc for proc in order if proc in self._procs and proc.poll() is None][: plan.devices]
        self._procs = first + [proc for proc in self._procs if proc not in first]

    def run(self, spec: JobSpec, plan: Plan, until_step: int | None = None,
            extra_env: dict[str, str] | None = None, timeout_s: float = JOB_TIMEOUT_S) -> LaunchResult:
        """Run the job on the first `plan.devices` warm workers until they return; the events
        rank 0 reported, as a launch through torchrun returns them."""
        folder, ranks = self._submit(spec, plan, until_step, extra_env)
        codes = [self._answer(proc, timeout_s) for proc in ranks]
        result = LaunchResult(returncode=max(codes, key=abs))
        out = folder / "rank0.out"
        for line in out.read_text().splitlines() if out.exists() else []:
            event = worker_events.parse(line)
            if event is not None:
                result.events.append(event)
        return result

    def _answer(self, proc: subprocess.Popen[str], timeout_s: float) -> int:
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
            if not selector.select(timeout_s):
                self.restart()
                return -9
        code = self.read_answer(proc)
        if code is None:  # the process died
            self.restart()
            return -9
        return code

    def output(self, rank: int = 0) -> str:
        """The newest job's output of `rank` (stdout and stderr), for a failure's message."""
        folder = self.root / f"job{self._jobs:04d}"
        return "".join(p.read_text() for p in (folder / f"rank{rank}.out", folder / f"rank{rank}.err") if p.exists())


def _run_job(request: dict[str, Any]) -> int:
    """One job in this process, with torchrun's environment for its rank."""
    import torch.distributed as dist
    from parashift.trainer import worker

    rank, world = request["rank"], request["world"]
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(request["port"]), environ.WARM_WORKER: "1",
           environ.STORE_PREFIX: request["prefix"],
           **request["env"]}
    saved = {key: os.environ.get(key) for key in env}
    folder = Path(request["folder"])
    root = logging.getLogger()
    with open(folder / f"rank{rank}.out", "w") as out, open(folder / f"rank{rank}.err", "w") as err, \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        os.environ.update(env)
        for handler in list(root.handlers):  # the worker configures logging onto this job's stderr
            root.removeHandler(handler)
        try:
            return worker.main(request["argv"])
        except PeerFailed as failed:  # the launcher knows why: no traceback
            print(f"rank {rank}: {failed}", file=sys.stderr)
            return 1
        except SystemExit as stop:
            if stop.code not in (None, 0):
                print(stop.code, file=sys.stderr)
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported as the job's failure; the process serves on
            traceback.print_exc()
            return 1
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if dist.is_initialized():
                dist.destroy_process_group()


def _clean_up() -> None:
    """What a finished job leaves behind, collected after its answer went out (the flow plans
    the next segment meanwhile; a failed job's before, `FAILED_CLEAN_UP_S`). Only the job's own
    objects are traversed: what the imports made is frozen at boot (`serve`), and a warm job
    freezes nothing (`worker.main`)."""
    # Imported here: the launcher's side of this module (WarmPool) imports no torch.
    import torch
    from parashift.trainer.mesh import forget_meshes, release_leftover_groups

    forget_meshes()  # the job's meshes, and with them its process groups' threads
    gc.collect()
    release_leftover_groups()  # a mesh torch still holds after a failed collective

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next job's model may be laid out otherwise


def _clean_up_within(limit_s: float) -> bool:
    """Whether `_clean_up` finished within `limit_s` (on a thread of its own: one stuck in a
    process group's teardown stays stuck, and the caller leaves)."""
    cleaning = threading.Thread(target=_clean_up, name="clean-up", daemon=True)
    cleaning.start()
    cleaning.join(limit_s)
    return not cleaning.is_alive()


def serve() -> None:
    """Answer job requests (one JSON line each on stdin) with their exit status (on stdout)."""
    signal.signal(PEER_FAILED_SIGNAL, on_peer_failed)  # for the process's life: a job's peer died
    end_with_parent()  # the launcher killed: no job of it runs on (a forked worker's client ends it too)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    import_what_jobs_use()

    # What the imports made (~250,000 objects) lives as long as the process: out of every
    # collection from now on. A full pass over it cost 0.1-0.9 s, paid at each job's clean-up
    # while the next job's ranks waited for this one at their rendezvous.
    gc.collect()
    gc.freeze()
    for line in sys.stdin:
        rc = _run_job(json.loads(line))
        if rc != 0 and not _clean_up_within(FAILED_CLEAN_UP_S):
            print(f"warm worker {os.getpid()}: the failed job's process groups were not let go within "
                  f"{FAILED_CLEAN_UP_S:.0f} s (a collective still pending); leaving", file=sys.stderr, flush=True)
            os._exit(LEFT_EXIT)  # the stuck thread ends with the process
        answers.write(json.dumps({"rc": rc, "pid": os.getpid()}) + "\n")  # a forked worker's client is another pid
        if rc == 0:
            _clean_up()  # while the flow plans the next segment


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a warm worker (started by WarmPool)")
    parser.add_argument("--serve", action="store_true", required=True)
    parser.parse_args()
    serve()
