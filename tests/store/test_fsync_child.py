"""The journal's fsync helper process (store/local/syncer.py, store/local/fsync_child.py):
commits are written and synced by it (never on the event loop), its errors fail the commit,
the store falls back to a thread when it dies, and it never outlives the proxy."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from pathlib import Path

import pytest

from ocxproxy.errors import StoreFailure
from ocxproxy.store import Store
from ocxproxy.store.local import committer, files, journal, syncer
from ocxproxy.store.local.durable import StateDirUnusable
from ocxproxy.store.local.journal import Journal
from ocxproxy.store.local.syncer import ChildGone, FsyncChild
from tests.conftest import MakeProxy
from tests.fakes.backend import FakeBackend
from tests.serve import Serve
from tests.store.helpers import durable_ids, inline, make_store, make_turn


async def started(tmp_path: Path) -> Store:
    store = make_store(tmp_path, fsync_child=True)
    await store.start()
    return store


def child_of(store: Store) -> FsyncChild:
    assert store.disk is not None and store.disk.child is not None
    return store.disk.child


async def chain(store: Store, prefix: str, n: int) -> None:
    parent = None
    for i in range(n):
        parent = store.put(make_turn(f"{prefix}{i}", f"{prefix} turn {i}"), parent)
        await store.commit(parent)


def in_process_io_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise OSError(errno.EIO, "in-process write or fsync called")

    monkeypatch.setattr(os, "fdatasync", broken)
    monkeypatch.setattr(os, "pwrite", broken)


async def test_commits_are_written_and_synced_by_the_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event loop never writes a commit into the journal file itself: a pwrite into the
    page cache can block for hundreds of ms while the disk is busy."""
    store = await started(tmp_path)
    await chain(store, "warm", 1)  # the journal file has its room allocated
    in_process_io_fails(monkeypatch)  # only the helper can write and sync now
    await chain(store, "c", 5)
    assert durable_ids(tmp_path) == ["warm0", "c0", "c1", "c2", "c3", "c4"]
    monkeypatch.undo()
    child = child_of(store)
    await store.close()
    assert child.gone and child.proc.returncode == 0  # told to exit, and it did
    assert store.check() == []


async def test_the_helper_reports_a_failed_sync(tmp_path: Path) -> None:
    child = await asyncio.to_thread(FsyncChild.spawn)
    assert child is not None
    child.attach(asyncio.get_running_loop())
    read, write = os.pipe()
    try:
        with pytest.raises(OSError) as info:
            await child.write(write, 1, b"x", 0)  # pwrite to a pipe
        assert info.value.errno == errno.ESPIPE
        fd = os.open(tmp_path / "file", os.O_WRONLY | os.O_CREAT)
        try:
            big = os.urandom(3 << 20)  # more than the socket takes at once
            await asyncio.gather(child.write(fd, 2, big, 5), child.write(fd, 2, b"abcde", 0))
        finally:
            os.close(fd)
        assert (tmp_path / "file").read_bytes() == b"abcde" + big  # the next file: it works
    finally:
        os.close(read)
        os.close(write)
        child.close()
        await asyncio.to_thread(child.wait)
    with pytest.raises(ChildGone):
        child.write(0, 3, b"", 0)


async def test_a_failed_write_is_cut_back_and_the_store_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await started(tmp_path)
    await chain(store, "ok", 2)

    def no_space(self: FsyncChild, fd: int, key: int, data: bytes, at: int) -> object:
        future = asyncio.get_running_loop().create_future()  # the helper's answer
        future.set_exception(OSError(errno.ENOSPC, "No space left on device"))
        return future

    monkeypatch.setattr(FsyncChild, "write", no_space)
    record = store.put(make_turn("lost0", "lost"), None)
    with pytest.raises(StoreFailure):
        await store.commit(record)
    assert not store.available
    monkeypatch.undo()
    await chain(store, "after", 2)
    assert store.available
    await store.close()
    assert durable_ids(tmp_path) == ["ok0", "ok1", "after0", "after1"]


async def test_a_dead_helper_falls_back_to_a_thread(tmp_path: Path) -> None:
    store = await started(tmp_path)
    await chain(store, "a", 2)
    child = child_of(store)
    child.proc.kill()
    await asyncio.to_thread(child.proc.wait)
    await chain(store, "b", 3)  # the first commit meets the dead helper, then a thread syncs
    assert child.gone
    assert store.disk is not None and store.disk.committer is not None
    assert store.disk.committer.child is None
    assert durable_ids(tmp_path) == ["a0", "a1", "b0", "b1", "b2"]
    await store.close()


def helpers_of(pid: int) -> list[int]:
    """The fsync helpers `pid` started (its children running fsync_child.py)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"fsync_child.py" in cmdline:
            found.append(int(entry))
    return found


def exited(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited; its new parent reaps it
            return True
        time.sleep(0.02)
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
async def test_the_helper_never_outlives_the_proxy(
    backend: FakeBackend, tmp_path: Path, processes: list[Serve], how: signal.Signals
) -> None:
    proxy = Serve(backend.url, tmp_path / "state")
    processes.append(proxy)
    await proxy.start()
    client = proxy.client()
    await client.responses.create(model="m", input="one")
    await client.close()
    assert proxy.proc is not None
    (helper,) = helpers_of(proxy.proc.pid)
    await proxy.stop(how)
    assert await asyncio.to_thread(exited, helper, 10.0)


async def test_the_proxy_group_signal_does_not_stop_the_helper_early(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    """A SIGINT to the whole process group (Ctrl-C in a terminal) reaches the helper too: it
    ignores it, so the proxy's graceful stop still syncs through it."""
    handle = await make_proxy(backend.url)
    client = handle.client()
    await client.responses.create(model="m", input="before")
    child = child_of(handle.proxy.store)
    os.kill(child.proc.pid, signal.SIGINT)
    os.kill(child.proc.pid, signal.SIGTERM)
    await asyncio.sleep(0.2)
    assert child.proc.poll() is None
    r = await client.responses.create(model="m", input="after")
    assert not child.gone
    state_dir = handle.proxy.config.state_dir
    assert state_dir is not None and r.id in durable_ids(state_dir)


class HeldSyncs:
    """A stand-in for the helper (it writes at once) whose answers the test gives, in any
    order."""

    def __init__(self) -> None:
        self.asked: list[asyncio.Future[None]] = []

    def write(self, fd: int, key: int, data: bytes, at: int) -> asyncio.Future[None]:
        os.pwrite(fd, data, at)
        future = asyncio.get_running_loop().create_future()
        self.asked.append(future)
        return future


async def in_flight(store: Store, syncs: HeldSyncs, n: int) -> None:
    for _ in range(200):
        if len(syncs.asked) >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{len(syncs.asked)} commits in flight, not {n}")


async def with_held_syncs(tmp_path: Path) -> tuple[Store, HeldSyncs]:
    store = make_store(tmp_path, offload=inline)
    await store.start()
    await chain(store, "warm", 1)  # room allocated: the next commits go through the helper
    syncs = HeldSyncs()
    assert store.disk is not None and store.disk.committer is not None
    store.disk.committer.child = syncs  # type: ignore[assignment]
    return store, syncs


async def test_commits_in_flight_are_answered_in_order(tmp_path: Path) -> None:
    store, syncs = await with_held_syncs(tmp_path)
    first = store.put(make_turn("a0", "first"), None)
    waits_first = asyncio.ensure_future(store.commit(first))
    await in_flight(store, syncs, 1)
    second = store.put(make_turn("b0", "second"), None)  # written while the first is synced
    waits_second = asyncio.ensure_future(store.commit(second))
    await in_flight(store, syncs, 2)
    syncs.asked[1].set_result(None)  # the later sync returns first
    await asyncio.sleep(0.05)
    assert not waits_second.done() and not waits_first.done()
    syncs.asked[0].set_result(None)
    await asyncio.wait_for(asyncio.gather(waits_first, waits_second), 5)
    assert durable_ids(tmp_path) == ["warm0", "a0", "b0"]
    await store.close()
    assert store.check() == []


async def test_commits_to_the_helper_are_cut_without_the_committer_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit the helper writes is cut and sent by a plain callback, also the one queued
    while MAX_FLIGHTS are in flight (sent once the oldest lands): the committer task,
    whose wake-up costs more than the callback, is not woken for any of them."""
    store, syncs = await with_held_syncs(tmp_path)
    started: list[object] = []
    start = committer.Committer._start

    async def counted(self: committer.Committer) -> object:
        started.append(self)
        return await start(self)

    monkeypatch.setattr(committer.Committer, "_start", counted)
    waits = []
    for i in range(committer.MAX_FLIGHTS + 1):
        record = store.put(make_turn(f"t{i}", f"turn {i}"), None)
        waits.append(asyncio.ensure_future(store.commit(record)))
        await in_flight(store, syncs, min(i + 1, committer.MAX_FLIGHTS))
    await asyncio.sleep(0.05)
    assert len(syncs.asked) == committer.MAX_FLIGHTS  # the last one waits for room
    syncs.asked[0].set_result(None)
    await in_flight(store, syncs, committer.MAX_FLIGHTS + 1)
    for sync in syncs.asked[1:]:
        sync.set_result(None)
    await asyncio.wait_for(asyncio.gather(*waits), 5)
    assert started == []
    assert durable_ids(tmp_path) == ["warm0"] + [f"t{i}" for i in range(committer.MAX_FLIGHTS + 1)]
    await store.close()
    assert store.check() == []


async def test_a_failed_sync_fails_every_later_commit_in_flight(tmp_path: Path) -> None:
    store, syncs = await with_held_syncs(tmp_path)
    waits = []
    for i, name in enumerate(("a0", "b0", "c0")):
        record = store.put(make_turn(name, name), None)
        waits.append(asyncio.ensure_future(store.commit(record)))
        await in_flight(store, syncs, i + 1)
    syncs.asked[2].set_result(None)
    syncs.asked[1].set_result(None)
    syncs.asked[0].set_exception(OSError(errno.EIO, "Input/output error"))
    for wait in waits:  # the later two were synced, but their bytes follow the failed one's
        with pytest.raises(StoreFailure):
            await asyncio.wait_for(wait, 5)
    assert durable_ids(tmp_path) == ["warm0"]  # cut back to where the failed commit began
    assert not store.available
    # The cut took the file's room too: the next commit grows it, in a thread.
    await chain(store, "d", 1)
    assert store.available
    record = store.put(make_turn("e0", "after"), None)  # and this one is the helper's again
    waits_after = asyncio.ensure_future(store.commit(record))
    await in_flight(store, syncs, 4)
    syncs.asked[3].set_result(None)
    await asyncio.wait_for(waits_after, 5)
    assert durable_ids(tmp_path) == ["warm0", "d0", "e0"]
    await store.close()
    assert store.check() == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
async def test_a_store_whose_dir_is_unusable_leaves_no_helper(tmp_path: Path) -> None:
    # The helper starts while the dir loads; when the dir turns out locked, it goes.
    first = await started(tmp_path)
    second = make_store(tmp_path, fsync_child=True)
    with pytest.raises(StateDirUnusable):
        await second.start()
    assert not second.durable and second.disk is not None and second.disk.child is None
    assert helpers_of(os.getpid()) == [child_of(first).proc.pid]  # the first store's only
    await first.close()


async def test_turns_finishing_in_one_pass_share_the_commit_the_first_starts(
    tmp_path: Path,
) -> None:
    """With nothing in flight, a turn's own call starts its commit once the callbacks the
    event loop runs now are done: the turns that finish in the same pass share its fsync,
    and the commit is sent at the next pass (a lone client is never held back longer)."""
    store, syncs = await with_held_syncs(tmp_path)
    commits, waited = [], []
    for n in ("a", "b", "c"):  # three turns finish in one pass of the loop
        record = store.put(make_turn(f"{n}0", n), None)
        commits.append(store.commit(record))
        waited.append(commits[-1].send(None))  # runs until the turn waits
    assert syncs.asked == []  # nothing is sent before the pass ends
    await asyncio.sleep(0)  # the next pass
    assert len(syncs.asked) == 1  # one commit, one fsync, for the three
    syncs.asked[0].set_result(None)
    await asyncio.wait(waited, timeout=5)
    for commit in commits:
        with pytest.raises(StopIteration):
            commit.send(None)
    assert durable_ids(tmp_path) == ["warm0", "a0", "b0", "c0"]
    assert len(syncs.asked) == 1
    await store.close()


async def test_a_failed_commit_fails_every_turn_in_it(tmp_path: Path) -> None:
    store, syncs = await with_held_syncs(tmp_path)
    records = [store.put(make_turn(f"{n}0", n), None) for n in ("a", "b", "c")]
    waits = [asyncio.ensure_future(store.commit(record)) for record in records]
    await in_flight(store, syncs, 1)
    await asyncio.sleep(0.05)
    assert len(syncs.asked) == 1  # the three turns share one commit
    syncs.asked[0].set_exception(OSError(errno.EIO, "Input/output error"))
    for wait in waits:
        with pytest.raises(StoreFailure):
            await asyncio.wait_for(wait, 5)
    assert durable_ids(tmp_path) == ["warm0"]
    assert not store.available
    await chain(store, "d", 1)
    assert store.available
    await store.close()
    assert store.check() == []


async def test_turns_queued_behind_a_commit_share_the_next_one(tmp_path: Path) -> None:
    store, syncs = await with_held_syncs(tmp_path)
    first = store.put(make_turn("a0", "first"), None)
    waits = [asyncio.ensure_future(store.commit(first))]
    await in_flight(store, syncs, 1)
    later = [store.put(make_turn(f"{n}0", n), None) for n in ("b", "c")]
    waits += [asyncio.ensure_future(store.commit(record)) for record in later]
    await in_flight(store, syncs, 2)  # written while the first is synced, as one commit
    await asyncio.sleep(0.05)
    assert len(syncs.asked) == 2
    syncs.asked[0].set_result(None)
    syncs.asked[1].set_result(None)
    await asyncio.wait_for(asyncio.gather(*waits), 5)
    assert durable_ids(tmp_path) == ["warm0", "a0", "b0", "c0"]
    await store.close()
    assert store.check() == []


async def test_a_turn_cancelled_while_waiting_leaves_its_commit_alone(tmp_path: Path) -> None:
    """Each turn waits on a future of its own: cancelling one (its client went away) does
    not cancel the commit, nor the other turns waiting for it."""
    store, syncs = await with_held_syncs(tmp_path)
    records = [store.put(make_turn(f"{n}0", n), None) for n in ("a", "b")]
    waits = [asyncio.ensure_future(store.commit(record)) for record in records]
    await in_flight(store, syncs, 1)
    waits[0].cancel()
    await asyncio.sleep(0.01)
    syncs.asked[0].set_result(None)
    await asyncio.wait_for(waits[1], 5)
    assert waits[0].cancelled()
    assert durable_ids(tmp_path) == ["warm0", "a0", "b0"]
    await store.close()
    assert store.check() == []


async def test_the_journal_file_grows_ahead_of_its_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit that finds no room left in the journal file waits for every flight to land,
    then for the file's growth synced in a thread: every commit behind it waits too. The
    room grows ahead instead, in a thread, while commits go on through the helper; one that
    finds that thread late waits for it, then goes to the helper too, as does the new
    file's first (written past its end). Without growth ahead every one of the six or more
    growths would be a slow commit."""
    monkeypatch.setattr(journal, "PREALLOCATE", 16 * 1024)
    monkeypatch.setattr(committer, "GROW_BELOW", 12 * 1024)
    slow, grown = counted(monkeypatch, Journal, "write"), counted(monkeypatch, Journal, "grow")
    store = await started(tmp_path)
    await chain(store, "warm", 1)  # the new file's first commit, its room made behind it
    assert store.disk is not None and store.disk.journal is not None
    before = store.disk.journal.size
    await chain(store, "c", 400)
    appended = store.disk.journal.size - before
    assert appended > 6 * journal.PREALLOCATE  # it needed room six times or more
    assert slow[0] == 0 and grown[0] >= 6
    await store.close()
    assert store.check() == []
    assert len(durable_ids(tmp_path)) == 401


def counted(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    """A list whose one item counts the calls of `cls.name` from now on."""
    calls, original = [0], getattr(cls, name)

    def counting(*args: object) -> object:
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(cls, name, counting)
    return calls


async def test_the_first_commit_after_a_rotation_goes_to_the_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file a checkpoint rotates to has no room (none is made for a store that commits
    nothing after it): its first commit goes to the helper all the same, written past the
    file's end, not through a thread that allocates, writes and fsyncs while every turn
    behind it waits; the room is made past it, in a thread, while commits go on."""
    store = await started(tmp_path)
    await chain(store, "a", 2)
    assert await store.flush()
    j = store.disk.journal if store.disk is not None else None
    assert j is not None
    fresh = j.path(j.active)
    assert fresh.stat().st_size == 0  # no room before a commit comes
    in_process_io_fails(monkeypatch)  # only the helper can write and sync now
    await chain(store, "b", 3)
    monkeypatch.undo()
    assert durable_ids(tmp_path) == ["a0", "a1", "b0", "b1", "b2"]
    assert fresh.stat().st_size >= journal.PREALLOCATE  # the room, made behind the first
    await store.close()
    assert store.check() == []
    assert fresh.stat().st_size == j.size  # sealed without the room it did not use


async def test_a_full_disk_while_the_rotated_to_file_gets_its_room_leaves_a_working_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the room cannot be made behind the first commit of a file (the disk is full),
    that commit still counts, and the next one allocates the room itself once it can."""
    store = await started(tmp_path)
    await chain(store, "a", 1)
    assert await store.flush()
    assert store.disk is not None and store.disk.committer is not None
    committer_ = store.disk.committer

    def refused(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(files.fs, "posix_fallocate", refused)
        await chain(store, "b", 1)
        await committer_._grown()
    j = store.disk.journal
    assert j is not None and j.room() < 0  # its entry is past the (empty) room
    await chain(store, "c", 2)
    assert j.room() > 0
    assert durable_ids(tmp_path) == ["a0", "b0", "c0", "c1"]
    await store.close()
    assert store.check() == []


def writes_by_thread(pid: int) -> dict[int, int]:
    """The write system calls (pwrite among them) each thread of process `pid` made so far."""
    counts = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # (a thread that just ended)
            fields = Path(f"/proc/{pid}/task/{tid}/io").read_text().split()
            counts[int(tid)] = int(fields[fields.index("syscw:") + 1])
    return counts


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
async def test_commits_in_flight_go_down_lanes_of_their_own(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    """Commits in flight at once are each written and synced by a lane of their own, so
    their fdatasyncs run at once (a lane's thread syncs what it took before it reads the
    next): seen from outside the proxy, as the helper's threads' own write calls. The
    helper is stopped while four turns come one after another (each commit then waits in
    flight), and let go: each of its four threads wrote once, not one of them four times."""
    handle = await make_proxy(backend.url)
    client = handle.client()
    await client.responses.create(model="m", input="warm")  # the journal has its room
    store = handle.proxy.store
    assert isinstance(store, Store) and store.disk is not None
    assert store.disk.committer is not None
    helper = child_of(store).proc.pid
    assert len(os.listdir(f"/proc/{helper}/task")) == syncer.LANES
    before = writes_by_thread(helper)
    flights = store.disk.committer._flights  # (only to know when each commit is sent)
    turns = []
    os.kill(helper, signal.SIGSTOP)
    try:
        for n in range(syncer.LANES):
            turns.append(asyncio.ensure_future(client.responses.create(model="m", input=f"{n}")))
            for _ in range(1000):
                if len(flights) > n:
                    break
                await asyncio.sleep(0.005)
            assert len(flights) == n + 1, "each turn's commit is in flight on its own"
    finally:
        os.kill(helper, signal.SIGCONT)
    await asyncio.wait_for(asyncio.gather(*turns), 10)
    after = writes_by_thread(helper)
    wrote = sorted(after[tid] - before.get(tid, 0) for tid in after)
    assert wrote == [1] * syncer.LANES, wrote
