"""What every section of the spec language shares: strict pydantic sections, and problems that
carry the path of the field they are about (so the loader can point at its line). A module of
its own so that model families (models/*/spec.py) can define their spec sections without
importing the whole job spec."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict

Loc = tuple[str | int, ...]

# Keys that hold secrets in fsspec/s3fs/gcsfs/adlfs storage options; compared case-insensitively.
CREDENTIAL_KEYS = frozenset(
    {
        "key",
        "secret",
        "password",
        "token",
        "session_token",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "access_key",
        "secret_key",
        "account_key",
        "sas_token",
        "client_secret",
        "connection_string",
    }
)
CREDENTIALS_RULE = (
    "credentials must come from the environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) "
    "or a Prefect Secret block (`storage.credentials_block`), never from the spec"
)

_JOB_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")  # fullmatch: `$` would admit a trailing newline
# Prefect block document names: lower-case letters, digits and dashes.
_BLOCK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class FieldIssues(ValueError):
    """Problems found by a validator, each at a path relative to the object it validated."""

    def __init__(self, issues: list[tuple[Loc, str]], *, at_key: bool = False) -> None:
        self.issues = issues
        self.at_key = at_key  # point at the key (not the value) in the source file
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {message}" for loc, message in issues))


def raise_if(issues: list[tuple[Loc, str]]) -> None:
    if issues:
        raise FieldIssues(issues)


def _find_credentials(value: Any, loc: Loc = (), seen: set[int] | None = None) -> list[tuple[Loc, str]]:
    """Every key (at any depth) of `value` that names a credential."""
    seen = set() if seen is None else seen
    if id(value) in seen:  # YAML aliases can share (or even nest) one object
        return []
    seen.add(id(value))
    found: list[tuple[Loc, str]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and key.lower() in CREDENTIAL_KEYS:
                found.append(((*loc, key), f"inline credential {key!r} is not allowed: {CREDENTIALS_RULE}"))
            else:
                found.extend(_find_credentials(item, (*loc, key), seen))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found.extend(_find_credentials(item, (*loc, index), seen))
    return found


def _check_storage_options(options: dict[str, Any]) -> dict[str, Any]:
    found = _find_credentials(options)
    if found:
        raise FieldIssues(found, at_key=True)
    return options


class Section(BaseModel):
    # Numbers are bounded to what can run (the limit is in the message); inf and nan never are.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)




# The names the rest of `specs` has always used.
_Section = Section
_raise_if = raise_if
