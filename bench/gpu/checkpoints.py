"""Part 3 of the GPU check, checkpoints: GPT-2 124M + AdamW on one GPU (the model the anchors
were measured on), saved and restored by parashift and by DCP in the same call, against the
disk's raw write of the same bytes.

- `stall_s`: what a training loop waits for one save: parashift's (the device-to-host snapshot
  into pinned buffers at `save`, plus any wait at the next optimizer step while a forward and
  backward pass runs) against DCP's `async_save` (its staging, plus the wait on its future at
  the next optimizer step). Anchors: pinned snapshot 37 ms, DCP async 0.74-1.22 s.
- `save_s` / `save_GBps`: a blocking save; `raw_write_GBps`: write + fsync of the same bytes.
- `restore_s` against `dcp_load_s`: reading the state back into the model and optimizer.
Medians over `ROUNDS`.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from parashift.bench.gpu.common import case, device_name, part_args, synced
from parashift.models.gpt.model import GPT, GPTConfig
from parashift.specs import JobSpec, example_path, load_spec
from parashift.specs.plan import Plan
from parashift.storage import CheckpointStore, ObjectStore
from parashift.trainer.checkpoint import Checkpointer, restore_latest
from parashift.trainer.layout import state_layout
from parashift.trainer.optim import LocalShardAdamW
from parashift.trainer.state import apply_state, collect_state, rng_state_bytes
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

PART = "checkpoints"
ROUNDS = 3


def job_spec(device: str, tiny: bool) -> JobSpec:
    spec = load_spec(example_path("gpt2-small-cuda"))
    update: dict[str, Any] = {"resources": spec.resources.model_copy(update={"kind": device})}
    if tiny:
        update["model"] = spec.model.model_copy(update={"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 64})
        update["training"] = spec.training.model_copy(update={"global_batch": 4, "micro_batch": 2})
    return spec.model_copy(update=update)


def train_pass(model: GPT, config: GPTConfig, device: torch.device, batch: int) -> None:
    """One forward and backward pass: what a save overlaps in training."""
    idx = torch.randint(0, config.vocab_size, (batch, config.seq_len), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(idx)
    F.cross_entropy(logits.float().flatten(0, 1), idx.flatten()).backward()
    synced(device)


def median(values: list[float], digits: int = 4) -> float:
    return round(statistics.median(values), digits)


def main() -> None:
    args = part_args(__doc__)
    device = torch.device(args.device)
    spec = job_spec(args.device, args.tiny)
    config = GPTConfig.of(spec.model)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = LocalShardAdamW(model, spec, device)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # the optimizer state exists, as in training
    optimizer.zero_grad()
    synced(device)
    folder = Path(args.dir)
    layout = state_layout(Plan.data_parallel(1), spec.model, rng_state_bytes(device))
    store = CheckpointStore(ObjectStore(f"file://{folder}/parashift"), "gpu-check")
    batch = spec.training.micro_batch

    def state() -> dict[str, torch.Tensor]:
        return collect_state(model, optimizer, 0, device, local=True)

    with case(PART, "parashift") as fields:
        # CPU runs copy host tensors at save (their buffers are then what the raw write writes).
        ck = Checkpointer(store, layout, 0, keep=2, copy_host_memory=device.type == "cpu")
        ck.save(1, state(), {"samples_consumed": 0}, {}, {}, blocking=True)  # allocates the pinned buffers
        saves, stalls = [], []
        step = 1
        for _ in range(ROUNDS):
            step += 1
            started = time.perf_counter()
            ck.save(step, state(), {"samples_consumed": 0}, {}, {}, blocking=True)
            saves.append(time.perf_counter() - started)
            step += 1
            started = time.perf_counter()
            report = ck.save(step, state(), {"samples_consumed": 0}, {}, {})
            snapshot_s = time.perf_counter() - started
            train_pass(model, config, device, batch)
            started = time.perf_counter()
            ck.before_update()
            stalls.append(snapshot_s + time.perf_counter() - started)
            ck.wait()
            optimizer.zero_grad()
        nbytes = sum(t.numel() * t.element_size() for t in ck.host_buffers) if ck.host_buffers else report.bytes_written
        raws = []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            with open(folder / "raw.bin", "wb", buffering=0) as f:
                for t in ck.host_buffers:
                    f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                os.fsync(f.fileno())
            raws.append(time.perf_counter() - started)
        (folder / "raw.bin").unlink()
        ck.close()
        restores = []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            restored = restore_latest(store, layout, 0)
            assert restored is not None and restored.step == step, restored
            apply_state(restored.tensors, model, optimizer, 0, device)
            synced(device)
            restores.append(time.perf_counter() - started)
        save_s, raw_s = statistics.median(saves), statistics.median(raws)
        fields.update(device=device_name(device), torch=torch.__version__,
                      params=sum(p.numel() for p in model.parameters()), state_bytes=nbytes,
                      stall_s=median(stalls), stalls_s=[round(s, 4) for s in stalls], save_s=median(saves, 3),
                      save_GBps=round(nbytes / save_s / 1e9, 3), raw_write_GBps=round(nbytes / raw_s / 1e9, 3),
                      save_over_raw=round(raw_s / save_s, 3), restore_s=median(restores, 3))

    with case(PART, "dcp") as fields:
        # The same tensors as DCP takes them (global, unsharded on one device); RNG states are not tensors DCP saves.
        tensors = {k: v for k, v in collect_state(model, optimizer, 0, device).items() if not k.startswith("rng/")}
        synced(device)
        saves, stalls, loads = [], [], []
        for r in range(ROUNDS):
            started = time.perf_counter()
            dcp.save(tensors, storage_writer=FileSystemWriter(str(folder / f"dcp-{r}")))
            saves.append(time.perf_counter() - started)
            started = time.perf_counter()
            future = dcp.async_save(tensors, storage_writer=FileSystemWriter(str(folder / f"dcp-async-{r}")))
            staged_s = time.perf_counter() - started
            train_pass(model, config, device, batch)
            started = time.perf_counter()
            future.result()  # the next optimizer step may not change what is still being written
            stalls.append(staged_s + time.perf_counter() - started)
            started = time.perf_counter()
            dcp.load(tensors, storage_reader=FileSystemReader(str(folder / f"dcp-{r}")))
            synced(device)
            loads.append(time.perf_counter() - started)
        fields.update(stall_s=median(stalls), stalls_s=[round(s, 4) for s in stalls], save_s=median(saves, 3),
                      load_s=median(loads, 3))


if __name__ == "__main__":
    main()
