"""How long a SIGKILLed process holding a large tensor takes to be gone, with glibc's default
malloc and the workers' tunables, each with and without transparent huge pages asked for
(`glibc.malloc.hugetlb=1`).

A killed rank's peers and launcher hear of its death only once it is gone: its sockets close
(and its pidfd turns readable) after the kernel has torn down its memory. A child process
allocates and touches `--mb` MiB in one tensor, says it is ready, and is SIGKILLed; the time
from the kill until its pidfd is readable is taken `--rounds` times per setting, with
`--spinners` busy processes beside it (a loaded host).

Last line JSON: the median and every round's seconds per setting, and the kernel's THP mode.

    python -m bench.kill_teardown [--mb 1500] [--rounds 5] [--spinners 2]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from parashift.bench.machine import busy_cores
from parashift.launcher.launch import KEEP_FREED_MEMORY

CHILD = "import sys, time, torch; t = torch.ones(int(sys.argv[1]) * 2**18); print('ready', flush=True); time.sleep(600)"
# glibc's defaults; the workers' own (`launcher.launch.KEEP_FREED_MEMORY`); each with huge pages.
SETTINGS = {"default": None, "hugetlb": "glibc.malloc.hugetlb=1", "workers": KEEP_FREED_MEMORY,
            "workers_hugetlb": f"{KEEP_FREED_MEMORY}:glibc.malloc.hugetlb=1"}


def kill_to_gone_s(mb: int, tunables: str | None) -> float:
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(mb)], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None and child.stdout.readline().startswith("ready")
    gone = os.pidfd_open(child.pid)
    try:
        began = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        select.select([gone], [], [], 30)
        return time.monotonic() - began
    finally:
        os.close(gone)
        child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spinners", type=int, default=2)
    args = parser.parse_args()
    results = {}
    with busy_cores(args.spinners):
        for name, tunables in SETTINGS.items():
            seconds = [round(kill_to_gone_s(args.mb, tunables), 4) for _ in range(args.rounds)]
            results[name] = {"median_s": statistics.median(seconds), "rounds_s": seconds}
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(json.dumps({"bench": "kill_teardown", "mb": args.mb, "spinners": args.spinners,
                      "thp": thp.read_text().strip() if thp.exists() else None, **results}))


if __name__ == "__main__":
    main()
