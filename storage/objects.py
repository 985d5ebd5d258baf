"""`ObjectStore`: bytes under string keys on file://, memory:// or s3://.

Keys are '/'-separated paths relative to the store's root URL. A backend (`storage.backends`:
local files, or any fsspec filesystem) supplies a few primitives on paths; every call of one
goes through `ObjectStore._call`, the one place that translates backend errors
(storage.errors) and retries idempotent operations on transient errors.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from parashift.storage.backends import TMP_SUFFIX, Backend, LocalFiles, open_backend, tag_of
from parashift.storage.errors import StorageError, is_transient, translate_error

logger = logging.getLogger("parashift.storage")

T = TypeVar("T")

# Retry policy (SDK-style exponential backoff, "full jitter"; see the AWS Architecture blog,
# "Exponential Backoff And Jitter"). 4 tries with a 50 ms base waits at most ~0.35 s in total:
# s3fs and botocore already retry underneath, this layer covers what they give up on.
MAX_TRIES = 4
BACKOFF_BASE_S = 0.05


@dataclass
class StoreStats:
    """Counters for benchmarks: payload bytes and backend requests issued by this store."""

    bytes_read: int = 0
    bytes_written: int = 0
    get_requests: int = 0
    put_requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, read: int = 0, written: int = 0, gets: int = 0, puts: int = 0) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written
            self.get_requests += gets
            self.put_requests += puts

    def reset(self) -> None:
        with self._lock:
            self.bytes_read = self.bytes_written = self.get_requests = self.put_requests = 0

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class ObjectStore:
    """Bytes under keys relative to a root URL (`file://`, plain path, `memory://`, `s3://`)."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        max_tries: int = MAX_TRIES,
        backoff_s: float = BACKOFF_BASE_S,
    ) -> None:
        self.backend: Backend = open_backend(url, storage_options)
        self.protocol = self.backend.protocol
        self.url = self.backend.url
        self.max_tries = max(1, max_tries)
        self.backoff_s = backoff_s
        self.stats = StoreStats()

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    @property
    def fs(self) -> Any:
        """The fsspec filesystem underneath (for tests and instrumentation)."""
        return self.backend.fs

    @property
    def _root(self) -> str:
        return self.backend.root

    # ------------------------------------------------------------------ paths

    @property
    def is_local(self) -> bool:
        """Files in a local folder: directory entries (links included) exist, folders rename."""
        return isinstance(self.backend, LocalFiles)

    def _lexical_path(self, key: str) -> str:
        """Backend path of `key`; rejects keys that name a path outside the root."""
        key = key.strip("/")
        parts = key.split("/") if key else []
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid storage key {key!r}")
        return f"{self._root.rstrip('/')}/{key}" if key else self._root

    def _path(self, key: str) -> str:
        """Backend path of `key`; rejects keys that lead outside the root, by name or by link."""
        path = self._lexical_path(key)
        return self.backend.inside(path) if key.strip("/") else path

    def _key_of(self, path: str) -> str:
        root = self._root.rstrip("/").lstrip("/")
        rel = path.lstrip("/")
        if rel == root:
            return ""
        if not rel.startswith(root + "/"):
            raise StorageError(f"backend returned {path!r} outside the store root {self.url}")
        return rel[len(root) + 1 :]

    def check_key(self, key: str) -> None:
        """Refuse, without reading anything, a key a read would refuse: ValueError for one that
        names a path outside the store, StorageError for one that leads out of it through a
        symbolic link (local files)."""
        self._path(key)

    def url_for(self, key: str) -> str:
        """Full URL of `key` (for logs and artifacts)."""
        key = key.strip("/")
        self._lexical_path(key)
        return f"{self.url}/{key}" if key else self.url

    # ------------------------------------------------------------------ the choke point

    def _call(self, op: str, key: str, fn: Callable[[], T], *, idempotent: bool = True) -> T:
        """Run one backend operation: translate errors, retry idempotent ones on transient errors."""
        where = f"{op} {self.url_for(key) if key is not None else self.url}"
        for attempt in range(1, self.max_tries + 1):
            try:
                return fn()
            except Exception as exc:
                if idempotent and attempt < self.max_tries and is_transient(exc):
                    delay = random.uniform(0, self.backoff_s * 2 ** (attempt - 1))
                    logger.warning(
                        "%s failed (try %d/%d, retrying in %.3fs): %r",
                        where,
                        attempt,
                        self.max_tries,
                        delay,
                        exc,
                    )
                    time.sleep(delay)
                    continue
                translated = translate_error(exc, where)
                if translated is exc:
                    raise
                raise translated from exc
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ bytes

    def put(self, key: str, data: bytes) -> None:
        """Write `data` at `key` atomically (readers see the old or the new object, never half)."""
        path = self._path(key)
        if not key.strip("/"):
            raise ValueError("put needs a non-empty key")
        self._call("put", key, lambda: self.backend.put(path, data))
        self.stats.add(written=len(data), puts=1)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of `key` (end exclusive); one ranged GET, no read-ahead."""
        if (start is not None and start < 0) or (end is not None and end < 0):
            raise ValueError("negative offsets are not supported")
        path = self._path(key)
        if start is not None and end is not None and end <= start:
            # Still a real error for a missing key; fsspec would return b"" without asking.
            self.size(key)
            return b""
        data = self._call("get", key, lambda: self.backend.get(path, start, end))
        self.stats.add(read=len(data), gets=1)
        return data

    def get_ranges(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        """Batch of (key, start, end) ranged reads (end exclusive), in request order.

        One batch call: concurrent ranged GETs on s3 (bounded by fsspec's batch size),
        sequential reads on local backends. Any failure fails the whole batch.
        """
        if not requests:
            return []
        for _, s, e in requests:
            if s < 0 or e < s:
                raise ValueError(f"invalid byte range [{s}, {e})")
        paths = [self._path(k) for k, _, _ in requests]
        starts = [int(s) for _, s, _ in requests]
        ends = [int(e) for _, _, e in requests]
        label = requests[0][0] if len(requests) == 1 else ""
        data = self._call(f"get_ranges[{len(requests)}]", label, lambda: self.backend.get_ranges(paths, starts, ends))
        self.stats.add(read=sum(len(d) for d in data), gets=len(requests))
        return data

    def put_stream(self, key: str, parts: Callable[[], Iterable[memoryview | bytes]]) -> int:
        """Write the concatenation of `parts()` at `key` atomically, without joining them: each
        part goes from its memory straight to the file (or to s3fs's upload buffer). `parts` is
        called again for a retry. Returns the bytes written."""
        path = self._path(key)
        if not key.strip("/"):
            raise ValueError("put needs a non-empty key")
        n = self._call("put", key, lambda: self.backend.put_stream(path, parts()))
        self.stats.add(written=n, puts=1)
        return n

    def read_into(self, requests: Sequence[tuple[str, int, list[memoryview]]],
                  then: Callable[[int], None] | None = None) -> None:
        """Fill each request's buffers, in order, with the bytes of its key from `start` on:
        local files are read straight into them (preadv scatters one range over several
        buffers; several requests at once), other backends in one batched `cat_ranges`. A short
        object is an error. `then(i)` runs once request i is read (on the reading thread, so
        checksumming overlaps the other reads)."""
        if not requests:
            return
        size = self.backend.read_batch or len(requests)
        batches = [range(i, min(i + size, len(requests))) for i in range(0, len(requests), size)]

        def read(batch: range) -> None:
            items = [(self._path(requests[i][0]), requests[i][1], requests[i][2]) for i in batch]
            op = "get" if self.backend.read_batch == 1 else f"get_ranges[{len(batch)}]"
            self._call(op, requests[batch[0]][0] if len(batch) == 1 else "", lambda: self.backend.read_into(items))
            self.stats.add(read=sum(len(b) for _, _, out in items for b in out), gets=len(batch))
            for i in batch if then is not None else ():
                then(i)

        threads = min(self.backend.read_threads, len(batches))
        if threads <= 1:
            for batch in batches:
                read(batch)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(read, batches))

    # ------------------------------------------------------------------ json

    def put_json(self, key: str, obj: Any) -> None:
        """Write `obj` as UTF-8 JSON (atomic, like `put`)."""
        self.put(key, json.dumps(obj, indent=1, sort_keys=True).encode())

    def get_json(self, key: str) -> Any:
        """Read the JSON document at `key`; StorageError when it is not valid JSON."""
        raw = self.get(key)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StorageError(f"{self.url_for(key)} is not valid JSON: {exc}") from exc

    # ------------------------------------------------------------------ conditional writes

    @property
    def conditional_writes(self) -> str:
        """How `create` and `replace` are made atomic on this backend:

        - "exact" on file:// (a hard link of a complete temporary file, which fails when the
          name exists, as O_EXCL does; a replace under flock(2) on the object) and on s3://
          (PutObject with If-None-Match: * / If-Match: <etag>, which S3 evaluates atomically);
        - "process" on memory://: the filesystem lives in this process, a lock makes it exact;
        - "best effort" elsewhere: a check, then the write; two writers that check in the same
          instant may both write (the window is one round trip).
        """
        return self.backend.conditional_writes

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and a version tag to `replace` it with. On S3 the tag (the ETag)
        is read before the bytes: bytes newer than the tag make the replace conflict, never
        overwrite something unseen. Elsewhere the tag is a digest of the bytes."""
        path = self._path(key)
        tag = self._call("head", key, lambda: self.backend.version_tag(path))
        if tag is not None:  # one request made (a backend without tags makes none)
            self.stats.add(gets=1)
        data = self.get(key)
        return data, tag_of(data) if tag is None else tag

    def create(self, key: str, data: bytes) -> str:
        """Write `data` at `key` only if nothing is there (WriteConflict otherwise), atomically
        (see `conditional_writes`); returns the new version's tag."""
        path = self._path(key)
        if not key.strip("/"):
            raise ValueError("create needs a non-empty key")
        data = bytes(data)
        tag = self._call("create", key, lambda: self.backend.create(path, data), idempotent=False)
        self.stats.add(written=len(data), puts=1)
        return tag

    def replace(self, key: str, data: bytes, tag: str) -> str:
        """Overwrite `key` with `data` only if it is still the version `tag` names (from
        `get_tagged`, `create` or a previous `replace`), atomically (see `conditional_writes`);
        WriteConflict when it changed, ObjectNotFound when it is gone. Returns the new tag."""
        path = self._path(key)
        data = bytes(data)
        new_tag = self._call("replace", key, lambda: self.backend.replace(path, data, tag), idempotent=False)
        self.stats.add(written=len(data), puts=1)
        return new_tag

    # ------------------------------------------------------------------ folders

    def _local_files(self, what: str) -> LocalFiles:
        if not isinstance(self.backend, LocalFiles):
            raise ValueError(f"{what} needs a file:// store")
        return self.backend

    def entry_exists(self, prefix: str) -> bool:
        """True when anything is stored under the folder `prefix`, or, on local files, any
        directory entry is there (a symbolic link included, wherever it
        points: it is not followed)."""
        if not self.is_local:
            return bool(self.list(prefix))
        path = self._lexical_path(prefix)
        self._path(prefix.strip("/").rpartition("/")[0])  # its folder must lie inside the store
        return self._local_files("entry_exists").lexists(path)

    def local_entries(self, prefix: str) -> list[str]:
        """Local files only: the names in folder `prefix` (links included, none followed)."""
        return self._local_files("local_entries").entries(self._path(prefix))

    def rename_local(self, src: str, dst: str) -> None:
        """Local files only: rename the directory entry `src` to `dst` (which must not exist),
        atomically. A symbolic link is renamed itself, never followed."""
        files = self._local_files("rename_local")
        source, target = self._lexical_path(src), self._lexical_path(dst)
        self._path(src.strip("/").rpartition("/")[0])  # both folders must lie inside the store
        self._path(dst.strip("/").rpartition("/")[0])
        self._call("rename", src, lambda: files.rename(source, target), idempotent=False)

    def copy(self, src: str, dst: str) -> None:
        """Copy the object `src` to `dst` (server-side on S3)."""
        source, target = self._path(src), self._path(dst)
        self._call("copy", src, lambda: self.backend.copy(source, target))
        self.stats.add(puts=1)

    # ------------------------------------------------------------------ metadata

    def exists(self, key: str) -> bool:
        """True when an object (not a folder) is stored at `key`."""
        path = self._path(key)
        return self._call("exists", key, lambda: self.backend.exists(path))

    def size(self, key: str) -> int:
        """Size in bytes of the object at `key`."""
        path = self._path(key)
        return self._call("size", key, lambda: self.backend.size(path))

    def list(self, prefix: str = "") -> list[str]:
        """Keys (relative to the root) of all objects under the folder `prefix`, recursive, sorted."""
        path = self._path(prefix)
        keys = [self._key_of(p) for p in self._call("list", prefix, lambda: self.backend.find(path))]
        prefix = prefix.strip("/")
        if prefix:  # `find` on an object path returns that object; we list folders only
            keys = [k for k in keys if k.startswith(prefix + "/")]
        return sorted(k for k in keys if k and not k.endswith(TMP_SUFFIX))

    def delete(self, prefix_or_key: str) -> None:
        """Delete the object `prefix_or_key` and/or everything under that folder; missing is
        fine. A symbolic link is deleted itself, never what it points at."""
        if not prefix_or_key.strip("/"):
            raise ValueError("refusing to delete the whole store; pass a key or folder")
        path = self._lexical_path(prefix_or_key)  # checked by the backend: a link is not followed
        self._call("delete", prefix_or_key, lambda: self.backend.delete(path))
