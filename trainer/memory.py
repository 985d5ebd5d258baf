"""What a training step keeps in memory for its backward pass, measured.

`kept_for_backward` packs every tensor autograd saves (saved-tensor hooks) during one forward
of a family's model and counts each storage once (views share one), leaving out the parameters
themselves: the activation memory the planner's cost model must predict (planner/builders.py
`gpt_graph`, each op's `saved`). On a GPU, `torch.cuda.max_memory_allocated` around the same
forward checks it from the allocator's side (bench/activation_memory.py).
"""

from __future__ import annotations

import contextlib

import torch
from parashift.models.layers import token_loss_sum


def kept_for_backward(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, precision: str) -> int:
    """Bytes of the distinct storages autograd keeps for one forward and loss of `tokens`
    ((B, T) ids) under the trainer's `precision` ("bf16": autocast over fp32 weights)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    autocast = (torch.autocast(tokens.device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        token_loss_sum(model(tokens), targets)
    return sum(kept.values())
