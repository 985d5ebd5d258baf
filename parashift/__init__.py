"""parashift: train PyTorch models whose parallelism changes while they run."""

__version__ = "0.1.0"
