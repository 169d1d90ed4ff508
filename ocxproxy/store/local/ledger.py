"""Records on their way into the journal (`Ledger`): their REC (or PUT) and DEL entries,
the futures `Store.commit` awaits, and each commit's outcome applied back through narrow
calls: SEG entries to the SegmentTable, REC, PUT and RSP entries here (a response's place
to its record and the keydir), a record whose entry failed to the store, which drops it
(never acknowledged).

Order of durability, so a crash never loses an acknowledged turn:
  1. a segment's bytes and a record's entry count as durable only after their fsync;
  2. a record's entry is appended after (or with) the entries of every segment it needs;
  3. a journal file is removed only when a checkpoint captured after its last live
     segment left it is durable (durable.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import Record, Segment, place, unplace
from ocxproxy.store.local import codec
from ocxproxy.store.local.codec import DEL, PUT, REC, RSP, SEG
from ocxproxy.store.local.committer import Committer, Outcome
from ocxproxy.store.local.segments import SegmentTable


class Owner(Protocol):
    """What the ledger tells the store that owns the records."""

    def unwritten(self, record: Record, failure: StoreFailure) -> None:
        """`record`'s PUT failed: it goes, and `commit` answers `failure` for its id."""

    def settle(self) -> None:
        """Back within the caps after a failed commit."""

    def holds(self, record: Record) -> bool:
        """Is `record` the store's live record of its id?"""

    def moved(self, record: Record) -> None:
        """`record`'s response moved (compaction): its checkpoint row changed."""


class Ledger:
    def __init__(self, owner: Owner, table: SegmentTable) -> None:
        self.owner = owner
        self.table = table
        # Set while the journal is open.
        self.committer: Committer | None = None
        self.changed: Callable[[], None] = _nothing  # a change the checkpoint lacks
        self._uncommitted: dict[str, tuple[Record, asyncio.Future[Any]]] = {}

    def put(self, record: Record, parent: str | None) -> None:
        """Queue `record`'s entry (a REC holding its response's bytes; a PUT when its
        response is a segment) after the SEG entries of the segments it needs that the
        journal neither holds nor awaits; `parent`: the id of the live durable record
        whose row precedes it in the journal, which names it."""
        committer = self.committer
        assert committer is not None
        link, response = record.links, record.response
        if parent is not None and link is not None:
            # The chain is the named parent's plus one, and a live durable record's
            # segments are in the journal or queued already: only this turn's can be new.
            needed: tuple[Any, ...] = (link.segment,)
        else:
            needed = record.segments
        fill = record.fill  # (its members filled in from the request)
        if fill is not None and fill.pack < 0:  # (the usual turn's are in the journal)
            needed = (*needed, fill)
        if type(response) is bytes:
            self.table.queue_missing(needed)  # (first: a segment's sid is given there)
            row = orjson.dumps(codec.record_row(record, parent))
            future = committer.submit(REC, (row, response), record, len(response))
        else:
            assert type(response) is Segment  # (never a place: an entry was committed)
            self.table.queue_missing((*needed, response))
            row = orjson.dumps(codec.record_row(record, parent))
            future = committer.submit(PUT, row, record)
        self._uncommitted[record.id] = (record, future)
        self.changed()

    def delete(self, record: Record, *, journaled: bool) -> None:
        """`record` went: a DEL when `journaled`, and whenever its PUT is still queued (the
        DEL must follow it, or the record comes back)."""
        assert self.committer is not None
        if journaled or self.pending(record):
            self.committer.submit(DEL, orjson.dumps(record.id), None)
            self.changed()

    def queued(self, record_id: str) -> bool:
        """A PUT of this id is queued or being written."""
        return record_id in self._uncommitted

    def uncommitted(self) -> set[str]:
        """The ids of the records whose PUT is queued or being written."""
        return set(self._uncommitted)

    def pending(self, record: Record) -> bool:
        """`record`'s PUT is queued or being written."""
        entry = self._uncommitted.get(record.id)
        return entry is not None and entry[0] is record

    async def commit(self, record: Record | None) -> None:
        """Until `record`'s entries (or everything queued so far) are durable; raises
        StoreFailure(WRITE_FAILED) when they could not be written."""
        if record is not None:
            entry = self._uncommitted.get(record.id)
            if entry is None or entry[0] is not record:
                return
            future: asyncio.Future[Any] | None = entry[1]
        else:
            future = self.committer.pending() if self.committer is not None else None
        if future is None:
            return
        committer = self.committer
        if committer is not None:
            error = await committer.waiter(future)
        else:
            error = await asyncio.shield(future)
        if error is not None:
            raise unavailable(error)

    async def wait_for_room(self, budget: int, patience: float) -> None:
        """While more than `budget` bytes wait for the journal, wait (at most `patience`)
        for commits."""
        committer = self.committer
        if committer is None or committer.queued_bytes <= budget:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(patience):
                while committer.queued_bytes > budget and (f := committer.pending()):
                    await asyncio.shield(f)

    def applied(self, outcome: Outcome) -> None:
        """A commit's outcome, applied to the segments and records, entry by entry."""
        if outcome.error is not None:
            self._failed(outcome, unavailable(outcome.error))
            return
        self.table.committed(outcome)
        assert outcome.places is not None
        uncommitted, keydir, holds = self._uncommitted, self.table.keydir, self.owner.holds
        jobs = zip(outcome.jobs, outcome.subjects, outcome.places, strict=True)
        for (kind, job), subject, at in jobs:
            if kind == REC:
                # Its response is in the journal now: it leaves memory (only GET reads it).
                if holds(subject) and type(subject.response) is bytes:
                    subject.response = place(at[0], at[1], at[2], len(job[1]))
                    keydir.locate_response(subject.id, subject.response)
            elif kind == RSP:  # moved by compaction, unless its record went or changed
                record, before = subject
                if holds(record) and record.response == before:
                    keydir.unlocate_response(before)
                    record.response = place(at[0], at[1], at[2], unplace(before)[3])
                    keydir.locate_response(record.id, record.response)
                    self.owner.moved(record)
                continue
            elif kind != PUT:
                continue
            entry = uncommitted.get(subject.id)
            if entry is not None and entry[0] is subject:
                del uncommitted[subject.id]

    def _failed(self, outcome: Outcome, failure: StoreFailure) -> None:
        for (kind, _), subject in zip(outcome.jobs, outcome.subjects, strict=True):
            if kind == SEG:
                self.table.not_written(subject)
            elif kind in (PUT, REC) and self.pending(subject):
                del self._uncommitted[subject.id]
                # Not durable: in ack mode never acknowledged; in relaxed mode within the
                # window it may lose. Its children name it in the journal: it goes.
                self.owner.unwritten(subject, failure)
        self.owner.settle()


def unavailable(error: OSError) -> StoreFailure:
    """The failure a turn whose entries could not be written answers with."""
    name = errno.errorcode.get(error.errno or 0, "error")
    return StoreFailure(FailureReason.WRITE_FAILED, f"{name}: {error.strerror or error}")


def _nothing() -> None:
    pass
