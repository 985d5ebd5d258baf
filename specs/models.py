"""The job-spec language: one pydantic model per section, composed into `JobSpec`.

Every model forbids unknown keys and validates strictly (a string is never an integer), because
specs come from YAML where the types are already right. Cross-field problems are raised as
`FieldIssues`, which carry the path of the most specific field so that the loader can point at
its line; constructed in Python they read as an ordinary pydantic `ValidationError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Self, Union, get_args

from parashift.models import DEFAULT_FAMILY, spec_sections
from parashift.specs.base import (
    _BLOCK_NAME,
    _JOB_NAME,
    Loc,
    _check_storage_options,
    _raise_if,
    _Section,
)
from parashift.specs.plan import AC_MODES, Plan, pinned_plan, plan_refusals
from parashift.specs.urls import DATA_SCHEMES, STORAGE_SCHEMES, check_url
from pydantic import Discriminator, Field, Tag, field_validator, model_validator


def _family_of(value: Any) -> str:
    """The family a `model:` section names; none named: the GPT."""
    found = value.get("family", DEFAULT_FAMILY) if isinstance(value, dict) else getattr(value, "family", DEFAULT_FAMILY)
    return found if isinstance(found, str) else repr(found)


def _any_of(schema: dict[str, Any]) -> None:
    """The families as `anyOf` in JSON Schema: `family` tells them apart (pydantic's
    discriminator), and a schema validator that ignores a section's defaults (Prefect's
    server, validating a deployment's parameters) finds a GPT section valid as a Llama one
    too, which `oneOf` refuses."""
    if "oneOf" in schema:
        schema["anyOf"] = schema.pop("oneOf")


# The spec sections of the registered model families (models/*/spec.py), told apart by `family`.
MODEL_SECTIONS: dict[str, type[_Section]] = spec_sections()
ModelSpec = Annotated[
    Union[tuple(Annotated[section, Tag(name)] for name, section in MODEL_SECTIONS.items())],  # noqa: UP007
    Discriminator(
        _family_of,
        custom_error_type="model_family",
        custom_error_message=f"model.family must be one of {', '.join(map(repr, MODEL_SECTIONS))}",
    ),
]


class DataSpec(_Section):
    """The training corpus and how it is tokenized."""

    url: str = Field(
        "builtin://python-stdlib",
        description=(
            "fsspec URL or glob of the corpus (file://, s3://, gs://, az://, http(s)://, hf://, memory://), "
            "a plain local path, or builtin://python-stdlib."
        ),
    )
    format: Literal["text", "tokens", "prepared"] = Field(
        "text",
        description=(
            "'text': UTF-8 text files, tokenized by every worker at start (small corpora); 'tokens': raw "
            "little-endian uint16 token ids; 'prepared': a dataset folder made by `parashift prepare-data`, "
            "streamed (memory does not grow with the corpus)."
        ),
    )
    tokenizer: str | None = Field(
        None,
        description=(
            "How text becomes token ids: 'bytes' (one per byte), or a Hugging Face tokenizer.json (or a model "
            "folder holding one) at any fsspec URL. Unset: 'bytes' for text, the dataset's own for 'prepared' "
            "(set: it must be the one the dataset was prepared with)."
        ),
    )
    max_bytes: int | None = Field(
        4_000_000, ge=1, description="Read at most this many bytes of corpus (null: read everything); "
                                     "not used by 'prepared' datasets, which are streamed."
    )
    samples: Literal["packed", "documents"] = Field(
        "packed",
        description=(
            "'packed': windows of seq_len + 1 tokens every seq_len tokens, across document ends; 'documents': "
            "only windows inside one document (a prepared dataset's index; each document's tail is left out)."
        ),
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra fsspec options for the corpus filesystem (no credentials).",
    )
    eval_url: str | None = Field(
        None,
        description="Held-out data for training.eval_every: a corpus of its own, read as `url` is (same format and "
                    "tokenizer, at most max_bytes).",
    )
    eval_share: float | None = Field(
        None, gt=0.0, lt=0.5,
        description="Held-out data for training.eval_every: this share of the corpus's documents (its files, for "
                    "'text' and 'tokens'), whole, chosen by training.seed and never trained on.",
    )

    @field_validator("url", "eval_url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        return url if url is None else check_url(url, DATA_SCHEMES, what="data")

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, tokenizer: str | None) -> str | None:
        if tokenizer is None or tokenizer == "bytes":
            return tokenizer
        return check_url(tokenizer, DATA_SCHEMES, what="tokenizer")

    @model_validator(mode="after")
    def _documents_need_an_index(self) -> Self:
        if self.samples == "documents" and self.format != "prepared":
            _raise_if([(("samples",), "'documents' needs data.format 'prepared' (its index of document ends)")])
        if self.eval_share is not None and self.format == "prepared":
            _raise_if([(("eval_share",), "a prepared dataset is streamed, not split here: give its held-out part "
                                         "as data.eval_url (a dataset prepared from other documents)")])
        if self.eval_share is not None and self.eval_url is not None:
            _raise_if([(("eval_share",), "give data.eval_url or data.eval_share, not both")])
        return self

    def held_out(self) -> DataSpec | None:
        """The evaluation data read as this one is (eval_url), or None (eval_share, or no eval)."""
        return None if self.eval_url is None else self.model_copy(update={"url": self.eval_url, "eval_url": None})

    @property
    def bytes_tokenizer(self) -> bool:
        """One token per byte: the default for text, never for a prepared dataset."""
        return self.format != "prepared" and self.tokenizer in (None, "bytes")

    @field_validator("storage_options")
    @classmethod
    def _options(cls, options: dict[str, Any]) -> dict[str, Any]:
        return _check_storage_options(options)


class OptimizerSpec(_Section):
    """AdamW with warmup and a learning-rate schedule."""

    lr: float = Field(1e-3, gt=0.0, description="Peak learning rate.")
    min_lr: float = Field(1e-4, ge=0.0, description="Learning rate at the end of the schedule (<= lr).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    weight_decay: float = Field(0.1, ge=0.0, description="Decoupled weight decay.")
    warmup_steps: int = Field(10, ge=0, le=10**9, description="Steps of linear warmup from 0 to lr.")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay from lr to min_lr after warmup."
    )
    grad_clip: float | None = Field(
        1.0, gt=0.0, description="Clip the global gradient norm (null: no clipping)."
    )

    @field_validator("betas", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: Any) -> Any:
        # YAML has no tuples; strict mode would reject the list it gives.
        return tuple(value) if isinstance(value, list) else value

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        _raise_if(
            [((i,), f"must be in [0, 1) (got {beta})") for i, beta in enumerate(betas) if not 0 <= beta < 1]
        )
        return betas

    @model_validator(mode="after")
    def _min_below_peak(self) -> Self:
        if self.min_lr > self.lr:
            _raise_if([(("min_lr",), f"must be <= optimizer.lr ({self.min_lr:g} > {self.lr:g})")])
        return self


class TrainingSpec(_Section):
    """The training loop: batch sizes, length, seeding and checkpointing."""

    global_batch: int = Field(16, ge=1, le=1 << 24, description="Sequences per optimizer step, over all devices.")
    micro_batch: int = Field(
        4, ge=1, le=1 << 24, description="Sequences per forward/backward pass; must divide global_batch."
    )
    steps: int = Field(60, ge=1, le=10**9, description="Optimizer steps to train for.")
    seed: int = Field(1234, ge=0, le=2**63 - 1, description="Seed for initialization and data order.")
    checkpoint_every: int = Field(20, ge=1, le=10**9, description="Commit a checkpoint every this many steps.")
    keep_checkpoints: int = Field(
        2, ge=1, le=1000, description="Committed checkpoints to keep; older ones are deleted."
    )
    log_every: int = Field(1, ge=1, description="Log metrics every this many steps.")
    eval_every: int | None = Field(
        None, ge=1, le=10**9,
        description="Every this many steps, and at the last, the loss on held-out data (data.eval_url or "
                    "data.eval_share): the same number under any plan or device count for the same weights.",
    )
    eval_samples: int = Field(64, ge=1, le=1 << 20,
                              description="Held-out sequences each evaluation reads (the first ones, always the same).")
    hang_timeout_s: float | None = Field(
        900.0, gt=0, le=86400,
        description="Workers that, once started, report nothing (no step, checkpoint or restore) for this "
        "long are presumed hung (a stuck collective), stopped, and handled as a failure; null: wait forever.",
    )
    stop_poll_s: float = Field(
        2.0, ge=0, le=3600,
        description="How often rank 0 checks the job's stop object in storage (one existence check: an S3 HEAD); "
        "signals on the node are heard at once. 0: every step.",
    )
    if_checkpoints_unusable: Literal["fail", "start-over"] = Field(
        "fail",
        description="When the job has committed checkpoints but none can be restored (another model's, or "
        "every one corrupted): fail and say why, or start over from step 0 beside them.",
    )

    @model_validator(mode="after")
    def _batches_fit(self) -> Self:
        if self.micro_batch > self.global_batch:
            _raise_if(
                [
                    (
                        ("micro_batch",),
                        f"must be <= training.global_batch ({self.micro_batch} > {self.global_batch})",
                    )
                ]
            )
        if self.global_batch % self.micro_batch:
            _raise_if(
                [
                    (
                        ("micro_batch",),
                        "indivisible batch: training.global_batch must be divisible by training.micro_batch "
                        f"({self.global_batch} % {self.micro_batch} != 0)",
                    )
                ]
            )
        return self


def checked_node_names(nodes: list[str] | None) -> list[str] | None:
    """Node names as a job spec or a pool file gives them: each a name, none twice; an empty
    list (as a form may send) is no nodes (this machine)."""
    if not nodes:
        return None
    issues: list[tuple[Loc, str]] = []
    for i, name in enumerate(nodes):
        if not _JOB_NAME.fullmatch(name):
            issues.append(((i,), f"must be a node name of lower-case letters, digits, '.', '_' or '-' (got {name!r})"))
        elif name in nodes[:i]:
            issues.append(((i,), f"names node {name!r} twice"))
    _raise_if(issues)
    return nodes


class ResourcesSpec(_Section):
    """The devices the job starts on."""

    devices: int = Field(2, ge=1, le=65536, description="Number of devices (processes) at start.")
    kind: Literal["cpu", "cuda"] = Field("cpu", description="Device type.")
    backend: Literal["auto", "gloo"] = Field(
        "auto",
        description="The workers' collectives. auto: gloo on CPU; on GPUs NCCL for CUDA tensors and gloo beside it "
        "for CPU ones. gloo: gloo for everything (several ranks sharing one GPU, which NCCL refuses).",
    )
    memory_gb: float | None = Field(
        None, gt=0.0, le=1e6, description="Memory per device in GiB, for the planner, which keeps the "
                                           "parallelism.memory_reserve of it free (null: measure).",
    )
    devices_per_node: int | None = Field(
        None, ge=1, le=1024, description="Devices per node, for the planner's communication model (null: one node)."
    )
    warm_workers: bool = Field(
        False,
        description=(
            "Keep the worker processes (torch and the trainer imported) alive across the device changes of a run "
            "on one node: a change costs a new process group, not new interpreters, its state moves from the "
            "workers' memory, and a planned change does not wait for a save of the step it stops at "
            "(docs/elastic.md). Jobs across nodes relaunch as before."
        ),
    )
    warm_spares: int = Field(
        1, ge=0, le=64,
        description=(
            "With warm_workers: how many idle warm processes are kept ready beside the job's, so that a rank that "
            "dies, or a device added, takes one at once instead of waiting for a fresh interpreter (each is "
            "replaced in the background; each costs one idle process's memory)."
        ),
    )
    nodes: list[str] | None = Field(
        None,
        max_length=4096,
        description=(
            "Names of the nodes the job runs on (null: this machine alone). Each node runs a Prefect worker on the "
            "work queue of its name in the pool of `node_deployment`; the job starts one launcher per node there. "
            "devices = nodes x devices_per_node (given nodes and devices_per_node, devices may be left out)."
        ),
    )
    min_devices: int | None = Field(
        None, ge=1, le=65536,
        description="In a pool (docs/pool.md): the fewest devices the job runs on; it waits rather than run on fewer "
                    "(null: 1).",
    )
    max_devices: int | None = Field(
        None, ge=1, le=65536,
        description="In a pool: the most devices the job is given (null: training.global_batch, one sequence each).",
    )
    priority: int = Field(
        0, ge=0, le=9,
        description="In a pool: a job of priority p counts 2**p times a job of priority 0 (0..9).",
    )
    pool: str | None = Field(
        None, max_length=63,
        description="The pool whose devices the job holds while it runs (`parashift submit --pool` sets it): each "
                    "segment takes its devices from the pool's Prefect concurrency limit, so no run oversubscribes it.",
    )
    node_deployment: str = Field(
        "node-launcher/parashift-node",
        max_length=300,
        description="The deployment (flow/deployment) of the per-node launcher (prefect.yaml's parashift-node).",
    )

    @field_validator("node_deployment")
    @classmethod
    def _flow_slash_deployment(cls, name: str) -> str:
        flow, _, deployment = name.partition("/")
        if not flow or not deployment or "/" in deployment or any(c.isspace() for c in name):
            raise ValueError(f"must be FLOW/DEPLOYMENT, e.g. node-launcher/parashift-node (got {name!r})")
        return name

    @field_validator("nodes")
    @classmethod
    def _node_names(cls, nodes: list[str] | None) -> list[str] | None:
        return checked_node_names(nodes)

    def outside_bounds(self, devices: int) -> tuple[str, int] | None:
        """("min_devices", its value) or ("max_devices", its value) where `devices` lies outside
        the job's own bounds (what a pool never gives it); None within them. The spec, an event
        and `parashift scale` all refuse such a count, each in its own words."""
        if self.min_devices is not None and devices < self.min_devices:
            return "min_devices", self.min_devices
        if self.max_devices is not None and devices > self.max_devices:
            return "max_devices", self.max_devices
        return None

    @model_validator(mode="after")
    def _pool_bounds(self) -> Self:
        low, high = self.min_devices or 1, self.max_devices
        if high is not None and low > high:
            _raise_if([(("min_devices",), f"must be <= max_devices ({low} > {high})")])
        if self.pool is not None and not _JOB_NAME.fullmatch(self.pool):
            _raise_if([(("pool",), f"must be a pool name of lower-case letters, digits, '.', '_' or '-' (got {self.pool!r})")])
        return self

    @model_validator(mode="after")
    def _devices_on_nodes(self) -> Self:
        if self.nodes is None:
            return self
        n = len(self.nodes)
        if "devices" not in self.model_fields_set and self.devices_per_node is not None:
            self.devices = n * self.devices_per_node  # devices follow from the nodes
            return self
        if self.devices_per_node is None:
            if self.devices % n:
                _raise_if([(("devices",), f"must be a multiple of the {n} nodes (got {self.devices}); "
                                          "or set resources.devices_per_node")])
            self.devices_per_node = self.devices // n
        elif self.devices != n * self.devices_per_node:
            _raise_if([(("devices",), f"must be nodes x devices_per_node = {n} x {self.devices_per_node} = "
                                      f"{n * self.devices_per_node} (got {self.devices})")])
        return self

    def node_devices(self, nodes: list[str]) -> int:
        """Devices (worker processes) on `nodes` of this job."""
        return len(nodes) * (self.devices_per_node or 1)


class ParallelismSpec(_Section):
    """Limits for the parallelization planner."""

    strategy: Literal["data-parallel", "auto", "pinned"] = Field(
        "data-parallel", description="'data-parallel' only, 'auto': let the planner search all placements, or "
                                     "'pinned': the plan `mesh` names (the data axis takes the devices left).",
    )
    mesh: dict[Literal["pp", "dp", "tp"], Annotated[int, Field(ge=1)]] | None = Field(
        None, description="With strategy 'pinned': the plan's degrees, e.g. {dp: 4, tp: 2} (torchtitan's way of "
                          "saying it). Their product must be resources.devices; on a change of device count tp and "
                          "pp stay and dp takes the rest (where it cannot, the planner's choice, and the run log "
                          "says why). The data axis is sharded (FSDP) where shard_data_parallel is true.",
    )
    micro_batches: int = Field(
        1, ge=1, le=1 << 16, description="With strategy 'pinned': micro-batches per step (pipelines need >= pp).",
    )
    max_tp: int | None = Field(
        None, ge=1, description="Largest tensor-parallel degree to consider (null: any)."
    )
    max_pp: int | None = Field(None, ge=1, description="Largest number of pipeline stages (null: any).")
    shard_data_parallel: bool = Field(
        True, description="Let the planner shard parameters, gradients and optimizer state over the data-parallel "
                          "axis (FSDP) where its cost model says it pays; false: data parallelism replicates them.",
    )
    precision: Literal["fp32", "bf16"] = Field("fp32", description="Compute precision.")
    mixed_precision: Literal["autocast", "fsdp"] = Field(
        "autocast",
        description="How bf16 compute is had: 'autocast' over fp32 parameters, or 'fsdp': FSDP2's mixed-precision "
                    "policy (bf16 parameters gathered and computed with, gradients reduced in fp32, fp32 master "
                    "weights and optimizer state; torchtitan's default). Checkpoints hold the same fp32 state "
                    "under both. Plans without a data-parallel axis run autocast.",
    )
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = Field(
        "auto",
        description="What each decoder layer keeps for backward: 'none' everything, 'selective' the outputs of "
                    "matmuls, attention and collectives (the rest recomputed), 'full' its input only (the layer "
                    "recomputed in backward). 'auto': the planner's choice under strategy 'auto' (checkpointing "
                    "only where the memory limit needs it), 'none' under 'data-parallel'.",
    )
    memory_reserve: float = Field(
        0.08, ge=0.0, lt=1.0,
        description="Fraction of each device's memory the planner leaves free for what its cost model does not "
                    "count (allocator fragmentation, communication buffers, the largest temporary).",
    )
    memory_reserve_gb: float = Field(
        1.0, ge=0.0, le=1e6, description="The least memory left free per device, in GiB (the larger of the two counts).",
    )
    compile: bool = Field(False, description="torch.compile the model.")
    pp_schedule: Literal["1F1B", "GPipe"] = Field(
        "1F1B", description="torch.distributed.pipelining's schedule for plans with pipeline stages: '1F1B' holds "
                            "at most as many micro-batches in flight as there are stages, 'GPipe' all of them.",
    )

    @model_validator(mode="after")
    def _pinned_needs_a_mesh(self) -> Self:
        if self.strategy == "pinned" and not self.mesh:
            _raise_if([(("mesh",), "strategy 'pinned' needs the plan's mesh, e.g. {dp: 4, tp: 2}")])
        if self.mesh and self.strategy != "pinned":
            _raise_if([(("strategy",), f"is {self.strategy!r} but a mesh is pinned: say strategy: pinned, or "
                                      "remove the mesh")])
        return self

    @model_validator(mode="after")
    def _mixed_precision_needs_bf16(self) -> Self:
        """'fsdp' under fp32 would be ignored: fp32 computes in fp32 throughout. ('autocast' is the default
        a form sends back, so only 'fsdp' is refused.)"""
        if self.mixed_precision == "fsdp" and self.precision != "bf16":
            _raise_if([(("mixed_precision",), f"{self.mixed_precision!r} says how bf16 compute is had, but "
                                             "parallelism.precision is 'fp32': set precision: bf16, or remove "
                                             "mixed_precision")])
        return self

    def ac_searched(self) -> tuple[str, ...]:
        """The activation checkpointing the planner may choose: the pinned mode, or every mode."""
        return AC_MODES if self.activation_checkpointing == "auto" else (self.activation_checkpointing,)

    def bf16_policy(self) -> str | None:
        """How bf16 compute is had ("autocast" or "fsdp"); None in fp32."""
        return self.mixed_precision if self.precision == "bf16" else None

    def pinned(self, devices: int) -> Plan:
        """The pinned plan on `devices` (`specs.plan.pinned_plan`); ValueError where it cannot be."""
        assert self.mesh is not None
        ac = "none" if self.activation_checkpointing == "auto" else self.activation_checkpointing
        return pinned_plan(dict(self.mesh), devices, sharded=self.shard_data_parallel, micro_batches=self.micro_batches,
                           activation_checkpointing=ac,
                           mixed_precision=self.mixed_precision if self.precision == "bf16" else "autocast")

    def plan_memory_bytes(self, device_bytes: int | None) -> int | None:
        """What the planner may fill of a device of `device_bytes` (None: unknown, unlimited):
        the device less the reserve, the larger of its fraction and its floor."""
        if device_bytes is None:
            return None
        reserve = max(self.memory_reserve * device_bytes, self.memory_reserve_gb * 2**30)
        return max(int(device_bytes - reserve), 0)


class MetricsSpec(_Section):
    """What rank 0 records per logged step (loss, gradient norm, lr, tokens/s, TFLOP/s, MFU,
    memory, data wait) besides the run log."""

    tensorboard: bool = Field(
        True, description="Write TensorBoard event files to the job's storage under jobs/{job}/metrics/ "
                          "(`tensorboard --logdir` on that folder, or a copy of it).",
    )
    wandb: bool = Field(
        False, description="Also record to Weights & Biases in offline mode (needs `pip install parashift[wandb]`; "
                           "no account or network): each segment's .wandb file goes to jobs/{job}/metrics/wandb/, "
                           "for `wandb sync` later.",
    )
    wandb_project: str = Field("parashift", min_length=1, description="The W&B project the offline runs belong to.")


class StorageSpec(_Section):
    """Where checkpoints, profiles and events are stored."""

    url: str = Field(
        "file://./parashift-store",
        description="fsspec URL of the store root (file://, memory://, s3://, gs://, az://, abfs://) or a local path.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra fsspec options such as endpoint_url or client_kwargs (no credentials).",
    )
    credentials_block: str | None = Field(
        None,
        description="Name of a Prefect Secret block holding the store's credentials.",
        json_schema_extra={"pattern": _BLOCK_NAME.pattern},
    )
    local_tier: str | None = Field(
        None,
        description=(
            "A folder on each node (host memory such as /dev/shm/parashift, or a local SSD) where the node keeps "
            "everything its ranks held at the two newest checkpoints; a restore on that node reads from there what "
            "it can and only the rest from the store, which still receives everything. '{node}' in the path is "
            "replaced by the node's name (nodes sharing a filesystem)."
        ),
    )
    local_tier_max_gb: float = Field(
        8.0, gt=0, description="Most a node keeps in its local tier; a rank whose share would exceed it skips the tier."
    )

    @field_validator("local_tier")
    @classmethod
    def _local_tier(cls, path: str | None) -> str | None:
        if path is None:
            return None
        if "://" in path and not path.startswith("file://"):
            raise ValueError(f"the local tier is a folder on the node, not a remote URL (got {path!r})")
        return path

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        if any(ch in url for ch in "*?["):
            raise ValueError(f"storage URL must be one location, not a glob (got {url!r})")
        return check_url(url, STORAGE_SCHEMES, what="storage")

    @field_validator("storage_options")
    @classmethod
    def _options(cls, options: dict[str, Any]) -> dict[str, Any]:
        return _check_storage_options(options)

    @field_validator("credentials_block")
    @classmethod
    def _block_name(cls, name: str | None) -> str | None:
        if name is not None and not _BLOCK_NAME.match(name):
            raise ValueError(
                f"must be a Prefect block name: lower-case letters, digits and '-', at most 63 (got {name!r})"
            )
        return name


# Why a job's resources change: one vocabulary for the spec's `elasticity`, resource events
# (`specs.elastic.ResourceEvent`, `parashift scale --reason`) and the job's records of them.
# scale: `parashift scale`'s default; scale-up, scale-down, manual: a person's or a tool's;
# preemption: the cluster took devices back; failure: a worker died or hung (the job's own
# change: one device fewer); node-left, node-joined: a node's worker went away or came back.
Reason = Literal["scale", "scale-up", "scale-down", "manual", "preemption", "failure", "node-left", "node-joined"]
REASONS: tuple[Reason, ...] = get_args(Reason)


class ResourceChange(_Section):
    """A scripted change of the device count (for demos and tests of elasticity)."""

    at_step: int = Field(
        ge=1, description="Apply the change before this step (0 < at_step < training.steps)."
    )
    devices: int = Field(ge=1, le=65536, description="Device count from then on.")
    reason: Reason = Field("manual", description="Why the resources change.")


_SECTIONS = ("model", "data", "optimizer", "training", "resources", "parallelism", "storage", "elasticity")


class JobSpec(_Section):
    """A parashift training job: what to train, on what, and where its state lives."""

    name: str = Field(
        description="Job id: lower-case letters, digits, '.', '_', '-'; at most 63 characters; no '..'.",
        json_schema_extra={"pattern": _JOB_NAME.pattern},
    )
    model: ModelSpec = Field(default_factory=MODEL_SECTIONS[DEFAULT_FAMILY],
                             description="The model to train: a family (gpt, llama, hf) and its shape.",
                             json_schema_extra=_any_of)
    data: DataSpec = Field(default_factory=DataSpec, description=DataSpec.__doc__)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description=OptimizerSpec.__doc__)
    training: TrainingSpec = Field(default_factory=TrainingSpec, description=TrainingSpec.__doc__)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description=ResourcesSpec.__doc__)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description=ParallelismSpec.__doc__)
    storage: StorageSpec = Field(default_factory=StorageSpec, description=StorageSpec.__doc__)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec, description=MetricsSpec.__doc__)
    elasticity: list[ResourceChange] = Field(
        default_factory=list, description="Scripted resource changes, in increasing at_step order."
    )

    @property
    def job_id(self) -> str:
        """The id used in storage paths and event resource ids."""
        return self.name

    def device_bounds(self) -> tuple[int, int]:
        """The fewest and the most devices the job runs on: its min and max devices, and at
        least one sequence per device."""
        batch = self.training.global_batch
        return self.resources.min_devices or 1, min(self.resources.max_devices or batch, batch)

    def on_devices(self, devices: int) -> JobSpec:
        """The same job on another device count (what a resource change runs)."""
        return self.model_copy(update={"resources": self.resources.model_copy(update={"devices": devices})})

    def on_nodes(self, nodes: list[str]) -> JobSpec:
        """The same job on another set of nodes, each with the spec's devices per node."""
        resources = self.resources.model_copy(update={"nodes": list(nodes), "devices": self.resources.node_devices(nodes)})
        return self.model_copy(update={"resources": resources})

    def with_storage_root(self, root: str) -> JobSpec:
        """The same job with a relative local storage URL (`file://./store`, `store`) made
        absolute under `root`: a spec read from a temporary checkout must not keep its state
        inside that checkout."""
        url = self.storage.url
        path = url.removeprefix("file://") if url.startswith("file://") else (url if "://" not in url else None)
        if path is None or path.startswith(("/", "~")):
            return self
        absolute = f"file://{Path(root).expanduser().resolve() / path}"
        return self.model_copy(update={"storage": self.storage.model_copy(update={"url": absolute})})

    def scripted_change_after(self, step: int) -> ResourceChange | None:
        """The next scripted change of the device count after `step` (the spec's `elasticity`):
        workers checkpoint at its step and the next launch resumes there on its devices."""
        return next((change for change in self.elasticity if change.at_step > step), None)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_mean_defaults(cls, data: Any) -> Any:
        # `parallelism:` followed only by comments is null in YAML; read it as "all defaults".
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in _SECTIONS and v is None)}
        return data

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        if not _JOB_NAME.fullmatch(name):
            raise ValueError(
                "must be a safe job id: lower-case letters, digits, '.', '_' or '-', starting with a letter "
                f"or digit, at most 63 characters (got {name!r})"
            )
        if ".." in name:
            raise ValueError(f"must not contain '..' (got {name!r})")
        return name

    @model_validator(mode="after")
    def _cross_section(self) -> Self:
        issues: list[tuple[Loc, str]] = []
        vocab = self.model.vocab_size  # None: a transformers config that leaves it to its default
        if self.data.bytes_tokenizer and self.data.format == "text" and vocab is not None and vocab < 256:
            issues.append(
                (
                    ("model", "vocab_size"),
                    f"must be >= 256 for the bytes tokenizer on text data (got {self.model.vocab_size})",
                )
            )
        if self.training.eval_every is not None and self.data.eval_url is None and self.data.eval_share is None:
            issues.append((("training", "eval_every"), "needs held-out data: set data.eval_url or data.eval_share"))
        batch = self.training.global_batch
        if (self.resources.min_devices or 1) > batch:
            issues.append((("resources", "min_devices"),
                           f"must be <= training.global_batch ({self.resources.min_devices} > {batch})"))
        pinned = self.parallelism.strategy == "pinned" and bool(self.parallelism.mesh)
        if self.resources.devices > batch and not pinned:  # a pinned mesh's data axis is checked against it instead
            issues.append(
                (
                    ("resources", "devices"),
                    f"must be <= training.global_batch ({self.resources.devices} > {batch}): "
                    "every device needs at least one sequence per step (or pin a mesh whose tp or pp take the rest)",
                )
            )
        issues += self._outside_bounds(("resources", "devices"), self.resources.devices)
        previous = 0
        for i, change in enumerate(self.elasticity):
            issues += self._outside_bounds(("elasticity", i, "devices"), change.devices)
            if change.at_step <= previous:
                issues.append(
                    (
                        ("elasticity", i, "at_step"),
                        f"must be greater than elasticity.{i - 1}.at_step ({change.at_step} <= {previous})",
                    )
                )
            elif change.at_step >= self.training.steps:
                issues.append(
                    (
                        ("elasticity", i, "at_step"),
                        f"must be < training.steps ({change.at_step} >= {self.training.steps})",
                    )
                )
            previous = max(previous, change.at_step)
            if change.devices > batch:
                issues.append(
                    (
                        ("elasticity", i, "devices"),
                        f"must be <= training.global_batch ({change.devices} > {batch}): "
                        "every device needs at least one sequence per step",
                    )
                )
        issues += self._pinned_plan_issues()
        _raise_if(issues)
        return self

    def _outside_bounds(self, where: Loc, devices: int) -> list[tuple[Loc, str]]:
        """A device count the job's own min_devices / max_devices rule out (`parashift run` took
        one without a word)."""
        match self.resources.outside_bounds(devices):
            case ("min_devices", low):
                return [(where, f"must be >= resources.min_devices ({devices} < {low})")]
            case ("max_devices", high):
                return [(where, f"must be <= resources.max_devices ({devices} > {high})")]
        return []

    def _pinned_plan_issues(self) -> list[tuple[Loc, str]]:
        """A pinned plan that cannot run on this model, batch and device count is refused here,
        with the trainer's reasons (those any family has; a family's own come at the launch)."""
        par = self.parallelism
        if par.strategy != "pinned" or not par.mesh:
            return []
        devices = 1
        for degree in par.mesh.values():
            devices *= degree
        if devices != self.resources.devices:
            return [(("parallelism", "mesh"), f"its degrees multiply to {devices} devices, but resources.devices is "
                                              f"{self.resources.devices}")]
        m = self.model
        reasons = plan_refusals(par.pinned(devices), n_layers=max(m.n_layers, 1),
                                n_heads=getattr(m, "n_heads", None) or 1, seq_len=m.seq_len,
                                global_batch=self.training.global_batch, n_kv_heads=getattr(m, "n_kv_heads", None))
        return [(("parallelism", "mesh"), f"the trainer cannot run it: {reason}") for reason in reasons]
