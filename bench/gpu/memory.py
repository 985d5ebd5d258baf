"""Part 2 of the GPU check, memory: the planner's predicted peak per device against what the
trainer's own step really allocates on the GPU (`torch.cuda.max_memory_allocated` over one
steady-state step, optimizer state present; `trainer.memory_probe` on real CUDA tensors).

Cases: the Llama 3.2 1B shape on one GPU without, with selective and with full activation
checkpointing (bf16 autocast), and as rank 0 of an FSDP world of 8 with FSDP2's bf16 policy;
the Llama 3 8B shape as rank 0 of FSDP over 8 with selective checkpointing (torchtitan's
`llama3_8b`: local batch 1 x 8192), whose peers are torch's fake process group (collectives
return at once, the rank's own memory is real); and the 8B shape on one GPU, cut to as many
layers as the estimate fits in 80% of the device. `ratio` = predicted / measured (allocator);
`tracker_gib` is what torch's memory tracker counted in the same step (CPU runs: the only one).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from parashift.bench.gpu.common import case, device_name, free_cuda, part_args
from parashift.bench.memory_truth import Case
from parashift.specs.plan import Plan
from parashift.trainer.memory_probe import measure_step_peak

PART = "memory"
GIB = 2**30
LLAMA3_1B = {"family": "llama", "n_layers": 16, "d_model": 2048, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 8192,
             "vocab_size": 128256, "seq_len": 2048, "rope_theta": 500000.0, "tie_embeddings": True}
LLAMA3_8B = {"family": "llama", "n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336,
             "vocab_size": 128256, "seq_len": 8192, "rope_theta": 500000.0}
TINY = {"family": "llama", "n_layers": 4, "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256,
        "vocab_size": 1024, "seq_len": 128}


def gpu_case(name: str, model: dict[str, Any], plan: Plan, global_batch: int, device: str) -> Case:
    """A memory-truth case in bf16 (autocast, or FSDP2's policy as the plan says) on `device`."""
    return Case(name, model, plan, global_batch, "bf16", plan.mixed_precision, device=device)


def one_gpu(ac: str) -> Plan:
    return Plan(devices=1, mesh={"dp": 1}, strategy="hand", activation_checkpointing=ac, mixed_precision="autocast")


def fsdp(world: int, ac: str) -> Plan:
    return Plan(devices=world, mesh={"dp": world}, dp_shard=world, strategy="hand", activation_checkpointing=ac,
                mixed_precision="fsdp")


def cases(tiny: bool, capacity_bytes: float, device: str) -> list[Case]:
    small, large = (TINY, TINY) if tiny else (LLAMA3_1B, LLAMA3_8B)
    batch = 2 if tiny else 8
    out = [gpu_case(f"llama3-1b-1gpu-{ac}", small, one_gpu(ac), batch, device) for ac in ("none", "selective", "full")]
    out.append(gpu_case("llama3-1b-fsdp8-selective-bf16", small, fsdp(8, "selective"), 8 * batch, device))
    out.append(gpu_case("llama3-8b-fsdp8-selective-bf16", large, fsdp(8, "selective"), 8, device))
    out.append(most_layers_that_fit(large, capacity_bytes, device))
    return out


def most_layers_that_fit(model: dict[str, Any], capacity_bytes: float, device: str) -> Case:
    """The 8B shape on one GPU (fp32 state, bf16 autocast, selective checkpointing, batch 1),
    cut to as many layers as the estimate fits in 80% of the device."""
    best = None
    for layers in range(1, model["n_layers"] + 1):
        candidate = gpu_case(f"llama3-8b-1gpu-{layers}-layers-selective", {**model, "n_layers": layers},
                             one_gpu("selective"), 1, device)
        if candidate.predicted_bytes() > 0.8 * capacity_bytes:
            break
        best = candidate
    if best is None:
        raise RuntimeError("not even one layer of the 8B shape fits")
    return best


def run_case(c: Case, device: str) -> dict[str, Any]:
    predicted = c.predicted_bytes()
    started = time.perf_counter()
    measured = measure_step_peak(c.spec(), c.plan, rank=0, fake=False, device=device)
    truth = measured.get("cuda_peak_bytes", measured["peak_bytes"])
    return {"world": c.plan.devices, "layers": c.model["n_layers"], "ac": c.plan.activation_checkpointing,
            "precision": f"bf16-{c.plan.mixed_precision}" if c.precision == "bf16" else c.precision,
            "global_batch": c.global_batch, "predicted_gib": round(predicted / GIB, 3),
            "measured_gib": round(truth / GIB, 3), "ratio": round(predicted / truth, 4),
            "tracker_gib": round(measured["peak_bytes"] / GIB, 3),
            "reserved_gib": round(measured.get("cuda_reserved_bytes", 0.0) / GIB, 3),
            "breakdown_gib": {k: round(v / GIB, 3) for k, v in measured.items()
                              if k in ("params", "grads", "optimizer", "activations", "temporaries", "unsharded_params")},
            "step_s": round(time.perf_counter() - started, 2)}


def main() -> None:
    args = part_args(__doc__)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        capacity = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        capacity = 2 * GIB if args.tiny else 64 * GIB
    for c in cases(args.tiny, capacity, args.device):
        with case(PART, c.name) as fields:
            fields["device"] = device_name(device)
            fields.update(run_case(c, args.device))
        free_cuda()


if __name__ == "__main__":
    main()
