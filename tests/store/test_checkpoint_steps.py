"""A checkpoint's work comes in short steps of the event loop at any store size.

Counted, not timed: with the step budget (upkeep.STEP) at zero every step is its
smallest, and a task that runs between steps counts the work done in each: rows encoded,
segments scanned, ordered and moved by compaction. The encoding also sets off (almost) no
cyclic GC collection: each one is a pause of the loop, a full one ~10-16 ms at 100,000
records.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest

from ocxproxy import heap
from ocxproxy.model import Record, Segment
from ocxproxy.store import Store, records
from ocxproxy.store.local import codec, durable, upkeep
from ocxproxy.store.local.journal import Journal
from ocxproxy.store.local.segments import SegmentTable
from tests.store.helpers import checkpoint_ids, make_store, make_turn

N = 3000


async def filled(tmp_path: Path, n: int = N) -> tuple[Store, list[Record]]:
    store = make_store(tmp_path, max_entries=2 * n, max_resident_bytes=1024**2)
    await store.start()
    records: list[Record] = []
    parent = None
    for i in range(n):
        parent = store.put(make_turn(f"r{i}", f"turn {i}"), parent if i % 30 else None)
        records.append(parent)
    await store.commit()
    return store, records


class Steps:
    """Runs between the loop's steps and keeps the most `work` any one step did."""

    def __init__(self) -> None:
        self.work = 0
        self.worst = 0
        self._seen = 0
        self.task = asyncio.ensure_future(self._run())

    def add(self, n: int) -> None:
        self.work += n

    async def _run(self) -> None:
        while True:
            self.worst = max(self.worst, self.work - self._seen)
            self._seen = self.work
            await asyncio.sleep(0)

    async def stop(self) -> int:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        return max(self.worst, self.work - self._seen)


async def test_the_encoding_yields_after_every_chunk_of_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = await filled(tmp_path)
    monkeypatch.setattr(upkeep, "STEP", 0.0)
    steps = Steps()
    segment_rows, record_rows = codec.checkpoint_segment_rows, codec.checkpoint_record_rows

    def counted_segments(*args: Any) -> Any:
        rows = segment_rows(*args)
        steps.add(len(rows))
        return rows

    def counted_records(*args: Any) -> Any:
        rows = record_rows(*args)
        steps.add(len(rows))
        return rows

    monkeypatch.setattr(codec, "checkpoint_segment_rows", counted_segments)
    monkeypatch.setattr(codec, "checkpoint_record_rows", counted_records)
    assert await store.flush()
    worst = await steps.stop()
    monkeypatch.undo()
    assert steps.work >= 2 * N  # every record and its own segment were encoded
    # and never more in one step than a generation-0 collection allows (700 new lists,
    # ~3 per row): the rows are dumped, and their lists freed, before it comes
    assert worst <= 700 // 3
    assert len(checkpoint_ids(tmp_path)) == N
    await store.close()


async def test_a_turn_of_several_passes_meets_at_most_one_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two steps the loop runs for upkeep.GAP, not for one pass: a turn's work
    takes several passes of the loop (its request, the backend's answer, its commit, its
    answer), and with a step in every pass it waited for one at each."""
    store, _ = await filled(tmp_path)
    monkeypatch.setattr(upkeep, "STEP", 0.0)  # every chunk is a step
    steps = [0]
    pause = upkeep.Pacer.pause

    async def counted(self: upkeep.Pacer) -> None:
        steps[0] += 1
        await pause(self)

    monkeypatch.setattr(upkeep.Pacer, "pause", counted)
    seen: list[int] = []  # steps begun while a chain of six passes ran
    done = False

    async def turns() -> None:
        while not done:
            before = steps[0]
            for _ in range(6):
                await asyncio.sleep(0)
            seen.append(steps[0] - before)

    task = asyncio.ensure_future(turns())
    assert await store.flush()
    done = True
    await task
    monkeypatch.undo()
    assert steps[0] >= N // upkeep.CHUNK  # the encoding's chunks, each a step
    assert any(seen)  # chains ran while it did
    assert max(seen) <= 2, sorted(seen)[-10:]  # (2: a chain that a descheduling spread)
    await store.close()


async def test_compaction_scans_and_moves_in_short_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, records = await filled(tmp_path)
    assert await store.flush()  # the journal so far is before the checkpoint
    for record in records[: int(N * 0.7)]:  # its files are mostly garbage now
        store.delete_nowait(record.scope, record.id)
    await store.commit()
    monkeypatch.setattr(upkeep, "STEP", 0.0)
    monkeypatch.setattr(durable, "SCAN", 256)
    scanned, moved, ordered = Steps(), Steps(), Steps()
    move = SegmentTable.move

    def counted_sort(items: Any, **kwargs: Any) -> list[Any]:
        out = sorted(items, **kwargs)
        ordered.add(len(out))
        return out

    def counted_scan(self: SegmentTable, pack: int, keys: list[str]) -> list[Segment]:
        scanned.add(len(keys))
        return scan(self, pack, keys)

    def counted_move(self: SegmentTable, *args: Any) -> None:
        moved.add(1)
        move(self, *args)

    scan = SegmentTable.in_file
    monkeypatch.setattr(SegmentTable, "in_file", counted_scan)
    monkeypatch.setattr(SegmentTable, "move", counted_move)
    monkeypatch.setattr(durable, "sorted", counted_sort, raising=False)
    written = store.metrics.spill_writes.get()
    assert await store.flush()
    worst_scan, worst_moves = await scanned.stop(), await moved.stop()
    worst_order = await ordered.stop()
    monkeypatch.undo()
    assert store.metrics.spill_writes.get() - written >= N * 0.3  # the live rest moved
    assert scanned.work >= 0.3 * N
    assert worst_scan <= 256  # a slice of them per step
    assert ordered.work >= 0.3 * N and worst_order <= 256  # ordered a slice at a time too
    assert worst_moves <= 1  # each move its own step (at STEP 0)
    assert not store.check()
    await store.close()


async def test_the_encoding_sets_off_almost_no_gc_collection(tmp_path: Path) -> None:
    store, _ = await filled(tmp_path)
    heap.settle()  # as `serve` keeps the heap
    collections: list[int] = []

    def counted(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(counted)
    try:
        assert await store.flush()
    finally:
        gc.callbacks.remove(counted)
    # ~3 GC-tracked lists per row: the old encoding, 500 rows between the dumps that free
    # them, set off ~2 generation-0 collections per chunk (~30 here, 800 at 100,000)
    assert len(collections) <= 3, collections
    await store.close()


async def test_the_capture_is_frozen_before_the_loop_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, records = await filled(tmp_path)
    del records
    heap.settle()  # as `serve` keeps the heap
    seen: list[int] = []
    seal = Journal.seal_retired

    def watched(self: Journal) -> None:
        # A thread's job the checkpoint awaits after its capture, while the loop runs on:
        # the longest list of records a GC collection could traverse now (one unfrozen
        # list of every record: a collection of any generation visits each of them, one
        # pause of 10-35 ms at 100,000 records under `serve`).
        seen.append(
            max(
                (
                    len(o)
                    for o in gc.get_objects()
                    if type(o) is list and o and type(o[0]) is Record
                ),
                default=0,
            )
        )
        seal(self)

    monkeypatch.setattr(Journal, "seal_retired", watched)
    assert await store.flush()
    monkeypatch.undo()
    assert seen and max(seen) < N // 10, seen
    assert len(checkpoint_ids(tmp_path)) == N
    await store.close()


async def test_a_parent_looked_for_in_copied_chunks_is_found_in_short_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copied chunk's map from chain link to record id is filled only when a parent
    lookup reaches it; a lookup that finds no parent (its record deleted, or a
    conversation's turn, whose parent record was rewritten) reaches every one before its
    chunk. Those maps are filled in steps, not all in the step that encodes that row
    (~40 ms at 100,000 records)."""
    monkeypatch.setattr(records, "CHUNK", 64)
    store, _ = await filled(tmp_path)
    assert await store.flush()
    assert await store.flush()  # (the next copies every chunk but the newest)
    parent = store.put(make_turn("p", "gone"), None)
    store.put(make_turn("c", "its parent gone"), parent)
    await store.commit()
    store.delete_nowait("scope-a", "p")
    await store.commit()
    made: list[upkeep.Named] = []
    init = upkeep.Named.__init__

    def kept(self: upkeep.Named) -> None:
        init(self)
        made.append(self)

    monkeypatch.setattr(upkeep.Named, "__init__", kept)
    monkeypatch.setattr(upkeep, "STEP", 0.0)
    mapped = [0, 0]  # chain links in the maps now, and at most
    steps = Steps()

    async def count() -> None:
        while True:
            now = sum(len(m) for named in made for m in named.maps)
            steps.add(max(now - mapped[0], 0))
            mapped[0], mapped[1] = now, max(mapped[1], now)
            await asyncio.sleep(0)

    counter = asyncio.ensure_future(count())
    assert await store.flush()
    counter.cancel()
    worst = await steps.stop()
    monkeypatch.undo()
    assert mapped[1] >= N  # the lookup did reach every chunk's map
    assert worst <= 2 * 64, worst
    await store.close()
