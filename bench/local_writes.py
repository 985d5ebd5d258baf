"""CPU time of writing one checkpoint object to local files: past the page cache (O_DIRECT,
what `LocalFiles.put_stream` does) against buffered (the page cache filled by the kernel),
in the same run, alternating.

A save runs in the background of training: on a host whose cores the training uses, the
save's CPU time is what the steps it overlaps lose. Each write is one object of `--mb` MB
(default 73: one of 4 ranks' share of bench.trace's 293 MB), streamed in 4 MB parts from a
tensor, fsynced and renamed into place as a save does, to a new file each time, the files
kept until the end (as a job's newest checkpoints are). Per mode: the writing thread's CPU time
(user + system) and the wall time, medians over `--rounds`. Last line: one JSON object.

    python -m bench.local_writes [--mb 73] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from parashift.storage.backends import _atomic_write_local

PART = 4 << 20


def write_once(path: Path, data: memoryview, past_page_cache: bool) -> tuple[float, float]:
    """(CPU s of this thread, wall s) of one atomic streamed write of `data`."""
    parts = (data[i : i + PART] for i in range(0, len(data), PART))
    cpu, wall = time.thread_time(), time.perf_counter()
    _atomic_write_local(str(path), parts, past_page_cache=past_page_cache)
    return time.thread_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=73)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    data = memoryview(torch.randn(args.mb * 2**20 // 4).numpy()).cast("B")
    runs: dict[str, list[tuple[float, float]]] = {"past_page_cache": [], "buffered": []}
    with tempfile.TemporaryDirectory(prefix="parashift-writes-", dir=args.dir) as tmp:
        for i in range(args.rounds):
            for mode in (("past_page_cache", "buffered") if i % 2 == 0 else ("buffered", "past_page_cache")):
                path = Path(tmp, f"{mode}-{i}.bin")
                runs[mode].append(write_once(path, data, mode == "past_page_cache"))
                if path.read_bytes() != data:
                    raise SystemExit(f"{mode}: the object is not the bytes written")
                # Kept, as a job keeps its newest checkpoints: deleting each file would hand its
                # page-cache pages straight to the next buffered write (0.02 s of CPU, not 0.1+).
    out = {mode: {"cpu_s": round(statistics.median(c for c, _ in r), 4), "wall_s": round(statistics.median(w for _, w in r), 4),
                  "cpu_s_rounds": [round(c, 4) for c, _ in r]} for mode, r in runs.items()}
    print(json.dumps({
        "bench": "local_writes",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "mb": args.mb, "rounds": args.rounds, **out,
        "cpu_ratio_buffered_over_direct": round(out["buffered"]["cpu_s"] / max(out["past_page_cache"]["cpu_s"], 1e-9), 2),
    }))


if __name__ == "__main__":
    main()
