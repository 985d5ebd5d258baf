"""What rank 0's metrics cost the store over a long segment: copies and bytes written.

The trainer's metrics board (`trainer.scalars.Metrics`) records the trainer's 12 scalars per
logged step, one step every `--step-s` seconds, for `--steps` steps, into a store (`--store`:
any fsspec URL; default a temporary folder), then closes. Each copy to the store rewrites a
whole object (S3 has no append), so what matters is how many copies there are and how large.

Last line JSON: steps, copies (`put_requests`), bytes written, the largest object, the event
files in the store, and the wall time of the recording loop (`record_s`, what the training loop
itself spends).

    python -m bench.metrics_copies [--steps 2000] [--step-s 0.005] [--store file:///tmp/x]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from parashift.storage import ObjectStore
from parashift.trainer.scalars import Metrics

TAGS = ("loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "memory_gib", "data_wait_s", "step_s",
        "devices", "eval_loss", "eval_perplexity")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-s", type=float, default=0.005, help="seconds between logged steps")
    parser.add_argument("--store", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="metrics-copies-") as folder:
        store = ObjectStore(args.store or f"file://{folder}/store")
        board = Metrics(store, "copies", 1e6, 4, torch.device("cpu"), "fp32", 1e11)
        recording = 0.0
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            board.record(step, {tag: 1.0 / step for tag in TAGS})
            recording += time.perf_counter() - start
            time.sleep(args.step_s)
        board.close()
        keys = [k for k in store.list("jobs/copies/metrics") if "tfevents" in k]
        sizes = [store.size(k) for k in keys]
        print(json.dumps({"bench": "metrics_copies", "steps": args.steps, "step_s": args.step_s,
                          "copies": store.stats.put_requests, "bytes_written": store.stats.bytes_written,
                          "largest_object": max(sizes), "event_files": len(keys), "total_size": sum(sizes),
                          "record_s": round(recording, 3)}))


if __name__ == "__main__":
    main()
