"""What a checkpoint makes commits wait for. It goes to disk a slice at a time
(journal.CHECKPOINT_SYNC bytes between syncs), so a journal commit's fdatasync meanwhile
waits behind at most that much of it on the disk's queue, not the whole checkpoint (~28 MB
at 100,000 records: 0.3-1 s of flushing on a shared disk, every acknowledged turn waiting
through it). Its rotation to a new journal file, made while commits wait, does no I/O: the
new file is made beforehand and the old one sealed after."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ocxproxy.store.local import files, journal, upkeep
from ocxproxy.store.local.journal import Journal
from tests.store.helpers import checkpoint_ids, durable_ids, make_store, make_turn


async def test_a_checkpoint_is_synced_as_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path)
    await store.start()
    parent = None
    for i in range(600):
        parent = store.put(make_turn(f"r{i}", f"turn {i} " + "x" * 200), parent if i % 50 else None)
    await store.commit()
    slice_bytes = 8 * 1024
    monkeypatch.setattr(journal, "CHECKPOINT_SYNC", slice_bytes)
    monkeypatch.setattr(upkeep, "CHUNK", 20)  # rows encoded at a time: chunks under a slice
    unsynced: dict[int, int] = {}
    worst = [0]
    chunks: list[int] = []
    syncs = [0]
    real_write_all, real_fdatasync, real_fsync = files.write_all, os.fdatasync, os.fsync

    def write_all(fd: int, data: bytes) -> None:
        real_write_all(fd, data)
        unsynced[fd] = unsynced.get(fd, 0) + len(data)
        chunks.append(len(data))

    def synced(real: object, fd: int) -> None:
        worst[0] = max(worst[0], unsynced.pop(fd, 0))
        syncs[0] += 1
        real(fd)  # type: ignore[operator]

    monkeypatch.setattr(files, "write_all", write_all)
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced(real_fdatasync, fd))
    monkeypatch.setattr(os, "fsync", lambda fd: synced(real_fsync, fd))
    assert await store.flush()
    monkeypatch.undo()
    size = (tmp_path / journal.CHECKPOINT).stat().st_size
    assert size > 8 * slice_bytes
    assert max(chunks) < slice_bytes
    assert worst[0] < 2 * slice_bytes  # never more than about a slice waits for the disk
    assert syncs[0] >= size // (2 * slice_bytes)  # synced a slice at a time as it was written
    assert len(checkpoint_ids(tmp_path)) == 600  # and it is the whole checkpoint
    await store.close()


async def test_the_rotation_commits_wait_for_does_no_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path)
    await store.start()
    parent = None
    for i in range(5):
        parent = store.put(make_turn(f"a{i}", f"before {i}"), parent)
    await store.commit()
    calls: list[str] = []
    rotate = Journal.rotate
    names = ("open", "fsync", "fdatasync", "ftruncate", "posix_fallocate", "close")
    reals = {name: getattr(os, name) for name in names}

    def counted(name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls.append(name)
            return reals[name](*args)

        return call

    def watched(self: Journal) -> tuple[int, int]:
        for name in names:
            setattr(os, name, counted(name))
        try:
            return rotate(self)
        finally:
            for name in names:
                setattr(os, name, reals[name])

    monkeypatch.setattr(Journal, "rotate", watched)
    assert await store.flush()
    assert calls == []  # the new file was made before, the old one is sealed after
    for i in range(5, 8):
        parent = store.put(make_turn(f"a{i}", f"after {i}"), parent)
        await store.commit(parent)
    await store.close()
    assert durable_ids(tmp_path) == [f"a{i}" for i in range(8)]
    assert store.check() == []
