"""Search a property test harder than the suite does: its own strategies, a random seed, many
examples, no example database. The suite runs each property a fixed, small number of times; a
rare counterexample (a planner exactness failure on 2026-12-06 surfaced in one of seven full
runs) turns up here in minutes.

    .venv/bin/python tests/hunt.py test_planner_memory test_constrained_search_equals_enumeration_on_random_dags 2000

Prints PASS with the time taken, or Hypothesis's falsifying example and exits 1. Tests that take
pytest fixtures besides their strategies cannot be run this way.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings


def main(module: str, name: str, examples: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))  # the tests' own helper modules
    handle = getattr(importlib.import_module(module), name).hypothesis
    hunt = settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                    derandomize=False, database=None)(given(**handle._given_kwargs)(handle.inner_test))
    started = time.monotonic()
    hunt()
    print(f"PASS {module}.{name}: {examples} examples in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
