"""Careful file primitives for the state directory: private dirs, atomic writes, reads that
never follow a symlink or open anything but a regular file, and the single-owner lock.

Blocking calls: run them in a thread. OSError passes through; the store maps it to its
typed failures.

Every call that changes the state dir or makes a change durable (open, write, truncate,
allocate, rename, unlink, mkdir, fsync, close of a written file) goes through `fs`, here
and in journal.py: `os` itself, bound once. Tests bind a layer there that keeps what was
written but not yet fsynced and drops it at a simulated power loss
(`tests/store/powerloss.py`). Reads go to `os` directly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows
    fcntl = None  # type: ignore[assignment]

DIR_MODE = 0o700
FILE_MODE = 0o600
TEMP_SUFFIX = ".tmp"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class FileSystem(Protocol):
    """The calls through which the store changes its files (the `os` module's)."""

    def open(self, path: str | Path, flags: int, mode: int = 0o777, /) -> int: ...
    def close(self, fd: int, /) -> None: ...
    def write(self, fd: int, data: bytes | memoryview, /) -> int: ...
    def pwrite(self, fd: int, data: bytes | memoryview, offset: int, /) -> int: ...
    def ftruncate(self, fd: int, length: int, /) -> None: ...
    def posix_fallocate(self, fd: int, offset: int, length: int, /) -> None: ...
    def fsync(self, fd: int, /) -> None: ...
    def fdatasync(self, fd: int, /) -> None: ...
    def mkdir(self, path: str | Path, mode: int = 0o777, /) -> None: ...
    def replace(self, src: str | Path, dst: str | Path, /) -> None: ...
    def unlink(self, path: str | Path, /) -> None: ...


fs: FileSystem = os  # the one seam (see the module's docstring); never checked per call


class UnsafePath(OSError):
    """A path in the state dir is a symlink or not the kind of file expected."""


def ensure_dir(path: Path) -> bool:
    """Create `path` 0700 (True when created); an existing entry must be a real directory."""
    try:
        fs.mkdir(path, DIR_MODE)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePath(errno.ENOTDIR, "not a directory (or a symlink)", str(path)) from None
        return False
    os.chmod(path, DIR_MODE)  # exactly 0700 whatever the umask
    return True


def ensure_root(path: Path) -> None:
    """The state dir itself: the operator's choice of path, created with its parents, each
    new entry fsynced in its directory (else a power loss may take the whole dir with it,
    and every acknowledged turn in it)."""
    if not path.exists():
        for parent in [p for p in path.parents if not p.exists()][::-1]:
            with contextlib.suppress(FileExistsError):
                fs.mkdir(parent)  # (the umask's mode, as `mkdir -p`)
                fsync_dir(parent.parent)
        if ensure_dir(path):
            fsync_dir(path.parent)
    elif not path.is_dir():
        raise UnsafePath(errno.ENOTDIR, "not a directory", str(path))


def fsync_dir(path: Path) -> None:
    fd = fs.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)


def temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[fs.write(fd, view) :]


def write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = fs.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_atomic(
    final: Path, chunks: Iterable[bytes], *, sync_every: int = 0, sync_dir: bool = True
) -> int:
    """Temp file in the same directory, fsync, rename over `final`, fsync the directory;
    the bytes written.

    A crash leaves either the old file or the new one (plus, at worst, a temp file that
    start-up sweeps). With sync_dir=False the caller fsyncs the directory once for a batch.
    With `sync_every`, the file is fdatasynced each time that many more bytes are written,
    so the disk never has more than that of it to flush at once: a journal commit's sync
    waits behind that much of it at most, not the whole file.
    """
    tmp = temp_name(final)
    fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, FILE_MODE)
    written = unsynced = 0
    try:
        try:
            for chunk in chunks:
                write_all(fd, chunk)
                written += len(chunk)
                unsynced += len(chunk)
                if sync_every and unsynced >= sync_every:
                    fs.fdatasync(fd)
                    unsynced = 0
            fs.fsync(fd)
        finally:
            fs.close(fd)
        fs.replace(tmp, final)  # rename never follows a symlink at `final`
    except BaseException:
        with contextlib.suppress(OSError):
            fs.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(final.parent)
    return written


def read_regular(path: Path, limit: int) -> bytes:
    """The whole file, refusing symlinks, non-regular files and files over `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(errno.ELOOP, "is a symlink", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(errno.EINVAL, "not a regular file", str(path))
        if st.st_size > limit:
            raise FileTooLarge(errno.EFBIG, f"{st.st_size} bytes > limit {limit}", str(path))
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1 << 20):
            size += len(chunk)
            if size > limit:  # grew while we read
                raise FileTooLarge(errno.EFBIG, f"over limit {limit}", str(path))
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class FileTooLarge(OSError):
    """A file is bigger than the reader accepts."""


class DirLock:
    """An exclusive advisory lock on `state_dir/lock`, held while a proxy owns the dir.

    It keeps a second proxy, or `ocxproxy state gc`, from deleting files a running proxy
    has written but not yet indexed. Released by close() or by the process ending.
    """

    def __init__(self, root: Path) -> None:
        self.path = root / "lock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        """True when held; False when another process holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, FILE_MODE)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
