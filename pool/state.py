"""A pool's state in its storage: the jobs submitted to it, what each holds, every decision.

    pools/{name}/state.json              # PoolState under a sha256 digest, written by the controller alone
    pools/{name}/lease.json              # the controller's lease (storage.lease): one writer per pool
    pools/{name}/submitted/{ms}-{job}.json   # one per submission (`parashift submit --pool`), never rewritten

Everything is JSON validated by pydantic (never unpickled), and the state carries a digest of its
own body: a corrupted object is refused with its URL, never loaded. A controller restarted (or a
new one after a `kill -9`) reads it back and goes on: nothing of the pool lives only in memory.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Literal

from parashift.specs import JobSpec
from parashift.storage import ObjectNotFound, ObjectStore, StorageError
from pydantic import BaseModel, Field, ValidationError

Status = Literal["waiting", "running", "finished", "failed"]
DIGEST = "sha256:"


def pool_key(pool: str, *parts: str) -> str:
    return "/".join(("pools", pool, *parts))


class JobRecord(BaseModel):
    """One job of the pool as the controller keeps it."""

    job_id: str
    spec: JobSpec
    submitted_at: float
    status: Status = "waiting"
    devices: int = Field(0, description="what the allocator gives it now (0: it waits)")
    told: int = Field(0, description="the device count the job was started on or last sent in a resource event")
    told_at: float = 0.0
    flow_run_id: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    reason: str | None = None
    nodes: list[str] | None = Field(None, description="in a pool over nodes: the nodes it is given now")
    told_nodes: list[str] | None = Field(None, description="the nodes it was started on or last sent")
    predicted_step_s: dict[int, float] = Field(default_factory=dict)
    measured_step_s: dict[int, float] = Field(default_factory=dict)
    change_cost_s: float | None = Field(None, description="the job's own measured downtime per change")
    state_bytes: int | None = Field(None, description="the training state a change moves (its model's, predicted)")
    steps_done: int = 0
    changes: int = 0

    @property
    def active(self) -> bool:
        return self.status in ("waiting", "running")


class Decision(BaseModel):
    """One run of the allocator: on what event, what each job gets, and why."""

    at: float
    event: str
    devices: dict[str, int]
    reasons: dict[str, str]
    nodes: dict[str, list[str]] = Field(default_factory=dict, description="in a pool over nodes: each job's nodes")


class PoolState(BaseModel):
    pool: str
    devices: int
    nodes: list[str] | None = Field(None, description="a pool over nodes: its nodes, in order (the pool file's)")
    devices_per_node: int | None = None
    nodes_down: list[str] = Field(default_factory=list, description="nodes whose worker is not online now")
    jobs: dict[str, JobRecord] = Field(default_factory=dict)
    decisions: list[Decision] = Field(default_factory=list)
    submissions_seen: list[str] = Field(default_factory=list)

    def active(self) -> list[JobRecord]:
        return [job for job in self.jobs.values() if job.active]


class PoolStateCorrupt(StorageError):
    """The pool's state object fails its digest or its schema: refused, never loaded."""


def _digest(data: object) -> str:
    """sha256 of the state's data as canonical JSON (sorted keys, no spaces)."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return DIGEST + hashlib.sha256(canonical.encode()).hexdigest()


def encode_state(state: PoolState) -> bytes:
    data = json.loads(state.model_dump_json())
    return json.dumps({"digest": _digest(data), "state": data}, sort_keys=True).encode()


def decode_state(raw: bytes, where: str) -> PoolState:
    """The state in `raw`, checked against its digest before it is read as a state."""
    try:
        document = json.loads(raw)
        data = document["state"]
        if document.get("digest") != _digest(data):
            raise PoolStateCorrupt(f"{where} fails its sha256 digest (corrupted): refused, not loaded")
        return PoolState.model_validate(data)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, ValidationError) as error:
        raise PoolStateCorrupt(f"{where} is not a pool state ({type(error).__name__}): refused, not loaded") from None


def read_state(store: ObjectStore, pool: str, devices: int, nodes: list[str] | None = None,
               devices_per_node: int | None = None) -> PoolState:
    """The pool's state; a new, empty one when it has none yet. What it has (devices, nodes) is
    what the pool file says now."""
    key = pool_key(pool, "state.json")
    try:
        state = decode_state(store.get(key), store.url_for(key))
    except ObjectNotFound:
        state = PoolState(pool=pool, devices=devices)
    state.devices, state.nodes, state.devices_per_node = devices, nodes, devices_per_node
    return state


def write_state(store: ObjectStore, state: PoolState) -> None:
    store.put(pool_key(state.pool, "state.json"), encode_state(state))


def submit(store: ObjectStore, pool: str, spec: JobSpec, now: float | None = None) -> str:
    """Put a job in the pool's queue (the controller takes it at its next look); the key."""
    stamp = int((now if now is not None else time.time()) * 1000)
    key = pool_key(pool, "submitted", f"{stamp:013d}-{spec.job_id}.json")
    store.create(key, json.dumps({"submitted_at": stamp / 1000, "spec": spec.model_dump(mode="json")}).encode())
    return key


def submissions(store: ObjectStore, pool: str, seen: set[str]) -> list[tuple[str, float, JobSpec | str]]:
    """New submissions in order: (key, submitted_at, spec), or the reason instead of a spec when
    one cannot be read (it is refused, with that reason, and never retried)."""
    out: list[tuple[str, float, JobSpec | str]] = []
    for key in sorted(store.list(pool_key(pool, "submitted"))):
        if key in seen or not key.endswith(".json"):
            continue
        try:
            document = json.loads(store.get(key))
            out.append((key, float(document["submitted_at"]), JobSpec.model_validate(document["spec"])))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, ValidationError) as error:
            out.append((key, time.time(), f"{store.url_for(key)} is not a submission: {' '.join(str(error).split())[:300]}"))
    return out
