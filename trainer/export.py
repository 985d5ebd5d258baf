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
from dataclasses import dataclass, field
from math import prod

from parashift.models import family_of
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


def export_hf(spec: JobSpec, to: str, step: int | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              storage_options: dict | None = None) -> ExportReport:
    """Write the job's newest (or `step`'s) committed checkpoint to the folder or fsspec URL `to`."""
    family = family_of(spec.model)
    adapter = family.hf_adapter()
    if adapter is None:
        raise ValueError(f"the {family.name} family has no Hugging Face adapter")
    store = job_store(spec)
    manifest = store.latest() if step is None else store.load_manifest(step)
    if manifest is None:
        raise FileNotFoundError(f"{spec.job_id} has no committed checkpoint to export")
    config = adapter.hf_config(spec.model)  # before anything is written: a model it cannot express fails here
    reshaped = getattr(adapter, "hf_tensor", None)  # beyond a transposition (OPT's offset position rows)
    out = ObjectStore(to, storage_options)
    params = [name for name in manifest.tensors if name.startswith("model/")]
    sizes = [(name, prod(manifest.tensors[name].shape) * torch_dtype(manifest.tensors[name].dtype).itemsize)
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
            tensors[key] = (reshaped(ours, tensor) if reshaped else tensor).contiguous()
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
    out.put("config.json", json.dumps(config, indent=2).encode())
    report.files.append("config.json")
    return report
