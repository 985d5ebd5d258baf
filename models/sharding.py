"""A family's sharding table: which modules of its decoder are which part of a Plan.

The Plan speaks of parts (specs/plan.py `TensorParallel`): the embedding and the head split on
the vocabulary, per layer a Megatron attention and MLP region (column-parallel linears, then one
row-parallel linear), the norms and the residual stream split on the sequence, and pipeline
stages of whole layers. A family says once, here, which of its modules play those parts; the
tensor-parallel styles (trainer.parallel), every parameter's shard dim, the pipeline stage split
and the checkpoint Layout (trainer.layout) are derived from it, so no code outside the family
folders names a parameter.

Every split a plan makes is on dim 0 of the tensor it splits: column-parallel linears are
`nn.Linear` (out, in) and row-parallel ones `models.layers.InputMajorLinear` (in, out), so each
rank's share of every tensor is a run of whole rows (docs/plans.md).

Pure data and string arithmetic: importable without torch.distributed (the flow computes
layouts before any process starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Region:
    """A Megatron region of one decoder layer: `colwise` linears split their output features,
    then `rowwise` splits its input features and sums the partial outputs (Shoeybi et al. 2019)."""

    part: Literal["attention", "mlp"]  # the Plan's TensorParallel field listing the layers it splits
    module: str  # the region's module inside a layer, e.g. "attn"
    colwise: tuple[str, ...]  # nn.Linear children of `module`: weight and bias split on dim 0
    rowwise: str  # the InputMajorLinear child of `module`: weight split on dim 0, bias replicated
    # Whether the activations between the region's entry and `rowwise` are split (attention
    # heads): dropout there draws per tp rank (trainer.parallel.apply_dropout_streams).
    split_inside: bool = False


@dataclass(frozen=True)
class ShardingTable:
    """Module names (attribute paths from the model's root) of a decoder's parts."""

    regions: tuple[Region, ...]
    embedding: str = "tok_emb"  # token embedding (vocab, d): vocab-parallel
    stream_start: str = "drop"  # the module whose input the sequence-parallel stream starts at
    layers: str = "blocks"  # a ModuleDict of decoder layers keyed by layer index
    layer_norms: tuple[str, ...] = ("attn_norm", "mlp_norm")  # per layer, sequence parallel
    stream_dropouts: tuple[str, ...] = ()  # per layer, dropouts on the residual stream
    final_norm: str = "norm"
    head: str = "lm_head"  # (vocab, d) nn.Linear: vocab-parallel
    first_stage: tuple[str, ...] = ("tok_emb", "drop")  # held by the first pipeline stage only
    last_stage: tuple[str, ...] = ("norm", "lm_head")  # held by the last pipeline stage only

    def layer_of(self, name: str) -> int | None:
        """The decoder layer a parameter (or module) name belongs to; None outside the layers."""
        head, _, rest = name.partition(".")
        if head != self.layers or not rest:
            return None
        return int(rest.split(".", 1)[0])

    def tp_shard_dims(self, names: list[str], choices: object) -> dict[str, int]:
        """Parameter name -> the dim tensor parallelism splits it along (always 0), for the parts
        `choices` (a TensorParallel) splits; parameters not named are replicated over tp."""
        dims: dict[str, int] = {}
        for name in names:
            module, _, kind = name.rpartition(".")
            if (module == self.embedding and getattr(choices, "embed", False)) or \
                    (module == self.head and getattr(choices, "head", False)):
                dims[name] = 0
                continue
            layer = self.layer_of(name)
            if layer is None:
                continue
            inside = module.split(".", 2)[2] if module.count(".") >= 2 else ""
            for region in self.regions:
                if layer not in getattr(choices, region.part, ()):
                    continue
                owner, _, linear = inside.rpartition(".")
                if owner != region.module:
                    continue
                if linear in region.colwise or (linear == region.rowwise and kind == "weight"):
                    dims[name] = 0
        return dims

    def stage_of(self, name: str, stages: list[list[int]]) -> int | None:
        """The pipeline stage holding parameter `name` under `stages` (None: no pipeline)."""
        if len(stages) == 1:
            return None
        top = name.split(".", 1)[0]
        if top in self.first_stage:
            return 0
        if top in self.last_stage:
            return len(stages) - 1
        layer = self.layer_of(name)
        if layer is None:
            raise ValueError(f"parameter {name!r} is in no pipeline stage of this family's sharding table")
        return next(s for s, layers in enumerate(stages) if layer in layers)
