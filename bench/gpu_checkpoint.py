"""The prepared device check for checkpoints: GPT-2 124M + AdamW on one GPU, saved and restored
by parashift and by DCP in the same call, against the disk's raw write of the same bytes; then a
2-rank CUDA job (two processes on one GPU, over gloo) that checkpoints and resumes.

    python -m bench.gpu_checkpoint --dir /local/disk/folder      # on the GPU machine
    python -m bench.gpu_checkpoint --device cpu --tiny           # a smoke run of the same code

`stall_s`: the loop's wait for a save (the device-to-host snapshot, plus any wait at the next
optimizer step while a forward and backward pass run). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from parashift.launcher.launch import launch_workers
from parashift.models.gpt.model import GPT, GPTConfig
from parashift.specs import JobSpec, example_path, load_spec
from parashift.specs.plan import Plan
from parashift.storage import CheckpointStore, ObjectStore
from parashift.trainer.checkpoint import Checkpointer, restore_latest
from parashift.trainer.layout import state_layout
from parashift.trainer.optim import LocalShardAdamW
from parashift.trainer.state import apply_state, collect_state, rng_state_bytes
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter


def job_spec(device: str, tiny: bool, store: str) -> JobSpec:
    spec = load_spec(example_path("gpt2-small-cuda"))
    update: dict = {"resources": spec.resources.model_copy(update={"kind": device}),
                    "storage": spec.storage.model_copy(update={"url": store})}
    if tiny:
        update["model"] = spec.model.model_copy(update={"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 64})
        update["training"] = spec.training.model_copy(update={"global_batch": 4, "micro_batch": 2})
        update["parallelism"] = spec.parallelism.model_copy(update={"compile": False, "precision": "fp32"})
    return spec.model_copy(update=update)


def synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_pass(model: GPT, config: GPTConfig, device: torch.device, batch: int) -> None:
    """One forward and backward pass (what a save overlaps in training)."""
    idx = torch.randint(0, config.vocab_size, (batch, config.seq_len), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(idx)
    F.cross_entropy(logits.float().flatten(0, 1), idx.flatten()).backward()
    synced(device)


def single_device(spec: JobSpec, device: torch.device, folder: Path) -> dict:
    config = GPTConfig.of(spec.model)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = LocalShardAdamW(model, spec, device)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad()
    synced(device)
    layout = state_layout(Plan.data_parallel(1), spec.model, rng_state_bytes(device))
    store = CheckpointStore(ObjectStore(f"file://{folder}/parashift"), "gpu-check")
    ck = Checkpointer(store, layout, 0, keep=2, copy_host_memory=device.type == "cpu")  # CPU smoke: buffers to write raw

    def state() -> dict[str, torch.Tensor]:
        return collect_state(model, optimizer, 0, device, local=True)

    ck.save(1, state(), {"samples_consumed": 0}, {}, {}, blocking=True)  # allocates the pinned buffers
    started = time.perf_counter()
    ck.save(2, state(), {"samples_consumed": 0}, {}, {}, blocking=True)
    save_s = time.perf_counter() - started
    # The stall as training sees it: save, one forward/backward, then the optimizer step's gate.
    report = ck.save(3, state(), {"samples_consumed": 0}, {}, {})
    train_pass(model, config, device, spec.training.micro_batch)
    ck.before_update()
    ck.wait()
    optimizer.zero_grad()
    nbytes = sum(t.numel() * t.element_size() for t in ck.host_buffers) if ck.host_buffers else report.bytes_written
    started = time.perf_counter()
    with open(folder / "raw.bin", "wb", buffering=0) as f:
        for t in ck.host_buffers:
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        os.fsync(f.fileno())
    raw_s = time.perf_counter() - started
    ck.close()

    dcp_dict = {k: v for k, v in collect_state(model, optimizer, 0, device).items() if not k.startswith("rng/")}
    synced(device)
    started = time.perf_counter()
    dcp.save(dcp_dict, storage_writer=FileSystemWriter(str(folder / "dcp")))
    dcp_save_s = time.perf_counter() - started

    started = time.perf_counter()
    restored = restore_latest(store, layout, 0)
    assert restored is not None and restored.step == 3
    apply_state(restored.tensors, model, optimizer, 0, device)
    synced(device)
    restore_s = time.perf_counter() - started
    started = time.perf_counter()
    dcp.load(dcp_dict, storage_reader=FileSystemReader(str(folder / "dcp")))
    synced(device)
    dcp_load_s = time.perf_counter() - started
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "params": sum(p.numel() for p in model.parameters()), "state_bytes": nbytes,
            "stall_s": round(report.stall_s, 4), "save_s": round(save_s, 3), "save_GBps": round(nbytes / save_s / 1e9, 3),
            "raw_write_GBps": round(nbytes / raw_s / 1e9, 3), "save_over_raw": round(raw_s / save_s, 3),
            "restore_s": round(restore_s, 3), "dcp_save_s": round(dcp_save_s, 3), "dcp_load_s": round(dcp_load_s, 3)}


def two_ranks_resume(spec: JobSpec, device: str) -> dict:
    """A 2-rank job on one device: checkpoint at step 4, resume to 8 (the restore's agreement and
    the save's record exchange run on the gloo group; CUDA tensors over gloo too)."""
    training = spec.training.model_copy(update={"steps": 8, "checkpoint_every": 4, "global_batch": 4, "micro_batch": 2})
    model = spec.model.model_copy(update={"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 64})
    job = spec.model_copy(update={"name": spec.name + "-2ranks", "training": training, "model": model,
                                  "resources": spec.resources.model_copy(update={"devices": 2}),
                                  "parallelism": spec.parallelism.model_copy(update={"compile": False})})
    env = {"PARASHIFT_DIST_BACKEND": "gloo"} if device == "cuda" else None
    first = launch_workers(job, Plan.data_parallel(2), until_step=4, extra_env=env)
    second = launch_workers(job, Plan.data_parallel(2), extra_env=env)
    resumed_at = second.start.step if second.start is not None else None
    return {"first_rc": first.returncode, "second_rc": second.returncode, "resumed_at": resumed_at,
            "final_step": second.final_step, "ok": first.returncode == 0 and second.returncode == 0
            and resumed_at == 4 and second.final_step == 8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--dir", type=Path, default=None, help="a folder on the disk to measure (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parashift-gpu-", dir=args.dir) as tmp:
        folder = Path(tmp)
        spec = job_spec(args.device, args.tiny, f"file://{folder}/jobs")
        out = {"single": single_device(spec, torch.device(args.device), folder),
               "two_ranks": two_ranks_resume(spec, args.device)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
