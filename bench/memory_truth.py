"""Memory truth: the planner's predicted peak per device against what the real trainer holds.

Each case builds the family, runs the trainer's own `parallelize` and one real training step
(forward, backward, optimizer) for one rank of a world of N on torch's fake process group, and
reads that rank's peak with torch's memory trackers (`trainer.memory_probe`): on real CPU
tensors at CPU sizes, under `FakeTensorMode` at the Llama 3 8B and 70B shapes (no memory is
allocated). The prediction is the cost model's estimate of the same plan (`planner.pinned`).

    python -m bench.memory_truth [--quick]     # --quick: CPU sizes and the 8B shape only

Last line: `{"cases": [{"name", "world", "plan", "ac", "precision", "predicted_gib",
"measured_gib", "ratio"}]}` (ratio = predicted / measured).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

from parashift.models import family_of
from parashift.planner.pinned import estimate
from parashift.planner.profile import profile_graph
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.memory_probe import measure_step_peak

GIB = 2**30

# A small Llama (grouped-query attention, SwiGLU) where activations and state both matter.
SMALL_LLAMA = {"family": "llama", "n_layers": 4, "d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 704,
               "vocab_size": 2048, "seq_len": 256}
SMALL_GPT = {"n_layers": 4, "d_model": 256, "n_heads": 8, "vocab_size": 2048, "seq_len": 256}
# Llama 3 8B and 70B (Meta's model cards: dim, layers, heads, kv heads, ffn, vocab), at 8192 tokens.
LLAMA3_8B = {"family": "llama", "n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336,
             "vocab_size": 128256, "seq_len": 8192, "rope_theta": 500000.0}
LLAMA3_70B = {**LLAMA3_8B, "n_layers": 80, "d_model": 8192, "n_heads": 64, "ffn_dim": 28672}


@dataclass
class Case:
    name: str
    model: dict[str, Any]
    plan: Plan
    global_batch: int
    precision: str = "fp32"
    mixed_precision: str = "autocast"
    fake: bool = False
    rank: int = 0  # the rank measured: under a pipeline, its stage's prediction is the one compared
    device: str = "cpu"  # where the measured rank's real tensors live (bench.gpu.memory: "cuda")

    @property
    def stage(self) -> int:
        return self.rank // (self.plan.devices // self.plan.degree("pp"))

    def spec(self) -> JobSpec:
        share = self.global_batch // self.plan.degree("dp")
        return JobSpec.model_validate({
            "name": f"memory-{self.name}", "model": self.model,
            "training": {"global_batch": self.global_batch, "micro_batch": max(share // self.plan.micro_batches, 1)},
            "resources": {"devices": self.plan.devices, "kind": self.device},
            "parallelism": {"precision": self.precision, "mixed_precision": self.mixed_precision},
        })

    def predicted_bytes(self) -> float:
        """The cost model's peak for the measured rank's stage of this plan (`planner.pinned`)."""
        m = self.spec().model
        profile = profile_graph(family_of(m).graph(m, self.global_batch, self.precision), "cuda")
        mixed = self.mixed_precision if self.precision == "bf16" else None
        return estimate(profile, self.plan, mixed, stage=self.stage).memory_bytes


def _plan(mesh: dict[str, int], ac: str = "none", sharded: bool = False, mixed: str = "autocast",
          micro_batches: int = 1) -> Plan:
    devices = 1
    for n in mesh.values():
        devices *= n
    return Plan(devices=devices, mesh=mesh, dp_shard=mesh.get("dp", 1) if sharded else 1, strategy="hand",
                activation_checkpointing=ac, mixed_precision=mixed, micro_batches=micro_batches)


def cpu_cases() -> list[Case]:
    """Real tensors: every plan kind the estimate covers, each checkpointing mode, both bf16 ways."""
    out = []
    for family, model in (("llama", SMALL_LLAMA), ("gpt", SMALL_GPT)):
        out += [
            Case(f"{family}-dp2", model, _plan({"dp": 2}), 8),
            Case(f"{family}-fsdp2", model, _plan({"dp": 2}, sharded=True), 8),
            Case(f"{family}-tp2", model, _plan({"tp": 2}), 4),
            Case(f"{family}-fsdp2-selective", model, _plan({"dp": 2}, "selective", True), 8),
            Case(f"{family}-fsdp2-full", model, _plan({"dp": 2}, "full", True), 8),
        ]
    out += [
        Case("llama-dp2xtp2", SMALL_LLAMA, _plan({"dp": 2, "tp": 2}), 8),
        Case("llama-tp2-selective", SMALL_LLAMA, _plan({"tp": 2}, "selective"), 4),
        Case("llama-fsdp2-bf16-autocast", SMALL_LLAMA, _plan({"dp": 2}, sharded=True), 8, "bf16"),
        Case("llama-fsdp2-bf16-fsdp", SMALL_LLAMA, _plan({"dp": 2}, sharded=True, mixed="fsdp"), 8, "bf16", "fsdp"),
        Case("llama-fsdp2-bf16-fsdp-selective", SMALL_LLAMA, _plan({"dp": 2}, "selective", True, "fsdp"), 8, "bf16",
             "fsdp"),
        # Pipelines (1F1B): the first stage holds the most micro-batches in flight, the last the loss.
        Case("llama-pp2xdp2-stage0", SMALL_LLAMA, _plan({"pp": 2, "dp": 2}, micro_batches=4), 16),
        Case("llama-pp2xdp2-last-stage", SMALL_LLAMA, _plan({"pp": 2, "dp": 2}, micro_batches=4), 16, rank=3),
        Case("llama-pp2xfsdp2xtp2-selective", SMALL_LLAMA, _plan({"pp": 2, "dp": 2, "tp": 2}, "selective", True,
                                                                  micro_batches=4), 16),
    ]
    return out


def scale_cases(quick: bool) -> list[Case]:
    """Fake tensors at real shapes: the 8B on 8 ranks (torchtitan's FSDP + selective, and the
    planner's own pick for the spec of the issue), the 70B on 64 (tp 8 x FSDP 8)."""
    bf16 = {"precision": "bf16", "mixed_precision": "fsdp", "fake": True}
    out = [
        Case("llama3-8b-fsdp8-selective", LLAMA3_8B, _plan({"dp": 8}, "selective", True, "fsdp"), 8, **bf16),
        Case("llama3-8b-fsdp8-full", LLAMA3_8B, _plan({"dp": 8}, "full", True, "fsdp"), 8, **bf16),
        Case("llama3-8b-dp4xtp2-fsdp-selective", LLAMA3_8B, _plan({"dp": 4, "tp": 2}, "selective", True, "fsdp"), 8,
             **bf16),
    ]
    out.append(Case("llama3-8b-planner-pick", LLAMA3_8B, planner_pick(LLAMA3_8B, 8, 8, 80.0), 8, **bf16))
    if not quick:
        # torchtitan's llama3_70b: tp 8 x FSDP 8, local batch 8 x 8192 (64 devices need >= 64 sequences).
        out += [Case("llama3-70b-tp8xfsdp8-selective", LLAMA3_70B,
                     _plan({"dp": 8, "tp": 8}, "selective", True, "fsdp"), 64, **bf16),
                Case("llama3-70b-tp8xfsdp8-full", LLAMA3_70B, _plan({"dp": 8, "tp": 8}, "full", True, "fsdp"), 64,
                     **bf16),
                # With a pipeline: 2 stages of 40 layers, each tp 8 x FSDP 4; 16 micro-batches of one
                # sequence per data rank (1F1B). Rank 0 is the first stage (2 micro-batches in flight).
                Case("llama3-70b-pp2xfsdp4xtp8-selective", LLAMA3_70B,
                     _plan({"pp": 2, "dp": 4, "tp": 8}, "selective", True, "fsdp", micro_batches=16), 64, **bf16)]
    return out


def planner_pick(model: dict[str, Any], devices: int, global_batch: int, memory_gb: float) -> Plan:
    """What `parashift plan` picks for this model, batch and device memory (strategy auto, bf16
    through FSDP2's policy, checkpointing the planner's choice), as the trainer would run it."""
    from parashift.planner.search import plan_model
    from parashift.specs.plan import AC_MODES

    spec = JobSpec.model_validate({"name": "pick", "model": model, "training": {"global_batch": global_batch,
                                   "micro_batch": 1}, "resources": {"devices": devices, "kind": "cuda",
                                   "memory_gb": memory_gb}, "parallelism": {"strategy": "auto", "precision": "bf16",
                                                                            "mixed_precision": "fsdp"}})
    m, par = spec.model, spec.parallelism
    profile = profile_graph(family_of(m).graph(m, global_batch, "bf16"), "cuda", memory_gb=memory_gb)
    plan = plan_model(profile, devices, par.plan_memory_bytes(profile.device.memory_bytes), ac_modes=AC_MODES,
                      mixed_precision="fsdp")
    return plan.model_copy(update={"mixed_precision": "fsdp"})


def run_case(case: Case) -> dict[str, Any]:
    spec = case.spec()
    predicted = case.predicted_bytes()
    started = time.perf_counter()
    measured = measure_step_peak(spec, case.plan, rank=case.rank, fake=case.fake)
    plan = " x ".join(f"{axis}{n}" for axis, n in case.plan.mesh.items())
    if case.plan.dp_shard > 1:
        plan += " (FSDP)" if case.plan.reshard_after_forward else " (FSDP, kept gathered after forward)"
    precision = case.precision if case.precision == "fp32" else f"bf16-{case.mixed_precision}"
    return {"name": case.name, "world": case.plan.devices, "plan": plan, "ac": case.plan.activation_checkpointing,
            "precision": precision, "fake": case.fake, "predicted_gib": round(predicted / GIB, 4),
            "measured_gib": round(measured["peak_bytes"] / GIB, 4), "ratio": round(predicted / measured["peak_bytes"], 4),
            "measured": {k: round(v / GIB, 4) for k, v in measured.items() if k.endswith("bytes") or k in (
                "params", "grads", "optimizer", "activations", "temporaries")},
            "seconds": round(time.perf_counter() - started, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CPU sizes and the 8B shape only (no 70B)")
    parser.add_argument("--only", default="", help="comma-separated case names")
    args = parser.parse_args()
    cases = cpu_cases() + scale_cases(args.quick)
    if args.only:
        cases = [c for c in cases if c.name in args.only.split(",")]
    results = []
    for case in cases:
        try:
            row = run_case(case)
        except Exception as error:  # one case's failure loses nothing else
            row = {"name": case.name, "error": f"{type(error).__name__}: {error}"[:300]}
        print(json.dumps(row), flush=True)
        results.append(row)
    print(json.dumps({"benchmark": "memory_truth", "cases": results}))


if __name__ == "__main__":
    main()
