"""Starting the workers: torchrun as a subprocess, its lines handed to the caller as they come.

Kept free of Prefect so the launcher is testable and usable alone; `tasks/launch` streams the
lines into a flow run's log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from parashift.launcher.forkserver import available as forkserver_available
from parashift.launcher.forkservers import Forkserver, find_or_start
from parashift.launcher.interrupts import owns_signals
from parashift.launcher.processes import hang_suspects, kill_tree, parent_of
from parashift.models.plans import job_plan_refusals
from parashift.specs import JobSpec, environ
from parashift.specs.loader import resolve_model
from parashift.specs.plan import Plan
from parashift.trainer.events import (
    CheckpointEvent,
    CommTimingsEvent,
    FatalEvent,
    FinishedEvent,
    HeldEvent,
    RestoringEvent,
    StartEvent,
    StepEvent,
    StoppedEvent,
    WorkerEvent,
    parse,
)

import parashift

E = TypeVar("E", bound=WorkerEvent)


class PlanNotExecutable(ValueError):
    """The trainer cannot run this plan on this model (the reasons are in the message)."""


@dataclass
class LaunchResult:
    returncode: int
    events: list[WorkerEvent] = field(default_factory=list)
    hung_s: float | None = None  # set when the watchdog killed workers that reported nothing this long
    hang_suspects: dict[int, str] = field(default_factory=dict)  # hung: rank -> why its peers wait for it
    failed_rank: tuple[int, int] | None = None  # (rank, exit code; -signal) of the first rank that died, where known
    first_exited: list[int] = field(default_factory=list)  # torchrun path: the ranks seen gone first (`ExitOrder`)
    lost_ranks: list[int] = field(default_factory=list)  # warm path: ranks whose process died (their memory with it)

    def of(self, kind: type[E]) -> list[E]:
        """The events of one kind, in order: `result.of(RestoringEvent)`."""
        return [e for e in self.events if isinstance(e, kind)]

    def held_step(self) -> int | None:
        """The last step a warm rank that outlived the segment holds whole (`HeldEvent`), if any.
        A rank can say it holds a step and be ended a moment later (a hang's watchdog ends every
        rank that has not answered): what it held went with it."""
        return max((e.step for e in self.of(HeldEvent) if e.rank not in self.lost_ranks), default=None)

    def losses(self) -> list[tuple[int, float]]:
        """Each step's loss as rank 0 reported it, and the held step's where rank 0 did not
        complete it: a rank killed mid-step can cut rank 0 out of the step's last collective
        (its final chunk never sent) while another rank completes the step and holds it; the
        job resumes past that step, whose loss only the holder's `HeldEvent` carries."""
        losses = [(e.step, e.loss) for e in self.steps]
        held = self.held_step()
        said = [e.loss for e in self.of(HeldEvent) if e.step == held and e.loss is not None]
        if held is not None and said and held not in {step for step, _ in losses}:
            losses.append((held, said[0]))
        return losses

    @property
    def start(self) -> StartEvent | None:
        """The workers' start report (None: they never got that far)."""
        starts = self.of(StartEvent)
        return starts[-1] if starts else None

    @property
    def steps(self) -> list[StepEvent]:
        return self.of(StepEvent)

    @property
    def final_step(self) -> int | None:
        ends = [e for e in self.events if isinstance(e, FinishedEvent | StoppedEvent)]
        return ends[-1].step if ends else None

    @property
    def stopped(self) -> bool:
        return bool(self.of(StoppedEvent))

    @property
    def checkpoints(self) -> list[CheckpointEvent]:
        return self.of(CheckpointEvent)

    @property
    def restoring(self) -> RestoringEvent | None:
        """Rank 0's restore report (None: nothing restored)."""
        reads = self.of(RestoringEvent)
        return reads[-1] if reads else None

    @property
    def fatal(self) -> FatalEvent | None:
        """The error no retry can fix, if the workers reported one."""
        fatal = self.of(FatalEvent)
        return fatal[-1] if fatal else None


class RunningWorkers:
    """The workers of a launch in progress on this node, for a stop request by signal: instant,
    where the stop object is polled every few seconds. Only processes whose parent is the
    torchrun this launch started, or a forkserver of this process, are signalled (a worker pid
    may be reused once it exited)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._launcher: int | None = None
        self._pids: list[int] = []
        self._kill: Callable[[], None] | None = None

    def _attach(self, launcher: int | None, pids: list[int] | None = None,
                kill: Callable[[], None] | None = None) -> None:
        """`launcher`: the workers' parent; `kill`: how to end them where that is not killing
        the launcher's tree (warm workers are children of this very process)."""
        with self._lock:
            self._launcher, self._pids, self._kill = launcher, list(pids or []), kill

    def _started(self, pids: list[int]) -> None:
        with self._lock:
            self._pids = list(pids)

    def reported_pid(self, rank: int) -> int | None:
        """The pid rank `rank` reported running as (its start event), if it did."""
        with self._lock:
            return self._pids[rank] if rank < len(self._pids) else None

    def _ours(self) -> list[int]:
        """The reported workers that are still this launch's processes."""
        with self._lock:
            launcher, pids = self._launcher, list(self._pids)
        parents = {launcher, *forkserver_pids()} if launcher is not None else set()
        return [pid for pid in pids if parent_of(pid) in parents]

    def by_rank(self) -> dict[int, int]:
        """{rank: pid} of the reported workers that are still this launch's processes."""
        with self._lock:
            pids = list(self._pids)
        ours = set(self._ours())
        return {rank: pid for rank, pid in enumerate(pids) if pid in ours}

    def kill(self) -> None:
        """End this launch's torchrun and every worker below it at once (the node is leaving,
        or the launch was aborted): forked workers first, their forkserver is no launcher's."""
        with self._lock:
            launcher, kill = self._launcher, self._kill
        if kill is not None:
            kill()
        elif launcher is not None:
            for pid in self._ours():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            kill_tree(launcher)

    def request_stop(self) -> int:
        """Ask every worker to stop at its next step boundary; returns how many were signalled
        (0 before the workers reported their pids: then only the stop object reaches them)."""
        from parashift.trainer.control import STOP_SIGNAL

        signalled = 0
        for pid in self._ours():
            try:
                os.kill(pid, STOP_SIGNAL)
                signalled += 1
            except ProcessLookupError:
                pass
        return signalled


@dataclass(frozen=True)
class NodeRendezvous:
    """This node's place in a job across nodes: its rank among `nodes` and where node 0's
    launcher waits for the others.

    torchrun's static rendezvous with a fixed `--node-rank`: global ranks are node-major
    (node i holds ranks i x k ... i x k + k - 1), which the plan relies on (tensor-parallel groups
    inside a node, each rank's node-local tier known before launch). c10d's dynamic rendezvous
    numbers nodes by arrival, and its elasticity (restarting workers on a smaller world) would
    run a plan made for another device count; parashift re-plans on a node change instead.
    """

    nodes: tuple[str, ...]
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def node(self) -> str:
        return self.nodes[self.node_rank]

    def env(self) -> dict[str, str]:
        """What the workers learn about their node (`trainer.worker`: node-local tier, manifest)."""
        return {environ.NODE: self.node, environ.NODES: ",".join(self.nodes)}


def torchrun_command(devices: int, module: str, *args: str, log_dir: Path, node: NodeRendezvous | None = None,
                     forked: bool = False) -> list[str]:
    """`torchrun` starting `python -m module args` on `devices` local processes: a private
    rendezvous on a free local port, or this node's part of a job across `node.nodes`.
    `log_dir`: where torchrun keeps its per-run files (the workers' error files), a folder the
    caller removes; without it torchrun makes a `torchelastic_*` folder in the system's temporary
    directory for every launch and never removes it. `forked`: each worker is forked by the
    forkserver its environment names (`launcher.forked`), and so is torchrun's agent."""
    if node is None:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={len(node.nodes)}", f"--node-rank={node.node_rank}", "--rdzv-backend=static",
                 f"--master-addr={node.master_addr}", f"--master-port={node.master_port}"]
    through = ["parashift.launcher.forked"] if forked else []
    # torchrun's agent as parashift runs it (launcher.agent): its stores listen on the address
    # given alone (loopback on one machine, the first node's address across nodes)
    return [sys.executable, "-m", *through, "parashift.launcher.agent", *where, f"--nproc-per-node={devices}",
            f"--log-dir={log_dir}", "-m", *through, module, *args]


def worker_command(devices: int, spec_file: Path, plan_file: Path, until_step: int | None,
                   node: NodeRendezvous | None = None, forked: bool = False) -> list[str]:
    """torchrun running the trainer; its own files go beside the spec file (the launch's folder)."""
    command = torchrun_command(devices, "parashift.trainer.worker", "--spec", str(spec_file), "--plan", str(plan_file),
                               log_dir=spec_file.parent / "torchrun", node=node, forked=forked)
    if until_step is not None:
        command += ["--until-step", str(until_step)]
    return command


def run_measure_comm(devices: int, kind: str, node: NodeRendezvous | None = None) -> tuple[int, list[WorkerEvent], str]:
    """Run `trainer.measure_comm` on `devices` workers (with `node`: this node's share of
    them); its exit code, its events (rank 0's `comm_timings`) and the end of its stderr."""
    here = devices if node is None else devices // len(node.nodes)
    env = {**worker_env(kind), **(node.env() if node else {})}
    server = forkserver_env(kind, env)
    with tempfile.TemporaryDirectory(prefix="parashift-comm-") as tmp:
        command = torchrun_command(here, "parashift.trainer.measure_comm", "--kind", kind, log_dir=Path(tmp), node=node,
                                   forked=bool(server))
        env.update(server)
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    events = [e for line in done.stdout.splitlines() if (e := parse(line)) is not None]
    return done.returncode, events, done.stderr[-2000:]


def measure_comm_timings(devices: int, kind: str) -> dict[str, Any]:
    """The collectives' timings on `devices` workers of this machine (the planner fits its
    model to them: `planner.comm.comm_model_from_timings`)."""
    returncode, events, stderr = run_measure_comm(devices, kind)
    timings = [e.timings for e in events if isinstance(e, CommTimingsEvent)]
    if returncode != 0 or not timings:
        raise RuntimeError(f"measuring collectives failed ({returncode}):\n{stderr}")
    return timings[-1]


# The folder holding the `parashift` package that launched them (a source tree or site-packages):
# workers import that one, never a `parashift/` folder in the user's working directory.
CODE_ROOT = str(Path(parashift.__file__).resolve().parents[1])


# glibc hands freed blocks of 128 KiB and more back to the kernel (mmap'd ones at once, the
# heap's top past a threshold), and nearly every tensor is such a block: each step faulted its
# gradients, reduce buffers and optimizer temporaries in afresh, and a warm worker's next job
# its whole model (system CPU: about 2 us a 4 KiB page on the 2-core CI VM; a 4-worker job of
# 293 MB of state faulted 3.8x more pages without this). Freed memory stays in the process
# instead, as PyTorch's CUDA caching allocator keeps device memory: a worker's resident size
# stays at its peak. The user's own GLIBC_TUNABLES win; other C libraries ignore it.
KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=68719476736"


def worker_env(kind: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GLIBC_TUNABLES", KEEP_FREED_MEMORY)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # `python -m` puts the working directory first on sys.path (where users keep a specs/
    # folder); safe-path mode leaves it out, and PYTHONPATH names where parashift lives.
    env["PYTHONSAFEPATH"] = "1"
    # Once each: a launcher's environment may have been a launcher's worker environment already
    # (a node's flow run), and the forkserver serves one start-up environment, PYTHONPATH included.
    paths = [CODE_ROOT, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if kind == "cpu":
        # Several processes share the cores: one thread each (measured: 2 x 2 threads ran 2.3x slower than 2 x 1).
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


# The forkservers this process's launches forked from (launcher.forkservers): found or started at
# each launch, shared with every launcher on the machine, and left running when this process
# exits (each lingers, then exits).
_forkservers: set[Forkserver] = set()
_forkservers_lock = threading.Lock()


# Set to 1 (in `env` or this process's environment) to fork CUDA jobs' workers too: off until a
# GPU run shows relaunches get faster and training stays bit-equal (`bench.gpu.changes`).
FORK_CUDA_ENV = environ.FORK_CUDA


def forkserver_env(kind: str, env: dict[str, str]) -> dict[str, str]:
    """What makes a launch's workers forked by this machine's forkserver for `env` (started now
    if there is none): {} where workers start as interpreters of their own, as a CUDA job's
    do unless `env` sets PARASHIFT_FORK_CUDA=1 (no GPU run has shown yet that forking them pays).
    A fork after CUDA's initialisation breaks the child: the forkserver imports torch but never
    initialises CUDA, and serves nobody if its imports did (`forkserver.cuda_loaded`)."""
    forked = kind == "cpu" or (kind == "cuda" and env.get(FORK_CUDA_ENV) == "1")
    if not forked or not forkserver_available():
        return {}
    # torchrun sets OMP_NUM_THREADS=1 for several local workers where it is unset (a CUDA job's
    # environment leaves it), and the server refuses a worker whose start-up variables differ
    # from its own: the server and every forked worker have it, a single worker too.
    threads = {"OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
    env = {**env, **threads}
    server = find_or_start(env)  # a few ms: a lock, a question to the server, its files' stat
    with _forkservers_lock:
        _forkservers.add(server)
    return {**threads, **server.env()}


def start_forkserver(kind: str) -> None:
    """Start the forkserver this process's launches of `kind` workers will fork them from (if
    they fork), now rather than at the first launch: it imports in the background."""
    forkserver_env(kind, worker_env(kind))


def forkserver_pids() -> set[int]:
    """The forkservers of this process: the parents of its forked workers."""
    with _forkservers_lock:
        return {server.pid for server in _forkservers}


# How long workers interrupted from outside get to reach a step boundary and commit.
STOP_GRACE_S = 60.0


class ExitOrder:
    """Which of this node's workers is gone first, by polling their pids (a zombie counts as
    gone): usually the rank that died before its peers, whose collectives then broke and who
    exited after it. torchrun's own "Root Cause" is only the first failure its agent observed,
    often a peer's. Ranks seen gone in the same poll are listed together. Evidence only between
    equals (`segment.root_cause`): a killed rank descheduled while it ended was seen gone after
    the peer it broke."""

    POLL_S = 0.02

    def __init__(self, pids: list[int], result: LaunchResult) -> None:
        self.pids, self.result = pids, result
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="exit-order", daemon=True).start()

    @staticmethod
    def gone(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        return state in ("Z", "X")

    def _watch(self) -> None:
        while not self._done.wait(self.POLL_S):
            first = [rank for rank, pid in enumerate(self.pids) if self.gone(pid)]
            if first:
                self.result.first_exited = first
                return

    def stop(self) -> None:
        self._done.set()


class WorkerOutput:
    """Where each output line of a launch's workers goes: to `on_line`; an event also into the
    result, the running workers' pids and `on_event`, and it resets the hang clock (armed by
    the first report: starting up is the launcher's to time out)."""

    def __init__(self, result: LaunchResult, workers: RunningWorkers, on_line: Callable[[str], None],
                 on_event: Callable[[WorkerEvent], None], watch_exits: bool = False) -> None:
        self.result, self.workers, self.on_line, self.on_event = result, workers, on_line, on_event
        self.last_report: float | None = None
        self.watch_exits = watch_exits
        self.exits: ExitOrder | None = None

    def __call__(self, line: str) -> None:
        self.on_line(line)
        event = parse(line)
        if event is not None:
            self.last_report = time.monotonic()
            self.result.events.append(event)
            if isinstance(event, StartEvent):
                self.workers._started(event.pids)
                if self.watch_exits and self.exits is None:
                    self.exits = ExitOrder(event.pids, self.result)
            self.on_event(event)

    def silent_s(self) -> float:
        """Seconds since the last report (0 before the first)."""
        return time.monotonic() - self.last_report if self.last_report is not None else 0.0


def torchrun_group(forked: bool) -> int | None:
    """torchrun's process group: its own (0) where this process stops its training on its own
    signals (`parashift run`), so that a terminal's Ctrl-C does not reach torchrun, which would
    end its workers its own way (a traceback, SIGTERM to each) beside that stop. Only a forked
    torchrun: its client ends with this process however it dies (a closed terminal's SIGHUP
    included), which a plain torchrun outside the terminal's group would not. Elsewhere the
    starter's (None): Prefect's worker ends a flow run by killing its group."""
    return 0 if owns_signals() and forked else None


def launch_workers(
    spec: JobSpec,
    plan: Plan,
    on_line: Callable[[str], None] = lambda line: None,
    on_event: Callable[[WorkerEvent], None] = lambda event: None,
    until_step: int | None = None,
    extra_env: dict[str, str] | None = None,
    workers: RunningWorkers | None = None,
    node: NodeRendezvous | None = None,
) -> LaunchResult:
    """Run torchrun with `plan.devices` workers until they exit (with `node`: this node's
    share of them, the rest on the other nodes); every output line goes to `on_line`, every
    worker event also to `on_event`. A plan the trainer cannot execute is refused here, before
    any process starts. `workers` follows the processes while they run."""
    spec = resolve_model(spec)  # workers read the model's shape from the spec (a checkpoint folder's config)
    refusals = job_plan_refusals(plan, spec)
    if node is not None and plan.devices % len(node.nodes):
        refusals.append(f"{plan.devices} devices do not split evenly over {len(node.nodes)} nodes")
    if refusals:
        raise PlanNotExecutable(f"plan {plan.mesh} cannot run on {spec.job_id}: " + "; ".join(refusals))
    result = LaunchResult(returncode=-1)
    with tempfile.TemporaryDirectory(prefix="parashift-launch-") as tmp:
        spec_file, plan_file = Path(tmp, "spec.json"), Path(tmp, "plan.json")
        spec_file.write_text(spec.model_dump_json())
        plan_file.write_text(plan.model_dump_json())
        here = plan.devices if node is None else plan.devices // len(node.nodes)
        env = {**worker_env(spec.resources.kind), **(extra_env or {}), **(node.env() if node else {})}
        server = forkserver_env(spec.resources.kind, env)
        process = subprocess.Popen(
            worker_command(here, spec_file, plan_file, until_step, node, forked=bool(server)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**env, **server},
            process_group=torchrun_group(forked=bool(server)),
        )
        assert process.stdout is not None
        workers = workers if workers is not None else RunningWorkers()
        workers._attach(process.pid)
        output = WorkerOutput(result, workers, on_line, on_event, watch_exits=node is None)  # pids of this node only
        done = threading.Event()

        def watchdog(timeout_s: float) -> None:
            """Workers stuck in a collective never exit by themselves (gloo waits 30 min)."""
            while not done.wait(min(timeout_s, 5.0) / 5):
                silent = output.silent_s()
                if silent > timeout_s:
                    result.hung_s = round(silent, 1)
                    result.hang_suspects = hang_suspects(workers.by_rank())
                    workers.kill()
                    return

        if spec.training.hang_timeout_s is not None:
            threading.Thread(target=watchdog, args=(spec.training.hang_timeout_s,), daemon=True).start()
        try:
            for raw in process.stdout:
                output(raw.rstrip("\n"))
        except KeyboardInterrupt:  # asked to stop at once: nothing of this launch outlives it
            workers.kill()
            raise
        except BaseException:  # e.g. the flow run cancelled: stop at a step boundary, briefly
            workers.request_stop()
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                workers.kill()
            raise
        finally:
            result.returncode = process.wait()
            done.set()
            if output.exits is not None:
                output.exits.stop()
            workers._attach(None)
    return result
