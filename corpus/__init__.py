"""The data people train on: tokenizers, token shards prepared once in storage, and the
reader workers stream them with (memory O(batch), never O(corpus)).

Engine room: numpy, fsspec, tokenizers and storage; no torch, no Prefect. The sampler that
turns tokens into training batches lives in `trainer.data`.
"""

from parashift.corpus.dataset import DatasetError, DatasetManifest, PreparedTokens, open_dataset
from parashift.corpus.prepare import PrepareOptions, prepare_dataset
from parashift.corpus.tokenizer import BYTES_TOKENIZER, Tokenizer, TokenizerError, load_tokenizer, train_bpe

__all__ = [
    "BYTES_TOKENIZER",
    "DatasetError",
    "DatasetManifest",
    "PrepareOptions",
    "PreparedTokens",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "open_dataset",
    "prepare_dataset",
    "train_bpe",
]
