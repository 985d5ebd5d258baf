"""The prepared GPU check (`bench.gpu_check`) at toy sizes on CPU: every part runs its real code
and prints every case, so the script a lent device runs cannot rot between devices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from parashift.bench.gpu_check import PARTS

# What each part's lines must carry for BENCHMARKS.md: its measurement and its reference.
FIELDS = {
    "memory": ("predicted_gib", "measured_gib", "ratio"),
    "throughput": ("trainer_tokens_per_s", "trainer_mfu"),
    "checkpoints": ("stall_s", "save_s"),
    "moves": (),
    "changes": (),
}


def test_every_part_runs_at_toy_sizes_on_cpu(tmp_path: Path) -> None:
    from parashift.bench.gpu import moves

    moves.prepare(tmp_path / "inputs")  # what `--prepare` makes here before a device is lent
    out = tmp_path / "check.jsonl"
    proc = subprocess.run([sys.executable, "-m", "parashift.bench.gpu_check", "--device", "cpu", "--tiny",
                           "--inputs", str(tmp_path / "inputs"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[-1].get("summary") == "gpu_check", proc.stdout[-3000:] + proc.stderr[-3000:]
    summary, cases = lines[-1], lines[:-1]
    assert summary["ok"] and proc.returncode == 0, (summary, out.with_suffix(".log").read_text()[-6000:])
    assert [name for name in summary["parts"]] == [p.name for p in PARTS]
    for part in PARTS:
        mine = [c for c in cases if c["part"] == part.name]
        assert mine and all(c["ok"] for c in mine), mine
        for c in mine:
            assert all(field in c for field in FIELDS[part.name]), (part.name, c)
    assert out.read_text().splitlines() == proc.stdout.splitlines()  # the file that comes back holds the same
    ratios = [c["ratio_vs_plain"] for c in cases if "ratio_vs_plain" in c]
    assert len(ratios) == 3 and all(r > 0 for r in ratios), ratios


def test_what_the_device_has_and_what_is_carried_are_named_as_installed_here() -> None:
    """`--prepare` pins each carried wheel (and `verify` each of the device's packages) to the
    version installed here: a misspelt or dropped name would fail only when preparing."""
    from importlib import metadata

    from parashift.bench.gpu_check import DEVICE_HAS, WHEELS

    assert not set(DEVICE_HAS) & set(WHEELS)
    for name in (*DEVICE_HAS, *WHEELS):
        assert metadata.version(name), name
    # what every trainer run and the `hf` family import, carried
    assert {"tensorboard", "protobuf", "transformers", "safetensors", "tokenizers", "pydantic"} <= set(WHEELS)
