"""The prepared GPU check: one command for everything in parashift that runs on CUDA, sized for
a device lent for minutes. Each part runs as its own process with its own timeout and prints a
JSON line per case, so a part that fails or hangs costs nothing else; the last line is a summary.

Parts (bench/gpu/): memory (the planner's predicted peak against the allocator's), throughput
(trainer against a plain loop, tokens/s and MFU), checkpoints (parashift's save stall and restore
against DCP's and the disk), moves (a checkpoint of a 4-rank CPU job restored, trained and
exported on the GPU, logits against `transformers`), changes (a warm change and relaunches on
CUDA, their downtime, forked CUDA workers).

    python -m parashift.bench.gpu_check --prepare                 # here, once: wheels + inputs into .gpu/, then
                                                                  # the toy check with only what the device has
    python3 -m parashift.bench.gpu_check --out OUT/gpu_check.jsonl --inputs .gpu/inputs   # on the GPU
    python -m parashift.bench.gpu_check --device cpu --tiny       # every part at toy sizes (the suite's smoke test)

docs/gpu.md has the device command (the wheels, `carry`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import import_module, metadata
from pathlib import Path
from typing import IO, Any

import parashift

CODE_ROOT = Path(parashift.__file__).resolve().parents[1]
PREPARED = CODE_ROOT / ".gpu"  # ignored by git; carried to the device
# What the device's Python has (torch, numpy, fsspec, pyyaml, typer, rich, matplotlib, pytest)
# and what the parts import beside it, carried as wheels for its version, each at the version
# installed here (what this checkout's tests run with). Found by running the toy check in a
# virtual environment of only the device's packages: without tensorboard every trainer run
# failed at its metrics (9 of 19 cases), without transformers the `hf` and export cases.
DEVICE_HAS = ("torch", "numpy", "fsspec", "pyyaml", "typer", "rich", "matplotlib", "pytest")
WHEELS = (
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "crc32c",
    "tensorboard", "protobuf", "absl-py",  # the metrics component's event files (torch.utils.tensorboard)
    # the `hf` family and the export's reference: transformers and what it imports
    "transformers", "tokenizers", "safetensors", "huggingface-hub", "kernels", "regex", "tqdm", "httpx2",
    "httpcore2", "h11", "idna", "truststore",
)
DEVICE_PYTHON = "3.12"


@dataclass(frozen=True)
class Part:
    name: str
    timeout_s: float  # on the GPU; toy sizes on CPU get their own (`TINY_TIMEOUT_S`)


# In order of what matters most if the minutes run out. Together at most 8 minutes.
PARTS = (Part("memory", 90), Part("throughput", 210), Part("checkpoints", 50), Part("moves", 50),
         Part("changes", 90))
TINY_TIMEOUT_S = 180.0
BUDGET_S = 490.0


def prepare(folder: Path) -> None:
    """Here, before a device is lent: the wheels the device's Python lacks and the inputs parts
    make on CPU (a part's `prepare(inputs)`), into `folder`."""
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", DEVICE_PYTHON, "--implementation", "cp",
                    *[arg for n in (17, 27, 28) for arg in ("--platform", f"manylinux_2_{n}_x86_64")],
                    "--platform", "manylinux2014_x86_64", "-d", str(wheels),
                    *[f"{name}=={metadata.version(name)}" for name in WHEELS]], check=True)
    for part in PARTS:
        module = import_module(f"parashift.bench.gpu.{part.name}")
        if hasattr(module, "prepare"):
            module.prepare(folder / "inputs")
    print(json.dumps({"prepared": str(folder), "wheels": sorted(p.name for p in wheels.glob("*.whl"))}))


def _release(name: str) -> str:
    """The version of `name` installed here, without a local label (2.13.0+cpu: 2.13.0)."""
    return metadata.version(name).split("+")[0]


def verify(inputs: Path, torch_version: str | None = None) -> bool:
    """The toy check run by a Python that has only what the device has and what is carried
    (`DEVICE_HAS` with their dependencies, `WHEELS` without, as the device's command installs
    them; for this machine's Python, and its torch unless `torch_version` names another, such
    as the device's): a part that imports what a device lacks fails here, minutes before a lent
    device, not on it."""
    with tempfile.TemporaryDirectory(prefix="parashift-device-env-") as tmp:
        python = Path(tmp) / "venv" / "bin" / "python"
        subprocess.run([sys.executable, "-m", "venv", str(python.parent.parent)], check=True)
        pinned = [f"{name}=={torch_version if name == 'torch' and torch_version else _release(name)}"
                  for name in DEVICE_HAS]
        subprocess.run([python, "-m", "pip", "install", "-q", *pinned], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps",
                        *[f"{name}=={metadata.version(name)}" for name in WHEELS]], check=True)
        out = Path(tmp) / "check.jsonl"
        env = {**os.environ, "PYTHONPATH": str(CODE_ROOT)}  # the source tree, as on the device
        proc = subprocess.run([python, "-m", "parashift.bench.gpu_check", "--device", "cpu", "--tiny",
                               "--inputs", str(inputs), "--out", str(out)], env=env, cwd=tmp)
        lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        cases = [line for line in lines if "case" in line]  # the last line is the summary
        failed = [f"{c['part']}/{c['case']}" for c in cases if not c.get("ok")]
        ok = proc.returncode == 0 and bool(cases) and not failed
        print(json.dumps({"verified": ok, "cases": len(cases), "failed": failed}), flush=True)
        return ok


def run_part(part: Part, args: argparse.Namespace, scratch: Path, timeout_s: float, log: IO[str],
             out: IO[str] | None) -> dict[str, Any]:
    """One part as its own process group: its JSON lines relayed (and kept in `out`), its other
    output into `log`; ended, group and all, at its timeout."""
    command = [sys.executable, "-m", f"parashift.bench.gpu.{part.name}", "--device", args.device,
               "--dir", str(scratch / part.name)]
    if args.tiny:
        command.append("--tiny")
    if args.inputs is not None:
        command += ["--inputs", str(args.inputs)]
    (scratch / part.name).mkdir(parents=True)
    # Offline, as the device is: a Hugging Face library that would ask its Hub for something says
    # so at once instead of waiting out a connection timeout.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(CODE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log.write(f"\n===== part {part.name}: {' '.join(command)}\n")
    log.flush()
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)
    lines: list[dict[str, Any]] = []

    def relay() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict) and record.get("part") == part.name:
                lines.append(record)
                print(line.rstrip(), flush=True)
                if out is not None:
                    out.write(line if line.endswith("\n") else line + "\n")
                    out.flush()
            else:
                log.write(line)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the group this part started (its workers too)
        proc.wait()
    reader.join(timeout=10)
    failed = [line["case"] for line in lines if not line.get("ok", False)]
    return {"ok": proc.returncode == 0 and not timed_out and bool(lines) and not failed,
            "returncode": proc.returncode, "timed_out": timed_out, "cases": len(lines), "failed": failed,
            "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="make the wheels and inputs folder, check them "
                        "(`verify`), then stop")
    parser.add_argument("--no-verify", action="store_true", help="with --prepare: skip the check in a "
                        "device-like environment (~2 minutes)")
    parser.add_argument("--device-torch", default=None, help="with --prepare: verify with this torch instead of "
                        "this machine's (the device's: 2.11.0, a CUDA build of ~4.7 GB installed)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: checks the code, not the GPU")
    parser.add_argument("--inputs", type=Path, default=None, help="the prepared inputs (default: .gpu/inputs)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON lines here; the parts' "
                        "other output goes beside it (.log)")
    parser.add_argument("--parts", default=",".join(p.name for p in PARTS), help="comma-separated, in order")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="all parts together (GPU)")
    args = parser.parse_args()
    if args.prepare:
        prepare(PREPARED)
        if not args.no_verify and not verify(PREPARED / "inputs", args.device_torch):
            sys.exit(1)
        return
    if args.inputs is None and (PREPARED / "inputs").is_dir():
        args.inputs = PREPARED / "inputs"
    chosen = [p for name in args.parts.split(",") for p in PARTS if p.name == name.strip()]
    deadline = time.monotonic() + args.budget_s
    summary: dict[str, Any] = {}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    out = args.out.open("w") if args.out is not None else None
    log_path = args.out.with_suffix(".log") if args.out is not None else None
    with tempfile.TemporaryDirectory(prefix="parashift-gpu-check-") as tmp, \
            (log_path.open("w") if log_path is not None else open(Path(tmp) / "parts.log", "w")) as log:
        for part in chosen:
            timeout_s = TINY_TIMEOUT_S if args.tiny else min(part.timeout_s, deadline - time.monotonic())
            if timeout_s < 10:
                summary[part.name] = {"ok": False, "skipped": "the check's time budget is spent"}
                continue
            summary[part.name] = run_part(part, args, Path(tmp), timeout_s, log, out)
            if not summary[part.name]["ok"]:
                log.flush()
                tail = (log_path or Path(tmp) / "parts.log").read_text().splitlines()[-25:]
                print("\n".join(f"  | {line}" for line in tail), file=sys.stderr, flush=True)
    final = {"summary": "gpu_check", "device": args.device, "tiny": args.tiny,
             "ok": all(s.get("ok") for s in summary.values()), "parts": summary}
    line = json.dumps(final)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.close()
    if not final["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
