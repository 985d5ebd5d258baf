"""Activation memory: what the planner counts against what the trainer's GPT keeps.

For one forward (and loss) of the trainer's GPT: the bytes autograd keeps for backward
(`trainer.memory.kept_for_backward`), on a GPU also the allocator's growth over the forward
(`torch.cuda.max_memory_allocated`, which adds the forward's transient peak), and the planner's
count for the same batch (each op's `saved` plus autocast's weight copies).

    python -m bench.activation_memory [--device cpu|cuda] [--layers 4 --d-model 256 ...]

Last line: one JSON object with `kept_bytes`, `planned_bytes`, `planned_over_kept` and, on a GPU,
`allocated_bytes`.
"""

from __future__ import annotations

import argparse
import json

import torch
from parashift.models.gpt.model import GPT, GPTConfig
from parashift.models.layers import token_loss_sum
from parashift.planner.builders import gpt_graph
from parashift.planner.costs import data_parallel_activation_bytes
from parashift.trainer.memory import kept_for_backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    config = GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, vocab_size=args.vocab,
                       seq_len=args.seq_len)
    device = torch.device(args.device)
    model = GPT(config).to(device)
    tokens, targets = torch.randint(0, config.vocab_size, (2, args.batch, config.seq_len), device=device)
    kept = kept_for_backward(model, tokens, targets, args.precision)
    result = {"benchmark": "activation_memory", "device": args.device, "config": vars(args), "kept_bytes": kept}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = token_loss_sum(model(tokens), targets)
        torch.cuda.synchronize()
        result["allocated_bytes"] = torch.cuda.memory_allocated() - before  # held for backward
        result["peak_bytes"] = torch.cuda.max_memory_allocated() - before
        del loss
    graph = gpt_graph(config.n_layers, config.d_model, config.n_heads, config.vocab_size, config.seq_len, args.batch,
                      precision=args.precision)
    planned = data_parallel_activation_bytes(graph)
    result.update(planned_bytes=planned, planned_over_kept=round(planned / kept, 5))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
