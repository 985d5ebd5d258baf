"""The data path: how fast the streaming reader and prepare-data are, how long a step waits
for data, and whether a worker's memory grows with the corpus.

- a synthetic prepared dataset of `--large-gb` (uint32 ids of a Llama 3-sized vocabulary, the
  format `parashift prepare-data` writes, checksums included) and one of 20 MB, on file://;
- `reader_tokens_per_s`: one process reading random samples (the trainer's order) through
  `SampleStream` over the large dataset;
- the default model (specs/default.yaml's size, vocabulary widened) trained on `--devices` CPU
  workers on each dataset: `trainer_tokens_per_s`, `data_wait_fraction` (of the step time,
  rank 0, after warm-up), each worker's peak resident memory (VmHWM, polled from /proc) as
  `rss_mb_small` / `rss_mb_large`, and `first_step_s_large` (workers' start to the first step);
- `prepare_MBps`: text MB/s through `prepare_dataset` with a byte-level BPE, against
  `tokenizers_MBps`, that tokenizer's own `encode_batch` on the same documents, same run.

Last line: one JSON object. Targets (issue 24): reader >= 20x trainer, data wait <= 1%,
rss_mb_large - rss_mb_small <= 300, prepare >= 0.8x tokenizers.

    OMP_NUM_THREADS=1 python -m bench.data [--large-gb 2] [--devices 4] [--steps 30] [--text-mb 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from parashift.corpus import open_dataset, prepare_dataset, train_bpe
from parashift.corpus.dataset import (
    CHUNK_BYTES,
    MANIFEST_KEY,
    DatasetManifest,
    ShardRecord,
    TokenizerRecord,
    chunk_checksums,
    encode_dataset_manifest,
)
from parashift.launcher.launch import launch_workers
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.storage import ObjectStore
from parashift.trainer.data import SampleStream
from parashift.trainer.events import StartEvent, StepEvent, WorkerEvent

VOCAB = 128_256  # Llama 3's: ids need uint32
SHARD_TOKENS = 64 * 2**20  # 256 MB of uint32 per shard


def synthetic_dataset(url: str, tokens: int, seed: int = 0, options: dict | None = None) -> None:
    """A prepared dataset of `tokens` random ids, written shard by shard (never all in memory)."""
    store = ObjectStore(url, options)
    rng = np.random.default_rng(seed)
    shards = []
    for i, start in enumerate(range(0, tokens, SHARD_TOKENS)):
        count = min(SHARD_TOKENS, tokens - start)
        body = rng.integers(0, VOCAB, count, dtype=np.uint32).astype("<u4").tobytes()
        record = ShardRecord(id=f"synthetic-{i:04d}", inputs=[], tokens=count, documents=1,
                             chunks=chunk_checksums(body, CHUNK_BYTES), docs_crc32c=0)
        store.put(record.tokens_key, body)
        store.put(record.docs_key, b"")
        del body
        shards.append(record)
    manifest = DatasetManifest(tokenizer=TokenizerRecord(name="synthetic", fingerprint="sha256:synthetic",
                                                         vocab_size=VOCAB, eos_id=None),
                               dtype="uint32", text_format="text", text_field="text", shards=shards,
                               tokens=tokens, documents=len(shards))
    store.put(MANIFEST_KEY, encode_dataset_manifest(manifest))


def reader_rate(url: str, seq_len: int, batch: int, seconds: float = 5.0) -> float:
    stream = SampleStream(open_dataset(url), seq_len, seed=1)
    done, start, position = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        inputs, _ = stream.batch(position, batch)
        done += inputs.numel() + batch
        position += batch
    return done / (time.perf_counter() - start)


def peak_rss_mb(pids: list[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out[pid] = int(line.split()[1]) / 1024
        except OSError:
            pass
    return out


def train_on(url: str, devices: int, steps: int, folder: Path, options: dict | None = None) -> dict[str, float]:
    spec = JobSpec.model_validate({
        "name": f"bench-data-{Path(url).name}",
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": VOCAB, "seq_len": 64, "dropout": 0.0},
        "data": {"url": url, "format": "prepared", "storage_options": options or {}},
        "training": {"global_batch": 16, "micro_batch": 4, "steps": steps, "seed": 1234, "checkpoint_every": 10**6,
                     "log_every": 1},
        "resources": {"devices": devices, "kind": "cpu"},
        "storage": {"url": f"file://{folder}/store"}})
    pids: list[int] = []
    peaks: dict[int, float] = {}
    started = time.perf_counter()
    first_step: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.1):
            for pid, mb in peak_rss_mb(pids).items():
                peaks[pid] = max(peaks.get(pid, 0.0), mb)

    def on_event(event: WorkerEvent) -> None:
        if isinstance(event, StartEvent):
            pids.extend(event.pids)
        if isinstance(event, StepEvent) and not first_step:
            first_step.append(time.perf_counter() - started)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    result = launch_workers(spec, Plan.data_parallel(devices), on_event=on_event)
    stop.set()
    poller.join()
    if result.returncode != 0:
        raise SystemExit(f"training on {url} failed ({result.returncode})")
    steps_after = result.steps[3:]
    return {
        "tokens_per_s": statistics.median(e.tokens_per_s for e in steps_after),
        "data_wait_fraction": sum(e.data_wait_s or 0.0 for e in steps_after) / sum(e.step_s for e in steps_after),
        "rss_mb": max(peaks.values()) if peaks else float("nan"),
        "first_step_s": first_step[0] if first_step else float("nan"),
        "start_phases": result.start.phases if result.start is not None else {},
    }


def train_on_s3(megabytes: float, devices: int, steps: int, folder: Path) -> dict[str, float]:
    """The same job on a dataset in a bucket of moto's S3 server on 127.0.0.1 (a test dependency)."""
    import os

    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench-data")
        options = {"endpoint_url": endpoint}
        synthetic_dataset("s3://bench-data/dataset", int(megabytes * 1e6 / 4), options=options)
        return train_on("s3://bench-data/dataset", devices, steps, folder / "s3", options)
    finally:
        server.stop()


def text_corpus(folder: Path, megabytes: float) -> Path:
    """The standard library's modules, copied until `megabytes` of text."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    folder.mkdir(parents=True)
    written, i = 0, 0
    while written < megabytes * 1e6:
        text = sources[i % len(sources)].read_text(errors="replace")
        (folder / f"{i:05d}.txt").write_text(text)
        written += len(text.encode())
        i += 1
    return folder


def prepare_rates(folder: Path, megabytes: float) -> dict[str, float]:
    corpus = text_corpus(folder / "text", megabytes)
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    total_mb = sum(len(t.encode()) for t in texts) / 1e6
    tokenizer = train_bpe(texts[:200], 8192)
    started = time.perf_counter()
    tokenizer.backend.encode_batch(texts, add_special_tokens=False)
    tokenizers_s = time.perf_counter() - started
    started = time.perf_counter()
    prepare_dataset(f"file://{corpus}", f"file://{folder}/prepared", tokenizer, group_bytes=8 * 2**20)
    prepare_s = time.perf_counter() - started
    return {"prepare_MBps": total_mb / prepare_s, "tokenizers_MBps": total_mb / tokenizers_s, "text_MB": total_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large-gb", type=float, default=2.0)
    parser.add_argument("--small-mb", type=float, default=20.0)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--text-mb", type=float, default=20.0)
    parser.add_argument("--s3-mb", type=float, default=200.0, help="a dataset on a local S3 server (moto); 0: skip")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parashift-bench-data-") as tmp:
        folder = Path(tmp)
        small, large = f"file://{folder}/small", f"file://{folder}/large"
        synthetic_dataset(small, int(args.small_mb * 1e6 / 4))
        started = time.perf_counter()
        synthetic_dataset(large, int(args.large_gb * 1e9 / 4))
        print(f"generated {args.large_gb} GB in {time.perf_counter() - started:.1f} s", flush=True)
        reader = reader_rate(large, 64, 16)
        print(f"reader {reader:,.0f} tokens/s", flush=True)
        runs = {}
        for name, url in (("small", small), ("large", large)):
            runs[name] = train_on(url, args.devices, args.steps, folder / name)
            print(name, json.dumps(runs[name]), flush=True)
        if args.s3_mb:
            runs["s3"] = train_on_s3(args.s3_mb, args.devices, args.steps, folder)
            print("s3", json.dumps(runs["s3"]), flush=True)
        rates = prepare_rates(folder, args.text_mb)
        print(json.dumps(rates), flush=True)
    trainer = runs["large"]["tokens_per_s"]
    print(json.dumps({
        "reader_tokens_per_s": round(reader),
        "trainer_tokens_per_s": round(trainer),
        "reader_vs_trainer": round(reader / trainer, 1),
        "data_wait_fraction": round(runs["large"]["data_wait_fraction"], 5),
        "data_wait_fraction_small": round(runs["small"]["data_wait_fraction"], 5),
        "rss_mb_small": round(runs["small"]["rss_mb"], 1),
        "rss_mb_large": round(runs["large"]["rss_mb"], 1),
        "first_step_s_small": round(runs["small"]["first_step_s"], 2),
        "first_step_s_large": round(runs["large"]["first_step_s"], 2),
        "data_phase_s_large": runs["large"]["start_phases"].get("data_s"),
        "prepare_MBps": round(rates["prepare_MBps"], 2),
        "tokenizers_MBps": round(rates["tokenizers_MBps"], 2),
        "prepare_vs_tokenizers": round(rates["prepare_MBps"] / rates["tokenizers_MBps"], 3),
        **({"rss_mb_s3": round(runs["s3"]["rss_mb"], 1), "data_wait_fraction_s3": round(runs["s3"]["data_wait_fraction"], 5),
            "s3_mb": args.s3_mb} if "s3" in runs else {}),
        "devices": args.devices, "large_gb": args.large_gb, "small_mb": args.small_mb, "text_MB": rates["text_MB"],
    }))


if __name__ == "__main__":
    main()
