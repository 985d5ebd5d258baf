"""Part 4 of the GPU check, moves onto the GPU: a checkpoint written by a 4-rank CPU job (FSDP 2 x
TP 2: each tensor stored as four boxes, cut by tensor parallelism, then by FSDP) restores into a
1-device CUDA job bitwise, a real CUDA job resumes from it at its step, and `parashift export`
turns it into a Hugging Face folder whose logits `transformers` reproduces on CUDA within 1e-5
(fp32, TF32 off).

Why: checkpoints are promised to move between plans and devices, and the CPU suite moves them
between plans on CPU only. Here the bytes cross to CUDA (host reads, copies to the device,
AdamW's state moved by `load_state_dict`), and the export is checked against the model users load.

    python -m parashift.bench.gpu.moves --dir /scratch --inputs PREPARED   # on the GPU machine
    python -m parashift.bench.gpu.moves --device cpu --tiny --dir /tmp/w --inputs PREPARED

`prepare(folder)` runs on CPU beforehand (`bench.gpu_check --prepare`) and writes
`folder/moves/`: the job's spec, its corpus (the built-in one is the interpreter's stdlib, which
differs between Python versions), its store, and what the CPU saw. The folder arrives at another
path: the cases copy the store into `--dir` and point the spec there. The job is small already:
`--tiny` changes nothing.

One JSON line each: `inputs` (the carried folder checked and copied), then the cases
`restore_bitwise`, `resume_on_device`, `export_logits`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from parashift.bench.gpu.common import case, device_name, free_cuda, part_args, synced

PART = "moves"
CHECKPOINT_STEP = 4  # the CPU job's checkpoint the GPU starts from
STEPS = 6  # the resumed job's end: two steps on the device
TOKENS_SEED = 3
LOGITS_ATOL = 1e-5
LAUNCH_TIMEOUT_S = 180.0  # a worker stuck before its first report (say in NCCL's start) is not waited for

# Grouped-query attention that tp 2 splits (4 kv heads), head width 8; fp32, no dropout: the
# whole training state is ~1 MB.
MODEL: dict[str, Any] = {"family": "llama", "n_layers": 2, "d_model": 64, "n_heads": 8, "n_kv_heads": 4,
                         "ffn_dim": 128, "vocab_size": 256, "seq_len": 32, "rope_theta": 500000.0, "dropout": 0.0}
CORPUS_BYTES = 200_000
TAIL_LINES = 20
TAIL, ERRORS = "worker_tail", "worker_errors"


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree_digests(root: Path) -> dict[str, str]:
    """Every file under `root` by relative path: the carried inputs can be checked on arrival."""
    return {str(p.relative_to(root)): _sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _cpu_plan() -> Any:
    """FSDP 2 x TP 2 on 4 ranks: each rank's box of a tensor is cut along the tensor-parallel dim
    and along dim 0, so a 1-device restore assembles every tensor from several boxes."""
    from parashift.specs.plan import Plan

    return Plan(devices=4, mesh={"dp": 2, "tp": 2}, dp_shard=2, strategy="hand")


def _job_spec(moves: Path) -> Any:
    from parashift.specs import JobSpec

    return JobSpec.model_validate({
        "name": "gpu-check-moves",
        "model": MODEL,
        "data": {"url": f"file://{moves / 'data' / 'corpus.txt'}", "tokenizer": "bytes"},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "training": {"global_batch": 8, "micro_batch": 2, "steps": STEPS, "seed": 7, "checkpoint_every": 2,
                     "hang_timeout_s": 60},
        "resources": {"devices": 4, "kind": "cpu"},
        "storage": {"url": f"file://{moves / 'store'}"},
    })


def _moved(spec: Any, store: Path, data: Path, kind: str) -> Any:
    """`spec` pointed at `store` and the corpus `data`, on one device of `kind`."""
    return spec.model_copy(update={
        "storage": spec.storage.model_copy(update={"url": f"file://{store}"}),
        "data": spec.data.model_copy(update={"url": f"file://{data}"}),
        "resources": spec.resources.model_copy(update={"devices": 1, "kind": kind}),
    })


def _launch(spec: Any, plan: Any, until_step: int | None = None, tail: dict[str, list[str]] | None = None) -> Any:
    """`launch_workers` with a deadline: workers that hang before their first report (which the
    launcher's own watchdog does not time) are ended, so the cases after this one still run.
    Every output line goes to stderr; `tail` keeps the last lines that are not events (a
    failure's traceback, for a JSON line read far from this machine), lines naming an error apart."""
    from parashift.launcher.launch import RunningWorkers, launch_workers

    workers = RunningWorkers()
    box: dict[str, Any] = {}

    def on_line(line: str) -> None:
        _to_stderr(line)
        if tail is not None and not line.startswith("PARASHIFT {"):
            # torchrun's own summary of a failure fills the last lines: the errors above it are kept apart
            keep = ERRORS if ("Error" in line or "Exception" in line) and "ChildFailedError" not in line else TAIL
            tail[keep].append(line[-300:])
            del tail[keep][:-TAIL_LINES]

    def run() -> None:
        try:
            box["result"] = launch_workers(spec, plan, on_line=on_line, until_step=until_step, workers=workers)
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = error

    thread = threading.Thread(target=run, name="moves-launch", daemon=True)
    thread.start()
    thread.join(LAUNCH_TIMEOUT_S)
    if thread.is_alive():
        workers.kill()
        thread.join(30)
        raise TimeoutError(f"workers still running after {LAUNCH_TIMEOUT_S:.0f} s: ended")
    if "error" in box:
        raise box["error"]
    return box["result"]


def prepare(folder: Path) -> None:
    """On CPU: a 4-rank job trains to step CHECKPOINT_STEP and commits it under `folder/moves/store`;
    one CPU rank then resumes a copy of it to STEPS (the losses the device's resume should see)."""
    from parashift.specs.plan import Plan
    from parashift.storage import job_store
    from parashift.trainer.data import builtin_corpus_files

    moves = folder / "moves"
    if moves.exists():
        shutil.rmtree(moves)
    (moves / "data").mkdir(parents=True)
    corpus = bytearray()
    for url in builtin_corpus_files():
        corpus += Path(url.removeprefix("file://")).read_bytes()
        if len(corpus) >= CORPUS_BYTES:
            break
    (moves / "data" / "corpus.txt").write_bytes(bytes(corpus[:CORPUS_BYTES]))

    spec = _job_spec(moves)
    plan = _cpu_plan()
    started = time.perf_counter()
    first = _launch(spec, plan, until_step=CHECKPOINT_STEP)
    if first.returncode != 0:
        raise RuntimeError(f"the 4-rank CPU job failed with exit code {first.returncode} (its output is on stderr)")
    manifest = job_store(spec).latest()
    if manifest is None or manifest.step != CHECKPOINT_STEP:
        raise RuntimeError(f"the 4-rank CPU job committed {manifest and manifest.step}, not step {CHECKPOINT_STEP}")
    cpu_s = time.perf_counter() - started

    # The reference for the device's two steps: the same checkpoint resumed by one CPU rank.
    with tempfile.TemporaryDirectory(prefix="parashift-moves-") as tmp:
        shutil.copytree(moves / "store", Path(tmp) / "store")
        resumed = _launch(_moved(spec, Path(tmp) / "store", moves / "data" / "corpus.txt", "cpu"), Plan.data_parallel(1))
    if resumed.returncode != 0 or resumed.final_step != STEPS:
        raise RuntimeError(f"the 1-rank CPU resume failed (exit code {resumed.returncode}, final step {resumed.final_step})")

    (moves / "job.json").write_text(spec.model_dump_json(indent=2))
    (moves / "prepared.json").write_text(json.dumps({
        "job_id": spec.job_id,
        "step": CHECKPOINT_STEP,
        "steps": STEPS,
        "plan": json.loads(plan.model_dump_json()),
        "cpu_losses": {e.step: e.loss for e in first.steps},
        "cpu_resumed_losses": {e.step: e.loss for e in resumed.steps},
        "tensors": len(manifest.tensors),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu_job_s": round(cpu_s, 2),
        "digests": {"store": _tree_digests(moves / "store"), "data": _tree_digests(moves / "data")},
    }, indent=2))
    print(f"moves: prepared step {CHECKPOINT_STEP} of {spec.job_id} in {moves} ({cpu_s:.1f} s)", file=sys.stderr)


@dataclass
class Workspace:
    """The carried inputs, checked and copied into the scratch folder."""

    prepared: dict[str, Any]
    spec: Any  # as prepared (the CPU job's)
    data: Path  # the carried corpus (only read)
    store: Path  # the copy restore_bitwise and export_logits read
    resume_store: Path  # the copy the resumed job trains on
    root: Path

    @property
    def step(self) -> int:
        return int(self.prepared["step"])


def workspace(inputs: Path | None, scratch: Path) -> Workspace:
    """`inputs/moves` verified against its digests; its store copied twice under `scratch/moves`
    (the carried folder stays as it came)."""
    from parashift.specs import JobSpec

    if inputs is None:
        raise ValueError("--inputs is required: the folder `prepare` wrote (bench.gpu_check --prepare)")
    carried = inputs / "moves"
    prepared = json.loads((carried / "prepared.json").read_text())
    for part, digests in prepared["digests"].items():
        found = _tree_digests(carried / part)
        if found != digests:
            differ = sorted(set(found.items()) ^ set(digests.items()))[:3]
            raise ValueError(f"{carried / part} is not what prepare wrote: {differ}")
    root = scratch / "moves"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(carried / "store", root / "store")
    shutil.copytree(carried / "store", root / "resume" / "store")
    spec = JobSpec.model_validate_json((carried / "job.json").read_text())
    return Workspace(prepared, spec, carried / "data" / "corpus.txt", root / "store", root / "resume" / "store", root)


def strict_fp32() -> dict[str, Any]:
    """fp32 matmuls and convolutions in full fp32 on CUDA (no TF32). Set through the legacy flags:
    torch 2.9+ refuses to read `cudnn.allow_tf32` (as libraries may) once the new
    `fp32_precision` API set it alone; the legacy setters keep both views consistent."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    seen: dict[str, Any] = {}
    for name, read in (("matmul_allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                       ("cudnn_allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
                       ("matmul_fp32_precision", lambda: torch.backends.cuda.matmul.fp32_precision),
                       ("float32_matmul_precision", torch.get_float32_matmul_precision)):
        try:
            seen[name] = read()
        except (AttributeError, RuntimeError) as error:
            seen[name] = f"{type(error).__name__}: {error}"[:160]
    return seen


def _named(device: torch.device) -> str:
    """The device's name for a line (its plain name where asking fails: the line still says it)."""
    try:
        return device_name(device)
    except (AssertionError, RuntimeError) as error:  # a CUDA that torch cannot use: the case will say why
        _to_stderr(f"moves: no name for {device}: {error}")
        return str(device)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (torch.equal would take -0.0 for 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bytes_a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    bytes_b = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(bytes_a, bytes_b)


def _checkpoint_tensors(spec: Any, step: int, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Whole tensors of the committed checkpoint at `step`, read on the host, checksums verified."""
    from parashift.storage import job_store
    from parashift.trainer.checkpoint import load_tensors

    store = job_store(spec)
    manifest = store.load_manifest(step)
    return load_tensors(store, manifest, [n for n in manifest.tensors if n.startswith(prefixes)])


def restore_bitwise(work: Workspace, device: torch.device, line: dict[str, Any]) -> None:
    """The trainer's own restore (`restore_latest` under a 1-device layout, `apply_state`) into a
    model and AdamW on `device`, then every parameter and optimizer tensor against the
    checkpoint's whole tensor read on the host: byte for byte."""
    from parashift.models import family_of
    from parashift.specs.plan import Plan
    from parashift.storage import job_store
    from parashift.trainer.checkpoint import restore_latest
    from parashift.trainer.layout import state_layout
    from parashift.trainer.optim import LocalShardAdamW
    from parashift.trainer.state import apply_state, collect_state, rng_state_bytes

    line.update({"device": _named(device), "expected_step": work.step, "saved_plan": work.prepared["plan"]["mesh"]})
    spec = _moved(work.spec, work.store, work.data, device.type)
    family = family_of(spec.model)
    model = family.build(spec.model).to(device)  # built on the host (its init's generators are CPU ones)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # whatever the restore does not write shows
    optimizer = LocalShardAdamW(model, spec, device)
    layout = state_layout(Plan.data_parallel(1), spec.model, rng_state_bytes(device))
    started = time.perf_counter()
    restored = restore_latest(job_store(spec), layout, 0)
    if restored is None:
        raise RuntimeError("no checkpoint restored")
    apply_state(restored.tensors, model, optimizer, 0, device)
    synced(device)
    line.update({"step": restored.step, "restore_s": round(time.perf_counter() - started, 3)})

    state = {n: t for n, t in collect_state(model, optimizer, 0, device).items() if n.startswith(("model/", "optim/"))}
    expected = _checkpoint_tensors(spec, restored.step, ("model/", "optim/"))
    differ, max_diff, on_device = [], 0.0, set()
    for name, want in expected.items():
        got = state.get(name)
        if got is None:
            differ.append(f"{name}: not restored")
            continue
        if got.dim():  # AdamW keeps its scalar step on the host unless fused/capturable
            on_device.add(got.device.type)
        if not _bitwise(got, want):
            differ.append(name)
            if got.shape == want.shape and got.is_floating_point():
                max_diff = max(max_diff, float((got.detach().cpu().double() - want.double()).abs().max()))
    extra = sorted(set(state) - set(expected))
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    line.update({"ok": not differ and not extra and restored.step == work.step and on_device == {device.type},
                 "params": sum(1 for n in expected if n.startswith("model/")),
                 "optim_tensors": sum(1 for n in expected if n.startswith("optim/")),
                 "bytes": nbytes, "n_differ": len(differ), "differ": differ[:10], "extra": extra[:10],
                 "max_abs_diff": max_diff, "state_on": sorted(on_device)})


def resume_on_device(work: Workspace, device: torch.device, line: dict[str, Any]) -> None:
    """A real 1-rank job on `device` resumes from the 4-rank CPU checkpoint (its own copy of the
    store) and trains to the end; its losses beside those of one CPU rank resuming the same."""
    from parashift.specs.plan import Plan

    line.update({"device": _named(device), "expected_step": work.step})
    spec = _moved(work.spec, work.resume_store, work.data, device.type)
    tail: dict[str, list[str]] = {TAIL: [], ERRORS: []}
    try:
        result = _launch(spec, Plan.data_parallel(1), tail=tail)
    except BaseException:
        line.update(tail)
        raise
    start = result.start
    losses = {e.step: e.loss for e in result.steps}
    cpu = {int(k): v for k, v in work.prepared["cpu_resumed_losses"].items()}
    rel = [abs(losses[s] - cpu[s]) / abs(cpu[s]) for s in losses if s in cpu and cpu[s]]
    fatal = result.fatal
    ok = (result.returncode == 0 and start is not None and start.resumed and start.step == work.step
          and result.final_step == int(work.prepared["steps"]) and len(losses) == result.final_step - work.step)
    line.update({"rc": result.returncode, "resumed": start.resumed if start else None,
                 "resumed_step": start.step if start else None, "final_step": result.final_step,
                 "losses": losses, "cpu_losses": cpu, "max_rel_loss_diff_vs_cpu": max(rel) if rel else None,
                 "checkpoint_loss": start.checkpoint_loss if start else None,
                 "restore_bytes": start.restore_bytes if start else None,
                 "restore_s": start.restore_s if start else None,
                 "checkpoints": [c.step for c in result.checkpoints],
                 "fatal": fatal.message if fatal else None, "failed_rank": result.failed_rank})
    if not ok:
        line.update(tail)
    line["ok"] = ok  # last: `case` adds its own `ok` to a line whose case raised


def _export_cli(spec_file: Path, to: Path, step: int) -> tuple[int, str]:
    """`python -m parashift.cli export` as a user runs it, on this same source tree."""
    from parashift.launcher.launch import CODE_ROOT

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([CODE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "parashift.cli", "export", str(spec_file), "--format", "hf",
                           "--to", str(to), "--step", str(step)], capture_output=True, text=True, env=env, timeout=120)
    for line in (done.stdout + done.stderr).splitlines():
        _to_stderr(f"[export] {line}")
    return done.returncode, (done.stdout.strip() or done.stderr.strip())[-1000:]


def export_logits(work: Workspace, device: torch.device, fp32: dict[str, Any], line: dict[str, Any]) -> None:
    """The checkpoint exported by the CLI, loaded by `transformers` on `device` in fp32; its
    logits for a fixed batch against parashift's model holding the checkpoint's weights."""
    import transformers
    from parashift.models import family_of
    from transformers import AutoModelForCausalLM

    line.update({"device": _named(device), "step": work.step, "atol": LOGITS_ATOL, "fp32": fp32,
                 "transformers": transformers.__version__, "torch": torch.__version__})
    spec = _moved(work.spec, work.store, work.data, device.type)
    spec_file = work.root / "export-job.json"
    spec_file.write_text(spec.model_dump_json(indent=2))
    hf_dir = work.root / "hf"
    rc, said = _export_cli(spec_file, hf_dir, work.step)
    exporter = "cli"
    line.update({"exporter": exporter, "cli_rc": rc, "cli_said": said})
    if rc != 0:  # still measured, by the function the command calls; the line says the command failed
        from parashift.trainer.export import export_hf

        exporter = "trainer.export.export_hf (the CLI failed)"
        line["exporter"] = exporter
        export_hf(spec, str(hf_dir), work.step)

    weights = _checkpoint_tensors(spec, work.step, ("model/",))
    family = family_of(spec.model)
    ours = family.build(spec.model).to(device)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(weights[f"model/{name}"])
    ours.eval()
    # transformers' own PyTorch layers: by default it swaps some for kernels from the Hub, which a
    # device without network cannot fetch and which are not the reference asked for.
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                  use_kernels=False)
    theirs = theirs.to(device).eval()
    dtypes = sorted({str(p.dtype) for p in theirs.parameters()})
    m = spec.model
    tokens = torch.randint(0, m.vocab_size, (4, m.seq_len), generator=torch.Generator().manual_seed(TOKENS_SEED))
    tokens = tokens.to(device)

    def diff() -> tuple[float, float]:
        with torch.no_grad():
            a, b = ours(tokens), theirs(tokens).logits
        synced(device)
        if a.shape != b.shape:
            raise ValueError(f"logits shapes differ: parashift {tuple(a.shape)}, transformers {tuple(b.shape)}")
        return float((a - b).abs().max()), float(b.abs().max())

    max_diff, scale = diff()
    line.update({"max_abs_diff": max_diff, "logits_abs_max": scale})
    math_diff = None
    try:  # the same with both attentions on the reference kernel: tells a kernel choice from a weight
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            math_diff, _ = diff()
    except (ImportError, RuntimeError) as error:
        _to_stderr(f"moves: the math-kernel comparison did not run: {error}")
    line.update({"ok": exporter == "cli" and max_diff <= LOGITS_ATOL, "files": sorted(p.name for p in hf_dir.iterdir()),
                 "hf_class": type(theirs).__name__, "hf_dtypes": dtypes, "tokens": list(tokens.shape),
                 "max_abs_diff_math_sdpa": math_diff})


def main() -> None:
    args = part_args(__doc__)
    device = torch.device(args.device)
    try:
        fp32 = strict_fp32()
    except Exception as error:  # noqa: BLE001 - reported by the case that needs it
        fp32 = {"error": f"{type(error).__name__}: {error}"[:200]}
    work: Workspace | None = None
    with case(PART, "inputs") as line:
        work = workspace(args.inputs, args.dir)
        line.update({"step": work.step, "job_id": work.prepared["job_id"], "saved_plan": work.prepared["plan"]["mesh"],
                     "prepared_with": {"torch": work.prepared["torch"], "python": work.prepared["python"]},
                     "here": {"torch": torch.__version__, "python": sys.version.split()[0]}})
    cases = (("restore_bitwise", lambda w, line: restore_bitwise(w, device, line)),
             ("resume_on_device", lambda w, line: resume_on_device(w, device, line)),
             ("export_logits", lambda w, line: export_logits(w, device, fp32, line)))
    for name, run in cases:
        with case(PART, name) as line:
            if work is None:
                raise RuntimeError("no inputs (see the `inputs` line)")
            run(work, line)
        try:
            free_cuda()
        except Exception as error:  # noqa: BLE001 - a broken CUDA context: the next case will say so itself
            _to_stderr(f"moves: freeing CUDA memory after {name} failed: {error}")


if __name__ == "__main__":
    main()
