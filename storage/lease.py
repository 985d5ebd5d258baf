"""One writer per job, enforced by storage: a lease object `jobs/{job}/lease.json`.

A run takes the job's lease before it writes anything and holds it while it runs; storage
refuses a second writer however it was started (another Prefect server, another embedded API,
a hand-started `parashift run`). The lease holds:

- its holder: host, pid and a run id (unique per `JobLease`);
- a fencing token: `generation`, incremented on every take-over, with the run id;
- an expiry: `expires_at` (wall clock, seconds since the epoch), `ttl_s` after the last renewal.
  A background thread renews it every TTL/3 while the job runs.

Taking it is one atomic conditional write (`ObjectStore.create` / `ObjectStore.replace`):

- no lease yet: create-if-absent (a hard link on local files, which fails like O_EXCL when the
  name exists; `PutObject` with `If-None-Match: *` on S3);
- a live lease of another run: refused at once, `JobLeaseHeld`, one line naming the holder and
  how long until its lease lapses;
- an expired or released lease: replaced only if still the version read (a replace under
  flock(2) on local files; `PutObject` with `If-Match: <etag>` on S3), generation + 1. Of two
  runs taking over at once, one wins; the other reads the winner's live lease and is refused.

A crashed holder's lease lapses by itself after its TTL; on the machine it ran on (the same
kernel boot and PID namespace, recorded in the lease) a crashed holder is seen at once (its
process is gone) and its lease taken over without waiting. A lease is never deleted: release
marks it expired, so generations only grow.

Every manifest commit carries the token (`LEASE_ENV` in the workers' environment, read by the
rank-0 commit path; `check_fence` before the manifest is written, and again before a save sets
aside a step folder): a writer whose lease was taken over cannot commit, and says so.

Stores without conditional writes (`ObjectStore.conditional_writes`): memory:// lives in one
process and a lock makes it exact; any other fsspec backend gets a check then a write, best
effort, two runs starting in the same instant may both believe they hold the lease there.
Expiry compares wall clocks of different hosts: their skew must stay well below the TTL (60 s
by default; NTP keeps it to milliseconds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from parashift.specs import environ
from parashift.storage.errors import ObjectNotFound, StorageError, WriteConflict
from parashift.storage.objects import ObjectStore

logger = logging.getLogger("parashift.storage")

LEASE_TTL_S = 60.0
# The workers' environment variable that carries the fencing token to the rank-0 commit path.
LEASE_ENV = environ.LEASE_TOKEN
# A commit needs its lease to have this share of its TTL left (a renewal every TTL/3 keeps two
# thirds): the manifest is written well before anyone else could take the lease over.
COMMIT_MARGIN = 1 / 6
# How often a contended take-over reads and tries again before giving up.
MAX_TRIES = 5


class JobLeaseHeld(StorageError):
    """Another run holds the job's lease, and it is live: this run may not write the job."""

    def __init__(self, message: str, record: LeaseRecord, remaining_s: float) -> None:
        super().__init__(message)
        self.record = record
        self.remaining_s = remaining_s


class LeaseLost(StorageError):
    """This writer's lease is no longer the job's (taken over, or lapsed): it may not commit."""


@dataclass(frozen=True)
class LeaseToken:
    """The fencing token a commit carries: the lease generation and the holder's run id."""

    generation: int
    run_id: str

    def __str__(self) -> str:
        return f"{self.generation}:{self.run_id}"

    @classmethod
    def parse(cls, text: str) -> LeaseToken:
        generation, sep, run_id = text.strip().partition(":")
        if not sep or not generation.isdigit() or not run_id:
            raise ValueError(f"{LEASE_ENV}={text!r} is not a lease token (generation:run-id)")
        return cls(int(generation), run_id)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> LeaseToken | None:
        """The token the flow passed to this worker; None when there is none (benchmarks,
        workers started by hand or by tests): commits are then unfenced."""
        text = (os.environ if environ is None else environ).get(LEASE_ENV)
        return cls.parse(text) if text else None


@dataclass(frozen=True)
class LeaseRecord:
    """The content of lease.json."""

    job_id: str
    generation: int
    run_id: str
    host: str
    pid: int
    acquired_at: float
    renewed_at: float
    expires_at: float
    ttl_s: float
    released: bool = False
    # Where the holder runs, to tell at once that it is gone (this machine: boot id and PID
    # namespace; its process: start time in clock ticks since boot). Empty: unknown.
    machine: str = ""
    started: int = 0

    @property
    def token(self) -> LeaseToken:
        return LeaseToken(self.generation, self.run_id)

    @property
    def holder(self) -> str:
        return f"run {self.run_id} on {self.host} (pid {self.pid}, lease generation {self.generation})"

    def remaining_s(self, now: float) -> float:
        """Seconds until the lease lapses (<= 0: lapsed or released)."""
        return 0.0 if self.released else self.expires_at - now

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LeaseRecord:
        try:
            doc = json.loads(raw)
            record = cls(**doc)
            if not isinstance(record.generation, int) or record.generation < 1:
                raise ValueError(f"generation {record.generation!r}")
            float(record.expires_at)
            return record
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a lease: {exc}") from None


def this_machine() -> str:
    """This kernel's boot id and this process's PID namespace ("" where /proc does not say):
    two processes agreeing on it see the same PIDs."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def process_started(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc), None when there is no such
    process: a PID reused by another process starts later."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def holder_gone(record: LeaseRecord) -> bool:
    """Whether the lease's holder ran on this machine (same kernel, same PID namespace) and its
    process no longer exists: a crashed run, whose lease need not be waited out."""
    return bool(record.machine) and record.machine == this_machine() and \
        process_started(record.pid) != record.started


def lease_key(job_id: str) -> str:
    """`jobs/{job_id}/lease.json` (`storage.checkpoints.JobPaths.lease`)."""
    if not job_id or "/" in job_id or job_id in (".", ".."):
        raise ValueError(f"invalid job id {job_id!r}")
    return f"jobs/{job_id}/lease.json"


def read_lease(store: ObjectStore, job_id: str, key: str | None = None) -> tuple[LeaseRecord | None, str] | None:
    """(record, version tag) of the job's lease (or of the lease at `key`); record None when the
    file is not a lease (edited by hand); None when there is no lease."""
    try:
        raw, tag = store.get_tagged(key or lease_key(job_id))
    except ObjectNotFound:
        return None
    try:
        return LeaseRecord.decode(raw), tag
    except ValueError:
        return None, tag


def check_fence(store: ObjectStore, job_id: str, token: LeaseToken, what: str, now: float | None = None) -> LeaseRecord:
    """Refuse (LeaseLost, one line) unless the job's lease is still `token` with at least
    COMMIT_MARGIN of its TTL left; `what` names the refused action ("step 12 not committed")."""
    now = time.time() if now is None else now
    url = store.url_for(lease_key(job_id))
    found = read_lease(store, job_id)
    mine = f"this writer's lease (generation {token.generation}, run {token.run_id})"
    if found is None:
        raise LeaseLost(f"{what}: {mine} is gone ({url} missing); another run may write this job")
    record, _ = found
    if record is None:
        raise LeaseLost(f"{what}: {url} is not a lease any more; {mine} cannot be checked")
    if record.token != token:
        raise LeaseLost(f"{what}: {mine} is no longer the job's: {url} is held by {record.holder}; "
                        "that run writes this job now")
    left = record.remaining_s(now)
    if left < record.ttl_s * COMMIT_MARGIN:
        state = "released" if record.released else (f"lapsed {-left:.1f} s ago" if left <= 0 else f"lapses in {left:.1f} s")
        raise LeaseLost(f"{what}: {mine} {state} (not renewed: is its flow run alive?); another run may take it over")
    return record


class JobLease:
    """The job's lease for one run: `acquire` it, keep it renewed (`hold`, or `with`), `release`.

    `on_lost(message)` runs (on the renewing thread) when a renewal finds the lease taken over;
    leaving the `with` block then raises LeaseLost."""

    def __init__(self, store: ObjectStore, job_id: str, *, ttl_s: float = LEASE_TTL_S, run_id: str | None = None,
                 clock: Callable[[], float] = time.time, on_lost: Callable[[str], None] | None = None,
                 key: str | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError("a lease needs a positive TTL")
        self.store, self.job_id, self.ttl_s, self.clock, self.on_lost = store, job_id, float(ttl_s), clock, on_lost
        self.run_id = run_id or uuid.uuid4().hex[:16]
        self.key = key or lease_key(job_id)  # validates the id; `key`: another writer's lease (a pool's)
        self.record: LeaseRecord | None = None
        self.previous: LeaseRecord | None = None  # the lease this one took over, if any
        self.lost_reason: str | None = None
        self._tag: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.store.url_for(self.key)

    @property
    def token(self) -> LeaseToken:
        if self.record is None:
            raise RuntimeError("the lease is not held")
        return self.record.token

    def _fresh(self, generation: int, acquired_at: float | None = None) -> LeaseRecord:
        now = self.clock()
        return LeaseRecord(job_id=self.job_id, generation=generation, run_id=self.run_id, host=socket.gethostname(),
                           pid=os.getpid(), acquired_at=now if acquired_at is None else acquired_at, renewed_at=now,
                           expires_at=now + self.ttl_s, ttl_s=self.ttl_s, machine=this_machine(),
                           started=process_started(os.getpid()) or 0)

    def acquire(self) -> LeaseToken:
        """Take the lease: create it, or take over an expired or released one (generation + 1).
        JobLeaseHeld when another run holds it live."""
        for _ in range(MAX_TRIES):
            found = read_lease(self.store, self.job_id, self.key)
            if found is None:
                record = self._fresh(1)
                try:
                    tag = self.store.create(self.key, record.encode())
                except WriteConflict:
                    continue  # someone created it first: read theirs
                return self._took(record, tag, None)
            current, tag = found
            if current is not None and current.run_id == self.run_id:  # ours (a write whose answer was lost)
                return self._took(current, tag, None)
            now = self.clock()
            if current is not None and current.remaining_s(now) > 0 and holder_gone(current):
                logger.warning("%s was held by %s, which no longer runs on this machine: taken over without "
                               "waiting %.0f s for it to lapse", self.url, current.holder, current.remaining_s(now))
            else:
                self._refuse_if_held(current, now)
            if current is None:
                logger.warning("%s is not a lease (edited by hand?): taken over", self.url)
            record = self._fresh(current.generation + 1 if current is not None else 1)
            try:
                new_tag = self.store.replace(self.key, record.encode(), tag)
            except (WriteConflict, ObjectNotFound):
                continue  # another run took it over (or renewed) first: read again
            return self._took(record, new_tag, current)
        raise StorageError(f"could not take the lease {self.url}: {MAX_TRIES} tries lost to other writers")

    def _refuse_if_held(self, current: LeaseRecord | None, now: float) -> None:
        """JobLeaseHeld where `current` is another run's live lease (its holder not seen gone)."""
        if current is None or current.remaining_s(now) <= 0 or holder_gone(current):
            return
        left = current.remaining_s(now)
        raise JobLeaseHeld(
            f"job {self.job_id} is already running: {current.holder} holds its storage lease {self.url} "
            f"for {left:.0f} s more unless renewed; this run trains nothing. Let that run finish, or stop it "
            f"with `parashift stop`, then run again (a crashed run's lease lapses by itself within "
            f"{current.ttl_s:.0f} s)", current, left)

    def check_free(self) -> None:
        """Read only: JobLeaseHeld where another run holds the lease live now, as `acquire`
        would refuse it (a command says so before it starts anything; `acquire` still decides)."""
        found = read_lease(self.store, self.job_id, self.key)
        if found is not None and (found[0] is None or found[0].run_id != self.run_id):
            self._refuse_if_held(found[0], self.clock())

    def _took(self, record: LeaseRecord, tag: str, previous: LeaseRecord | None) -> LeaseToken:
        with self._lock:
            self.record, self._tag, self.previous, self.lost_reason = record, tag, previous, None
        if previous is not None:
            how = "released" if previous.released else f"lapsed {self.clock() - previous.expires_at:.0f} s ago"
            logger.info("took over the lease of job %s from %s (%s): generation %d", self.job_id, previous.holder, how,
                        record.generation)
        return record.token

    def renew(self) -> None:
        """Push the expiry TTL ahead, if the lease is still ours (LeaseLost otherwise)."""
        with self._lock:
            record, tag = self.record, self._tag
            if record is None or tag is None:
                raise RuntimeError("the lease is not held")
            now = self.clock()
            renewed = replace(record, renewed_at=now, expires_at=now + self.ttl_s)
            try:
                self._tag = self.store.replace(self.key, renewed.encode(), tag)
                self.record = renewed
                return
            except (WriteConflict, ObjectNotFound):
                pass
            found = read_lease(self.store, self.job_id, self.key)
            current = found[0] if found else None
            if current is not None and current.token == record.token and found is not None:
                # Ours still (an earlier renewal whose answer was lost): renew on top of it.
                self._tag = self.store.replace(self.key, renewed.encode(), found[1])
                self.record = renewed
                return
            holder = current.holder if current is not None else "nobody (the lease is gone)"
            self.lost_reason = (f"the storage lease of job {self.job_id} ({self.url}) was taken over: held by {holder}, "
                                f"not this run's generation {record.generation}; this run's commits are refused")
            raise LeaseLost(self.lost_reason)

    def ensure(self) -> None:
        """LeaseLost when the lease is no longer this run's: renewed now, to know. A storage
        error on the way is left to the background renewal, which tries again."""
        if self.lost_reason:
            raise LeaseLost(self.lost_reason)
        try:
            self.renew()
        except LeaseLost:
            raise
        except StorageError as error:
            logger.warning("could not renew the lease of job %s now (the background renewal retries): %s",
                           self.job_id, error)

    def release(self) -> None:
        """Mark the lease released (a new run takes it over at once); nothing when it is no
        longer ours."""
        with self._lock:
            record, tag = self.record, self._tag
            self.record = self._tag = None
        if record is None or tag is None or self.lost_reason:
            return
        now = self.clock()
        try:
            self.store.replace(self.key, replace(record, released=True, renewed_at=now, expires_at=now).encode(), tag)
        except (WriteConflict, ObjectNotFound):
            logger.warning("the lease of job %s was no longer this run's when it ended", self.job_id)
        except StorageError as error:  # it lapses by itself
            logger.warning("could not release the lease of job %s (it lapses within %.0f s): %s", self.job_id,
                           self.ttl_s, error)

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    def _renew_forever(self) -> None:
        interval = self.ttl_s / 3
        wait = interval
        while not self._stop.wait(wait):
            try:
                self.renew()
                wait = interval
            except LeaseLost as error:
                logger.error("%s", error)
                if self.on_lost is not None:
                    self.on_lost(str(error))
                return
            except StorageError as error:  # transient: try again soon, the lease has 2/3 of its TTL left
                wait = max(interval / 6, 0.05)
                logger.warning("renewing the lease of job %s failed (retrying in %.1f s): %s", self.job_id, wait, error)

    @contextlib.contextmanager
    def hold(self) -> Iterator[LeaseToken]:
        """Acquire, renew every TTL/3 on a background thread, release at the end. Leaving
        after the lease was lost raises LeaseLost (unless something else is raised already)."""
        token = self.acquire()
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_forever, name=f"parashift-lease-{self.job_id}", daemon=True)
        self._renewer.start()
        failed = False
        try:
            yield token
        except BaseException:
            failed = True
            raise
        finally:
            self._stop.set()
            self._renewer.join()
            self.release()
            if self.lost_reason and not failed:
                raise LeaseLost(self.lost_reason)

    def __enter__(self) -> LeaseToken:
        self._held = self.hold()
        return self._held.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._held.__exit__(*exc)
