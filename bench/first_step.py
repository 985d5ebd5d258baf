"""How soon `parashift run SPEC` trains: seconds from the command's start to its first step,
and to its end, over several rounds (medians). Each round runs the spec afresh (new storage)
against the embedded Prefect API on a Prefect home whose database is already migrated (a
copy made once, as a user's second run finds it), so the rounds measure the run, not Prefect's
migrations.

    .venv/bin/python -m bench.first_step [--spec specs/default.yaml] [--steps 10] [--rounds 3]

The last line is JSON: `to_first_step_s` (the command's start to the run log's first
`step 1/` line) and `total_s` per round, and their medians; and `refused_s`: how soon a
`parashift run` of a job whose storage lease another run holds (here: this bench) says so and
exits, per round, and its median.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from parashift.specs import load_spec
from parashift.storage import ObjectStore
from parashift.storage.lease import JobLease

REPO = Path(__file__).resolve().parents[1]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\bstep 1/\d+", re.MULTILINE)


def one_run(spec_file: Path, home: Path, folder: Path) -> tuple[float, float]:
    """(seconds to the first step, seconds to the end) of one `parashift run` in `folder`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(home)
    started = time.time()
    done = subprocess.run([str(Path(sys.executable).with_name("parashift")), "run", str(spec_file)], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=600)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"parashift run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    log = next((folder / ".parashift" / "logs").glob("*.log")).read_text()
    first = STAMP.search(log)
    if first is None:
        raise SystemExit("no `step 1/` line in the run log")
    at = datetime.strptime(first.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return at - started, ended - started


def one_refusal(spec_file: Path, home: Path, folder: Path) -> float:
    """Seconds `parashift run` takes to refuse a job whose storage lease another run holds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(home)
    started = time.time()
    done = subprocess.run([str(Path(sys.executable).with_name("parashift")), "run", str(spec_file)], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=600)
    took = time.time() - started
    if done.returncode != 1 or "is already running" not in done.stderr:
        raise SystemExit(f"parashift run was not refused:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=REPO / "specs/default.yaml")
    parser.add_argument("--steps", type=int, default=10, help="the spec's steps, overridden (short rounds)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spec = load_spec(args.spec)
    with tempfile.TemporaryDirectory(prefix="parashift-first-step-") as tmp:
        root = Path(tmp)
        seeded = root / "home-seeded"

        def round_folder(name: str) -> tuple[Path, Path]:
            folder = root / name
            folder.mkdir()
            job = spec.model_copy(update={
                "training": spec.training.model_copy(update={"steps": args.steps}),
                "storage": spec.storage.model_copy(update={"url": f"file://{folder}/store"})})
            spec_file = folder / "job.yaml"
            spec_file.write_text(job.model_dump_json(exclude_none=True))  # JSON is YAML
            return folder, spec_file

        folder, spec_file = round_folder("warm-up")  # migrates the database once
        one_run(spec_file, seeded, folder)
        firsts, totals = [], []
        for i in range(args.rounds):
            folder, spec_file = round_folder(f"round{i}")
            home = root / f"home{i}"
            shutil.copytree(seeded, home)
            first, total = one_run(spec_file, home, folder)
            firsts.append(round(first, 2))
            totals.append(round(total, 2))
            print(json.dumps({"round": i, "to_first_step_s": firsts[-1], "total_s": totals[-1]}), flush=True)
        # The last round's job, held by this process as a running first run would hold it.
        lease = JobLease(ObjectStore(f"file://{folder}/store"), spec.job_id, ttl_s=600)
        lease.acquire()
        try:
            refused = [round(one_refusal(spec_file, home, folder), 2) for _ in range(args.rounds)]
        finally:
            lease.release()
    print(json.dumps({"bench": "first_step", "spec": str(args.spec), "steps": args.steps, "rounds": args.rounds,
                      "to_first_step_s": firsts, "total_s": totals, "refused_s": refused,
                      "median_to_first_step_s": statistics.median(firsts), "median_total_s": statistics.median(totals),
                      "median_refused_s": statistics.median(refused)}))


if __name__ == "__main__":
    main()
