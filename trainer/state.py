"""The kinds of training state, each in one place: where it lives under a Plan, how a rank
collects it for a save, what a restore reads into, and how it is applied.

A checkpoint is these kinds and nothing else (`STATE_KINDS`), so a new kind (say a family's
extra buffers) is one class here and one entry in the tuple: the Layout (`trainer.layout`),
the saver, the restore and the reshard planning all follow from it.

- `Parameters`: `model/<name>`, placed as the family's sharding table and the Plan say;
- `OptimizerState`: AdamW's `optim/<name>/{exp_avg,exp_avg_sq}` placed like their parameter,
  and its scalar `optim/<name>/step` on the parameter's stage;
- `RandomState`: each rank's generators, `rng/rank<r>/{cpu,cuda}`, held by that rank alone;
- the data position is not a tensor: it travels in the manifest (`DataPosition.to_manifest`,
  `DataPosition.from_manifest` in `trainer.data`), the same number on every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from parashift.ptc.dtensor import local_data
from parashift.ptc.layout import Layout, TensorPlacement
from parashift.ptc.transpose import copy_across_transpose
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from parashift.trainer.optim import LocalShardAdamW

# AdamW's per-parameter state: two moments shaped and placed like the parameter, and a scalar
# float32 step count (torch.optim.AdamW without `capturable`).
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Held:
    """What one rank holds live: its optimizer (over its part of the model, whose local shards
    it keeps as `views`), the module itself, its rank and device."""

    optimizer: LocalShardAdamW
    model: nn.Module | None = None  # not needed for a restore's destinations
    rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def module(self) -> nn.Module:
        if self.model is None:
            raise ValueError("this use of the training state needs the live module")
        return self.model


class StateKind:
    """One kind of training state, its tensors named under `prefix/`."""

    prefix: ClassVar[str]

    def placements(self, parameters: dict[str, TensorPlacement], devices: int,
                   rng_bytes: dict[str, int]) -> dict[str, TensorPlacement]:
        """Where each tensor of this kind lives under a Plan, given where every parameter
        lives (`parameters`, by parameter name), the Plan's device count and the size of each
        generator's state."""
        raise NotImplementedError

    def collect(self, held: Held, *, local: bool) -> dict[str, torch.Tensor]:
        """The tensors a save writes: global ones (DTensors whose local shard is this rank's
        box, or whole tensors), or with `local` only this rank's boxes."""
        raise NotImplementedError

    def destinations(self, held: Held, *, in_place: bool) -> dict[str, torch.Tensor]:
        """Host tensors a restore reads this kind into (none: the restore allocates them)."""
        return {}

    def apply(self, tensors: dict[str, torch.Tensor], held: Held, *, adopt: bool) -> None:
        """Put restored tensors (this rank's boxes, under `prefix/`) into the live state."""
        raise NotImplementedError

    def own(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of `tensors` that are this kind's, their prefix removed."""
        start = f"{self.prefix}/"
        return {name[len(start):]: t for name, t in tensors.items() if name.startswith(start)}


class Parameters(StateKind):
    prefix = "model"

    def placements(self, parameters, devices, rng_bytes):
        return {f"model/{name}": where for name, where in parameters.items()}

    def collect(self, held, *, local):
        return {f"model/{name}": local_data(p).detach() if local else p.detach()
                for name, p in held.module.named_parameters()}

    def destinations(self, held, *, in_place):
        """Each parameter's local shard (in place) or a new host tensor shaped like it; GPU
        parameters are read into new host tensors by the restore and copied over."""
        out = {}
        for name, view in held.optimizer.views.items():
            live = view.detach()  # outside autograd: written through
            if live.device.type == "cpu":
                out[f"model/{name}"] = live if in_place and live.is_contiguous() else torch.empty_like(live)
        return out

    def apply(self, tensors, held, *, adopt):
        """`adopt`: a plain parameter takes a restored host tensor as its data instead of
        copying it; only before anything (compile, a pipeline stage) has taken hold of
        parameter storage."""
        with torch.no_grad():
            for name, param in held.module.named_parameters():
                value, live = tensors[f"model/{name}"], local_data(param)
                if value.data_ptr() == live.data_ptr() and value.shape == live.shape:
                    continue  # read in place
                if (adopt and not isinstance(param, DTensor) and value.device == param.device
                        and value.dtype == param.dtype and value.shape == param.shape and value.is_contiguous()):
                    param.data = value
                else:
                    copy_across_transpose(live, value)


class OptimizerState(StateKind):
    prefix = "optim"

    def placements(self, parameters, devices, rng_bytes):
        out = {}
        for name, where in parameters.items():
            for moment in MOMENTS:
                out[f"optim/{name}/{moment}"] = where
            out[f"optim/{name}/step"] = TensorPlacement((), "float32", where.stage)
        return out

    def collect(self, held, *, local):
        return {f"optim/{key}": value for key, value in held.optimizer.state_tensors(local=local).items()}

    def destinations(self, held, *, in_place):
        """New tensors for the whole state, or (in place) the live ones where they exist: a
        checkpoint refused half-way then needs `LocalShardAdamW.clear_state`."""
        state = held.optimizer.empty_state_tensors()
        if in_place:
            for key, live in held.optimizer.state_tensors(local=True).items():
                if key in state and _fits(live, state[key]):
                    state[key] = live
        return {f"optim/{name}": t for name, t in state.items()}

    def apply(self, tensors, held, *, adopt):
        # The optimizer adopts these tensors as its state: contiguous, as it would have made them.
        held.optimizer.load_state_tensors({key: value.contiguous() for key, value in self.own(tensors).items()})


class RandomState(StateKind):
    prefix = "rng"

    def placements(self, parameters, devices, rng_bytes):
        return {f"rng/rank{rank:05d}/{device}": TensorPlacement((size,), "uint8", rank=rank)
                for rank in range(devices) for device, size in rng_bytes.items()}

    def collect(self, held, *, local):
        return generator_states(held.rank, held.device)

    def apply(self, tensors, held, *, adopt):
        cpu = tensors.get(f"rng/rank{held.rank:05d}/cpu")
        if cpu is not None:
            torch.set_rng_state(cpu)
        cuda = tensors.get(f"rng/rank{held.rank:05d}/cuda")
        if cuda is not None and held.device.type == "cuda":
            torch.cuda.set_rng_state(cuda, held.device)


STATE_KINDS: tuple[StateKind, ...] = (Parameters(), OptimizerState(), RandomState())


def generator_states(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's generator states as a checkpoint names them (copies)."""
    state = {f"{RandomState.prefix}/rank{rank:05d}/cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state[f"{RandomState.prefix}/rank{rank:05d}/cuda"] = torch.cuda.get_rng_state(device)
    return state


def rng_state_bytes(device: torch.device) -> dict[str, int]:
    """Bytes of each generator state a rank saves: the CPU one always, the CUDA one on GPUs
    (the live size where a GPU is present; else its Philox seed and offset, 16 bytes)."""
    sizes = {"cpu": torch.get_rng_state().numel()}
    if device.type == "cuda":
        sizes["cuda"] = torch.cuda.get_rng_state(device).numel() if torch.cuda.is_available() else 16
    return sizes


def collect_state(model: nn.Module, optimizer: LocalShardAdamW, rank: int, device: torch.device,
                  *, local: bool = False) -> dict[str, torch.Tensor]:
    """The training state as named global tensors: whole tensors, or DTensors whose local
    shard is this rank's box; `local`: just this rank's boxes (cheaper: a save knows the
    Layout, only the check against it needs DTensors)."""
    held = Held(optimizer, model, rank, device)
    return {name: t for kind in STATE_KINDS for name, t in kind.collect(held, local=local).items()}


def restore_destinations(optimizer: LocalShardAdamW, *, in_place: bool = False) -> dict[str, torch.Tensor]:
    """Host tensors for a restore to read into, adopted afterwards by `apply_state(adopt=True)`.

    Default: new ones for every parameter and the optimizer's state, so a checkpoint refused
    half-way leaves the live state as it was. `in_place`: the parameters' own local shards
    (DTensor or plain) and whatever optimizer state exists, new tensors only for state not
    yet created: no second copy of the state, and no page faults on memory the process has
    already touched (on 4 ranks sharing 2 cores, reading into fresh memory took 2-4x as long).
    The caller of an in-place restore that refused every checkpoint initialises the model
    again and clears the optimizer state (`LocalShardAdamW.clear_state`)."""
    held = Held(optimizer)  # destinations need the optimizer's views only
    return {name: t for kind in STATE_KINDS for name, t in kind.destinations(held, in_place=in_place).items()}


def apply_state(tensors: dict[str, torch.Tensor], model: nn.Module, optimizer: LocalShardAdamW, rank: int,
                device: torch.device, *, adopt: bool = False) -> None:
    """Put restored tensors (this rank's boxes of every kind) into the live model, optimizer
    and generators (see `Parameters.apply` for `adopt`)."""
    held = Held(optimizer, model, rank, device)
    for kind in STATE_KINDS:
        kind.apply(tensors, held, adopt=adopt)


def _fits(live: torch.Tensor, fresh: torch.Tensor) -> bool:
    return (live.shape == fresh.shape and live.dtype == fresh.dtype and live.device == fresh.device
            and live.is_contiguous())


def rank_private(name: str) -> int | None:
    """The rank whose own state tensor `name` is (its generator state, `RandomState`), or None
    for state every plan lays out over its ranks."""
    match = re.fullmatch(rf"{RandomState.prefix}/rank(\d+)/\w+", name)
    return int(match.group(1)) if match else None


def held_by_kept(layout: Layout, devices: int) -> bool:
    """Whether the ranks of `layout` whose processes warm workers keep for a job on `devices`
    devices (`Layout.covering_ranks`, as `launcher.warm_pool` keeps them) hold every box it
    needs, so that they can serve it from memory alone. Ranks' own generator states do not
    count: every warm rank holds every rank's (`trainer.worker`, at the end of a segment)."""
    kept = set(layout.covering_ranks(devices)[:devices])
    return all(kept & set(ranks) for name, _, ranks in layout.distinct_slices() if rank_private(name) is None)
