"""A pool file (`pool.yaml`): the devices a pool shares among its jobs, where it keeps its state,
and its policy's settings. Loaded like a job spec: every problem names the file, line and field.

    name: local
    devices: 4                 # this machine's devices (worker processes) the pool hands out
    kind: cpu
    storage: {url: "file://./parashift-store"}   # pools/{name}/ holds its state
    policy: {horizon_s: 600, aging_s: 900}

Over nodes (docs/nodes.md: a Prefect worker per node, on the work queue of its name), the pool
hands out whole nodes; `devices` follows from them:

    nodes: [gpu-a, gpu-b, gpu-c, gpu-d]
    devices_per_node: 8
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from parashift.specs.base import _JOB_NAME, Section, raise_if
from parashift.specs.models import StorageSpec, checked_node_names
from pydantic import Field, field_validator, model_validator


class PoolPolicySpec(Section):
    """The allocator's settings (docs/pool.md says what each promises)."""

    horizon_s: float = Field(600.0, gt=0, le=30 * 86400,
                             description="How far ahead a change's gain is counted against its downtime.")
    aging_s: float = Field(900.0, gt=0, le=30 * 86400,
                           description="A waiting job's rank rises by one priority per this many seconds of waiting.")
    mode: Literal["throughput", "static-fifo"] = Field(
        "throughput", description="throughput: the allocator; static-fifo: each job its requested devices for its "
                                  "whole run, in submission order, no backfill (the baseline, to compare with).")


class PoolSpec(Section):
    """A pool of devices, on this machine or over nodes, shared by the jobs submitted to it."""

    name: str = Field(description="Pool name: lower-case letters, digits, '.', '_', '-'.")
    # 0 (not validated) only until `_devices` sets it from the nodes, or says it is missing.
    devices: int = Field(0, ge=1, le=65536,
                         description="Devices (worker processes) the pool hands out; over nodes, nodes x "
                                     "devices_per_node (may be left out).")
    nodes: list[str] | None = Field(
        None, max_length=4096,
        description="The nodes whose devices the pool hands out (null: this machine). Each runs a Prefect worker "
                    "of the node pool on the work queue of its name (docs/nodes.md); a job of the pool runs on "
                    "whole nodes.")
    devices_per_node: int | None = Field(None, ge=1, le=1024, description="Devices of each node (with nodes).")
    kind: Literal["cpu", "cuda"] = Field("cpu", description="Device type of every job in the pool.")
    storage: StorageSpec = Field(default_factory=StorageSpec,
                                 description="Where the pool keeps its state (pools/{name}/), submissions included.")
    policy: PoolPolicySpec = Field(default_factory=PoolPolicySpec, description=PoolPolicySpec.__doc__)
    deployment: str = Field("train-job/train-job", max_length=300,
                            description="The deployment each job of the pool runs as (prefect.yaml's train-job).")
    tick_s: float = Field(2.0, gt=0, le=600, description="How often the controller looks for pool events.")
    node_deployment: str = Field(
        "node-launcher/parashift-node", max_length=300,
        description="Over nodes: the per-node launcher's deployment; a node is up while the worker `node-NAME` "
                    "of its work pool is online.")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        if not _JOB_NAME.fullmatch(name) or ".." in name:
            raise ValueError(f"must be lower-case letters, digits, '.', '_' or '-', at most 63 characters (got {name!r})")
        return name

    @field_validator("nodes")
    @classmethod
    def _node_names(cls, nodes: list[str] | None) -> list[str] | None:
        return checked_node_names(nodes)

    @model_validator(mode="after")
    def _devices(self) -> Self:
        if self.nodes is None:
            if self.devices_per_node is not None:
                raise_if([(("devices_per_node",), "only a pool over nodes has it: name the nodes too")])
            if "devices" not in self.model_fields_set:
                raise_if([(("devices",), "a pool names its devices (this machine's), or its nodes and "
                                         "devices_per_node")])
            return self
        if self.devices_per_node is None:
            raise_if([(("devices_per_node",), "a pool over nodes names the devices of each node")])
        assert self.devices_per_node is not None
        total = len(self.nodes) * self.devices_per_node
        if "devices" in self.model_fields_set and self.devices != total:
            raise_if([(("devices",), f"must be nodes x devices_per_node = {len(self.nodes)} x "
                                     f"{self.devices_per_node} = {total} (got {self.devices}); or leave it out")])
        self.devices = total
        return self

    def with_storage_root(self, root: str) -> PoolSpec:
        """Relative local storage made absolute under `root` (as `JobSpec.with_storage_root`)."""
        from parashift.specs import JobSpec

        rooted = JobSpec(name="pool", storage=self.storage).with_storage_root(root).storage
        return self.model_copy(update={"storage": rooted})


def load_pool(path: str | Path) -> PoolSpec:
    """Read and validate a pool file; SpecError (file:line:col: field: message) on any problem."""
    from parashift.specs.loader import parse_document, read_source

    return parse_document(read_source(path), str(path), PoolSpec)
