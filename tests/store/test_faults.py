"""Fault injection: each fault gives its typed outcome, is counted, never crashes the
store and never corrupts another chain."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import orjson
import pytest

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store import Store, files, snapshot
from tests.store.helpers import inline, make_store, make_turn, sample, spill_files


def chain(store: Store, prefix: str, n: int) -> None:
    parent = None
    for i in range(n):
        parent = store.put(make_turn(f"{prefix}{i}", f"{prefix} turn {i}"), parent)


async def resolves(store: Store, response_id: str) -> bool:
    history = await store.history(store.lookup("scope-a", response_id))
    items = orjson.loads(b"[" + b",".join(history) + b"]")
    prefix = response_id.rstrip("0123456789")
    n = int(response_id[len(prefix) :]) + 1
    return [i["content"] for i in items[::2]] == [f"{prefix} turn {k}" for k in range(n)]


async def reason_of(store: Store, response_id: str) -> FailureReason:
    with pytest.raises(StoreFailure) as info:
        await store.history(store.lookup("scope-a", response_id))
    return info.value.reason


async def started(tmp_path: Path, **overrides: object) -> Store:
    store = make_store(tmp_path, offload=inline, **overrides)
    await store.start()
    return store


async def test_disk_full_on_demotion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await started(tmp_path, max_resident_bytes=400)
    chain(store, "safe", 2)
    await store.flush()  # on disk before the fault

    def full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "write_all", full)
    chain(store, "doomed", 6)
    assert store.disk is not None
    await store.disk._write_pending()
    assert sample(store.metrics.spill_failures, reason="write_failed") > 0
    assert await reason_of(store, "doomed5") == FailureReason.WRITE_FAILED
    assert await resolves(store, "safe1")
    assert await store.flush() is False  # the snapshot cannot be written either
    assert sample(store.metrics.snapshot_failures, reason="write_failed") == 1
    assert not any(files.is_temp_name(n) for _, _, names in os.walk(tmp_path) for n in names)
    monkeypatch.undo()  # space again: the next snapshot goes through
    chain(store, "later", 3)
    assert await store.flush() is True
    await store.close()
    store = await started(tmp_path)
    assert await resolves(store, "safe1") and await resolves(store, "later2")
    assert store.check() == []


async def test_write_error_on_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await started(tmp_path, max_resident_bytes=300)

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken)
    chain(store, "c", 4)
    assert store.disk is not None
    await store.disk._write_pending()
    assert sample(store.metrics.spill_failures, reason="write_failed") > 0
    monkeypatch.undo()
    assert await reason_of(store, "c3") == FailureReason.WRITE_FAILED
    assert store.check() == []
    await store.close()


async def test_read_error_is_transient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await started(tmp_path, max_resident_bytes=300)
    chain(store, "c", 4)
    await store.flush()
    real = files.read_regular

    def broken(path: Path, limit: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(files, "read_regular", broken)
    assert await reason_of(store, "c3") == FailureReason.READ_FAILED
    assert sample(store.metrics.spill_failures, reason="read_failed") >= 1
    monkeypatch.setattr(files, "read_regular", real)
    assert await resolves(store, "c3")  # nothing was marked lost
    await store.close()


async def test_corrupt_file_fails_its_chains_only(tmp_path: Path) -> None:
    store = await started(tmp_path, max_resident_bytes=100)
    chain(store, "bad", 3)
    chain(store, "good", 3)
    await store.flush()
    victim = store.lookup("scope-a", "bad0").segments[0]
    path = spill_files(tmp_path)[victim.key]
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    assert await reason_of(store, "bad2") == FailureReason.CORRUPT
    assert await reason_of(store, "bad1") == FailureReason.CORRUPT  # same segment
    assert sample(store.metrics.spill_failures, reason="corrupt") == 1
    assert await resolves(store, "good2")
    await store.flush()
    await store.flush()
    assert victim.key not in spill_files(tmp_path)  # the bad file is cleared away
    assert store.check() == []
    await store.close()


async def test_deleted_spill_file_is_missing(tmp_path: Path) -> None:
    store = await started(tmp_path, max_resident_bytes=100)
    chain(store, "c", 3)
    chain(store, "d", 2)
    await store.flush()
    key = store.lookup("scope-a", "c1").segments[1].key
    spill_files(tmp_path)[key].unlink()
    assert await reason_of(store, "c2") == FailureReason.MISSING
    assert await resolves(store, "c0") and await resolves(store, "d1")
    await store.close()
    store = await started(tmp_path)
    assert await resolves(store, "d1") and await resolves(store, "c0")
    assert store.check() == []


async def test_file_lost_while_stopped_drops_only_its_chains(tmp_path: Path) -> None:
    store = await started(tmp_path)
    chain(store, "c", 3)
    chain(store, "d", 2)
    await store.close()
    key = store.lookup("scope-a", "c1").segments[1].key
    spill_files(tmp_path)[key].unlink()
    store = await started(tmp_path)
    with pytest.raises(StoreFailure) as info:
        store.lookup("scope-a", "c2")
    assert info.value.reason == FailureReason.MISSING
    assert sample(store.metrics.spill_failures, reason="missing") == 1
    assert await resolves(store, "c0") and await resolves(store, "d1")
    assert store.check() == []


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncate", "corrupt"),
        ("garbage", "corrupt"),
        ("symlink", "unsafe"),
        ("directory", "unsafe"),
        ("oversized", "too_large"),
    ],
)
async def test_bad_snapshot_starts_empty_and_keeps_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str, reason: str
) -> None:
    store = await started(tmp_path)
    chain(store, "c", 3)
    await store.close()
    state = tmp_path / "state.json"
    before = set(spill_files(tmp_path))
    if damage == "truncate":
        state.write_bytes(state.read_bytes()[:50])
    elif damage == "garbage":
        state.write_bytes(b"\x00\xff" * 10)
    elif damage == "symlink":
        (tmp_path / "elsewhere.json").write_bytes(state.read_bytes())
        state.unlink()
        state.symlink_to(tmp_path / "elsewhere.json")
    elif damage == "directory":
        state.unlink()
        state.mkdir()
    else:
        monkeypatch.setattr(snapshot, "MAX_BYTES", 10)
        monkeypatch.setattr(snapshot.load, "__defaults__", (10,))
    store = await started(tmp_path)
    assert len(store) == 0
    assert sample(store.metrics.snapshot_failures, reason=reason) == 1
    assert set(spill_files(tmp_path)) == before  # kept for an operator to look at
    chain(store, "n", 2)
    if damage == "directory":
        assert await store.flush() is False  # a directory is in the way; still serving
    else:
        assert await store.flush() is True
    assert await resolves(store, "n1")
    if damage == "symlink":
        assert (tmp_path / "elsewhere.json").read_bytes().startswith(b'{"format"')
        assert not state.is_symlink()  # replaced by the real index, target untouched
    await store.close()


async def test_symlinked_spill_entries_are_never_followed(tmp_path: Path) -> None:
    store = await started(tmp_path)
    chain(store, "c", 2)
    await store.close()
    key = store.lookup("scope-a", "c1").segments[1].key
    path = spill_files(tmp_path)[key]
    outside = tmp_path.parent / f"{tmp_path.name}-outside.zst"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)
    store = await started(tmp_path)
    with pytest.raises(StoreFailure):  # its chain is not served from a link
        store.lookup("scope-a", "c1")
    assert await resolves(store, "c0")
    assert not path.is_symlink() and not path.exists()  # the link went, not its target
    assert outside.exists()
    assert store.check() == []
    await store.close()


async def test_symlinked_spill_dir_runs_memory_only(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    (state / "spill").symlink_to(elsewhere)
    store = await started(state, max_resident_bytes=200)
    assert store.disk is not None and not store.disk.enabled
    assert sample(store.metrics.snapshot_failures, reason="unsafe") == 1
    chain(store, "c", 5)
    await store.close()
    assert os.listdir(elsewhere) == []


async def test_stale_temp_files_and_orphans_are_swept(tmp_path: Path) -> None:
    store = await started(tmp_path)
    chain(store, "c", 2)
    await store.close()
    orphan_dir = tmp_path / "spill" / "ab"
    orphan_dir.mkdir(exist_ok=True)
    orphan = orphan_dir / ("ab" + "0" * 62 + ".zst")
    orphan.write_bytes(b"whatever")
    temp = orphan_dir / ".abc.zst.123.tmp"
    temp.write_bytes(b"half")
    root_temp = tmp_path / ".state.json.1.tmp"
    root_temp.write_bytes(b"{")
    store = await started(tmp_path)
    assert not orphan.exists() and not temp.exists() and not root_temp.exists()
    assert await resolves(store, "c1")
    assert store.check() == []
    await store.close()
