"""Storage exceptions and the ONE table that maps backend errors onto them.

Everything that leaves `storage/` is a `StorageError` (or a built-in it also subclasses, e.g.
`ObjectNotFound` is a `FileNotFoundError`); botocore/aiohttp exceptions never leak out.
`translate_error` is the only place that inspects backend exceptions; `ObjectStore._call` is
the only place that calls it.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass


class StorageError(Exception):
    """Base class of every error raised by `storage/`."""


class ObjectNotFound(StorageError, FileNotFoundError):
    """The object (key) does not exist."""


class StoragePermissionError(StorageError, PermissionError):
    """The backend refused access (403 / AccessDenied / bad credentials)."""


class TransientStorageError(StorageError):
    """Throttling, 5xx or a dropped connection that persisted through every retry."""


class TierUnusable(StorageError):
    """A node-local tier could not serve its reads (missing, unreadable or corrupted copies)."""


class ChecksumMismatch(StorageError):
    """Bytes read back do not match the checksum recorded when they were written."""

    def __init__(self, key: str, start: int, end: int, expected: str, actual: str) -> None:
        self.key = key
        self.start = start
        self.end = end
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"checksum mismatch in {key} bytes [{start}, {end}): expected crc32c {expected}, got {actual}"
        )


class CheckpointNotFound(StorageError):
    """No committed checkpoint (no manifest.json) at that step."""


class MalformedManifest(StorageError):
    """A manifest.json exists but is not valid JSON, does not match the Manifest schema, or its
    recorded digest does not match its content (edited by hand or corrupted)."""


class StaleLineage(StorageError):
    """A commit whose manifest would not continue the newest committed step: another writer
    committed since this one started."""


class WriteConflict(StorageError):
    """A conditional write lost: the object exists already (create), or changed since it was
    read (replace). Nothing was written."""


@dataclass(frozen=True)
class ErrorRule:
    """How one backend error is surfaced: the exception class and whether a retry may help."""

    exc: type[StorageError]
    transient: bool


# ---------------------------------------------------------------------------------------------
# THE error table. Keys are S3 error codes or HTTP status codes (as strings), as found in a
# botocore ClientError's `response["Error"]["Code"]` / `ResponseMetadata.HTTPStatusCode`.
# s3fs translates ClientErrors into OSErrors but keeps the ClientError as `__cause__`; we look
# through that chain, so a SlowDown that s3fs turned into `OSError(EBUSY)` is still transient.
# Codes: https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html
# ---------------------------------------------------------------------------------------------
_NOT_FOUND = ErrorRule(ObjectNotFound, transient=False)
_DENIED = ErrorRule(StoragePermissionError, transient=False)
_TRANSIENT = ErrorRule(TransientStorageError, transient=True)
_CONFLICT = ErrorRule(WriteConflict, transient=False)

ERROR_TABLE: dict[str, ErrorRule] = {
    "NoSuchKey": _NOT_FOUND,
    "NoSuchBucket": _NOT_FOUND,
    "NoSuchUpload": _NOT_FOUND,
    "NotFound": _NOT_FOUND,
    "404": _NOT_FOUND,
    "AccessDenied": _DENIED,
    "403": _DENIED,
    "InvalidAccessKeyId": _DENIED,
    "SignatureDoesNotMatch": _DENIED,
    "ExpiredToken": _DENIED,
    # Conditional writes (If-None-Match / If-Match): the precondition did not hold, or another
    # conditional write of the same key was in flight (409: the caller reads again and decides).
    "PreconditionFailed": _CONFLICT,
    "412": _CONFLICT,
    "ConditionalRequestConflict": _CONFLICT,
    "SlowDown": _TRANSIENT,
    "Throttling": _TRANSIENT,
    "ThrottlingException": _TRANSIENT,
    "RequestLimitExceeded": _TRANSIENT,
    "TooManyRequests": _TRANSIENT,
    "429": _TRANSIENT,
    "RequestTimeout": _TRANSIENT,
    "InternalError": _TRANSIENT,
    "ServiceUnavailable": _TRANSIENT,
    "500": _TRANSIENT,
    "502": _TRANSIENT,
    "503": _TRANSIENT,
    "504": _TRANSIENT,
}

# Built-in exceptions (what fsspec's local/memory backends and s3fs raise), most specific first.
OSERROR_TABLE: tuple[tuple[type[BaseException], ErrorRule], ...] = (
    (FileNotFoundError, _NOT_FOUND),
    (IsADirectoryError, _NOT_FOUND),  # a "key" that is a folder is not an object
    (NotADirectoryError, _NOT_FOUND),
    (PermissionError, _DENIED),
    (ConnectionError, _TRANSIENT),  # includes ConnectionResetError / BrokenPipeError
    (TimeoutError, _TRANSIENT),  # includes asyncio.TimeoutError, fsspec FSTimeoutError
    (OSError, ErrorRule(StorageError, transient=False)),
)

# Transport exceptions of the S3 client stack that are not ClientErrors (matched by class name
# so that storage does not import botocore/aiohttp).
TRANSIENT_TRANSPORT_NAMES: frozenset[str] = frozenset(
    {
        "HTTPClientError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "ClientConnectionError",
        "ClientPayloadError",
        "ServerDisconnectedError",
    }
)
_BACKEND_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "s3fs")

# OSError errnos that mean "try again" when no error code is attached.
_TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EAGAIN})


def _client_error_code(exc: BaseException) -> str | None:
    """The S3 error code (or HTTP status) of a botocore ClientError when the table knows it."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = (response.get("Error") or {}).get("Code")
    if code and str(code) in ERROR_TABLE:
        return str(code)
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    if status is not None and str(status) in ERROR_TABLE:
        return str(status)
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """exc, its __cause__, that one's __cause__... (bounded, cycle-safe).

    Only explicit causes: s3fs raises its translated OSError `from` the ClientError, while an
    implicit __context__ may be an unrelated, already handled error.
    """
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 8:
        out.append(cur)
        cur = cur.__cause__
    return out


def _is_backend_exception(exc: BaseException) -> bool:
    return any(cls.__module__.split(".")[0] in _BACKEND_MODULES for cls in type(exc).__mro__)


def classify(exc: BaseException) -> ErrorRule | None:
    """The table's rule for `exc`, or None when it is not a backend error (e.g. a ValueError)."""
    if isinstance(exc, StorageError):
        return ErrorRule(type(exc), transient=isinstance(exc, TransientStorageError))
    chain = _chain(exc)
    for e in chain:  # an S3 error code anywhere in the chain is the most precise information
        code = _client_error_code(e)
        if code is not None:
            return ERROR_TABLE[code]
    for e in chain:
        if any(cls.__name__ in TRANSIENT_TRANSPORT_NAMES for cls in type(e).__mro__):
            return _TRANSIENT
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return _TRANSIENT
    for builtin, rule in OSERROR_TABLE:
        if isinstance(exc, builtin):
            return rule
    if _is_backend_exception(exc):
        return ErrorRule(StorageError, transient=False)
    return None


def translate_error(exc: BaseException, where: str = "") -> BaseException:
    """Map a backend exception to a storage exception (non-backend exceptions pass through).

    `where` (e.g. "get s3://bucket/key") prefixes the message. The original is kept as
    `__cause__` by the caller's `raise ... from exc`.
    """
    if isinstance(exc, StorageError):
        return exc
    rule = classify(exc)
    if rule is None:
        return exc
    detail = str(exc) or type(exc).__name__
    message = f"{where}: {detail}" if where else detail
    return rule.exc(message)


def is_transient(exc: BaseException) -> bool:
    """True when retrying the same idempotent operation may succeed."""
    rule = classify(exc)
    return rule is not None and rule.transient
