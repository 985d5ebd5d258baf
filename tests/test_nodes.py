"""Jobs across nodes, on this machine: one Prefect process worker per node (work queues `a` and
`b` of the pool `parashift-nodes`), each with its own node-local tier; torchrun's rendezvous on
127.0.0.1. The job's flow runs here, against the session's Prefect server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jobs import descendants, kill_tree, run, tiny_spec
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from test_deployments import prefect_cli
from test_elastic_events import run_log

from parashift.commands.serve import NODE_POOL, start_node_worker

pytestmark = pytest.mark.slow


class NodeWorker:
    """A node: a Prefect worker serving the node's work queue, started and stopped by PID."""

    def __init__(self, name: str, env: dict[str, str], home: Path) -> None:
        self.name, self.env, self.home = name, env, home
        self.process: subprocess.Popen[bytes] | None = None
        self.orphans: list[int] = []  # its flow runs outlive a killed worker; they end by themselves

    def start(self) -> None:
        env = {**self.env, "PREFECT_HOME": str(self.home / self.name)}
        self.process = start_node_worker(self.name, env, self.home / f"worker-{self.name}.log")

    def kill(self) -> None:
        """The node goes away: its worker dies at once (SIGKILL), as on a lost machine."""
        assert self.process is not None
        self.orphans = descendants(self.process.pid)
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            kill_tree(self.process.pid)
            self.process.wait()
        for pid in self.orphans:
            kill_tree(pid) if Path(f"/proc/{pid}").exists() else None


@pytest.fixture(scope="module")
def nodes(prefect_server: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeWorker]]:
    """The node deployment from prefect.yaml, and workers for nodes a and b."""
    from prefect.settings import PREFECT_API_URL

    home = tmp_path_factory.mktemp("nodes")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(home / "cli"),
           "PARASHIFT_NODE_ADDR": "127.0.0.1", "PREFECT_WORKER_QUERY_SECONDS": "1"}
    prefect_cli("work-pool", "create", NODE_POOL, "--type", "process", "--overwrite", env=env)
    prefect_cli("--no-prompt", "deploy", "--name", "parashift-node", env=env)
    workers = {name: NodeWorker(name, env, home) for name in ("a", "b")}
    try:
        for worker in workers.values():
            worker.start()
        yield workers
    finally:
        for worker in workers.values():
            worker.close()


def node_spec(name: str, tmp_path: Path, devices: int = 4, **training: Any) -> JobSpec:
    return tiny_spec(name, f"file://{tmp_path}/store", training={"log_every": 1, **training},
                     resources={"devices": devices, "nodes": ["a", "b"]},
                     storage={"local_tier": f"{tmp_path}/tier-{{node}}"})


def static_losses(spec: JobSpec) -> dict[int, float]:
    """The same job on one node, as many workers, never changed (on the session's warm workers:
    what is tested here is the job across nodes, not this reference's launch)."""
    single = spec.model_copy(update={"name": f"{spec.name}-static",
                                     "resources": spec.resources.model_copy(update={"nodes": None})})
    return {e.step: e.loss for e in run(single, Plan.data_parallel(spec.resources.devices)).steps}


def assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), f"step {step}"


def segment_losses(summary: Any) -> dict[int, float]:
    """Every step's loss; steps trained again after a failure count as the run that kept them."""
    return {step: loss for seg in summary.segments for step, loss in seg.losses}


def launcher_tags(names: list[str]) -> list[set[str]]:
    """The tags of the node launcher runs of these names, by name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names)))
    return [set(next(r for r in runs if r.name == name).tags) for name in names]


def test_two_nodes_of_two_train_as_one_node_of_four(nodes: dict[str, NodeWorker], tmp_path: Path) -> None:
    from parashift.flows.train import train_job

    spec = node_spec("two-nodes", tmp_path, steps=12, checkpoint_every=4)
    state = train_job(spec, return_state=True)
    summary = state.result()
    assert [(s.nodes, s.outcome) for s in summary.segments] == [(["a", "b"], "finished")]
    assert_same_losses(segment_losses(summary), static_losses(spec))
    # the job's run tells the nodes' story: the step lines of rank 0 (on node a) are on it, and
    # the node launcher runs carry the job's tags and their node's
    assert any(m.startswith("[a] step 12/12") for m in run_log(state, "[a] step 12/12"))
    assert launcher_tags(["two-nodes-a", "two-nodes-b"]) == [
        {"job:two-nodes", f"model:{spec.model.tag}", "devices:4", f"node:{n}"} for n in "ab"]
    # each node's tier holds what its ranks held (ranks 0-1 on a, 2-3 on b), the store none of it
    for node, ranks in (("a", {"hold00000.bin", "hold00001.bin"}), ("b", {"hold00002.bin", "hold00003.bin"})):
        assert {p.name for p in (tmp_path / f"tier-{node}").rglob("hold*.bin")} == ranks, node
    assert not list((tmp_path / "store").rglob("hold*.bin"))
    # rank 0 ran on node a, a launcher run: its commits are still fenced by the job's lease
    job = tmp_path / "store" / "jobs" / spec.job_id
    lease = json.loads((job / "lease.json").read_text())
    for path in job.glob("ckpt/*/manifest.json"):
        writer = json.loads(path.read_text())["writer"]
        assert writer is not None and writer["generation"] == lease["generation"], path
    # the job goes on later on the same nodes: every byte of its restore comes from the nodes
    longer = node_spec("two-nodes", tmp_path, steps=16, checkpoint_every=4)
    resumed = train_job(longer).segments[-1]
    assert resumed.start_step == 12 and resumed.final_step == 16
    assert resumed.restore_bytes is not None and resumed.restore_bytes["store"] == 0
    assert resumed.restore_bytes["local"] == resumed.restore_bytes["read"] >= resumed.restore_bytes["needed"] > 0


def latest_step(root: Path) -> int:
    steps = [int(p.parent.name) for p in root.glob("ckpt/*/manifest.json")]
    return max(steps, default=-1)


def test_a_node_leaves_the_job_goes_on_and_a_node_joins_at_a_step_boundary(nodes: dict[str, NodeWorker],
                                                                          tmp_path: Path) -> None:
    """Node b's worker dies at step >= 10: the job resumes from its last checkpoint on node a
    alone; node b's worker comes back: the job hears it and takes b in at the next step
    boundary. Once the job on both nodes has committed a checkpoint, it is asked to stop.
    Every step's loss equals the static run's to the same step (a constant learning rate after
    warm-up: a step's loss does not depend on how many steps the job was given; up to 600, as
    node b's worker takes a few seconds to start and be heard from and the job must still be
    training then)."""
    from parashift.flows.train import train_job
    from parashift.storage import JobPaths, open_store

    # One device per node: what is tested is a node's leaving and joining (two per node: the
    # test below), and the job's steps leave the node workers' start-ups more of the 2 cores.
    spec = node_spec("node-leaves", tmp_path, devices=2, steps=600, checkpoint_every=5)
    spec = spec.model_copy(update={"optimizer": spec.optimizer.model_copy(update={"schedule": "constant"})})
    root = tmp_path / "store/jobs/node-leaves"
    seen: dict[str, Any] = {}

    def launches() -> int:
        return len(list((root / "launches").iterdir())) if (root / "launches").exists() else 0

    def drive() -> None:
        deadline = time.monotonic() + 400
        while latest_step(root) < 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        seen["killed_after"] = latest_step(root)
        nodes["b"].kill()
        # the job goes on alone on node a: a second launch, and a checkpoint past the kill
        while time.monotonic() < deadline and not (launches() >= 2 and latest_step(root) >= seen["killed_after"] + 5):
            time.sleep(0.2)
        seen["joined_after"] = latest_step(root)
        nodes["b"].start()
        # node b is taken in: a third launch, then a checkpoint it committed; then the job stops
        while time.monotonic() < deadline and launches() < 3:
            time.sleep(0.2)
        third = latest_step(root)
        while time.monotonic() < deadline and latest_step(root) < third + 5:
            time.sleep(0.2)
        open_store(spec.storage).put_json(JobPaths(spec.job_id).stop(), {"reason": "the test has seen the join"})

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    summary = train_job(spec)
    driver.join(timeout=60)
    assert [(s.nodes, s.outcome) for s in summary.segments] == [
        (["a", "b"], "failed"), (["a"], "rescaled"), (["a", "b"], "stopped")], summary.segments
    left, alone, joined = summary.segments
    assert left.left_nodes == ["b"] and "node b left" in (left.reason or "")
    assert "node-joined" in (alone.reason or "")  # its worker was heard from again: no event needed
    assert alone.devices == 1 and alone.start_step == left.final_step
    assert joined.devices == 2 and joined.start_step == alone.final_step >= seen["joined_after"]
    assert joined.final_step >= joined.start_step + 5
    # node a alone: its ranks held every box (data parallel), so its tier serves the whole restore;
    # node b rejoins with a tier of an older step: its ranks read from the store
    assert alone.restore_bytes and alone.restore_bytes["store"] == 0 and alone.restore_bytes["local"] > 0
    assert joined.restore_bytes and joined.restore_bytes["store"] > 0 and joined.restore_bytes["local"] > 0
    reference = spec.model_copy(update={"training": spec.training.model_copy(update={"steps": joined.final_step})})
    assert_same_losses(segment_losses(summary), static_losses(reference))


def test_the_planner_times_collectives_within_and_across_the_job_s_nodes(nodes: dict[str, NodeWorker],
                                                                         tmp_path: Path) -> None:
    """A job whose planner chooses (strategy auto) fits its communication model to collectives
    timed on its own nodes: within a node and between nodes, each level on its own."""
    from parashift.tasks.profile import build_profile

    spec = node_spec("timed-nodes", tmp_path)
    spec = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"strategy": "auto"})})
    comm = build_profile(spec).comm
    assert comm.measured and comm.devices_per_node == 2
    assert comm.intra != comm.inter  # two groups, two fits (on one machine both are loopback)
    assert comm.p2p is not None


def test_node_changes_apply_to_the_node_set() -> None:
    """What an event does to a job across nodes (no processes): a node list replaces the set, a
    device count keeps the first nodes that hold it, anything else is refused."""
    from parashift.tasks.events import ResourceEvent, apply_change

    spec = tiny_spec("sets", "file:///tmp/unused", resources={"devices": 6, "nodes": ["a", "b", "c"]})
    now = (6, ["a", "b", "c"])
    assert apply_change(ResourceEvent(nodes=["a", "c"], epoch=1), spec, *now) == (4, ["a", "c"])
    assert apply_change(ResourceEvent(devices=2, epoch=1), spec, *now) == (2, ["a"])
    for bad in (ResourceEvent(devices=3, epoch=1), ResourceEvent(devices=8, epoch=1)):
        with pytest.raises(ValueError):
            apply_change(bad, spec, *now)
    with pytest.raises(ValueError):  # a job on one machine has no nodes to name
        apply_change(ResourceEvent(nodes=["a"], epoch=1), spec, 2, None)
    assert ResourceEvent(nodes=["a", "b"], epoch=1).differs(4, ["a"])
    assert not ResourceEvent(nodes=["a"], epoch=1).differs(2, ["a"])
    with pytest.raises(ValueError):
        ResourceEvent(epoch=1)  # names neither devices nor nodes


def test_the_node_watch_waits_only_for_nodes_the_job_lost() -> None:
    """`NodeWatch.now_on`: a node the job lost (`JobState.left`) is watched for its worker's
    return; one an event moved it off, or one it runs on, is not (no server needed)."""
    from parashift.tasks.events import ResourceWatcher
    from parashift.tasks.node_watch import NodeWatch

    spec = tiny_spec("watched-nodes", "file:///tmp/unused", resources={"devices": 6, "nodes": ["a", "b", "c"]})
    watch = NodeWatch(spec, ResourceWatcher(spec.job_id))
    watch.now_on(["a"])  # `parashift scale --nodes a`: b and c let go
    assert watch.left_at == {}
    watch.now_on(["a", "c"], left=("b",))  # b's worker went away
    assert set(watch.left_at) == {"b"}
    since = watch.left_at["b"]
    watch.now_on(["a", "c"], left=("b",))  # still waiting, since it left
    assert watch.left_at == {"b": since}
    watch.now_on(["a", "b", "c"])  # back
    assert watch.left_at == {}
