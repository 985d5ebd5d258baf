"""Storage credentials from a Prefect Secret block, as environment variables.

A spec names the block (`storage.credentials_block`), never the secret. The block holds a
JSON object of environment variables (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); the
flow's own storage calls and the worker processes get them through their environment, which
is where fsspec backends look for credentials.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping

from parashift.specs import JobSpec

_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def storage_environment(spec: JobSpec) -> dict[str, str]:
    """The environment variables the job's storage credentials block holds ({} without one)."""
    name = spec.storage.credentials_block
    if not name:
        return {}
    from prefect.blocks.system import Secret

    value = Secret.load(name).get()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"Secret block {name!r} must hold a JSON object of environment variables") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and _ENV_NAME.match(k) for k in value):
        raise ValueError(f"Secret block {name!r} must hold an object mapping environment variable names to values")
    return {key: str(val) for key, val in value.items()}


@contextlib.contextmanager
def environment(extra: Mapping[str, str | None]) -> Iterator[None]:
    """Set `extra` in this process's environment for the duration (nothing when empty; a None
    value unsets its variable)."""
    saved = {key: os.environ.get(key) for key in extra}
    for key, value in extra.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
