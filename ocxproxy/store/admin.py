"""`ocxproxy state stats|verify|gc`: look at a state dir from outside a running proxy.

stats and verify only read. gc removes orphaned spill files and temp files, and refuses
while a proxy holds the dir's lock (it could delete files written but not yet indexed).
Blocking, synchronous; failures come back as text lines, never as tracebacks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store import files, snapshot
from ocxproxy.store.spill import Scan, SpillDir, compressed_limit, decode

_MAX_ORPHAN = 1024**3  # largest uncompressed size a file without an index entry may claim


@dataclass(slots=True)
class StateReport:
    root: Path
    index: snapshot.Index | None = None
    error: str | None = None  # why the snapshot could not be read
    snapshot_bytes: int = 0
    scan: Scan = field(default_factory=Scan)
    referenced: dict[str, int] = field(default_factory=dict)  # key -> uncompressed size

    @property
    def missing(self) -> list[str]:
        return sorted(k for k, size in self.referenced.items() if size and k not in self.scan.files)

    @property
    def orphans(self) -> list[str]:
        return sorted(k for k in self.scan.files if k not in self.referenced)

    def lines(self) -> list[str]:
        idx = self.index
        disk_bytes = sum(self.scan.files.values())
        raw = sum(self.referenced.values())
        out = [f"state dir      {self.root}"]
        if self.error:
            out.append(f"snapshot       unreadable: {self.error}")
        elif idx is None:
            out.append("snapshot       none yet")
        else:
            age = max(0.0, time.time() - idx.written_at)
            out.append(
                f"snapshot       {self.snapshot_bytes} bytes, written {age:.0f}s ago, "
                f"version {snapshot.VERSION}"
            )
            out.append(f"records        {len(idx.records)}")
            out.append(f"segments       {len(self.referenced)} ({raw} bytes uncompressed)")
        out.append(f"disk tier      {len(self.scan.files)} files, {disk_bytes} bytes")
        out.append(f"orphans        {len(self.orphans)}")
        out.append(f"missing        {len(self.missing)}")
        out.append(f"temp files     {len(self.scan.temps)}")
        out.append(f"unsafe entries {len(self.scan.unsafe)}")
        return out


def inspect(root: Path) -> StateReport:
    report = StateReport(root)
    try:
        report.index = snapshot.load(root)
    except snapshot.SnapshotError as exc:
        report.error = str(exc)
    if report.index is not None:
        report.snapshot_bytes = (root / snapshot.NAME).lstat().st_size
        report.referenced = {s.key: s.size for s in report.index.segments}
    report.scan = SpillDir(root / "spill").scan()
    return report


def verify(root: Path) -> tuple[StateReport, list[str]]:
    """Every spill file decompressed and checked against its name; problems as lines."""
    report = inspect(root)
    problems: list[str] = []
    if report.error:
        problems.append(f"snapshot: {report.error}")
    problems += [f"missing: {k} (named in the snapshot)" for k in report.missing]
    problems += [f"unsafe entry: {p}" for p in report.scan.unsafe]
    spill = SpillDir(root / "spill")
    for key in sorted(report.scan.files):
        size = report.referenced.get(key)
        try:
            if size is None:
                _verify_unindexed(spill, key)
            else:
                spill.read(key, size)
        except StoreFailure as failure:
            problems.append(f"{failure.reason}: {key}: {failure.detail}")
    return report, problems


def _verify_unindexed(spill: SpillDir, key: str) -> None:
    """A file no index entry describes: trust the size its frame declares, within reason."""
    try:
        blob = files.read_regular(spill.path(key), compressed_limit(_MAX_ORPHAN))
        size = zstandard.frame_content_size(blob)
    except FileNotFoundError:
        raise StoreFailure(FailureReason.MISSING, "gone") from None
    except (files.UnsafePath, files.FileTooLarge, zstandard.ZstdError) as exc:
        raise StoreFailure(FailureReason.CORRUPT, str(exc)) from None
    except OSError as exc:
        raise StoreFailure(FailureReason.READ_FAILED, str(exc)) from None
    if not 0 <= size <= _MAX_ORPHAN:
        raise StoreFailure(FailureReason.CORRUPT, f"frame declares {size} bytes")
    decode(key, size, blob)


class StateBusy(Exception):
    """A running proxy holds the state dir."""


def gc(root: Path) -> list[Path]:
    """Remove orphaned spill files, temp files and stray links; the paths removed."""
    lock = files.DirLock(root)
    if not lock.acquire():
        raise StateBusy(f"{root} is in use by a running ocxproxy; stop it first")
    try:
        report = inspect(root)
        doomed = [*report.scan.temps, *(p for p in report.scan.unsafe if p.is_symlink())]
        doomed += [p for p in root.iterdir() if files.is_temp_name(p.name)]
        if report.error is None:  # without a readable index every file looks orphaned
            doomed += [SpillDir(root / "spill").path(k) for k in report.orphans]
        removed = []
        for path in doomed:
            try:
                path.unlink()
            except OSError:
                continue
            removed.append(path)
        return removed
    finally:
        lock.release()
