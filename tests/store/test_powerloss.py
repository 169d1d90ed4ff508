"""The power-loss layer itself (powerloss.py): what survives a simulated power loss is
exactly what was synced (file data by the file's fsync, names by their directory's), plus
what a mode lets through. Then the store on it: an acknowledged turn in a state dir the
store created itself survives."""

from __future__ import annotations

import asyncio
import errno
import os
import random
from pathlib import Path

import pytest

from ocxproxy.store.local import files, journal
from tests.store.helpers import durable_ids, inline, make_store, make_turn
from tests.store.powerloss import Mode, PowerLossFS, installed

FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL


@pytest.fixture
def layer(tmp_path: Path) -> PowerLossFS:
    return PowerLossFS(tmp_path, random.Random(1))


def write_file(layer: PowerLossFS, path: Path, data: bytes, *, sync: bool) -> None:
    fd = layer.open(path, FLAGS, 0o600)
    layer.write(fd, data)
    if sync:
        layer.fdatasync(fd)
    layer.close(fd)


def sync_dir(layer: PowerLossFS, path: Path) -> None:
    fd = layer.open(path, os.O_RDONLY | os.O_DIRECTORY)
    layer.fsync(fd)
    layer.close(fd)


def test_unsynced_data_and_names_are_lost(tmp_path: Path, layer: PowerLossFS) -> None:
    write_file(layer, tmp_path / "synced", b"kept", sync=True)
    write_file(layer, tmp_path / "unsynced", b"gone", sync=False)
    sync_dir(layer, tmp_path)
    write_file(layer, tmp_path / "no-dir-sync", b"data synced, name not", sync=True)
    assert (tmp_path / "unsynced").read_bytes() == b"gone"  # it reads back until the loss
    layer.lose(Mode.LOSE)
    layer.restore()
    assert sorted(os.listdir(tmp_path)) == ["synced", "unsynced"]
    assert (tmp_path / "synced").read_bytes() == b"kept"
    assert (tmp_path / "unsynced").read_bytes() == b""


def test_renames_and_unlinks_need_the_directory_sync(tmp_path: Path, layer: PowerLossFS) -> None:
    write_file(layer, tmp_path / "a", b"A", sync=True)
    write_file(layer, tmp_path / "b", b"B", sync=True)
    sync_dir(layer, tmp_path)
    layer.replace(tmp_path / "a", tmp_path / "c")
    layer.unlink(tmp_path / "b")
    assert sorted(os.listdir(tmp_path)) == ["c"]
    layer.lose(Mode.LOSE)
    layer.restore()
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]
    assert (tmp_path / "b").read_bytes() == b"B"


def test_truncation_and_allocation_need_the_file_sync(tmp_path: Path, layer: PowerLossFS) -> None:
    write_file(layer, tmp_path / "f", b"0123456789", sync=True)
    sync_dir(layer, tmp_path)
    fd = layer.open(tmp_path / "f", os.O_WRONLY)
    layer.posix_fallocate(fd, 0, 100)
    layer.fsync(fd)
    layer.ftruncate(fd, 4)
    layer.close(fd)
    layer.lose(Mode.LOSE)
    layer.restore()
    assert (tmp_path / "f").read_bytes() == b"0123456789" + bytes(90)


def test_prefix_keeps_some_unsynced_writes_in_order(tmp_path: Path) -> None:
    seen = set()
    for seed in range(40):
        layer = PowerLossFS(tmp_path, random.Random(seed))
        fd = layer.open(tmp_path / "f", FLAGS, 0o600)
        sync_dir(layer, tmp_path)
        for chunk in (b"aa", b"bb", b"cc"):
            layer.write(fd, chunk)
        layer.close(fd)
        layer.lose(Mode.PREFIX)
        layer.restore()
        seen.add((tmp_path / "f").read_bytes())
        os.unlink(tmp_path / "f")
    assert seen == {b"", b"aa", b"aabb", b"aabbcc"}


def test_torn_keeps_part_of_the_next_write(tmp_path: Path) -> None:
    seen = set()
    for seed in range(60):
        layer = PowerLossFS(tmp_path, random.Random(seed))
        fd = layer.open(tmp_path / "f", FLAGS, 0o600)
        sync_dir(layer, tmp_path)
        layer.write(fd, b"abcd")
        layer.close(fd)
        layer.lose(Mode.TORN)
        layer.restore()
        seen.add((tmp_path / "f").read_bytes())
        os.unlink(tmp_path / "f")
    assert seen == {b"", b"a", b"ab", b"abc", b"abcd"}


def test_armed_loss_fails_that_call_and_every_later_one(tmp_path: Path, layer: PowerLossFS) -> None:
    fd = layer.open(tmp_path / "f", FLAGS, 0o600)
    layer.write(fd, b"first")
    layer.fdatasync(fd)
    layer.arm(1)
    layer.write(fd, b"second")  # the call before the armed one goes through
    with pytest.raises(OSError) as failed:
        layer.fdatasync(fd)  # the power goes here: this sync never happened
    assert failed.value.errno == errno.EIO
    with pytest.raises(OSError):
        layer.write(fd, b"third")
    layer.close(fd)
    layer.restore()
    assert os.listdir(tmp_path) == []  # its directory was never synced


def test_acknowledged_turn_in_a_new_state_dir_survives_power_loss(tmp_path: Path) -> None:
    """The store creates the state dir (and its parent) itself: each new entry is synced
    in its directory, or a power loss takes the whole dir, and the turn, with it."""
    state = tmp_path / "parent" / "state"
    with installed(tmp_path, random.Random(0)) as layer:
        store = make_store(state, offload=inline)

        async def run() -> None:
            await store.start()
            record = store.put(make_turn("r1", "hello"), None)
            await store.commit(record)
            layer.lose(Mode.LOSE)
            await store.abandon()

        asyncio.run(run())
        layer.restore()
    assert durable_ids(state) == ["r1"]
    assert files.fs is os


class Crash(BaseException):
    """The process dies here."""


def test_what_start_up_replays_is_made_durable_before_it_is_built_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that died between a commit's write and its sync leaves the entries in
    the page cache: the next start replays them, and a turn acknowledged on top of them
    must not depend on bytes a power loss takes away. (With no room allocated ahead, the
    file ends where the entries do: no zeros after them for start-up to cut.)"""
    monkeypatch.setattr(journal, "PREALLOCATE", 1)
    state = tmp_path / "state"
    with installed(tmp_path, random.Random(0)) as layer:

        async def crashed_mid_commit() -> None:
            store = make_store(state, offload=inline)
            await store.start()
            await store.commit(store.put(make_turn("r1", "one"), None))
            real = layer.fsync

            def die(fd: int) -> None:
                raise Crash

            layer.fsync = die  # type: ignore[method-assign]
            store.put(make_turn("r2", "two"), store.lookup_nowait("scope-a", "r1"))
            assert store._committer is not None
            try:
                await store._committer.write()
            except Crash:
                pass
            finally:
                layer.fsync = real  # type: ignore[method-assign]
            with layer.process_dead():
                await store.abandon()

        async def continued_then_power_lost() -> None:
            store = make_store(state, offload=inline)
            await store.start()
            parent = store.lookup_nowait("scope-a", "r2")  # replayed from the page cache
            await store.commit(store.put(make_turn("r3", "three"), parent))
            layer.lose(Mode.LOSE)
            await store.abandon()

        asyncio.run(crashed_mid_commit())
        asyncio.run(continued_then_power_lost())
        layer.restore()
    assert durable_ids(state) == ["r1", "r2", "r3"]
