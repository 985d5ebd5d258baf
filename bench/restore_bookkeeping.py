"""The bookkeeping of a warm change's restore, without processes: the Python each rank runs
before and around the bytes it moves, on the state `bench.trace` moves (a GPT with AdamW, ~293
MB, 3,549 checksum chunks).

- `record_s`: a failure's survivor describing the step it holds whole as a pending manifest
  (`describe_held`: every box's chunk checksums, one CRC pass over 293 MB, and the records),
  what the other survivors wait for;
- `record_split_s`: the same split between the 3 survivors of bench.trace's failure, as
  `LivePeers.record` splits it: the largest share's checksums and records, plus the writer's
  part (every share's records through pickle, as `gather_object` moves them, validated, and
  the manifest built): the record's path with the shares computed at once;
- `plan_s`: a rank planning its reads of a pending manifest: parse it, `check_usable`, its reads
  (live holders' copies first) and the buffers they land in (`Assembly`), what every rank of a
  scale-up runs before any byte moves.

Medians of `--rounds` (after one warm-up), in seconds; last line JSON.

    python -m bench.restore_bookkeeping [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from parashift.bench.trace import job_spec
from parashift.ptc.reconfig import Assembly
from parashift.ptc.reshard import check_usable, reads_for
from parashift.specs.plan import Plan
from parashift.storage import ObjectRecord, SliceRecord, job_store
from parashift.storage.manifest import encode_manifest
from parashift.trainer.checkpoint.saver import describe_held, held_manifest, held_records, record_shares
from parashift.trainer.layout import state_layout
from parashift.trainer.state import rng_state_bytes


def median_s(work: Callable[[], Any], rounds: int) -> float:
    work()  # warm-up: imports, caches
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    spec = job_spec("bookkeeping", Path(tempfile.mkdtemp()), steps=24, warm=True)
    store = job_store(spec)
    old = state_layout(Plan.data_parallel(4), spec.model, rng_state_bytes(torch.device("cpu")))
    held = {(name, box): torch.zeros(box.numel * old.tensors[name].itemsize, dtype=torch.uint8)
            for name, box, _ in old.distinct_slices()}

    def record() -> Any:
        return describe_held(store, old, 13, held, {"consumed": 1}, {}, {}, previous_step=12)

    shares = record_shares(old, 3)

    def share_records(share: list[int]) -> dict[int, Any]:
        return {r: (o.model_dump() if o else None, [s.model_dump() for s in slices])
                for r, (o, slices) in held_records(store, old, held, share).items()}

    gathered = [share_records(share) for share in shares]
    largest = max(shares, key=lambda share: sum(held[k].numel() for r in share for k in old.slices_to_write(r)))

    def record_split() -> Any:
        share_records(largest)
        everyone = pickle.loads(pickle.dumps(gathered))
        records = {r: (ObjectRecord(**o) if o else None, [SliceRecord(**s) for s in slices])
                   for said in everyone for r, (o, slices) in said.items()}
        return held_manifest(store.job_id, old, 13, records, {"consumed": 1}, {}, {}, 12)

    raw = encode_manifest(record())
    # A scale-up from 2 to 4: ranks 0 and 1 hold every box; rank 2 (new) plans its reads.
    holdings = {r: [(n, b, tuple(range(len(b.lengths)))) for n, b in sorted(old.boxes_of(r).items())] for r in (0, 1)}

    def plan() -> Any:
        manifest = store.parse_manifest(13, raw)
        stored = check_usable(manifest, old, None)
        wanted = {n: b for n, b in old.boxes_of(2).items() if n in manifest.tensors}
        reads = reads_for(manifest, wanted, 2, frozenset(), holdings, stored)
        return Assembly(reads, None)

    chunks = sum(len(s.chunks) for t in record().tensors.values() for s in t.slices)
    result = {"bench": "restore_bookkeeping", "machine": f"{platform.machine()} {os.cpu_count()} cores",
              "state_bytes": sum(t.numel() for t in held.values()), "chunks": chunks, "rounds": args.rounds,
              "record_s": round(median_s(record, args.rounds), 4),
              "record_split_s": round(median_s(record_split, args.rounds), 4),
              "plan_s": round(median_s(plan, args.rounds), 4)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
