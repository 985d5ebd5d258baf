"""The backends behind `ObjectStore`: a few primitives each, on backend paths.

`ObjectStore` turns keys into paths, counts what moves, and runs every primitive through its
one choke point (`ObjectStore._call`: the error table, retries of idempotent calls). A
primitive here raises what its backend raises and never retries.

- `LocalFiles` (file://, plain paths): writes are atomic (a temporary file, fsynced, renamed
  into place), ranged reads go straight into the caller's buffers (preadv, several files at
  once), `create` is a hard link that fails where the name exists, `replace` runs under
  flock(2), and a symbolic link may not lead out of the store.
- `FsspecObjects` (memory://, gs://, az://, ... any fsspec filesystem): one PUT per object,
  ranged reads batched through `cat_ranges`; `create`/`replace` are a check, then the write.
  `MemoryObjects` (memory://, one filesystem per process) makes them exact with a process
  lock; `S3Objects` (s3://) with conditional PutObject (If-None-Match / If-Match).

`LocalFiles` reuses the fsspec local filesystem for what needs no care of its own (whole and
ranged reads, listings, deletes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import math
import mmap
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Protocol

import fsspec
from parashift.storage.errors import ObjectNotFound, StorageError, WriteConflict

# Suffix of the temporary files that local writes rename into place; listings hide them.
TMP_SUFFIX = ".parashift-tmp"

# Ranged reads of local files run on this many threads (preadv releases the GIL): enough to keep
# a disk's queue busy while one rank checksums what arrived.
LOCAL_READ_THREADS = 4

# memory:// lives in this process (one filesystem shared by every instance): a lock around its
# conditional writes makes them exact.
_MEMORY_LOCK = threading.Lock()

# preadv takes at most IOV_MAX buffers (1024 on Linux).
_IOV_MAX = 1024

# One read into buffers: (backend path, first byte, the buffers its bytes fill, in order).
ReadInto = tuple[str, int, list[memoryview]]


class Backend(Protocol):
    """What `ObjectStore` needs of a backend. Paths are backend paths under `root`, already
    checked by `inside` (except `delete`'s, see there)."""

    protocol: str  # "file", "memory", "s3", ...
    root: str  # the backend path of the store's root
    url: str  # the root's URL
    fs: Any  # the fsspec filesystem underneath
    # How `create` and `replace` are made atomic: "exact", "process" (exact within this
    # process) or "best effort" (a check, then the write).
    conditional_writes: str
    # `read_into` takes `read_batch` requests per call (0: all of them in one call), and
    # `ObjectStore.read_into` runs up to `read_threads` such calls at once.
    read_batch: int
    read_threads: int

    def url_of(self, path: str) -> str:
        """The URL of `path` (for messages)."""
        ...

    def inside(self, path: str) -> str:
        """`path`, or StorageError where it resolves outside the store (a symbolic link)."""
        ...

    def put(self, path: str, data: bytes) -> None:
        """Write the object at once: readers see the old bytes or the new, never half."""
        ...

    def put_stream(self, path: str, parts: Iterable[memoryview | bytes]) -> int:
        """Write the concatenation of `parts` as one object, atomically as `put`; its size."""
        ...

    def get(self, path: str, start: int | None, end: int | None) -> bytes:
        """Bytes [start, end) of the object (None: its start / its end); one ranged read."""
        ...

    def get_ranges(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        """A batch of ranged reads, in order; any failure fails the batch."""
        ...

    def read_into(self, requests: Sequence[ReadInto]) -> None:
        """Fill each request's buffers with the object's bytes from its start on; an object
        that ends first is a StorageError."""
        ...

    def exists(self, path: str) -> bool:
        """Whether an object (not a folder) is there."""
        ...

    def size(self, path: str) -> int:
        """The object's size; ObjectNotFound where there is none (a folder included)."""
        ...

    def find(self, path: str) -> list[str]:
        """Every object under the folder `path` (and `path` itself if it is one); [] if none."""
        ...

    def delete(self, path: str) -> None:
        """Delete the object `path` and everything under that folder; missing is fine. `path`
        is as named, not yet checked by `inside`: a symbolic link is deleted itself."""
        ...

    def copy(self, src: str, dst: str) -> None:
        """Copy one object (server-side where the backend can)."""
        ...

    def version_tag(self, path: str) -> str | None:
        """The object's version tag read without its bytes (S3: the ETag); None where the
        backend has none (the tag is then `tag_of` its bytes), without any I/O."""
        ...

    def create(self, path: str, data: bytes) -> str:
        """Write `data` only if nothing is at `path` (WriteConflict otherwise); its tag."""
        ...

    def replace(self, path: str, data: bytes, tag: str) -> str:
        """Overwrite the object only if it is still the version `tag` names (WriteConflict
        otherwise; ObjectNotFound where it is gone); the new tag."""
        ...


def split_url(url: str) -> tuple[str, str]:
    """("file" | "memory" | "s3" | ..., path-without-protocol)."""
    if "://" not in url:
        return "file", url
    protocol, _, path = url.partition("://")
    protocol = protocol.lower()
    if protocol == "s3a":
        protocol = "s3"
    return protocol, path


def open_backend(url: str, options: dict[str, Any] | None = None) -> Backend:
    """The backend of a store URL: local files for file:// and plain paths, fsspec otherwise."""
    options = dict(options or {})
    protocol, path = split_url(url)
    if protocol == "file":
        return LocalFiles(path, options)
    kind = {"s3": S3Objects, "memory": MemoryObjects}.get(protocol, FsspecObjects)
    return kind.at(protocol, url, options)


def tag_of(data: bytes) -> str:
    """A version tag of an object's bytes (where the backend has no ETag)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------- fsspec


class FsspecObjects:
    """Any fsspec filesystem: objects written with one PUT, ranged reads batched through
    `cat_ranges` (concurrent on object stores), conditional writes best effort."""

    conditional_writes: ClassVar[str] = "best effort"
    # Objects below this many bytes are written with one `put` (None: the filesystem's upload
    # block size), larger ones streamed through an upload that only `commit()` makes visible.
    one_put_below: ClassVar[float | None] = None
    read_batch: ClassVar[int] = 0  # one `cat_ranges` for all the reads at hand
    read_threads: ClassVar[int] = 1
    # Held around a conditional write's check and write (no lock: two writers that check in
    # the same instant may both write; the window is one round trip).
    _guard: ClassVar[contextlib.AbstractContextManager[Any]] = contextlib.nullcontext()

    def __init__(self, fs: Any, protocol: str, root: str) -> None:
        self.fs = fs
        self.protocol = protocol
        self.root = root
        self.url = self.url_of(root)

    @classmethod
    def at(cls, protocol: str, url: str, options: dict[str, Any]) -> FsspecObjects:
        # A fresh instance per store: fsspec otherwise shares one instance per option set,
        # and tests with several endpoints / credentials would collide.
        fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
        root = cls._root_of(fs._strip_protocol(url).rstrip("/"))
        if not root.strip("/"):
            raise ValueError(f"storage URL {url!r} needs a bucket/name")
        return cls(fs, protocol, root)

    @staticmethod
    def _root_of(stripped: str) -> str:
        return stripped

    def url_of(self, path: str) -> str:
        return f"{self.protocol}://{path.lstrip('/')}"

    def inside(self, path: str) -> str:
        return path  # no links

    def put(self, path: str, data: bytes) -> None:
        # One PUT (s3fs switches to a multipart upload above 100 MB, which S3 also makes
        # visible atomically at CompleteMultipartUpload).
        self.fs.pipe_file(path, bytes(data))

    def put_stream(self, path: str, parts: Iterable[memoryview | bytes]) -> int:
        # An object smaller than one upload block goes as one PUT (`put`), as s3fs itself does
        # with autocommit; its parts are joined first, the copy s3fs's buffer would make anyway.
        # A larger one is made visible by `commit()` alone (fsspec's autocommit=False): s3fs
        # uploads parts of its block size as they fill and completes the multipart upload at
        # commit, which S3 makes visible atomically. A source that fails part-way is discarded
        # (the upload aborted): with autocommit, leaving `with open(...)` on an error would
        # complete the upload with the bytes so far, a short object under the final name.
        block = self.one_put_below or getattr(self.fs, "default_block_size", None) or getattr(self.fs, "blocksize", 2**22)
        head, rest = bytearray(), iter(parts)
        for part in rest:
            head += part
            if len(head) >= block:
                break
        else:
            self.put(path, bytes(head))
            return len(head)
        written = 0
        f = self.fs.open(path, "wb", autocommit=False)
        try:
            try:
                for part in itertools.chain([head], rest):
                    f.write(part)
                    written += len(part)
            finally:
                f.close()  # uploads what is buffered; nothing is visible before commit
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()
            raise
        f.commit()
        return written

    def get(self, path: str, start: int | None, end: int | None) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def get_ranges(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        out = self.fs.cat_ranges(paths, starts, ends, on_error="return")
        for item in out:
            if isinstance(item, BaseException):
                raise item
        return out

    def read_into(self, requests: Sequence[ReadInto]) -> None:
        if any(start < 0 for _, start, _ in requests):  # cat_ranges would count it from the end
            raise ValueError("negative offsets are not supported")
        sizes = [sum(len(b) for b in out) for _, _, out in requests]
        data = self.get_ranges([p for p, _, _ in requests], [s for _, s, _ in requests],
                               [s + n for (_, s, _), n in zip(requests, sizes, strict=True)])
        for (path, start, out), n, payload in zip(requests, sizes, data, strict=True):
            if len(payload) != n:
                raise StorageError(f"{self.url_of(path)}: {len(payload)} bytes at {start}, expected {n}")
            offset = 0
            for buffer in out:
                buffer[:] = payload[offset : offset + len(buffer)]
                offset += len(buffer)

    def exists(self, path: str) -> bool:
        return bool(self.fs.isfile(path))

    def size(self, path: str) -> int:
        info = self.fs.info(path)
        if info.get("type") != "file":
            raise ObjectNotFound(f"size {self.url_of(path)}: not an object")
        return int(info["size"])

    def find(self, path: str) -> list[str]:
        try:
            return list(self.fs.find(path))
        except FileNotFoundError:
            return []

    def delete(self, path: str) -> None:
        # Exact matches only: folder "a/b" must not take "a/bc" with it on prefix-listing
        # backends. Backends report paths with or without a leading "/" (memory vs s3).
        norm = path.strip("/")
        found = [p for p in self.find(path) if p.strip("/").startswith(norm + "/")]
        targets = ([path] if self.fs.isfile(path) else []) + found
        if targets:
            # FileNotFoundError: deleted concurrently, the goal state is reached.
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(targets)

    def copy(self, src: str, dst: str) -> None:
        self.fs.copy(src, dst)

    def version_tag(self, path: str) -> str | None:
        return None

    def create(self, path: str, data: bytes) -> str:
        with self._guard:
            if self.fs.isfile(path):
                raise WriteConflict(f"create {self.url_of(path)}: the object exists")
            self.fs.pipe_file(path, data)
        return tag_of(data)

    def replace(self, path: str, data: bytes, tag: str) -> str:
        with self._guard:
            if tag_of(self.fs.cat_file(path)) != tag:
                raise WriteConflict(f"replace {self.url_of(path)}: the object changed since it was read")
            self.fs.pipe_file(path, data)
        return tag_of(data)


class MemoryObjects(FsspecObjects):
    """memory://: the filesystem lives in this process, shared by every instance; a process
    lock makes conditional writes exact."""

    conditional_writes: ClassVar[str] = "process"
    _guard: ClassVar[contextlib.AbstractContextManager[Any]] = _MEMORY_LOCK

    @staticmethod
    def _root_of(stripped: str) -> str:
        return "/" + stripped.lstrip("/")

    # fsspec's memory filesystem stores a file at open, whatever autocommit says: every object
    # is joined first (its bytes live in this process either way) and stored with one `put`.
    one_put_below: ClassVar[float | None] = math.inf


class S3Objects(FsspecObjects):
    """s3://: conditional writes are PutObject with If-None-Match: * / If-Match: <etag>,
    which S3 evaluates atomically; the ETag is the version tag."""

    conditional_writes: ClassVar[str] = "exact"

    @classmethod
    def at(cls, protocol: str, url: str, options: dict[str, Any]) -> FsspecObjects:
        # Listings may change behind our back (other ranks, other processes): never answer
        # `find`/`size` from s3fs's directory cache.
        return super().at(protocol, url, {"use_listings_cache": False, **options})

    def version_tag(self, path: str) -> str | None:
        bucket, name, _ = self.fs.split_path(path)
        return str(self.fs.call_s3("head_object", Bucket=bucket, Key=name)["ETag"])

    def create(self, path: str, data: bytes) -> str:
        bucket, name, _ = self.fs.split_path(path)
        return str(self.fs.call_s3("put_object", Bucket=bucket, Key=name, Body=data, IfNoneMatch="*")["ETag"])

    def replace(self, path: str, data: bytes, tag: str) -> str:
        bucket, name, _ = self.fs.split_path(path)
        return str(self.fs.call_s3("put_object", Bucket=bucket, Key=name, Body=data, IfMatch=tag)["ETag"])


# ---------------------------------------------------------------------------------- local files


class LocalFiles(FsspecObjects):
    """Files under a folder: atomic writes, reads straight into buffers, exact conditional
    writes, symbolic links kept inside the store."""

    conditional_writes: ClassVar[str] = "exact"
    read_batch: ClassVar[int] = 1  # one file range per call, several calls at once
    read_threads: ClassVar[int] = LOCAL_READ_THREADS

    def __init__(self, path: str, options: dict[str, Any] | None = None) -> None:
        # Resolved once, at construction: a later chdir does not move the store.
        root = os.path.abspath(os.path.expanduser(path or "."))
        self._real_root = os.path.realpath(root)
        super().__init__(fsspec.filesystem("file", skip_instance_cache=True, **(options or {})), "file",
                         root.replace(os.sep, "/").rstrip("/") or "/")

    def url_of(self, path: str) -> str:
        return "file://" + path

    def inside(self, path: str) -> str:
        # A symbolic link inside the store may point anywhere: what it resolves to must still
        # lie inside the store's root, or the path is refused.
        real = os.path.realpath(path)
        if real != self._real_root and not real.startswith(self._real_root.rstrip("/") + "/"):
            raise StorageError(f"{self.url_of(path)} resolves to {real}, outside the store: refused")
        return path

    def put(self, path: str, data: bytes) -> None:
        _atomic_write_local(path, data)

    def put_stream(self, path: str, parts: Iterable[memoryview | bytes]) -> int:
        return _atomic_write_local(path, parts, past_page_cache=True)

    def read_into(self, requests: Sequence[ReadInto]) -> None:
        for path, start, out in requests:
            _pread_exact(path, start, out)

    def find(self, path: str) -> list[str]:
        return [p.replace(os.sep, "/") for p in super().find(path)]

    def delete(self, path: str) -> None:
        if os.path.islink(path):  # the link itself, never what it points at (wherever that is)
            self.inside(os.path.dirname(path))
            os.unlink(path)
            return
        super().delete(self.inside(path))
        if os.path.isdir(path):
            _remove_empty_dirs(path)

    def copy(self, src: str, dst: str) -> None:
        with open(src, "rb") as f:
            data = f.read()
        _atomic_write_local(dst, data)

    def create(self, path: str, data: bytes) -> str:
        _create_local(path, data)
        return tag_of(data)

    def replace(self, path: str, data: bytes, tag: str) -> str:
        _replace_local(path, data, tag)
        return tag_of(data)

    # Directory entries (local files only: object stores have none).

    def lexists(self, path: str) -> bool:
        """Whether any directory entry is at `path` (a symbolic link too, not followed)."""
        return os.path.lexists(path)

    def entries(self, path: str) -> list[str]:
        """The names in folder `path` (links included, none followed); [] if it is none."""
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def rename(self, src: str, dst: str) -> None:
        """Rename the directory entry `src` to `dst`, which must not exist (WriteConflict)."""
        if os.path.lexists(dst):
            raise WriteConflict(f"rename to {self.url_of(dst)}: it exists")
        os.rename(src, dst)


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


def _atomic_write_local(path: str, data: bytes | Iterable[memoryview | bytes], past_page_cache: bool = False) -> int:
    """temp file in the same folder → write → fsync → os.replace → fsync the folder.
    `past_page_cache`: a stream (a checkpoint object) is written with O_DIRECT where the
    filesystem takes it (`_DirectWrites`)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")
    parts = [data] if isinstance(data, bytes | bytearray) else data
    written = 0
    try:
        if past_page_cache:
            written = _DirectWrites.write(tmp, parts)
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb", buffering=0) as f:
                for part in parts:
                    written += _write_all(f.fileno(), memoryview(part).cast("B"))
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


def _write_all(fd: int, view: memoryview) -> int:
    """Write all of `view` (an unbuffered write may be short)."""
    total = len(view)
    while view:
        view = view[os.write(fd, view):]
    return total


class _DirectWrites:
    """A stream written past the page cache: O_DIRECT writes from one aligned buffer.

    Why: a buffered write of a checkpoint object costs its every byte in kernel time to fill
    the page cache (measured on the 2-core VM: 0.17 s of CPU for 73 MB, against 0.01 s with
    O_DIRECT), and a save runs in the background of training, so that CPU is taken from the
    steps it overlaps. O_DIRECT needs the buffer's address, each write's size and the file
    offset aligned to the device's block: the parts are copied into one page-aligned buffer
    (a pass the CRC's makes cheap; memory bandwidth, not kernel time), written whole; the
    last block is padded and the file truncated to its size. A filesystem without O_DIRECT
    (tmpfs on older kernels, a platform without the flag) or one that refuses the alignment
    gets the same writes buffered."""

    BLOCK = 4096  # alignment that covers 512- and 4096-byte logical blocks
    BUFFER = 1 << 22  # bytes per write
    FLAG = getattr(os, "O_DIRECT", 0)  # 0: a platform without it (macOS): buffered

    @classmethod
    def write(cls, tmp: str, parts: Iterable[memoryview | bytes]) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd = -1
        if cls.FLAG:
            try:
                fd = os.open(tmp, flags | cls.FLAG, 0o666)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
        if fd < 0:
            fd = os.open(tmp, flags, 0o666)
        buffer = mmap.mmap(-1, cls.BUFFER)  # anonymous: page aligned
        failure: OSError | None = None
        try:
            with memoryview(buffer) as view:
                filled = written = 0
                try:
                    for part in parts:
                        part = memoryview(part).cast("B")
                        while part:
                            n = min(len(part), cls.BUFFER - filled)
                            view[filled : filled + n] = part[:n]
                            filled, part = filled + n, part[n:]
                            if filled == cls.BUFFER:
                                written += cls._flush(fd, view)
                                filled = 0
                    if filled:
                        padded = -(-filled // cls.BLOCK) * cls.BLOCK
                        cls._flush(fd, view[:padded])
                        written += filled
                        os.ftruncate(fd, written)
                except OSError as error:
                    # Its traceback's frames hold slices of `view`: releasing the view would then
                    # raise BufferError in place of the write's own error (a full disk, say).
                    failure = error.with_traceback(None)
            if failure is not None:
                raise failure
            os.fsync(fd)
            return written
        finally:
            buffer.close()
            os.close(fd)

    @classmethod
    def _flush(cls, fd: int, view: memoryview) -> int:
        """Write `view` at the file's end; where O_DIRECT refuses it (EINVAL: an alignment the
        filesystem does not take), the file goes on buffered."""
        try:
            return _write_all(fd, view)
        except OSError as error:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if error.errno != errno.EINVAL or not flags & cls.FLAG:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~cls.FLAG)
            return _write_all(fd, view)


def _create_local(path: str, data: bytes) -> None:
    """Create `path` with `data`, complete or not at all: a temporary file, fsynced, is hard
    linked to the name (link(2) fails with EEXIST when the name exists, atomically, as
    open(O_CREAT | O_EXCL) does, and a reader never sees the file half written)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")
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


# A replace holds its object's lock for a read and an atomic write (milliseconds). One held far
# longer belongs to a writer paused or frozen in the middle of its replace (SIGSTOP, a suspended
# VM): the replace waiting on it gives up as a write conflict rather than waiting forever.
LOCK_WAIT_S = 10.0


def _lock_exclusive(fd: int, path: str) -> None:
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise WriteConflict(f"replace {path}: another writer has held its lock for over {LOCK_WAIT_S:.0f} s "
                                    "(paused or frozen in the middle of a replace?)") from None
            time.sleep(0.005)


def _replace_local(path: str, data: bytes, tag: str) -> None:
    """Replace `path` with `data` if its bytes are still those `tag` names: under an exclusive
    flock(2) on the object's file (held by every replace of it, waited for at most
    LOCK_WAIT_S), checked to still be the file the name points at (a replace puts a new file
    there), then written atomically."""
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFound(f"replace {path}: the object is gone") from None
        try:
            _lock_exclusive(fd, path)
            try:
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    continue  # replaced while we waited for the lock: lock the new one
            except FileNotFoundError:
                raise ObjectNotFound(f"replace {path}: the object is gone") from None
            with os.fdopen(os.dup(fd), "rb") as f:
                current = f.read()
            if tag_of(current) != tag:
                raise WriteConflict(f"replace {path}: the object changed since it was read")
            _atomic_write_local(path, data)
            return
        finally:
            os.close(fd)  # releases the lock


def _remove_empty_dirs(top: str) -> None:
    """Remove `top` and its sub-folders bottom-up while they are empty."""
    for dirpath, _, _ in sorted(os.walk(top), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
