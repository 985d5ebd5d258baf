"""Hugging Face checkpoint folders, local or at any fsspec URL: `config.json` and weights in
`*.safetensors` (one file, or shards named by `model.safetensors.index.json`).

Weights are read with `safetensors` (memory-mapped: a process touches only the tensors it
asks for). A folder at a remote URL is copied to a cache on the node once, because safetensors
maps local files. Never pickle: a folder holding only `*.bin` (torch.save) weights is refused.
Nothing here imports torch or transformers at module level: specs read configs through it.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cache
from pathlib import Path
from typing import Any

from parashift.specs import environ
from parashift.specs.base import FieldIssues

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_folder(url: str) -> Path:
    """A local folder holding the checkpoint at `url`: the folder itself, or, for a remote
    fsspec URL, a copy in this node's cache (`$PARASHIFT_HF_CACHE`, else
    ~/.cache/parashift/hf) made once: the ranks of a node that race to make it each download
    into a folder of their own and rename it into place, and the first wins."""
    if _is_local(url):
        return Path(url.removeprefix("file://")).expanduser()
    import fsspec

    cache_root = Path(os.environ.get(environ.HF_CACHE, Path.home() / ".cache" / "parashift" / "hf"))
    target = cache_root / hashlib.sha256(url.encode()).hexdigest()[:16]
    if target.exists():
        return target
    fs, root = fsspec.core.url_to_fs(url)
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    wanted = [n for n in names if n == CONFIG_NAME or n.endswith((".safetensors", ".safetensors.index.json"))]
    staging = cache_root / f".{target.name}.{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    for name in wanted:
        fs.get(f"{root.rstrip('/')}/{name}", str(staging / name))
    try:
        staging.rename(target)
    except OSError:  # another rank was first: its copy is the same
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


# What a Hugging Face folder holds beside config and weights that a user of a model expects to find
# with it: the tokenizer and the generation defaults (its end-of-sequence ids). Copied as bytes,
# never loaded here.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
GENERATION_FILE = "generation_config.json"


def companion_files(url: str, names: tuple[str, ...]) -> dict[str, bytes]:
    """Those of `names` the folder at `url` (a path or any fsspec URL) holds, by name."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(local_folder(url)) if _is_local(url) else url)
    held = {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    return {name: fs.cat_file(f"{root.rstrip('/')}/{name}") for name in names if name in held}


class CheckpointUnreadable(RuntimeError):
    """An `init_from` folder the workers cannot read weights from: no retry can fix it."""


def read_config(url: str) -> dict[str, Any]:
    """The folder's config.json (from a remote URL: that file alone, no weights). Refused here,
    where a spec is validated, if the folder holds no safetensors weights: workers would fail on
    that later, each of them, after the launch."""
    try:
        if _is_local(url):
            folder = local_folder(url)
            names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
            text = (folder / CONFIG_NAME).read_text()
        else:
            import fsspec

            fs, root = fsspec.core.url_to_fs(url)
            names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
            text = fs.cat_file(f"{root.rstrip('/')}/{CONFIG_NAME}").decode()
        config = json.loads(text)
    except FileNotFoundError:
        raise FieldIssues([(("init_from",), f"{url} holds no {CONFIG_NAME}")]) from None
    except ValueError as error:
        raise FieldIssues([(("init_from",), f"{url}/{CONFIG_NAME} is not JSON: {error}")]) from None
    if SINGLE_NAME not in names and INDEX_NAME not in names:
        raise FieldIssues([(("init_from",), no_safetensors(url, names))])
    return config


def no_safetensors(where: str | Path, names: list[str]) -> str:
    pickled = sorted(n for n in names if n.endswith(".bin"))
    why = f" ({', '.join(pickled)}: pickle, never loaded)" if pickled else ""
    return (f"{where} holds no {SINGLE_NAME} or {INDEX_NAME}{why}; save it with transformers' "
            "save_pretrained(..., safe_serialization=True)")


class Weights:
    """The tensors of a local safetensors checkpoint, by Hugging Face name."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / INDEX_NAME
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / SINGLE_NAME).exists():
            files = [SINGLE_NAME]
        else:
            raise CheckpointUnreadable(no_safetensors(folder, [p.name for p in folder.glob("*")]))
        self.where: dict[str, Any] = {}
        for name in files:
            handle = safe_open(str(folder / name), framework="pt")
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self.where[key] = handle

    def get(self, name: str) -> Any:
        if name not in self.where:
            raise CheckpointUnreadable(f"the checkpoint has no tensor {name}")
        return self.where[name].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.where:
            raise CheckpointUnreadable(f"the checkpoint has no tensor {name}")
        return tuple(self.where[name].get_slice(name).get_shape())

    def part(self, name: str, index: tuple[slice, ...]) -> Any:
        """The `index` of tensor `name`, reading only its bytes (safetensors' slices)."""
        if name not in self.where:
            raise CheckpointUnreadable(f"the checkpoint has no tensor {name}")
        return self.where[name].get_slice(name)[index]


@cache
def checkpoint_weights(url: str) -> Weights:
    """The weights of the checkpoint at `url`, opened once per process."""
    return Weights(local_folder(url))
