"""A committed checkpoint written as a Hugging Face checkpoint: `config.json` and size-sharded
`*.safetensors` (with `model.safetensors.index.json`), loadable by
`transformers.AutoModelForCausalLM.from_pretrained`.

One output shard at a time: its tensors are read whole from the checkpoint with exact ranged
reads (every chunk verified against its checksum), renamed and transposed by the family's
Hugging Face adapter, encoded by `safetensors` and written; nothing else of the state is held.
safetensors only, never pickle.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
from parashift.corpus.tokenizer import load_tokenizer
from parashift.models import family_of
from parashift.models.hub import GENERATION_FILE, TOKENIZER_FILES, companion_files, read_config
from parashift.ptc.codec import torch_dtype
from parashift.specs import JobSpec
from parashift.storage import ObjectStore, job_store
from parashift.trainer.checkpoint import load_tensors
from safetensors.torch import save as safetensors_bytes

# transformers' default shard size for save_pretrained ("5GB").
DEFAULT_SHARD_BYTES = 5 * 10**9


@dataclass
class ExportReport:
    step: int
    url: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes_written: int = 0
    copied: dict[str, str] = field(default_factory=dict)  # companion file -> where it came from


def exported_config(spec: JobSpec, ours: dict[str, Any]) -> dict[str, Any]:
    """The family's config for the model (`ours`), over its `init_from` folder's config where
    there is one: what the model's math does not decide stays the source's (its token ids, the
    context it supports: a Llama 3 fine-tuned at 2,048 tokens still serves 8,192; both were
    lost, so an export generated with transformers' default end-of-sequence id)."""
    source = getattr(spec.model, "init_from", None)
    if source is None:
        return ours
    theirs = read_config(source)
    merged = {**theirs, **ours}
    if "max_position_embeddings" in theirs:
        merged["max_position_embeddings"] = max(theirs["max_position_embeddings"], ours.get("max_position_embeddings", 0))
    return merged  # its dtype is the one written (`export_hf`)


def companions(spec: JobSpec) -> dict[str, tuple[bytes, str]]:
    """The files an export carries beside config and weights, each with where it came from: the
    `init_from` folder's generation defaults and tokenizer, or, where the job names a tokenizer
    of its own (`data.tokenizer`), that one's tokenizer.json instead of the folder's."""
    out: dict[str, tuple[bytes, str]] = {}
    source = getattr(spec.model, "init_from", None)
    own = spec.data.tokenizer not in (None, "bytes")
    if source is not None:
        wanted = (GENERATION_FILE,) if own else (GENERATION_FILE, *TOKENIZER_FILES)
        out.update({name: (data, source) for name, data in companion_files(source, wanted).items()})
    if own:
        tokenizer = load_tokenizer(spec.data.tokenizer, spec.data.storage_options)
        assert tokenizer.backend is not None  # not the bytes tokenizer
        out["tokenizer.json"] = (tokenizer.backend.to_str().encode(), tokenizer.name)
    return out


# The weight files of a Hugging Face folder (transformers' names, which an export writes).
WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")


def stale_weights(out: ObjectStore, written: list[str]) -> list[str]:
    """Weight files at the top of `out` that this export did not write: an earlier export's.
    Left, a sharded export over a single-file one loaded the old weights (transformers reads
    `model.safetensors` before an index), silently; `save_pretrained` removes them too."""
    return [key for key in out.list() if "/" not in key and WEIGHT_FILE.match(key) and key not in written]


def shard_groups(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into runs of at most `max_bytes` (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes:
        if groups[-1] and filled + nbytes > max_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += nbytes
    return groups


# What `dtype` may name: the checkpoint's fp32 weights as they are, or rounded to half their size
# (as Llama and most checkpoints on the Hub are published: an fp32 70B is 280 GB).
DTYPES = ("float32", "bfloat16", "float16")


def export_hf(spec: JobSpec, to: str, step: int | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              storage_options: dict | None = None, dtype: str = "float32") -> ExportReport:
    """Write the job's newest (or `step`'s) committed checkpoint to the folder or fsspec URL `to`,
    its floating-point weights in `dtype` (one of DTYPES; the config says which)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    to_dtype = getattr(torch, dtype)
    family = family_of(spec.model)
    adapter = family.hf_adapter()
    if adapter is None:
        raise ValueError(f"the {family.name} family has no Hugging Face adapter")
    store = job_store(spec)
    manifest = store.latest() if step is None else store.load_manifest(step)
    if manifest is None:
        raise FileNotFoundError(f"{spec.job_id} has no committed checkpoint to export")
    config = exported_config(spec, adapter.hf_config(spec.model))  # before anything is written: a model it
    # cannot express fails here
    config["torch_dtype"] = dtype  # what is written; transformers 5 also reads "dtype"
    if "dtype" in config:
        config["dtype"] = dtype
    reshaped = getattr(adapter, "hf_tensor", None)  # beyond a transposition (OPT's offset position rows)
    out = ObjectStore(to, storage_options)
    params = [name for name in manifest.tensors if name.startswith("model/")]

    def written_as(stored: torch.dtype) -> torch.dtype:
        return to_dtype if stored.is_floating_point else stored

    sizes = [(name, prod(manifest.tensors[name].shape) * written_as(torch_dtype(manifest.tensors[name].dtype)).itemsize)
             for name in params]
    groups = shard_groups(sizes, max_shard_bytes)
    report = ExportReport(manifest.step, out.url)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
        tensors = {}
        for name, tensor in load_tensors(store, manifest, names).items():
            ours = name.removeprefix("model/")
            key, transposed = adapter.hf_name(ours)
            tensor = tensor.t() if transposed else tensor
            tensor = reshaped(ours, tensor) if reshaped else tensor
            tensors[key] = tensor.to(written_as(tensor.dtype)).contiguous()
            weight_map[key] = file
        data = safetensors_bytes(tensors, metadata={"format": "pt"})
        out.put(file, data)
        report.files.append(file)
        report.tensors += len(tensors)
        report.bytes_written += len(data)
    if len(groups) > 1:
        total = sum(n for _, n in sizes)
        out.put("model.safetensors.index.json",
                json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2).encode())
        report.files.append("model.safetensors.index.json")
    for stale in stale_weights(out, report.files):
        out.delete(stale)
    out.put("config.json", json.dumps(config, indent=2).encode())
    report.files.append("config.json")
    for name, (data, origin) in companions(spec).items():
        out.put(name, data)
        report.files.append(name)
        report.copied[name] = origin
    return report
