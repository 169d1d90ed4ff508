"""`ocxproxy state stats|verify|gc`: look at a state dir from outside a running proxy.

All three read the checkpoint and replay the journal as start-up does, without changing
anything (a torn tail is reported, not cut), and refuse a dir in a newer format than
this release reads (stateformat.py), as `serve` does. verify also reads every live segment back
and checks its digest (segment files too), and every live response its record's entry
holds, checking its checksum. gc removes journal files and segment files no
live segment needs and temp files, and refuses while a proxy holds the dir's lock.
Blocking, synchronous; failures come back as text lines, never as tracebacks.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ocxproxy.errors import StoreFailure
from ocxproxy.model import Segment, place, unplace
from ocxproxy.store.local import codec, files, journal, segment_files, stateformat
from ocxproxy.store.local.codec import Loaded
from ocxproxy.store.local.journal import Journal
from ocxproxy.store.local.segment_files import FILES


@dataclass(slots=True)
class StateReport:
    root: Path
    loaded: Loaded = field(default_factory=Loaded)
    checkpoint_bytes: int = 0
    format: int = stateformat.FORMAT
    live: dict[int, Segment] = field(default_factory=dict)  # sid -> segment a record needs
    # (record id, place) of each live response kept in its record's entry
    responses: list[tuple[str, int]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # records needing an unknown segment
    # records kept whose chain was evicted while their turn was in flight (codec.UNWRITTEN)
    evicted: list[str] = field(default_factory=list)
    bad_ids: list[str] = field(default_factory=list)  # conversations whose ids disagree
    temps: list[Path] = field(default_factory=list)
    checked: int = 0

    @property
    def journal_bytes(self) -> int:
        return sum(self.loaded.sizes.values())

    @property
    def unneeded(self) -> list[int]:
        """Journal files before the checkpoint's position that hold no live segment."""
        first = self.loaded.replay_from[0]
        used = {s.pack for s in self.live.values()}
        used.update(unplace(at)[0] for _, at in self.responses)
        return sorted(p for p in self.loaded.sizes if p < first and p not in used)

    @property
    def unneeded_files(self) -> list[str]:
        """Keys of the segment files on disk that no live segment needs."""
        used = {s.key for s in self.live.values() if s.pack == FILES}
        return [key for key in segment_files.on_disk(self.root) if key not in used]

    def lines(self) -> list[str]:
        ld = self.loaded
        out = [f"state dir      {self.root}"]
        unmarked = " (written before the marker)" if self.format == stateformat.UNMARKED else ""
        out.append(f"format         {self.format}{unmarked}")
        if ld.error:
            out.append(f"checkpoint     unusable: {ld.error}")
        elif ld.checkpoint_at is None:
            out.append("checkpoint     none yet")
        else:
            age = max(0.0, time.time() - ld.checkpoint_at)
            out.append(f"checkpoint     {self.checkpoint_bytes} bytes, written {age:.0f}s ago")
        live_bytes = sum(s.length for s in self.live.values())
        raw = sum(s.size for s in self.live.values())
        out.append(f"records        {len(ld.records)}")
        out.append(f"segments       {len(self.live)} ({raw} bytes, {live_bytes} compressed)")
        held = sum(unplace(at)[2] for _, at in self.responses)
        out.append(f"responses      {len(self.responses)} in their records' entries "
                   f"({held} bytes compressed)")  # fmt: skip
        out.append(f"journal        {len(ld.sizes)} files, {self.journal_bytes} bytes")
        own = [s for s in self.live.values() if s.pack == FILES]
        own_bytes = sum(s.length for s in own)
        out.append(f"segment files  {len(own)} ({own_bytes} bytes), unneeded "
                   f"{len(self.unneeded_files)}")  # fmt: skip
        out.append(f"replayed       {ld.entries} entries after the checkpoint")
        out.append(f"torn tails     {ld.cut}")
        out.append(f"unneeded files {len(self.unneeded)}")
        out.append(f"missing        {len(self.missing)}")
        out.append(f"history lost   {len(self.evicted)} (in flight on a chain evicted)")
        out.append(f"temp files     {len(self.temps)}")
        return out


def inspect(root: Path) -> StateReport:
    """The dir's index as start-up would load it; NewerFormat (a ConfigError) for a dir
    in a format this release does not read."""
    found = stateformat.read(root)
    j = Journal(root)
    report = StateReport(root, j.load(repair=False), format=found)
    with contextlib.suppress(OSError):
        report.checkpoint_bytes = (root / journal.CHECKPOINT).lstat().st_size
    now = time.time()
    segments = report.loaded.segments
    for row in report.loaded.records.values():
        if row[3] <= now:
            continue
        needed = [*(codec.chain_sids(row) or (-1,))]  # None: its parent is gone
        chain = list(needed)
        held = row[5]  # a segment's sid, or the place [file, offset, length, size] of its entry's
        if type(held) is list:
            response = _response(held, report.loaded)
        else:
            needed.append(held)
        if len(row) > codec.FILL:  # its members filled in from the request, by sid
            needed.append(row[codec.FILL][0])
        if codec.UNWRITTEN in needed:  # lost before it was written: kept, its chain EVICTED
            report.evicted.append(row[0])
            needed = [sid for sid in needed if sid != codec.UNWRITTEN]
            chain = []
        if any(sid not in segments or not _present(segments[sid], report.loaded)
               for sid in needed) or (type(held) is list and response is None):  # fmt: skip
            report.missing.append(row[0])
            continue
        for sid in needed:
            report.live[sid] = segments[sid]
        if type(held) is list and response is not None:
            report.responses.append((row[0], response))
        if not _ids_agree(row, [segments[sid] for sid in chain]):
            report.bad_ids.append(row[0])
    report.temps = j.temps()
    return report


def _response(held: list[Any], loaded: Loaded) -> int | None:
    """A loaded row's response place as an int, or None when its file is gone or bad."""
    try:
        return place(*held) if held[0] in loaded.sizes else None
    except (TypeError, ValueError):
        return None


def _present(segment: Segment, loaded: Loaded) -> bool:
    """Is the file that holds `segment`'s bytes there (as far as the index knows)?"""
    return segment.pack == FILES or segment.pack in loaded.sizes


def _ids_agree(row: list[Any], chain: list[Segment]) -> bool:
    """A conversation's row: one list of item ids per segment of its chain, as long as the
    segment's items (an empty conversation's chain is one empty segment). Other rows: True."""
    try:
        ids = codec.conversation_ids(row)
    except ValueError:
        return False
    if ids is None:
        return True
    if len(chain) == 1 and not chain[0].size:
        chain = []
    return [len(i) for i in ids] == [s.n_items for s in chain]


def verify(root: Path) -> tuple[StateReport, list[str]]:
    """Every live segment read back and checked against its digest; problems as lines."""
    report = inspect(root)
    problems: list[str] = []
    if report.loaded.error:
        problems.append(f"checkpoint: {report.loaded.error}")
    problems += [f"torn or corrupt journal at file {p} offset {o}" for p, o in report.loaded.cut_at]
    problems += [f"missing: record {r} needs a segment that is gone" for r in report.missing]
    problems += [f"conversation {r}: its item ids disagree with its items" for r in report.bad_ids]
    j = Journal(root)
    try:
        for info in report.live.values():
            if not info.size:
                continue
            try:
                j.read(info.key, info.size, info.pack, info.offset, info.length)
            except StoreFailure as failure:
                problems.append(f"{failure.reason}: {info.key}: {failure.detail}")
            report.checked += 1
        for rid, at in report.responses:
            try:
                j.read_response(at)
            except StoreFailure as failure:
                problems.append(f"{failure.reason}: {rid}'s response: {failure.detail}")
            report.checked += 1
    finally:
        j.close()
    return report, problems


class StateBusy(Exception):
    """A running proxy holds the state dir."""


def gc(root: Path) -> list[Path]:
    """Remove journal files no live segment needs and temp files; the paths removed."""
    lock = files.DirLock(root)
    if not lock.acquire():
        raise StateBusy(f"{root} is in use by a running ocxproxy; stop it first")
    try:
        report = inspect(root)
        j = Journal(root)
        doomed = list(report.temps)
        if report.loaded.error is None:  # without a usable checkpoint keep every file
            doomed += [j.path(p) for p in report.unneeded]
            doomed += [segment_files.path(root, k) for k in report.unneeded_files]
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
