"""A turn in flight on a record dropped meanwhile (DELETE, expiry, the count cap) takes
the chain's segments back where their bytes still are, on disk only, only while the
durable index still names that place: no checkpoint captured since they were forgotten,
nor being encoded then. So the turn, once acknowledged, reads back live and after a
crash alike, and no checkpoint removes a file or a journal file it took a segment back
in; otherwise its chain is lost at once (EVICTED), never found missing later: after a
crash too, the turn answers EVICTED, and no segment is counted missing."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import Record
from ocxproxy.store import Store
from ocxproxy.store.local import admin, codec, durable, segment_files
from ocxproxy.store.local.segment_files import FILES
from tests.store.helpers import inline, make_store, make_turn, sample
from tests.store.test_checkpoint_reuse import chains
from tests.store.test_segment_files import LARGE, noise


def new_store(state: Path, large: bool) -> Store:
    """Bytes on disk only (no resident tier to take them back from); `large`: the first
    turn's segment in a file of its own, else in a journal file that other live
    segments keep."""
    options: dict[str, Any] = {"large_segment_bytes": LARGE} if large else {}
    return make_store(state, max_resident_bytes=1, offload=inline, **options)


async def first_turn(state: Path, large: bool) -> tuple[Store, Record]:
    """A store started in `state` and its first turn, on disk only."""
    store = new_store(state, large)
    await store.start()
    first = store.put(make_turn("r0", noise(40_000, 1) if large else "first"), None)
    await chains(store, "x", 30)  # (other live segments in the journal files)
    assert await store.flush()
    assert first.own is not None and first.own.data is None  # on disk only
    assert (first.own.pack == FILES) == large
    return store, first


async def answer(store: Store, record_id: str) -> bytes | FailureReason:
    try:
        return b"".join(await store.history(store.lookup_nowait("scope-a", record_id)))
    except StoreFailure as failure:
        return failure.reason


async def after_crash(state: Path, tmp_path: Path, large: bool) -> bytes | FailureReason:
    """What a store started on a copy of `state` as it is now (every commit acknowledged
    so far is durable in it: a crash) answers for r1's chain."""
    crashed = tmp_path / "crashed"
    shutil.copytree(state, crashed)
    _, problems = admin.verify(crashed)  # (`ocxproxy state verify`)
    assert problems == []
    store = new_store(crashed, large)
    await store.start()
    try:
        got = await answer(store, "r1")
        assert store.check() == []
    finally:
        await store.close()
    assert sample(store.metrics.spill_failures, reason="missing") == 0
    return got


async def check_r1(store: Store, state: Path, tmp_path: Path, large: bool) -> None:
    """r1 was acknowledged: its chain reads back, or it was lost at once (EVICTED), and
    after a crash the same, never found missing: from the journal, and from the next
    checkpoint."""
    live = await answer(store, "r1")
    assert isinstance(live, bytes) or live == FailureReason.EVICTED
    assert await after_crash(state, tmp_path, large) == live
    assert await store.flush()
    assert await after_crash(state, tmp_path / "checkpointed", large) == live


@pytest.mark.parametrize("large", [False, True], ids=["journal", "file"])
async def test_taken_back_before_the_next_checkpoint(tmp_path: Path, large: bool) -> None:
    """Dropped and taken back between two checkpoints: the chain reads back, after a
    crash and after the next checkpoint too."""
    state = tmp_path / "state"
    store, first = await first_turn(state, large)
    assert first.own is not None
    pack = first.own.pack
    assert store.delete_nowait("scope-a", "r0")
    await store.commit()
    child = store.put(make_turn("r1", "second"), first)
    await store.commit(child)
    assert child.segments[0] is not first.own and child.segments[0].pack == pack
    live = await answer(store, "r1")
    assert isinstance(live, bytes) and live.startswith(b'{"role":"user"')
    assert await after_crash(state, tmp_path, large) == live
    assert await store.flush()
    assert store.check() == []
    await check_r1(store, state, tmp_path / "later", large)
    await store.close()


@pytest.mark.parametrize("large", [False, True], ids=["journal", "file"])
async def test_not_taken_back_after_a_checkpoint_left_it_out(tmp_path: Path, large: bool) -> None:
    """A checkpoint captured after the drop no longer names the segment, and its entry
    is in a journal file before it: a record naming it would not load after a crash."""
    state = tmp_path / "state"
    store, first = await first_turn(state, large)
    assert store.delete_nowait("scope-a", "r0")
    await store.commit()
    assert await store.flush()
    await store.commit(store.put(make_turn("r1", "second"), first))
    await check_r1(store, state, tmp_path, large)
    await store.close()


@pytest.mark.parametrize("large", [False, True], ids=["journal", "file"])
async def test_not_taken_back_while_a_checkpoint_removes_it(
    tmp_path: Path, large: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn lands while the checkpoint that no longer names the segment removes its
    file (in a thread: the loop runs meanwhile): it does not take the segment back into
    a file on its way out."""
    state = tmp_path / "state"
    store, first = await first_turn(state, large)
    assert store.delete_nowait("scope-a", "r0")
    await store.commit()
    if not large:  # (the first turn's journal file made removable: nothing else there)
        for i in range(30):
            store.delete_nowait("scope-a", f"x{i}")
        await store.commit()
    put: list[Record] = []

    def meanwhile(remove: Callable[..., Any]) -> Callable[..., Any]:
        def removing(*args: Any) -> Any:
            if not put:
                put.append(store.put(make_turn("r1", "second"), first))
            return remove(*args)

        return removing

    if large:
        monkeypatch.setattr(durable.segment_files, "remove", meanwhile(segment_files.remove))
    else:
        assert store.disk is not None and store.disk.journal is not None
        journal = store.disk.journal
        monkeypatch.setattr(journal, "remove", meanwhile(journal.remove))
    assert await store.flush()
    assert put, "nothing removed"
    await store.commit(put[0])
    await check_r1(store, state, tmp_path, large)
    await store.close()


@pytest.mark.parametrize("large", [False, True], ids=["journal", "file"])
async def test_not_taken_back_when_dropped_while_a_checkpoint_encodes(
    tmp_path: Path, large: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropped after the checkpoint's capture but before its rows of the segment's file
    are encoded: the checkpoint leaves the segment out (no record it names holds it), so
    it is not taken back after that checkpoint either."""
    state = tmp_path / "state"
    store, first = await first_turn(state, large)
    assert first.own is not None
    pack, encode = first.own.pack, codec.checkpoint_segment_rows
    dropped: list[bool] = []

    def dropping(found: Any, at: int) -> Any:
        if at == pack and not dropped:
            dropped.append(store.delete_nowait("scope-a", "r0"))
            found = [s if s is not first.own else None for s in found]  # (as looked up now)
        return encode(found, at)

    assert store.disk is not None
    store.disk.rows = {}  # (every file's rows encoded, none copied)
    monkeypatch.setattr(codec, "checkpoint_segment_rows", dropping)
    assert await store.flush()
    assert dropped == [True]
    monkeypatch.setattr(codec, "checkpoint_segment_rows", encode)
    await store.commit()
    await store.commit(store.put(make_turn("r1", "second"), first))
    await check_r1(store, state, tmp_path, large)
    await store.close()
