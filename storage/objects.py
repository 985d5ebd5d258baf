"""`ObjectStore`: bytes under string keys on file://, memory:// or s3:// — the only fsspec user.

Keys are '/'-separated paths relative to the store's root URL. Every backend call goes through
`ObjectStore._call`, the one place that translates backend errors (storage.errors) and retries
idempotent operations on transient errors.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import fsspec

from storage.errors import ObjectNotFound, StorageError, WriteConflict, is_transient, translate_error

logger = logging.getLogger("parashift.storage")

T = TypeVar("T")

# Retry policy (SDK-style exponential backoff, "full jitter"; see the AWS Architecture blog,
# "Exponential Backoff And Jitter"). 4 tries with a 50 ms base waits at most ~0.35 s in total:
# s3fs and botocore already retry underneath, this layer covers what they give up on.
MAX_TRIES = 4
BACKOFF_BASE_S = 0.05

# Suffix of the temporary files that local `put` renames into place; `list` hides them.
_TMP_SUFFIX = ".parashift-tmp"

# Ranged reads of local files run on this many threads (preadv releases the GIL): enough to keep
# a disk's queue busy while one rank checksums what arrived.
LOCAL_READ_THREADS = 4

# memory:// lives in this process (one filesystem shared by every instance): a lock around its
# conditional writes makes them exact.
_MEMORY_LOCK = threading.Lock()


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


def _split_url(url: str) -> tuple[str, str]:
    """("file" | "memory" | "s3" | ..., path-without-protocol)."""
    if "://" not in url:
        return "file", url
    protocol, _, path = url.partition("://")
    protocol = protocol.lower()
    if protocol == "s3a":
        protocol = "s3"
    return protocol, path


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
        options = dict(storage_options or {})
        protocol, path = _split_url(url)
        self.protocol = protocol
        self.max_tries = max(1, max_tries)
        self.backoff_s = backoff_s
        self.stats = StoreStats()
        if protocol == "file":
            # Resolved once, at construction: a later chdir does not move the store.
            root = os.path.abspath(os.path.expanduser(path or "."))
            self.fs = fsspec.filesystem("file", skip_instance_cache=True, **options)
            self._root = root.replace(os.sep, "/").rstrip("/") or "/"
            self._real_root = os.path.realpath(root)
            self.url = "file://" + self._root
        else:
            if protocol == "s3":
                # Listings may change behind our back (other ranks, other processes): never
                # answer `list`/`size` from s3fs's directory cache.
                options.setdefault("use_listings_cache", False)
            # A fresh instance per store: fsspec otherwise shares one instance per option set,
            # and tests with several endpoints / credentials would collide.
            self.fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
            root = self.fs._strip_protocol(url).rstrip("/")
            if protocol == "memory":
                root = "/" + root.lstrip("/")
            if not root.strip("/"):
                raise ValueError(f"storage URL {url!r} needs a bucket/name")
            self._root = root
            self.url = f"{protocol}://{root.lstrip('/')}"

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    # ------------------------------------------------------------------ paths

    @property
    def is_local(self) -> bool:
        return self.protocol == "file"

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
        if self.is_local and key.strip("/"):
            # A symbolic link inside the store may point anywhere: what it resolves to must
            # still lie inside the store's root, or the key is refused.
            real = os.path.realpath(path)
            if real != self._real_root and not real.startswith(self._real_root.rstrip("/") + "/"):
                raise StorageError(f"{self.url}/{key} resolves to {real}, outside the store: refused")
        return path

    def _key_of(self, path: str) -> str:
        path = path.replace(os.sep, "/") if self.is_local else path
        root = self._root.rstrip("/").lstrip("/")
        rel = path.lstrip("/")
        if rel == root:
            return ""
        if not rel.startswith(root + "/"):
            raise StorageError(f"backend returned {path!r} outside the store root {self.url}")
        return rel[len(root) + 1 :]

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
        n = len(data)
        if self.is_local:
            self._call("put", key, lambda: _atomic_write_local(path, data))
        else:
            # One PUT (s3fs switches to a multipart upload above 100 MB, which S3 also makes
            # visible atomically at CompleteMultipartUpload).
            self._call("put", key, lambda: self.fs.pipe_file(path, bytes(data)))
        self.stats.add(written=n, puts=1)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of `key` (end exclusive); one ranged GET, no read-ahead."""
        if (start is not None and start < 0) or (end is not None and end < 0):
            raise ValueError("negative offsets are not supported")
        path = self._path(key)
        if start is not None and end is not None and end <= start:
            # Still a real error for a missing key; fsspec would return b"" without asking.
            self.size(key)
            return b""
        data = self._call("get", key, lambda: self.fs.cat_file(path, start=start, end=end))
        self.stats.add(read=len(data), gets=1)
        return data

    def get_ranges(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        """Batch of (key, start, end) ranged reads (end exclusive), in request order.

        One `fs.cat_ranges` call: concurrent ranged GETs on s3 (bounded by fsspec's batch
        size), sequential reads on local backends. Any failure fails the whole batch.
        """
        if not requests:
            return []
        for _, s, e in requests:
            if s < 0 or e < s:
                raise ValueError(f"invalid byte range [{s}, {e})")
        paths = [self._path(k) for k, _, _ in requests]
        starts = [int(s) for _, s, _ in requests]
        ends = [int(e) for _, _, e in requests]

        def batch() -> list[bytes]:
            out = self.fs.cat_ranges(paths, starts, ends, on_error="return")
            for item in out:
                if isinstance(item, BaseException):
                    raise item
            return out

        label = requests[0][0] if len(requests) == 1 else ""
        data = self._call(f"get_ranges[{len(requests)}]", label, batch)
        self.stats.add(read=sum(len(d) for d in data), gets=len(requests))
        return data

    def put_stream(self, key: str, parts: Callable[[], Iterable[memoryview | bytes]]) -> int:
        """Write the concatenation of `parts()` at `key` atomically, without joining them: each
        part goes from its memory straight to the file (or to s3fs's upload buffer). `parts` is
        called again for a retry. Returns the bytes written."""
        path = self._path(key)
        if not key.strip("/"):
            raise ValueError("put needs a non-empty key")
        if self.is_local:
            n = self._call("put", key, lambda: _atomic_write_local(path, parts()))
        else:

            def upload() -> int:
                # One object; s3fs uploads parts of its block size as they fill and completes the
                # multipart upload at close, which S3 makes visible atomically.
                written = 0
                with self.fs.open(path, "wb") as f:
                    for part in parts():
                        f.write(part)
                        written += len(part)
                return written

            n = self._call("put", key, upload)
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
        if self.is_local:

            def read_one(i: int) -> None:
                key, start, out = requests[i]
                self._call("get", key, lambda: _pread_exact(self._path(key), start, out))
                if then is not None:
                    then(i)

            if len(requests) == 1:
                read_one(0)
            else:
                with ThreadPoolExecutor(min(LOCAL_READ_THREADS, len(requests))) as pool:
                    list(pool.map(read_one, range(len(requests))))
        else:
            sizes = [sum(len(b) for b in out) for _, _, out in requests]
            data = self.get_ranges([(key, start, start + n) for (key, start, _), n in zip(requests, sizes, strict=True)])
            for (key, start, out), n, payload in zip(requests, sizes, data, strict=True):
                if len(payload) != n:
                    raise StorageError(f"{self.url_for(key)}: {len(payload)} bytes at {start}, expected {n}")
                offset = 0
                for buffer in out:
                    buffer[:] = payload[offset : offset + len(buffer)]
                    offset += len(buffer)
            for i in range(len(requests)) if then is not None else ():
                then(i)
            return
        self.stats.add(read=sum(len(b) for _, _, out in requests for b in out), gets=len(requests))

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
        if self.protocol in ("file", "s3"):
            return "exact"
        return "process" if self.protocol == "memory" else "best effort"

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and a version tag to `replace` it with. On S3 the tag (the ETag)
        is read before the bytes: bytes newer than the tag make the replace conflict, never
        overwrite something unseen. Elsewhere the tag is a digest of the bytes."""
        path = self._path(key)
        if self.protocol == "s3":
            bucket, name, _ = self.fs.split_path(path)
            head = self._call("head", key, lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=name))
            self.stats.add(gets=1)
            return self.get(key), str(head["ETag"])
        data = self.get(key)
        return data, _tag_of(data)

    def create(self, key: str, data: bytes) -> str:
        """Write `data` at `key` only if nothing is there (WriteConflict otherwise), atomically
        (see `conditional_writes`); returns the new version's tag."""
        path = self._path(key)
        if not key.strip("/"):
            raise ValueError("create needs a non-empty key")
        data = bytes(data)
        if self.is_local:
            self._call("create", key, lambda: _create_local(path, data), idempotent=False)
            tag = _tag_of(data)
        elif self.protocol == "s3":
            bucket, name, _ = self.fs.split_path(path)
            response = self._call("create", key, lambda: self.fs.call_s3(
                "put_object", Bucket=bucket, Key=name, Body=data, IfNoneMatch="*"), idempotent=False)
            tag = str(response["ETag"])
        else:
            with _MEMORY_LOCK if self.protocol == "memory" else contextlib.nullcontext():
                if self.exists(key):
                    raise WriteConflict(f"create {self.url_for(key)}: the object exists")
                self._call("create", key, lambda: self.fs.pipe_file(path, data), idempotent=False)
            tag = _tag_of(data)
        self.stats.add(written=len(data), puts=1)
        return tag

    def replace(self, key: str, data: bytes, tag: str) -> str:
        """Overwrite `key` with `data` only if it is still the version `tag` names (from
        `get_tagged`, `create` or a previous `replace`), atomically (see `conditional_writes`);
        WriteConflict when it changed, ObjectNotFound when it is gone. Returns the new tag."""
        path = self._path(key)
        data = bytes(data)
        if self.is_local:
            self._call("replace", key, lambda: _replace_local(path, data, tag), idempotent=False)
            new_tag = _tag_of(data)
        elif self.protocol == "s3":
            bucket, name, _ = self.fs.split_path(path)
            response = self._call("replace", key, lambda: self.fs.call_s3(
                "put_object", Bucket=bucket, Key=name, Body=data, IfMatch=tag), idempotent=False)
            new_tag = str(response["ETag"])
        else:
            with _MEMORY_LOCK if self.protocol == "memory" else contextlib.nullcontext():
                if _tag_of(self.get(key)) != tag:
                    raise WriteConflict(f"replace {self.url_for(key)}: the object changed since it was read")
                self._call("replace", key, lambda: self.fs.pipe_file(path, data), idempotent=False)
            new_tag = _tag_of(data)
        self.stats.add(written=len(data), puts=1)
        return new_tag

    # ------------------------------------------------------------------ folders

    def entry_exists(self, prefix: str) -> bool:
        """True when anything is stored under the folder `prefix`, or, on local files, any
        directory entry is there (a symbolic link included, wherever it
        points: it is not followed)."""
        if self.is_local:
            path = self._lexical_path(prefix)
            self._path(prefix.strip("/").rpartition("/")[0])  # its folder must lie inside the store
            return os.path.lexists(path)
        return bool(self.list(prefix))

    def local_entries(self, prefix: str) -> list[str]:
        """Local files only: the names in folder `prefix` (links included, none followed)."""
        path = self._path(prefix)
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def rename_local(self, src: str, dst: str) -> None:
        """Local files only: rename the directory entry `src` to `dst` (which must not exist),
        atomically. A symbolic link is renamed itself, never followed."""
        if not self.is_local:
            raise ValueError("rename_local needs a file:// store")
        source, target = self._lexical_path(src), self._lexical_path(dst)
        self._path(src.strip("/").rpartition("/")[0])  # both folders must lie inside the store
        self._path(dst.strip("/").rpartition("/")[0])

        def rename() -> None:
            if os.path.lexists(target):
                raise WriteConflict(f"rename to {self.url_for(dst)}: it exists")
            os.rename(source, target)

        self._call("rename", src, rename, idempotent=False)

    def copy(self, src: str, dst: str) -> None:
        """Copy the object `src` to `dst` (server-side on S3)."""
        source, target = self._path(src), self._path(dst)
        if self.is_local:
            self._call("copy", src, lambda: _atomic_write_local(target, _read_local(source)))
        else:
            self._call("copy", src, lambda: self.fs.copy(source, target))
        self.stats.add(puts=1)

    # ------------------------------------------------------------------ metadata

    def exists(self, key: str) -> bool:
        """True when an object (not a folder) is stored at `key`."""
        path = self._path(key)
        return bool(self._call("exists", key, lambda: self.fs.isfile(path)))

    def size(self, key: str) -> int:
        """Size in bytes of the object at `key`."""
        path = self._path(key)
        info = self._call("size", key, lambda: self.fs.info(path))
        if info.get("type") != "file":
            raise ObjectNotFound(f"size {self.url_for(key)}: not an object")
        return int(info["size"])

    def list(self, prefix: str = "") -> list[str]:
        """Keys (relative to the root) of all objects under the folder `prefix`, recursive, sorted."""
        path = self._path(prefix)

        def find() -> list[str]:
            try:
                return list(self.fs.find(path))
            except FileNotFoundError:
                return []

        keys = [self._key_of(p) for p in self._call("list", prefix, find)]
        prefix = prefix.strip("/")
        if prefix:  # `find` on an object path returns that object; we list folders only
            keys = [k for k in keys if k.startswith(prefix + "/")]
        return sorted(k for k in keys if k and not k.endswith(_TMP_SUFFIX))

    def delete(self, prefix_or_key: str) -> None:
        """Delete the object `prefix_or_key` and/or everything under that folder; missing is fine."""
        if not prefix_or_key.strip("/"):
            raise ValueError("refusing to delete the whole store; pass a key or folder")
        if self.is_local and os.path.islink(self._lexical_path(prefix_or_key)):
            # A symbolic link is deleted itself, never what it points at (wherever that is).
            self._path(prefix_or_key.strip("/").rpartition("/")[0])
            self._call("delete", prefix_or_key, lambda: os.unlink(self._lexical_path(prefix_or_key)))
            return
        path = self._path(prefix_or_key)

        def rm() -> None:
            # Exact matches only: folder "a/b" must not take "a/bc" with it on prefix-listing
            # backends. Backends report paths with or without a leading "/" (memory vs s3).
            norm = path.strip("/")
            try:
                found = [p for p in self.fs.find(path) if p.strip("/").startswith(norm + "/")]
            except FileNotFoundError:
                found = []
            targets = ([path] if self.fs.isfile(path) else []) + found
            if targets:
                # FileNotFoundError: deleted concurrently, the goal state is reached.
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(targets)
            if self.is_local and os.path.isdir(path):
                _remove_empty_dirs(path)

        self._call("delete", prefix_or_key, rm)


def _pread_exact(path: str, start: int, out: list[memoryview]) -> None:
    """Read sum(len(b) for b in out) bytes at `start` of a local file straight into `out`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        pending = [b for b in out if len(b)]
        position = start
        while pending:
            n = os.preadv(fd, pending[:_IOV_MAX], position)
            if n == 0:
                raise StorageError(f"{path}: ends before byte {start + sum(len(b) for b in out)}")
            position += n
            while n and pending:  # drop what was filled, keep the rest of a partly filled buffer
                if n >= len(pending[0]):
                    n -= len(pending.pop(0))
                else:
                    pending[0] = pending[0][n:]
                    n = 0
    finally:
        os.close(fd)


# preadv takes at most IOV_MAX buffers (1024 on Linux).
_IOV_MAX = 1024


def _atomic_write_local(path: str, data: bytes | Iterable[memoryview | bytes]) -> int:
    """temp file in the same folder → write → fsync → os.replace → fsync the folder."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}{_TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    written = 0
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            for part in [data] if isinstance(data, bytes | bytearray) else data:
                view = memoryview(part).cast("B")
                while view:  # an unbuffered write may be short
                    n = f.write(view)
                    written += n
                    view = view[n:]
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable; not possible on every platform / filesystem
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return written
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return written


def _tag_of(data: bytes) -> str:
    """A version tag of an object's bytes (where the backend has no ETag)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _read_local(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _create_local(path: str, data: bytes) -> None:
    """Create `path` with `data`, complete or not at all: a temporary file, fsynced, is hard
    linked to the name (link(2) fails with EEXIST when the name exists, atomically, as
    open(O_CREAT | O_EXCL) does, and a reader never sees the file half written)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}{_TMP_SUFFIX}")
    try:
        _atomic_write_local(tmp, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise WriteConflict(f"create {path}: the object exists") from None
        except OSError as error:  # a filesystem without hard links: O_EXCL, then the bytes
            if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                raise WriteConflict(f"create {path}: the object exists") from None
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _replace_local(path: str, data: bytes, tag: str) -> None:
    """Replace `path` with `data` if its bytes are still those `tag` names: under an exclusive
    flock(2) on the object's file (held by every replace of it), checked to still be the file
    the name points at (a replace puts a new file there), then written atomically."""
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFound(f"replace {path}: the object is gone") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    continue  # replaced while we waited for the lock: lock the new one
            except FileNotFoundError:
                raise ObjectNotFound(f"replace {path}: the object is gone") from None
            with os.fdopen(os.dup(fd), "rb") as f:
                current = f.read()
            if _tag_of(current) != tag:
                raise WriteConflict(f"replace {path}: the object changed since it was read")
            _atomic_write_local(path, data)
            return
        finally:
            os.close(fd)  # releases the lock


def _remove_empty_dirs(top: str) -> None:
    """Remove `top` and its sub-folders bottom-up while they are empty (local backend only)."""
    for dirpath, _, _ in sorted(os.walk(top), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
