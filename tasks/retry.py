"""Which task failures a retry may fix.

A retry repeats the same work: it helps where the failure came from the moment (a dropped
connection, throttling, a port another process took), never where it came from the input (a
bad spec, missing data, refused credentials, storage that is not there), which it would only
repeat, minutes later, with the same error.
"""

from __future__ import annotations

from typing import Any

from parashift.storage import StorageError, is_transient

# Failures of the input: retrying them repeats them.
PERMANENT = (ValueError, TypeError, KeyError, FileNotFoundError, PermissionError, ImportError, NotImplementedError)


def may_fix(error: BaseException) -> bool:
    """True when repeating the failed work may succeed."""
    if isinstance(error, StorageError):
        return is_transient(error)
    return not isinstance(error, PERMANENT)


def retry_if_it_may_help(task: Any, task_run: Any, state: Any) -> bool:
    """A Prefect `retry_condition_fn`: retry only failures `may_fix` accepts."""
    try:
        state.result()
    except BaseException as error:  # noqa: BLE001 - the failure being judged
        return may_fix(error)
    return False
