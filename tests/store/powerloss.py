"""A file layer that simulates power loss, for the store's tests (as LazyFS does under a
real filesystem, or SQLite's crash-simulating VFS).

Bound at `ocxproxy.store.files.fs` (the one seam through which the store changes its
files), it does each call on the real files, so everything reads back as usual, and
keeps apart what an fsync has made durable: per file, its bytes and size as of its last
fsync/fdatasync and the writes, truncations and allocations since; per directory, its
entries as of its last fsync and the creations, renames and unlinks since (a file's
fsync does not make its name durable: only its directory's fsync does).

`lose()` is the power loss: what survives is what was synced plus, per `Mode`, nothing
else (`LOSE`), a random prefix of each file's and each directory's unsynced changes
(`PREFIX`), or such a prefix and the next unsynced write torn at a random byte (`TORN`).
From then on every call through the layer fails with EIO (the disk is gone; the process
may still run a little, but nothing it writes survives, and nothing more can be
acknowledged) until `restore()` rewrites the directory as the power loss left it.

`arm(n)` loses power at the n-th call through the layer from now, inside whatever the
store was doing (a commit between its write and its fdatasync, a checkpoint between its
rename and the directory's fsync, a removal...).

It does not sync for real: the tests that use it do not depend on the disk.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import random
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ocxproxy.store.local import files


class Mode(enum.Enum):
    LOSE = "lose"  # only what was synced survives
    PREFIX = "prefix"  # and a random prefix of each file's and directory's unsynced changes
    TORN = "torn"  # and the next unsynced write torn at a random byte


@dataclass
class File:
    data: bytearray = field(default_factory=bytearray)  # synced bytes; zeros up to size
    size: int = 0
    pending: list[tuple[str, int, bytes]] = field(default_factory=list)  # since the last sync

    def sync(self) -> None:
        self.size = _apply(self.data, self.size, self.pending)
        self.pending.clear()

    def applied(self, n: int, torn: int | None = None) -> tuple[bytearray, int]:
        """The bytes and size with the first `n` unsynced changes applied (and, with
        `torn`, that many bytes of the next one, when it is a write)."""
        ops = self.pending[:n]
        if torn is not None and n < len(self.pending) and self.pending[n][0] == "w":
            _, offset, chunk = self.pending[n]
            ops.append(("w", offset, chunk[: torn % (len(chunk) + 1)]))
        data = bytearray(self.data)
        return data, _apply(data, self.size, ops)


def _apply(data: bytearray, size: int, ops: list[tuple[str, int, bytes]]) -> int:
    """Apply file changes to `data` (in place); the size after them."""
    for kind, at, chunk in ops:
        if kind == "w":
            if len(data) < at:
                data.extend(bytes(at - len(data)))
            data[at : at + len(chunk)] = chunk
            size = max(size, at + len(chunk))
        elif kind == "t":  # truncated to `at`
            del data[at:]
            size = at
        else:  # "a": allocated up to `at` (zeros)
            size = max(size, at)
    return size


@dataclass
class Dir:
    synced: dict[str, File | Dir] = field(default_factory=dict)
    live: dict[str, File | Dir] = field(default_factory=dict)
    # ("link", name, node) | ("unlink", name, None) | ("rename", src, dst) since the last fsync
    pending: list[tuple[str, str, Any]] = field(default_factory=list)

    def sync(self) -> None:
        self.synced = dict(self.live)
        self.pending.clear()

    def applied(self, n: int) -> dict[str, File | Dir]:
        entries = dict(self.synced)
        for kind, a, b in self.pending[:n]:
            if kind == "link":
                entries[a] = b
            elif kind == "unlink":
                entries.pop(a, None)
            elif a in entries:  # rename a -> b
                entries[b] = entries.pop(a)
        return entries


# What survives: a directory's entries, a file's (bytes, size).
Tree = dict[str, "Tree | tuple[bytes, int]"]


class PowerLost(OSError):
    def __init__(self) -> None:
        super().__init__(errno.EIO, "simulated power loss (or process death)")


class PowerLossFS:
    """The layer over one directory tree (`root`, which itself always exists)."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root = root.resolve()
        self.rng = rng
        self.top = self._scan(self.root)
        self.fds: dict[int, File | Dir] = {}
        self.calls = 0  # calls through the layer (what `arm` counts)
        self.syncs = 0  # fsyncs and fdatasyncs
        self.losses = 0
        self._countdown: int | None = None
        self._mode: Mode | None = None  # the armed loss's
        self._dead = False  # the process is dead (`process_dead`)
        self._survivors: Tree | None = None  # set while the power is off

    # -- the experiment ----------------------------------------------------------------

    def arm(self, calls: int, mode: Mode | None = None) -> None:
        """Lose power at the `calls`-th call through the layer from now (0: the next)."""
        self._countdown, self._mode = calls, mode

    @property
    def off(self) -> bool:
        return self._survivors is not None

    def lose(self, mode: Mode | None = None) -> None:
        """Power loss now (a no-op when it happened already)."""
        self._countdown = None
        if self._survivors is not None:
            return
        mode = mode or self._mode or self.rng.choice(list(Mode))
        self._survivors = self._survive(self.top, mode)
        self.losses += 1

    @contextlib.contextmanager
    def process_dead(self) -> Iterator[None]:
        """The process died (as `kill -9`): what it wrote stays in the page cache,
        synced or not, and whatever still runs of it meanwhile (a test's `abandon`)
        changes no file: every call fails with EIO, but closing."""
        self._dead = True
        try:
            yield
        finally:
            self._dead = False

    def restore(self) -> None:
        """Power back: the directory as the power loss left it (call `lose` first)."""
        assert self._survivors is not None, "power was not lost"
        for entry in os.listdir(self.root):
            path = self.root / entry
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        self._write(self.root, self._survivors)
        self._survivors = None
        self.fds.clear()
        self.top = self._scan(self.root)

    def _survive(self, d: Dir, mode: Mode) -> Tree:
        keep = 0 if mode is Mode.LOSE else self.rng.randint(0, len(d.pending))
        tree: Tree = {}
        for name, node in d.applied(keep).items():
            if isinstance(node, Dir):
                tree[name] = self._survive(node, mode)
                continue
            n = 0 if mode is Mode.LOSE else self.rng.randint(0, len(node.pending))
            torn = self.rng.randint(0, 1 << 20) if mode is Mode.TORN else None
            data, size = node.applied(n, torn)
            tree[name] = (bytes(data), size)
        return tree

    def _write(self, path: Path, tree: Tree) -> None:
        for name, node in tree.items():
            if isinstance(node, dict):
                os.mkdir(path / name, files.DIR_MODE)
                self._write(path / name, node)
            else:
                data, size = node
                fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, files.FILE_MODE)
                try:
                    os.write(fd, data)
                    os.ftruncate(fd, size)
                finally:
                    os.close(fd)

    def _scan(self, path: Path) -> Dir:
        """A directory as it is now, all of it durable."""
        d = Dir()
        for entry in os.listdir(path):
            p = path / entry
            st = os.lstat(p)
            node: File | Dir
            if stat.S_ISDIR(st.st_mode):
                node = self._scan(p)
            else:
                node = File(bytearray(p.read_bytes()) if stat.S_ISREG(st.st_mode) else bytearray())
                node.size = len(node.data)
            d.live[entry] = node
        d.sync()
        return d

    # -- bookkeeping -------------------------------------------------------------------

    def _call(self) -> None:
        self.calls += 1
        if self._countdown is not None:
            if self._countdown <= 0:
                self.lose(self._mode)
            else:
                self._countdown -= 1
        if self.off or self._dead:
            raise PowerLost

    def _dir_of(self, path: str | Path) -> tuple[Dir | None, str]:
        """The directory node holding `path` and its name there (None: not under root)."""
        p = Path(os.path.abspath(path))
        try:
            parts = p.relative_to(self.root).parts
        except ValueError:
            return None, ""
        if not parts:
            return None, ""
        d: File | Dir = self.top
        for part in parts[:-1]:
            if not isinstance(d, Dir) or part not in d.live:
                return None, ""
            d = d.live[part]
        return (d if isinstance(d, Dir) else None), parts[-1]

    def _file(self, fd: int) -> File | None:
        node = self.fds.get(fd)
        return node if isinstance(node, File) else None

    # -- files.FileSystem --------------------------------------------------------------

    def open(self, path: str | Path, flags: int, mode: int = 0o777, /) -> int:
        self._call()
        parent, name = self._dir_of(path)
        is_root = Path(os.path.abspath(path)) == self.root
        fd = os.open(path, flags, mode)
        if is_root:
            self.fds[fd] = self.top
        elif parent is not None:
            node = parent.live.get(name)
            if node is None:  # created by this open
                node = parent.live[name] = File()
                parent.pending.append(("link", name, node))
            elif flags & os.O_TRUNC and isinstance(node, File):
                node.pending.append(("t", 0, b""))
            self.fds[fd] = node
        else:
            self.fds.pop(fd, None)
        return fd

    def close(self, fd: int, /) -> None:
        self.fds.pop(fd, None)  # (closing never fails for power: the fd goes)
        os.close(fd)

    def write(self, fd: int, data: bytes | memoryview, /) -> int:
        self._call()
        at = os.lseek(fd, 0, os.SEEK_CUR)
        n = os.write(fd, data)
        if (node := self._file(fd)) is not None:
            node.pending.append(("w", at, bytes(data[:n])))
        return n

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int, /) -> int:
        self._call()
        n = os.pwrite(fd, data, offset)
        if (node := self._file(fd)) is not None:
            node.pending.append(("w", offset, bytes(data[:n])))
        return n

    def ftruncate(self, fd: int, length: int, /) -> None:
        self._call()
        os.ftruncate(fd, length)
        if (node := self._file(fd)) is not None:
            node.pending.append(("t", length, b""))

    def posix_fallocate(self, fd: int, offset: int, length: int, /) -> None:
        self._call()
        os.posix_fallocate(fd, offset, length)
        if (node := self._file(fd)) is not None:
            node.pending.append(("a", offset + length, b""))

    def fsync(self, fd: int, /) -> None:
        self._call()
        os.fstat(fd)  # (EBADF as a real fsync would; the sync itself is simulated)
        self.syncs += 1
        node = self.fds.get(fd)
        if node is not None:
            node.sync()

    fdatasync = fsync  # the same here: the size a read needs is synced with the data

    def mkdir(self, path: str | Path, mode: int = 0o777, /) -> None:
        self._call()
        os.mkdir(path, mode)
        parent, name = self._dir_of(path)
        if parent is not None:
            node = parent.live[name] = Dir()
            parent.pending.append(("link", name, node))

    def replace(self, src: str | Path, dst: str | Path, /) -> None:
        self._call()
        os.replace(src, dst)
        parent, a = self._dir_of(src)
        other, b = self._dir_of(dst)
        assert parent is other, "renames across directories are not simulated"
        if parent is not None and a in parent.live:
            parent.live[b] = parent.live.pop(a)
            parent.pending.append(("rename", a, b))

    def unlink(self, path: str | Path, /) -> None:
        self._call()
        os.unlink(path)
        parent, name = self._dir_of(path)
        if parent is not None and parent.live.pop(name, None) is not None:
            parent.pending.append(("unlink", name, None))


@contextlib.contextmanager
def installed(root: Path, rng: random.Random) -> Iterator[PowerLossFS]:
    """The layer bound at the store's seam over `root` while the block runs."""
    layer = PowerLossFS(root, rng)
    real, files.fs = files.fs, layer
    try:
        yield layer
    finally:
        files.fs = real
