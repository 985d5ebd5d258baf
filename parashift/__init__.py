"""parashift: train PyTorch models whose parallelism changes while they run.

Its rooms (specs, corpus, models, storage, trainer, launcher, planner, ptc, pool, tasks, flows, bench) keep
their folders at the top of the source tree and are imported as `parashift.<room>`: installed,
they live inside this package (pyproject's package-dir); run from a source tree without an
install (torchrun workers on a machine that was only given the tree), the tree's top is part of
this package's path. Either way a user's own `specs/` or `tasks/` folder never stands in for
them.
"""

from pathlib import Path

__version__ = "0.1.0"

_SOURCE_TREE = Path(__file__).resolve().parent.parent
if (_SOURCE_TREE / "pyproject.toml").is_file() and (_SOURCE_TREE / "specs" / "__init__.py").is_file():
    __path__.append(str(_SOURCE_TREE))  # noqa: F821 - a package's __path__
