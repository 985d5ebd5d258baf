"""Moving training state between plans: parashift against torch DCP, same state, same storage,
same run. For each case a GPT with AdamW state (~300 MB) is built under the old plan on CPU
workers, saved three ways (the same bytes written raw with fsync or one PUT; parashift's
asynchronous checkpoint; DCP's synchronous save), then restored under the new plan by parashift
and by DCP, whose results must agree element for element.

    python -m bench.reshard [--storage file,s3] [--cases dp2xtp2-tp3,dp2xtp2-dp3,pp2xdp2-dp4]
                            [--fencing on|off|both]

Saves are fenced as a job's are (`--fencing on`): the bench holds the job's storage lease and its
workers commit under its token. `--fencing both` alternates fenced and unfenced rounds in the same
run and reports each, and the ratio: what the lease itself costs.

Progress goes to stderr; the last line on stdout is one JSON object with a list `cases`.
On s3 (moto's server on 127.0.0.1, started here) judge by bytes and requests: moto reads the
whole object for every ranged GET, so its times say little.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from parashift.launcher.launch import torchrun_command, worker_env
from parashift.specs import JobSpec
from parashift.specs.plan import Plan

# d 768 and 12 heads split over tp 2, 3 and 4; 3 layers + vocab 2048: 24.4M parameters, so
# parameters + AdamW moments (+ steps and RNG) are ~293 MB.
MODEL = {"n_layers": 3, "d_model": 768, "n_heads": 12, "vocab_size": 2048, "seq_len": 24, "dropout": 0.0}

MESHES = {
    "dp2xtp2": {"dp": 2, "tp": 2},
    "tp3": {"tp": 3},
    "dp3": {"dp": 3},
    "pp2xdp2": {"pp": 2, "dp": 2},
    "dp4": {"dp": 4},
    "tp4": {"tp": 4},
    "tp2": {"tp": 2},
    "tp1": {},
    "fsdp4": {"dp": 4},  # dp sharding the state (FSDP2): see SHARDED
    "fsdp3": {"dp": 3},
}
SHARDED = {"fsdp4", "fsdp3"}
CASES = ["dp2xtp2-tp3", "dp2xtp2-dp3", "pp2xdp2-dp4"]


def plan_of(name: str) -> Plan:
    mesh = MESHES[name]
    devices = 1
    for n in mesh.values():
        devices *= n
    return Plan(devices=devices, mesh=mesh, strategy="bench", micro_batches=mesh.get("pp", 1),
                dp_shard=mesh["dp"] if name in SHARDED else 1)


def spec_for(job: str, url: str, options: dict[str, Any]) -> JobSpec:
    return JobSpec.model_validate({
        "name": job,
        "model": MODEL,
        "data": {"url": "builtin://python-stdlib", "max_bytes": 100_000},
        "training": {"global_batch": 12, "micro_batch": 2, "steps": 1},
        "resources": {"devices": 4, "kind": "cpu"},
        "storage": {"url": url, "storage_options": options},
    })


def run_phase(phase: str, plan: Plan, spec: JobSpec, dcp_url: str, raw_url: str, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    plan_file, spec_file = tmp / f"{phase}-plan.json", tmp / f"{phase}-spec.json"
    plan_file.write_text(plan.model_dump_json())
    spec_file.write_text(spec.model_dump_json())
    command = torchrun_command(plan.devices, "parashift.bench.reshard_worker", "--phase", phase, "--plan", str(plan_file),
                               "--spec", str(spec_file), "--dcp", dcp_url, "--raw", raw_url, log_dir=tmp / "torchrun")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if "RESHARD " in line]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{phase} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].split("RESHARD ", 1)[1])


def measure_stalls(plan: Plan, spec: JobSpec, env: dict[str, str], fenced: bool = True) -> list[float]:
    """How long the trainer's loop waits for each save (capture + `before_update`, slowest
    rank), in real training with a checkpoint after every step (`fenced`: under the job's
    storage lease)."""
    from parashift.launcher.launch import launch_workers

    training = spec.training.model_copy(update={"steps": 5, "checkpoint_every": 1, "log_every": 1})
    spec = spec.model_copy(update={"training": training, "name": spec.name + "-train"})
    lines: list[str] = []
    with fenced_env(spec, env, fenced) as train_env:
        result = launch_workers(spec, plan, on_line=lines.append, extra_env=train_env)
    if result.returncode != 0:
        raise RuntimeError("training for stalls failed:\n" + "\n".join(lines[-40:]))
    from parashift.trainer.events import CheckpointStallEvent

    return [e.stall_s for e in result.of(CheckpointStallEvent)]


def start_moto() -> tuple[Any, str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def one_round(storage: str, old: str, new: str, endpoint: str | None, env: dict[str, str],
              fenced: bool = True) -> dict[str, Any]:
    """Save under `old`, restore under `new`, both ways, in fresh storage (`fenced`: under the
    job's storage lease)."""
    with tempfile.TemporaryDirectory(prefix="parashift-bench-", dir=os.environ.get("BENCH_TMP")) as tmp:
        job = f"bench-{uuid.uuid4().hex[:8]}"
        if storage == "s3":
            import boto3

            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
            options: dict[str, Any] = {"endpoint_url": endpoint}
            url, dcp_url, raw_url = f"s3://{bucket}/parashift", f"s3://{bucket}/dcp", f"s3://{bucket}/raw"
        else:
            options = {}
            url, dcp_url, raw_url = f"file://{tmp}/parashift", f"{tmp}/dcp", f"{tmp}/raw"
        spec = spec_for(job, url, options)
        with fenced_env(spec, env, fenced) as phase_env:
            saved = run_phase("save", plan_of(old), spec, dcp_url, raw_url, Path(tmp), phase_env)
            loaded = run_phase("load", plan_of(new), spec, dcp_url, raw_url, Path(tmp), phase_env)
    return {**saved, **loaded}


@contextlib.contextmanager
def fenced_env(spec: JobSpec, env: dict[str, str], fenced: bool) -> Iterator[dict[str, str]]:
    """The workers' environment, holding the job's storage lease (renewed in the background) and
    carrying its token when `fenced`, as `parashift run` does; `env` unchanged otherwise."""
    if not fenced:
        yield env
        return
    from parashift.storage import LEASE_ENV, JobLease, open_store

    with JobLease(open_store(spec.storage), spec.job_id).hold() as token:
        yield {**env, LEASE_ENV: str(token)}


def summarize(storage: str, old: str, new: str, rounds: list[dict[str, Any]], stalls: list[float]) -> dict[str, Any]:
    """Medians over rounds, and the medians of the per-round ratios the targets are about."""

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    first = rounds[0]
    stall = statistics.median(stalls)
    row = {
        "storage": storage,
        "change": f"{old}->{new}",
        "bytes_needed": first["bytes_needed"],
        "bytes_read": first["bytes_read"],
        "bytes_written": first["bytes_written"],
        "requests": first["requests"],
        "wall_s": round(med("save_s") + med("restore_s"), 3),
        "dcp_bytes_read": first["dcp_bytes_read"],
        "dcp_wall_s": round(med("dcp_save_s") + med("dcp_load_s"), 3),
        "raw_write_MBps": round(med("raw_write_MBps"), 1),
        "save_MBps": round(med("save_MBps"), 1),
        "stall_s": round(stall, 4),
        "dcp_save_s": round(med("dcp_save_s"), 3),
        "save_s": round(med("save_s"), 3),
        "restore_s": round(med("restore_s"), 3),
        "dcp_load_s": round(med("dcp_load_s"), 3),
        "stalls_s": stalls,
        "rounds": len(rounds),
        "restores_agree": all(r["agree"] for r in rounds),
        "read_ratio": round(first["bytes_read"] / first["bytes_needed"], 5),
        "dcp_read_ratio": round(first["dcp_bytes_read"] / first["bytes_needed"], 3),
        "wall_over_dcp": round(statistics.median((r["save_s"] + r["restore_s"]) / (r["dcp_save_s"] + r["dcp_load_s"])
                                                 for r in rounds), 3),
        "save_over_raw": round(statistics.median(r["save_MBps"] / r["raw_write_MBps"] for r in rounds), 3),
        "stall_over_dcp_save": round(stall / med("dcp_save_s"), 4),
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", default="file,s3")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=3, help="save + restore rounds per case (medians reported)")
    parser.add_argument("--fencing", choices=("on", "off", "both"), default="on",
                        help="save under the job's storage lease (on), without (off), or alternate the two")
    args = parser.parse_args()
    env = worker_env("cpu")
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.fencing]
    server = endpoint = None
    cases = []
    try:
        for storage in args.storage.split(","):
            if storage == "s3" and server is None:
                server, endpoint = start_moto()
            for case in args.cases.split(","):
                old, new = case.split("-")
                rounds: dict[bool, list[dict[str, Any]]] = {m: [] for m in modes}
                for i in range(args.rounds):
                    for fenced in modes if i % 2 == 0 else modes[::-1]:  # alternate which goes first
                        print(f"[{storage}] {old} -> {new}: round {i + 1}/{args.rounds}"
                              f"{' fenced' if fenced else ' unfenced'}", file=sys.stderr, flush=True)
                        rounds[fenced].append(one_round(storage, old, new, endpoint, env, fenced))
                print(f"[{storage}] {old}: training with a checkpoint every step", file=sys.stderr, flush=True)
                spec = spec_for(f"bench-{uuid.uuid4().hex[:8]}", f"file://{tempfile.mkdtemp(prefix='parashift-bench-')}/store", {})
                stalls = measure_stalls(plan_of(old), spec, env, modes[0])
                row = summarize(storage, old, new, rounds[modes[0]], stalls)
                row["fenced"] = modes[0]
                if len(modes) == 2:
                    pairs = list(zip(rounds[True], rounds[False], strict=True))
                    row["unfenced"] = {k: round(statistics.median(r[k] for r in rounds[False]), 3)
                                       for k in ("save_s", "restore_s")}
                    row["fenced_over_unfenced"] = {
                        k: round(statistics.median(f[k] / u[k] for f, u in pairs), 3) for k in ("save_s", "restore_s")}
                print(json.dumps(row), file=sys.stderr, flush=True)
                cases.append(row)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps({"bench": "reshard", "machine": f"{platform.machine()} {os.cpu_count()} cores", "model": MODEL,
                      "cases": cases}))


if __name__ == "__main__":
    main()
