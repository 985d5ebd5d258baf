"""Tokenizers: how text becomes token ids, and a fingerprint that says which tokenizer did it.

Two kinds:
- `bytes`: one token per UTF-8 byte, vocabulary 256, no end-of-document token (the embedded
  default: it needs no file);
- a Hugging Face `tokenizers` tokenizer, from a `tokenizer.json` at any fsspec URL or a model
  folder that holds one (the file a Hugging Face checkpoint carries). Its fingerprint is the
  sha256 of its canonical JSON, so a dataset prepared with it and a job that names it can be
  matched without comparing vocabularies.

`train_bpe` trains a byte-level BPE offline (nothing is downloaded): `parashift tokenizer train`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec

BYTES = "bytes"
TOKENIZER_FILE = "tokenizer.json"
# The end-of-document token a trained tokenizer carries (GPT-2's spelling), looked for first
# in a loaded one; then the other common spellings.
EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<|im_end|>", "<eos>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used; one line that names it."""


@dataclass(frozen=True)
class Tokenizer:
    """Text to ids, with what a dataset records about it."""

    name: str  # `bytes`, or the URL it was loaded from
    vocab_size: int
    eos_id: int | None
    fingerprint: str  # "bytes", or "sha256:<hex>" of the tokenizer's canonical JSON
    backend: Any = None  # tokenizers.Tokenizer; None for bytes

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text (no special tokens added). `tokenizers` encodes a batch on all of
        its threads (RAYON_NUM_THREADS caps them)."""
        if self.backend is None:
            return [list(text.encode("utf-8")) for text in texts]
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]


BYTES_TOKENIZER = Tokenizer(BYTES, 256, None, BYTES)


def _eos_of(backend: Any) -> int | None:
    for token in _EOS_CANDIDATES:
        found = backend.token_to_id(token)
        if found is not None:
            return int(found)
    return None


def from_json(text: str, name: str) -> Tokenizer:
    """A tokenizer from the text of a tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_str(text)
    except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        raise TokenizerError(f"{name} is not a tokenizers tokenizer.json ({str(error).splitlines()[0][:200]})") from None
    canonical = json.dumps(json.loads(backend.to_str()), sort_keys=True, separators=(",", ":"))
    return Tokenizer(name, backend.get_vocab_size(with_added_tokens=True), _eos_of(backend),
                     "sha256:" + hashlib.sha256(canonical.encode()).hexdigest(), backend)


def load_tokenizer(ref: str | None, storage_options: dict[str, Any] | None = None) -> Tokenizer:
    """`bytes` (or None), a tokenizer.json URL, or a folder URL holding tokenizer.json."""
    if ref is None or ref == BYTES:
        return BYTES_TOKENIZER
    options = dict(storage_options or {})
    fs, path = fsspec.core.url_to_fs(ref, **options)
    try:
        if fs.isdir(path):
            path = f"{path.rstrip('/')}/{TOKENIZER_FILE}"
            ref = f"{ref.rstrip('/')}/{TOKENIZER_FILE}"
        with fs.open(path, "rb") as handle:
            text = handle.read().decode("utf-8")
    except FileNotFoundError:
        raise TokenizerError(f"no tokenizer at {ref}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise TokenizerError(f"{ref} cannot be read ({type(error).__name__}: {error})") from None
    return from_json(text, ref)


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE trained on `texts` (GPT-2's pre-tokenization; every byte is in the
    vocabulary, so any text encodes), with `EOS_TOKEN` as id 0 ... the first special token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise TokenizerError(f"vocab_size {vocab_size}: a byte-level BPE needs at least 257 (256 bytes + {EOS_TOKEN})")
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    return from_json(backend.to_str(), "trained")


def save_tokenizer(tokenizer: Tokenizer, url: str, storage_options: dict[str, Any] | None = None) -> str:
    """Write `tokenizer` as tokenizer.json at `url` (a folder URL gets tokenizer.json inside)."""
    if tokenizer.backend is None:
        raise TokenizerError("the bytes tokenizer has no file")
    target = url if url.endswith(".json") else f"{url.rstrip('/')}/{TOKENIZER_FILE}"
    fs, path = fsspec.core.url_to_fs(target, **dict(storage_options or {}))
    fs.makedirs(fs._parent(path), exist_ok=True)
    with fs.open(path, "wb") as handle:
        handle.write(tokenizer.backend.to_str(pretty=True).encode("utf-8"))
    return target
