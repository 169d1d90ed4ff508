"""Background responses' files on one node (store/local/background.py): status lines
synced by the fsync helper, rewritten once the file has grown, ended streams' event logs
read back after a restart (a torn one refused), and all of it counted in
--max-disk-bytes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from ocxproxy.metrics import Metrics
from ocxproxy.store.background import Job
from ocxproxy.store.local import background
from ocxproxy.store.local.background import LocalBackgrounds
from tests.store.helpers import inline, make_store, make_turn, sample

pytestmark = pytest.mark.asyncio


def book(state: Path, **overrides: int) -> LocalBackgrounds:
    return LocalBackgrounds(
        Metrics(), state_dir=state, log_bytes=overrides.get("log_bytes", 1 << 20), ttl=3600
    )


def response(response_id: str, status: str) -> bytes:
    return orjson.dumps({"id": response_id, "status": status, "background": True})


def job(n: int, *, stream: bool = False) -> Job:
    return Job(f"resp_{n}", "scope", "queued", response(f"resp_{n}", "queued"), stream)


def event(kind: str, n: int, status: str = "in_progress") -> bytes:
    data = {"type": kind, "sequence_number": n, "response": {"id": "resp_1", "status": status}}
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def test_status_lines_are_synced_by_the_helper_not_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = book(tmp_path)
    await first.load()
    first.open(job(1))
    assert first._starting is not None
    await first._starting  # the helper process is up
    assert first._child is not None and not first._child.gone

    def no_thread(fd: int, data: bytes, at: int) -> None:
        raise AssertionError("synced in a thread")

    monkeypatch.setattr(background, "_pwrite", no_thread)
    for n in range(2, 6):
        first.open(job(n))
        await first.commit()
    cancelled = await first.get("scope", "resp_3")
    assert cancelled is not None
    first.moved(cancelled, "cancelled", response("resp_3", "cancelled"))
    await first.commit()
    await first.close()
    assert first._child is None

    again = book(tmp_path)
    await again.load()  # what was left queued is failed now; the cancelled one kept
    statuses = {key[1]: j.status for key, j in again.jobs.items()}
    assert statuses == {f"resp_{n}": "cancelled" if n == 3 else "failed" for n in range(1, 6)}
    await again.close()


async def test_the_file_is_rewritten_once_it_has_grown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(background, "REWRITE_BYTES", 4000)
    books = book(tmp_path)
    await books.load()
    for n in range(200):  # each opened, then ended as the store keeps it: nothing left
        one = job(n)
        books.open(one)
        books.moved(one, "in_progress")
        books.moved(one, "completed", response(one.id, "completed"))
        await books.commit()
    kept = job(1000)
    books.open(kept)
    await books.commit()
    size = (tmp_path / background.FILE).stat().st_size
    assert size == books.file_bytes
    assert size <= 2 * 4000
    await books.close()
    again = book(tmp_path)
    await again.load()
    assert [key[1] for key in again.jobs] == ["resp_1000"]
    assert again.jobs["scope", "resp_1000"].status == "failed"
    await again.close()


async def test_an_ended_stream_is_read_back_and_a_torn_one_refused(tmp_path: Path) -> None:
    books = book(tmp_path)
    await books.load()
    one = job(1, stream=True)
    books.open(one)
    events = [event("response.created", 0, "queued"), event("response.in_progress", 1)]
    events.append(event("response.completed", 2, "completed"))
    for data in events:
        books.append(one, data)
    books.moved(one, "completed", response("resp_1", "completed"))
    await books.close()
    (tmp_path / "background" / "resp_9.log").write_bytes(
        orjson.dumps({"id": "resp_9", "scope": "scope", "status": "completed", "ended": 1.0,
                      "sizes": [100]}) + b"\n" + b"short"
    )  # fmt: skip
    again = book(tmp_path)
    await again.load()
    read = await again.get("scope", "resp_1")
    assert read is not None and read.log is not None and read.log.closed
    assert read.log.events == events
    assert orjson.loads(read.response)["status"] == "completed"
    assert await again.get("scope", "resp_9") is None
    assert not (tmp_path / "background" / "resp_9.log").exists()
    assert (
        again.disk_bytes()
        == (tmp_path / "background" / "resp_1.log").stat().st_size
        + (tmp_path / background.FILE).stat().st_size
    )
    again.drop(read)
    await again.commit()  # (its log file goes within LOG_WRITE_DELAY, or at close)
    await again.close()
    assert not (tmp_path / "background" / "resp_1.log").exists()
    third = book(tmp_path)
    await third.load()
    assert await third.get("scope", "resp_1") is None
    await third.close()


async def test_background_files_count_in_max_disk_bytes(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_disk_bytes=60_000, max_resident_bytes=1, offload=inline)
    await store.start()
    for i in range(16):
        await store.commit(store.put(make_turn(f"t{i}", f"turn {i} words"), None))
    assert await store.flush()
    assert sample(store.metrics.store_evictions, reason="disk_bytes") == 0
    before = store.stats().disk_bytes
    store.count_on_disk(lambda: 50_000)  # background files past what the cap leaves
    assert store.stats().disk_bytes >= before + 50_000
    assert await store.flush()
    assert sample(store.metrics.store_evictions, reason="disk_bytes") > 0
    await store.close()


async def test_creates_arriving_during_a_sync_share_the_next_one_sent_at_once(
    tmp_path: Path,
) -> None:
    """A commit in flight does not hold up the next: the lines queued while it syncs go
    out at once, all in one write (one sync serves every create waiting), and each of
    those commits returns only once the lines before theirs are durable too."""
    books = book(tmp_path)
    await books.load()
    books.open(job(0))
    assert books._starting is not None
    await books._starting
    child = books._child
    assert child is not None
    sent: list[bytes] = []
    held = asyncio.Event()  # the first write lands (is answered) only once this is set
    real = child.write

    def counted(fd: int, key: int, data: bytes, offset: int) -> asyncio.Future[None]:
        sent.append(data)
        synced = real(fd, key, data, offset)
        if len(sent) > 1:
            return synced

        async def late() -> None:
            await synced
            await held.wait()

        return asyncio.ensure_future(late())

    child.write = counted  # type: ignore[method-assign]
    first = asyncio.ensure_future(books.commit())
    await until(lambda: len(sent) == 1)
    for n in range(1, 9):
        books.open(job(n))
    creates = [asyncio.ensure_future(books.commit()) for _ in range(8)]
    await until(lambda: len(sent) == 2)  # sent while the first one still syncs
    assert all(b'"resp_%d"' % n in sent[1] for n in range(1, 9))
    await asyncio.sleep(0.05)
    assert not first.done() and not any(create.done() for create in creates)
    held.set()
    await asyncio.gather(first, *creates)
    assert len(sent) == 2  # nine creates, two syncs
    await books.close()
    again = book(tmp_path)
    await again.load()
    assert sorted(key[1] for key in again.jobs) == sorted(f"resp_{n}" for n in range(9))
    await again.close()


@pytest.mark.timeout(20)
async def test_a_commit_waiting_for_flights_that_landed_lets_them_clear(tmp_path: Path) -> None:
    """Every write in flight has landed, but the callbacks that clear them have not run
    yet (a commit arriving between the two): the commit must yield to them, not spin on
    the event loop (which froze the whole proxy under concurrent creates)."""
    books = book(tmp_path)
    await books.load()
    books.open(job(0))
    await books.commit()  # the file is open
    loop = asyncio.get_running_loop()
    flights: list[asyncio.Future[None]] = []
    for _ in range(background.MAX_FLIGHTS):
        flights.append(loop.create_future())
        flights[-1].add_done_callback(books._landed)
        books._flights.append(flights[-1])
    books.open(job(1))
    committing = asyncio.ensure_future(books.commit())  # its first step runs first
    for flight in flights:
        flight.set_result(None)  # landed; their _landed run after the commit's step
    await asyncio.wait_for(committing, 10)
    assert not books._flights and not books._pending
    await books.close()
    again = book(tmp_path)
    await again.load()
    assert sorted(key[1] for key in again.jobs) == ["resp_0", "resp_1"]
    await again.close()


async def test_a_commit_does_not_wait_for_event_log_files_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ended streams' log files are written beside the status lines, not before them: a
    create is not held up by a slow disk writing someone else's log."""
    monkeypatch.setattr(background, "LOG_WRITE_DELAY", 0.0)
    writing, release = threading.Event(), threading.Event()
    write_logs = background._write_logs

    def slow(directory: Path, files: list[tuple[str, bytes | None]]) -> dict[str, int | None]:
        writing.set()
        release.wait(10)
        return write_logs(directory, files)

    monkeypatch.setattr(background, "_write_logs", slow)
    books = book(tmp_path)
    await books.load()
    ended = job(1, stream=True)
    books.open(ended)
    await books.commit()
    books.append(ended, event("response.created", 0, "queued"))
    books.moved(ended, "cancelled", response("resp_1", "cancelled"))
    await until(writing.is_set)  # its log file is being written (and stays so)
    books.open(job(2))
    try:
        async with asyncio.timeout(5):
            await books.commit()
    finally:
        release.set()
    await books.close()
    assert (tmp_path / "background" / "resp_1.log").exists()


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


async def test_a_running_streams_part_is_read_back_to_its_last_whole_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's events are appended to its .part as it runs; a process that died
    leaves it failed, its log the .part's whole events then its `response.failed`."""
    monkeypatch.setattr(background, "LOG_WRITE_DELAY", 0.01)
    books = book(tmp_path)
    await books.load()
    one = job(1, stream=True)
    books.open(one)
    await books.commit()
    events = [event("response.created", 0, "queued"), event("response.in_progress", 1)]
    events.append(event("response.output_text.delta", 2))
    books.append(one, *events)
    part = tmp_path / "background" / "resp_1.part"
    size = sum(len(b"%d\n" % len(data)) + len(data) for data in events)
    await until(lambda: part.exists() and part.stat().st_size == size)
    await books.close()  # (as a kill: the run never ended)
    with part.open("r+b") as file:
        file.truncate(size - 5)  # its last event's write torn
    again = book(tmp_path)
    await again.load()
    read = await again.get("scope", "resp_1")
    assert read is not None and read.status == "failed"
    assert read.log is not None and read.log.closed
    assert read.log.events[:2] == events[:2]
    assert len(read.log.events) == 3
    ended = orjson.loads(read.log.events[2].partition(b"data: ")[2])
    assert ended["type"] == "response.failed" and ended["sequence_number"] == 2
    assert ended["response"]["error"]["message"].startswith("background_lost")
    await again.close()
    assert not part.exists()
    assert (tmp_path / "background" / "resp_1.log").exists()
    third = book(tmp_path)  # and so it stays
    await third.load()
    kept = await third.get("scope", "resp_1")
    assert kept is not None and kept.log is not None and kept.log.events == read.log.events
    await third.close()


async def test_input_items_are_kept_as_its_own_and_its_parent_and_an_earlier_whole_reads(
    tmp_path: Path,
) -> None:
    """A create's line holds its own input items and the response it continues; a line an
    earlier version wrote, with the whole input, still reads (and is kept whole)."""
    first = book(tmp_path)
    await first.load()
    continuing = job(1)
    continuing.inputs, continuing.parent = b'{"role":"user","content":"own"}', "resp_parent"
    first.open(continuing)
    first.moved(continuing, "cancelled", response("resp_1", "cancelled"))
    await first.commit()
    whole = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "reply"}]
    old = {"id": "resp_2", "scope": "scope", "status": "failed", "input": whole}
    old["response"] = orjson.loads(response("resp_2", "failed"))
    with (tmp_path / background.FILE).open("ab") as file:
        file.write(orjson.dumps(old) + b"\n")
    await first.close()

    second = book(tmp_path)
    await second.load()
    loaded = await second.get("scope", "resp_1")
    assert loaded is not None and loaded.status == "cancelled"
    assert await second.inputs(loaded) == ("resp_parent", b'{"role":"user","content":"own"}')
    earlier = await second.get("scope", "resp_2")
    assert earlier is not None and earlier.status == "failed"
    kept = await second.inputs(earlier)
    assert kept is not None and kept[0] is None
    assert orjson.loads(b"[" + kept[1] + b"]") == whole
    await second.close()
    third = book(tmp_path)  # (rewritten at the load: the same again)
    await third.load()
    again = await third.get("scope", "resp_2")
    assert again is not None and await third.inputs(again) == kept
    await third.close()


async def test_a_whole_input_kept_after_its_delete_does_not_bring_it_back(
    tmp_path: Path,
) -> None:
    """A DELETE of the response a background one continues keeps that one's whole input
    after reading its chain: a DELETE of the background one that lands meanwhile wins, and
    a restart does not bring it back."""
    first = book(tmp_path)
    await first.load()
    ended = job(1)
    ended.inputs, ended.parent = b'{"role":"user","content":"own"}', "resp_parent"
    first.open(ended)
    first.moved(ended, "cancelled", response("resp_1", "cancelled"))
    first.drop(ended)
    await first.commit()
    await first.keep_whole(ended, "resp_parent", b'{"role":"user","content":"whole"}')
    await first.commit()
    assert await first.get("scope", "resp_1") is None
    await first.close()

    second = book(tmp_path)
    await second.load()
    assert await second.get("scope", "resp_1") is None
    await second.close()
