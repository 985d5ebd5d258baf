"""`make setup` keeps the torch it chose: the pinned build, and on a machine without a GPU the
CPU wheel with no CUDA packages beside it (gigabytes a CPU user should never download)."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def pinned_torch() -> str:
    found = re.search(r"^TORCH_SPEC \?= torch==([\w.]+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert found, "the Makefile pins torch with TORCH_SPEC ?= torch==X.Y.Z"
    return found.group(1)


def test_the_pinned_torch_is_the_one_installed() -> None:
    assert torch.__version__.split("+")[0] == pinned_torch()


def test_no_cuda_packages_without_a_gpu() -> None:
    if shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a GPU: the CUDA build is the right one")
    cuda = sorted(d.metadata["Name"] for d in importlib.metadata.distributions()
                  if d.metadata["Name"].lower().startswith("nvidia-"))
    assert cuda == [] and torch.version.cuda is None, f"CPU machine with CUDA torch {torch.__version__}: {cuda}"
