"""Preflight: what can be known about a job before any worker starts, checked in seconds.

A spec can be well formed and still unable to run: storage the workers cannot share or reach,
a backend package that is missing, a corpus that is empty or shorter than one sample, a model
whose state cannot fit the devices. Each of these is one `Problem` (the spec field and what to
do about it), found here instead of as a rank's traceback minutes into a launch.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from parashift.models import ModelUnbuildable
from parashift.specs import JobSpec
from parashift.specs.words import gib
from parashift.tasks.profile import exact_parameter_count
from prefect import task
from prefect.cache_policies import NO_CACHE

T = TypeVar("T")

# Each probe of storage or data gets this long before it counts as unreachable.
PROBE_TIMEOUT_S = 20.0
# fp32 parameter, gradient and AdamW's two moments: what a replica of the state holds per parameter.
STATE_BYTES_PER_PARAM = 16
# What one CPU worker process costs before any tensor (interpreter, torch, gloo): measured ~0.35 GB.
WORKER_PROCESS_BYTES = 350 * 2**20
# S3 clients answer within these or the probe reports the endpoint unreachable (botocore's
# default connect timeout is 60 s, with retries on top).
_S3_PROBE_CONFIG = {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 2}}


@dataclass(frozen=True)
class Problem:
    """One reason the job cannot run: the spec field it comes from, and what to do."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class PreflightFailed(ValueError):
    """The job cannot run; `problems` say why, one line each."""

    def __init__(self, job: str, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__(f"{job} cannot run: " + "; ".join(str(p) for p in problems))


def _within(seconds: float, what: str, fn: Callable[[], T]) -> T:
    """fn() on a daemon thread, or TimeoutError after `seconds` (a backend call that hangs on an
    unreachable host must not hold the check for minutes)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            box["error"] = error

    thread = threading.Thread(target=run, name=f"parashift-preflight-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _protocol(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else "file"


def _backend_problem(field: str, url: str) -> Problem | None:
    """A Problem when the URL's fsspec backend package is not installed."""
    import fsspec

    protocol = _protocol(url)
    if protocol in ("builtin", "file"):
        return None
    try:
        fsspec.get_filesystem_class("s3" if protocol == "s3a" else protocol)
    except (ImportError, ValueError) as error:
        return Problem(field, f"{protocol}:// needs a package that is not installed here ({error})")
    return None


def _first_line(error: BaseException) -> str:
    """What an error says, on one line (backend errors carry multi-line detail)."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _describe_storage_error(error: BaseException) -> str:
    from parashift.storage import ObjectNotFound, StoragePermissionError

    text = _first_line(error)
    if "credential" in text.lower():
        return f"no credentials found ({text}): set them in the environment or name a storage.credentials_block"
    if isinstance(error, StoragePermissionError):
        return f"access denied ({text}): check the credentials and the bucket's permissions"
    if isinstance(error, ObjectNotFound):
        return f"not found ({text}): fix the URL, or create the bucket or folder"
    if isinstance(error, TimeoutError):
        return f"unreachable: {text}"
    return f"cannot be used: {text}"


def check_storage(spec: JobSpec, timeout_s: float = PROBE_TIMEOUT_S) -> list[Problem]:
    """Storage every process of the job can share: a write, read and delete of a probe object
    under the job's folder; the node-local tier writable."""
    from parashift.storage import JobPaths, open_store

    url = spec.storage.url
    if _protocol(url) == "memory":
        return [Problem("storage.url", "memory:// lives inside one process, and the flow and every worker are "
                                       "separate processes: use file:// (one machine) or s3://")]
    missing = _backend_problem("storage.url", url)
    if missing:
        return [missing]
    probing = {"config_kwargs": _S3_PROBE_CONFIG} if _protocol(url) in ("s3", "s3a") else None
    key = JobPaths(spec.job_id).job_key(f".preflight-{uuid.uuid4().hex}")

    def probe() -> None:
        store = open_store(spec.storage, max_tries=1, option_defaults=probing)
        store.put(key, b"parashift preflight")
        try:
            if store.get(key) != b"parashift preflight":
                raise OSError("read back different bytes than were written")
        finally:
            store.delete(key)

    problems = []
    try:
        _within(timeout_s, "storage", probe)
    except Exception as error:  # noqa: BLE001 - every failure becomes the one line below
        problems.append(Problem("storage.url", f"{url}: {_describe_storage_error(error)}"))
    tier = spec.storage.local_tier
    if tier:
        try:
            os.makedirs(tier, exist_ok=True)
            probe_file = os.path.join(tier, f".{uuid.uuid4().hex}.probe")
            with open(probe_file, "wb") as handle:
                handle.write(b"ok")
            os.unlink(probe_file)
        except OSError as error:
            problems.append(Problem("storage.local_tier", f"{tier} is not a writable folder here ({error.strerror})"))
    return problems


def check_data(spec: JobSpec, timeout_s: float = PROBE_TIMEOUT_S) -> list[Problem]:
    """A corpus that resolves to at least one non-empty file and holds one whole sample."""
    import fsspec
    from parashift.trainer.data import BUILTIN_STDLIB, builtin_corpus_files

    data = spec.data
    if _protocol(data.url) == "memory":
        return [Problem("data.url", "memory:// lives inside one process and the workers are other processes: "
                                    "use a file, a glob or an object store URL")]
    missing = _backend_problem("data.url", data.url)
    if missing:
        return [missing]
    if data.format == "prepared":
        return check_prepared(spec, timeout_s)
    if not data.bytes_tokenizer:
        found = check_tokenizer(spec, timeout_s)
        if found:
            return found
    bytes_per_token = 2 if data.format == "tokens" else 1
    needed = (spec.model.seq_len + 1) * bytes_per_token  # one sample: seq_len inputs and the next token

    def measure() -> tuple[int, int]:
        if data.url == BUILTIN_STDLIB:
            files = [f.removeprefix("file://") for f in builtin_corpus_files()]
            fs = fsspec.filesystem("file")
        else:
            fs, _, files = fsspec.get_fs_token_paths(data.url, storage_options=dict(data.storage_options))
        total = 0
        for path in files:
            total += fs.size(path) or 0
            if total >= needed:
                break
        return len(files), total

    try:
        count, total = _within(timeout_s, "data", measure)
    except Exception as error:  # noqa: BLE001 - one line per failure
        return [Problem("data.url", f"{data.url} cannot be read ({type(error).__name__}: {_first_line(error)})")]
    if count == 0:
        return [Problem("data.url", f"{data.url} matches no files")]
    usable = min(total, data.max_bytes) if data.max_bytes else total
    if usable < needed:
        limit = f" (data.max_bytes {data.max_bytes})" if data.max_bytes and data.max_bytes < total else ""
        return [Problem("data.url", f"{data.url} holds {usable} bytes{limit}; one sample of model.seq_len "
                                    f"{spec.model.seq_len} needs {needed}: point it at more data or shorten seq_len")]
    return []


def _vocab_problem(spec: JobSpec, vocab_size: int, whose: str) -> list[Problem]:
    vocab = spec.model.vocab_size  # None: a transformers config's default, checked by the model itself
    if vocab is not None and vocab < vocab_size:
        return [Problem("model.vocab_size", f"{vocab} ids cannot embed {whose}'s {vocab_size}: "
                                            f"set model.vocab_size to at least {vocab_size}")]
    return []


def check_tokenizer(spec: JobSpec, timeout_s: float = PROBE_TIMEOUT_S) -> list[Problem]:
    """The spec's tokenizer loads, and the model's vocabulary holds every id it makes."""
    from parashift.corpus import load_tokenizer

    data = spec.data
    try:
        tokenizer = _within(timeout_s, "tokenizer", lambda: load_tokenizer(data.tokenizer, dict(data.storage_options)))
    except Exception as error:  # noqa: BLE001 - one line per failure
        return [Problem("data.tokenizer", _first_line(error))]
    return _vocab_problem(spec, tokenizer.vocab_size, f"the tokenizer {data.tokenizer}")


def check_prepared(spec: JobSpec, timeout_s: float = PROBE_TIMEOUT_S) -> list[Problem]:
    """A prepared dataset: its manifest under its digest, every shard there at its size, a
    dtype that holds its vocabulary, the tokenizer the spec names (if it names one), a model
    vocabulary that holds its ids, and at least one sample. No shard is read."""
    from parashift.corpus import DatasetError, load_tokenizer, open_dataset

    data = spec.data
    try:
        dataset = _within(timeout_s, "dataset", lambda: open_dataset(data.url, dict(data.storage_options)))
    except DatasetError as error:
        return [Problem("data.url", str(error))]
    except Exception as error:  # noqa: BLE001 - one line per failure
        return [Problem("data.url", f"{data.url} cannot be read ({type(error).__name__}: {_first_line(error)})")]
    made_with = dataset.manifest.tokenizer
    problems = _vocab_problem(spec, made_with.vocab_size, f"the dataset's tokenizer ({made_with.name})")
    if data.tokenizer is not None:
        try:
            named = _within(timeout_s, "tokenizer", lambda: load_tokenizer(data.tokenizer, dict(data.storage_options)))
        except Exception as error:  # noqa: BLE001 - one line per failure
            return [*problems, Problem("data.tokenizer", _first_line(error))]
        if named.fingerprint != made_with.fingerprint:
            problems.append(Problem("data.tokenizer", f"{data.url} was prepared with another tokenizer "
                                    f"({made_with.name}, {made_with.fingerprint[:19]}) than {data.tokenizer} "
                                    f"({named.fingerprint[:19]}): prepare it again, or leave data.tokenizer unset"))
    if len(dataset) < spec.model.seq_len + 1:
        problems.append(Problem("data.url", f"{data.url} holds {len(dataset)} tokens; one sample of model.seq_len "
                                            f"{spec.model.seq_len} needs {spec.model.seq_len + 1}"))
    return problems


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_nodes(spec: JobSpec) -> list[Problem]:
    """A job across nodes runs a launcher on each node through a Prefect server's node workers:
    without one (the embedded API) it waited 180 s for launchers nobody could start, then said
    every node left."""
    from parashift.tasks.events import api_url

    if spec.resources.nodes is None or api_url() is not None:
        return []
    return [Problem("resources.nodes", "a job across nodes runs a launcher on each node through a Prefect server's "
                                       "node workers, and PREFECT_API_URL names none: set it (`parashift serve --nodes "
                                       "a,b` tries it on one machine; docs/nodes.md), or remove resources.nodes to "
                                       "train on this machine")]


def _devices_here(spec: JobSpec) -> list[Problem]:
    """The devices a one-machine job names exist on this machine."""
    import torch

    resources = spec.resources
    if resources.kind == "cuda" and not torch.cuda.is_available():
        return [Problem("resources.kind", "cuda, but no CUDA device is visible on this machine: "
                                          "use kind: cpu, or run the job where the GPUs are")]
    if resources.kind == "cpu" and resources.devices * WORKER_PROCESS_BYTES > _host_memory_bytes():
        most = _host_memory_bytes() // WORKER_PROCESS_BYTES
        return [Problem("resources.devices", f"{resources.devices:,} CPU worker processes need about "
                                             f"{resources.devices * WORKER_PROCESS_BYTES / 1e9:,.0f} GB before any "
                                             f"tensor; this machine has {_host_memory_bytes() / 1e9:.1f} GB: "
                                             f"use at most {most}")]
    return []


def check_devices(spec: JobSpec) -> list[Problem]:
    """Devices of the spec's kind exist here, and the training state fits them at least when
    split as far as the strategy allows (a lower bound: a refusal is never wrong). A job across
    nodes has its devices on the nodes, not here (where its flow runs): only the bound against
    a `memory_gb` it states is checked."""
    import torch

    resources = spec.resources
    problems: list[Problem] = []
    if resources.nodes is None:
        here = _devices_here(spec)
        if here:
            return here
    elif resources.memory_gb is None:
        return problems
    try:
        params = exact_parameter_count(spec)[0]
    except ModelUnbuildable as error:
        return [Problem(error.field, error.message)]
    replica = params * STATE_BYTES_PER_PARAM
    split = resources.devices if spec.parallelism.strategy == "auto" else 1
    per_device = replica / split
    how = f"{params:,} parameters x {STATE_BYTES_PER_PARAM} bytes" + (f" / {split} devices" if split > 1 else "")
    # What the planner may fill of a device: its memory (memory_gb in GiB, as the planner reads
    # it) less the spec's reserve. A 0.05 GiB device passed here (50 MB > the state's 40 MB) and
    # the planner, left 0 GiB by the 1 GiB reserve, ran a plan over its limit.
    reserve, reserved = spec.parallelism.plan_memory_bytes, True
    if resources.memory_gb is not None:
        have = reserve(int(resources.memory_gb * 2**30)) or 0
        where = f"resources.memory_gb {resources.memory_gb:g} (GiB) less the planner's reserve"
    elif resources.kind == "cuda":
        have, where = reserve(torch.cuda.get_device_properties(0).total_memory) or 0, \
            "the GPU's memory less the planner's reserve"
    else:  # CPU workers share the host's memory, each a process of its own
        have, reserved = _host_memory_bytes() / resources.devices - WORKER_PROCESS_BYTES, False
        where = f"this machine's {_host_memory_bytes() / 1e9:.1f} GB shared by {resources.devices} worker processes"
    if per_device > have:
        fix = "a smaller model or more devices" + ("" if split > 1 else ", or parallelism.strategy: auto to split it")
        if reserved:
            fix += ", or a smaller parallelism.memory_reserve_gb"
        problems.append(Problem("model", f"the training state needs at least {gib(per_device)} per device "
                                         f"({how}); {where} gives {gib(max(have, 0))}: {fix}"))
    return problems


def preflight(spec: JobSpec, *, storage: bool = True, data: bool = True, devices: bool = True,
              timeout_s: float = PROBE_TIMEOUT_S) -> list[Problem]:
    """Every problem found with the job's devices, data and storage (each unless turned off:
    the device check imports torch, seconds that `parashift run` overlaps with its API's boot)."""
    problems = check_nodes(spec) + check_devices(spec) if devices else []
    if data:
        problems += check_data(spec, timeout_s)
    if storage:
        problems += check_storage(spec, timeout_s)
    return problems


@task(name="preflight", cache_policy=NO_CACHE)
def preflight_job(spec: JobSpec) -> None:
    """Refuse, in seconds and before any worker starts, a job that cannot run (PreflightFailed
    lists why); the flow does not retry it."""
    problems = preflight(spec)
    if problems:
        raise PreflightFailed(spec.job_id, problems)
