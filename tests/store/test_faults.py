"""Fault injection at the file layer: each fault gives its typed outcome, is counted, never
crashes the store and never corrupts another chain. A turn whose commit failed is never
acknowledged (commit raises) and is not served; what was committed before keeps working;
the store recovers by itself once the disk takes writes again."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import orjson
import pytest

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store import Store
from ocxproxy.store.local import files, journal
from ocxproxy.store.local.durable import StateDirUnusable
from ocxproxy.store.local.journal import Journal
from tests.store.helpers import (
    durable_ids,
    inline,
    journal_files,
    make_store,
    make_turn,
    sample,
)


async def chain(store: Store, prefix: str, n: int, *, commit: bool = True) -> None:
    parent = None
    for i in range(n):
        parent = store.put(make_turn(f"{prefix}{i}", f"{prefix} turn {i}"), parent)
        if commit:
            await store.commit(parent)


async def resolves(store: Store, response_id: str) -> bool:
    history = await store.history(store.lookup_nowait("scope-a", response_id))
    items = orjson.loads(b"[" + b",".join(history) + b"]")
    prefix = response_id.rstrip("0123456789")
    n = int(response_id[len(prefix) :]) + 1
    return [i["content"] for i in items[::2]] == [f"{prefix} turn {k}" for k in range(n)]


async def reason_of(store: Store, response_id: str) -> FailureReason:
    with pytest.raises(StoreFailure) as info:
        await store.history(store.lookup_nowait("scope-a", response_id))
    return info.value.reason


async def started(tmp_path: Path, **overrides: object) -> Store:
    store = make_store(tmp_path, offload=inline, **overrides)
    await store.start()
    return store


def no_space(fd: int, data: bytes, offset: int) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_disk_full_during_append(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The turn is not acknowledged, the store keeps serving what it had, memory does not
    grow with the refused turns, and writes resume by themselves when space returns."""
    store = await started(tmp_path, max_resident_bytes=400)
    await chain(store, "safe", 2)
    monkeypatch.setattr(files, "write_at", no_space)
    for i in range(50):
        record = store.put(make_turn(f"doomed{i}", f"doomed turn {i} " + "x" * 200), None)
        with pytest.raises(StoreFailure) as info:
            await store.commit(record)
        assert info.value.reason == FailureReason.WRITE_FAILED
        assert "ENOSPC" in info.value.detail
    assert not store.available
    assert sample(store.metrics.store_write_failures, reason="ENOSPC") == 50
    assert sample(store.metrics.store_available) == 0
    assert store.metrics.journal_lag.get() == 0  # nothing left waiting
    with pytest.raises(StoreFailure):  # never acknowledged, so never served
        store.lookup_nowait("scope-a", "doomed7")
    assert len(store) == 2 and store.stats().resident_bytes <= 400
    assert await resolves(store, "safe1")  # continuations from stored state keep working
    child = store.put(make_turn("child", "on top"), store.lookup_nowait("scope-a", "safe1"))
    with pytest.raises(StoreFailure):
        await store.commit(child)
    assert store.check() == []
    monkeypatch.undo()  # space again: the maintainer's probe finds out without traffic
    for _ in range(100):
        if store.available:
            break
        await asyncio.sleep(0.05)
    assert store.available and sample(store.metrics.store_available) == 1
    await chain(store, "later", 3)
    await store.abandon()
    store = await started(tmp_path)
    assert await resolves(store, "safe1") and await resolves(store, "later2")
    assert "doomed0" not in durable_ids(tmp_path)
    assert store.check() == []
    await store.close()


async def test_relaxed_mode_does_not_wait_and_survives_a_failed_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await started(tmp_path, durability="relaxed", snapshot_delay=0.05)
    record = store.put(make_turn("r0", "relaxed"), None)
    await asyncio.wait_for(store.commit(record), 0.01)  # returns at once
    assert durable_ids(tmp_path) == []
    await asyncio.sleep(0.2)
    assert durable_ids(tmp_path) == ["r0"]  # written within the window
    monkeypatch.setattr(files, "write_at", no_space)
    store.put(make_turn("r1", "lost"), None)
    await asyncio.sleep(0.2)
    assert not store.available
    monkeypatch.undo()
    await store.close()


async def test_write_error_on_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await started(tmp_path, max_resident_bytes=300)
    await chain(store, "ok", 2)

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken)
    monkeypatch.setattr(os, "fdatasync", broken)
    record = store.put(make_turn("c0", "c turn 0"), None)
    with pytest.raises(StoreFailure):
        await store.commit(record)
    monkeypatch.undo()
    assert sample(store.metrics.store_write_failures, reason="EIO") == 1
    # The failed bytes were cut off the file again: the journal stays whole.
    await chain(store, "after", 2)
    assert store.check() == []
    await store.abandon()
    loaded = Journal(tmp_path).load(repair=False)
    assert loaded.cut == 0 and list(loaded.records) == ["ok0", "ok1", "after0", "after1"]


async def test_read_error_is_transient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await started(tmp_path, max_resident_bytes=300)
    await chain(store, "c", 4)

    def broken(fd: int, n: int, offset: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pread", broken)
    assert await reason_of(store, "c3") == FailureReason.READ_FAILED
    assert sample(store.metrics.spill_failures, reason="read_failed") >= 1
    monkeypatch.undo()
    assert await resolves(store, "c3")  # nothing was marked lost
    await store.close()


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


async def test_corrupt_segment_bytes_fail_their_chains_only(tmp_path: Path) -> None:
    store = await started(tmp_path, max_resident_bytes=100)
    await chain(store, "bad", 3)
    await chain(store, "good", 3)
    victim = store.lookup_nowait("scope-a", "bad0").segments[0]
    assert victim.data is None and victim.on_disk
    flip(journal_files(tmp_path)[victim.pack], victim.offset + victim.length // 2)
    assert await reason_of(store, "bad2") == FailureReason.CORRUPT
    assert await reason_of(store, "bad1") == FailureReason.CORRUPT  # remembered as lost
    assert await resolves(store, "good2")
    assert sample(store.metrics.spill_failures, reason="corrupt") == 1
    await store.close()


async def test_torn_journal_tail_is_cut_and_counted(tmp_path: Path) -> None:
    store = await started(tmp_path)
    await chain(store, "c", 4)
    await store.abandon()
    path = journal_files(tmp_path)[1]
    size = path.stat().st_size
    os.truncate(path, size - 7)  # the last entry (c3's record) half written
    store = await started(tmp_path)
    assert sample(store.metrics.journal_cut) == 1
    assert await resolves(store, "c2")
    with pytest.raises(StoreFailure):
        store.lookup_nowait("scope-a", "c3")
    await chain(store, "d", 2)
    assert store.check() == []
    await store.close()
    store = await started(tmp_path)  # the tail was cut off the file: not met again
    assert sample(store.metrics.journal_cut) == 0
    assert await resolves(store, "c2") and await resolves(store, "d1")
    await store.close()


async def test_corrupt_entry_mid_journal_cuts_the_rest_of_its_file(tmp_path: Path) -> None:
    store = await started(tmp_path)
    await chain(store, "a", 2)
    a_end = store.journal.size if store.journal else 0
    await chain(store, "b", 3)
    await store.abandon()
    path = journal_files(tmp_path)[1]
    flip(path, a_end + 12)  # inside the first entry after a's turns
    store = await started(tmp_path)
    assert sample(store.metrics.journal_cut) == 1
    assert await resolves(store, "a1")
    for lost in ("b0", "b1", "b2"):
        with pytest.raises(StoreFailure):
            store.lookup_nowait("scope-a", lost)
    assert store.check() == []
    await store.close()


async def test_journal_without_checkpoint(tmp_path: Path) -> None:
    store = await started(tmp_path)
    await chain(store, "c", 5)
    assert store.delete_nowait("scope-a", "c4")
    await store.commit()
    await store.abandon()
    assert not (tmp_path / journal.CHECKPOINT).exists()
    store = await started(tmp_path)
    assert sorted(r.id for r in store.records()) == ["c0", "c1", "c2", "c3"]
    assert await resolves(store, "c3")
    await store.close()


async def test_a_bad_checkpoint_replays_the_whole_journal_and_keeps_every_file(
    tmp_path: Path,
) -> None:
    store = await started(tmp_path, checkpoint_bytes=1)
    await chain(store, "c", 3)
    assert await store.flush()
    await chain(store, "d", 2)
    await store.abandon()
    before = set(journal_files(tmp_path))
    (tmp_path / journal.CHECKPOINT).write_bytes(b"\x00garbage")
    store = await started(tmp_path)
    assert sample(store.metrics.snapshot_failures, reason="corrupt") == 1
    assert set(journal_files(tmp_path)) >= before  # nothing removed on a bad checkpoint
    assert await resolves(store, "d1")
    await store.close()


@pytest.mark.parametrize("step", ["moved", "checkpointed", "removed"])
async def test_crash_during_compaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """Compaction re-appends live segments, writes a checkpoint, then removes the old
    file: a crash after any step loses nothing committed and strands nothing for good."""
    store = await started(tmp_path, max_resident_bytes=100)
    await chain(store, "keep", 3)
    await chain(store, "gone", 6)
    assert await store.flush()  # file 1 is now before the checkpoint
    for i in range(6):
        store.delete_nowait("scope-a", f"gone{i}")
    await store.commit()
    old = set(journal_files(tmp_path))

    class Crash(Exception):
        pass

    def crash(*args: object) -> None:
        raise Crash

    if step == "moved":  # segments re-appended, no checkpoint yet
        monkeypatch.setattr(Journal, "write_checkpoint", crash)
    elif step == "checkpointed":  # checkpoint durable, old file still there
        monkeypatch.setattr(Journal, "remove", crash)
    if step == "removed":
        assert await store.flush()
        assert not old <= set(journal_files(tmp_path))  # the sparse file went
    else:
        with pytest.raises(Crash):
            await store.disk.checkpoint()
    monkeypatch.undo()
    await store.abandon()
    store = await started(tmp_path)
    assert sorted(r.id for r in store.records()) == ["keep0", "keep1", "keep2"]
    assert await resolves(store, "keep2")
    assert store.check() == []
    assert await store.flush()
    await store.close()
    everything = b"".join(p.read_bytes() for p in journal_files(tmp_path).values())
    assert b"gone turn" not in everything  # compacted away in the end


async def test_a_symlinked_journal_dir_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    (state / "journal").symlink_to(elsewhere)
    with pytest.raises(StateDirUnusable, match=f"state dir {state} cannot be used"):
        await started(state)
    assert os.listdir(elsewhere) == []


async def test_stale_temp_files_are_swept(tmp_path: Path) -> None:
    store = await started(tmp_path)
    await chain(store, "c", 2)
    await store.close()
    temp = tmp_path / ".checkpoint.abc.tmp"
    temp.write_bytes(b"half")
    store = await started(tmp_path)
    assert not temp.exists()
    assert await resolves(store, "c1")
    await store.close()


async def test_empty_journal_files_from_earlier_starts_are_removed(tmp_path: Path) -> None:
    """Each start appends to a new journal file; the empty ones earlier starts left are
    removed at the next, all but the last (file numbers only grow), and nothing is lost."""
    store = await started(tmp_path)
    await chain(store, "c", 2)
    await store.close()
    for _ in range(5):
        store = await started(tmp_path)
        await store.close()
    files_left = journal_files(tmp_path)
    assert sorted(p.stat().st_size == 0 for p in files_left.values()) == [False, True, True]
    store = await started(tmp_path)
    assert await resolves(store, "c1")
    await chain(store, "d", 2)
    assert store.journal is not None and store.journal.active > max(files_left)
    await store.close()
    store = await started(tmp_path)
    assert await resolves(store, "c1") and await resolves(store, "d1")
    assert store.check() == []
    await store.close()


async def test_the_preallocated_tail_of_a_killed_store_is_a_clean_end(tmp_path: Path) -> None:
    """The active journal file has room allocated past its last entry (so a commit's
    fdatasync need not touch metadata); after kill -9 those zeros are no torn tail."""
    import shutil

    store = await started(tmp_path / "live")
    await chain(store, "c", 3)
    path = journal_files(tmp_path / "live")[1]
    assert path.stat().st_size > store.journal.size if store.journal else False
    shutil.copytree(tmp_path / "live", tmp_path / "killed")  # the disk as kill -9 leaves it
    await store.close()
    assert path.stat().st_size == Journal(tmp_path / "live").load(repair=False).sizes[1]
    copy = await started(tmp_path / "killed")
    assert sample(copy.metrics.journal_cut) == 0
    assert await resolves(copy, "c2")
    assert copy.check() == []
    await copy.close()
