"""Large segments in digest-named files of their own: written before the journal entry that
names them, checkable with sha256sum, read back with a digest check (a mismatch is a typed,
counted failure), removed once a durable checkpoint no longer needs them, never copied by
compaction, never written for store:false."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
import zstandard

from ocxproxy.cli import main
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import Record, Segment
from ocxproxy.store import Store
from ocxproxy.store.local import journal, segment_files
from ocxproxy.store.local.segments import SegmentTable
from tests.store.helpers import inline, journal_files, make_store, make_turn, sample

LARGE = 1024  # compressed bytes from which a segment gets its own file, in these tests


def noise(n: int, seed: int) -> str:
    """`n` characters zstd cannot shrink much: a large segment's worth of them."""
    return random.Random(seed).randbytes(n // 2).hex()


def own_files(state: Path) -> dict[str, Path]:
    return {p.name.removesuffix(".zst"): p for p in (state / "segments").glob("*.zst")}


def journal_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in journal_files(state).values())


def new_store(state: Path, **overrides: object) -> Store:
    return make_store(state, offload=inline, large_segment_bytes=LARGE, **overrides)


async def history_of(store: Store, record_id: str, scope: str = "scope-a") -> list[bytes]:
    return await store.history(store.lookup_nowait(scope, record_id))


def test_a_large_segment_is_its_own_file_named_by_its_digest(tmp_path: Path) -> None:
    """Committed: the file is there, named by the SHA-256 of the segment's bytes (checked
    with the sha256sum and zstd commands where the machine has them), and the journal
    holds its entry, not its bytes. A restart reads the chain back from the file."""
    big = noise(40_000, 1)

    turn = make_turn("r1", big)

    async def run() -> str:
        store = new_store(tmp_path)
        await store.start()
        record = store.put(turn, None)
        await store.commit(record)
        await store.close()
        return record.segments[-1].key

    key = asyncio.run(run())
    assert list(own_files(tmp_path)) == [key]
    path = own_files(tmp_path)[key]
    assert (
        hashlib.sha256(zstandard.ZstdDecompressor().decompress(path.read_bytes())).hexdigest()
        == key
    )
    if shutil.which("zstd") and shutil.which("sha256sum"):
        out = subprocess.run(
            f"zstd -dc {path} | sha256sum", shell=True, capture_output=True, check=True, text=True
        ).stdout
        assert out.split()[0] == key
    assert journal_bytes(tmp_path) < 5_000 < path.stat().st_size  # the bytes are not there twice
    assert os.stat(path).st_mode & 0o777 == 0o600

    async def reopen() -> list[bytes]:
        store = new_store(tmp_path)
        await store.start()
        try:
            return await history_of(store, "r1")
        finally:
            await store.close()

    assert asyncio.run(reopen()) == [turn.items]


def test_small_segments_stay_in_the_journal(tmp_path: Path) -> None:
    async def run() -> None:
        store = new_store(tmp_path)
        await store.start()
        await store.commit(store.put(make_turn("r1", "a short turn " * 20), None))
        await store.close()

    asyncio.run(run())
    assert own_files(tmp_path) == {}


async def test_a_large_segment_is_compressed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit with a large segment, which the fsync helper cannot write, is encoded
    when its turn's own commit call tries to send it at once, then written by the
    committer in a thread: with the encoding kept, each segment is compressed once, also
    the turns' that joined it meanwhile (each of their commit calls tries again), and
    those queued after it was encoded are encoded after it."""
    compressed: list[int] = []
    real, response = journal.compress, journal.response_blob

    def counting(data: bytes) -> bytes:
        compressed.append(len(data))
        return real(data)

    def counting_response(data: bytes) -> bytes:
        compressed.append(len(data))
        return response(data)

    monkeypatch.setattr(journal, "compress", counting)
    monkeypatch.setattr(journal, "response_blob", counting_response)
    store = make_store(tmp_path, large_segment_bytes=LARGE, fsync_child=True)
    await store.start()
    big = store.put(make_turn("r1", noise(20_000, 3)), None)  # ~40 KB: encoded on the loop
    turns = [make_turn(f"s{n}", f"small {n}") for n in range(3)]
    small = [store.put(turn, None) for turn in turns[:2]]
    # Each turn's commit call, run until it waits (as the proxy calls it, in the step that
    # put the turn): each tries to send what is queued at once.
    commits = [store.commit(record) for record in (big, *small)]
    waited = [commit.send(None) for commit in commits]
    small.append(store.put(turns[2], None))  # joins after the first entries were encoded
    commits.append(store.commit(small[-1]))
    waited.append(commits[-1].send(None))
    await asyncio.wait(waited, timeout=10)
    for commit in commits:
        with pytest.raises(StopIteration):
            commit.send(None)
    sizes = [s.size for r in (big, *small) for s in r.segments] + [
        r.response_size for r in (big, *small)
    ]
    assert sorted(compressed) == sorted(sizes)  # each segment and response once
    assert list(own_files(tmp_path)) == [big.segments[-1].key]
    await store.close()
    reopened = new_store(tmp_path)
    await reopened.start()
    assert await history_of(reopened, "r1") == await history_of(store, "r1")
    for turn in turns:
        assert await history_of(reopened, turn.response_id) == [turn.items]
    await reopened.close()
    assert reopened.check() == []


def test_store_false_never_writes_one(tmp_path: Path) -> None:
    async def run() -> None:
        store = new_store(tmp_path)
        await store.start()
        store.put(make_turn("r1", noise(40_000, 2), durable=False), None)
        await store.flush()
        await store.close()

    asyncio.run(run())
    assert own_files(tmp_path) == {}


def test_a_corrupt_file_is_a_counted_failure_never_wrong_bytes(tmp_path: Path) -> None:
    """One flipped byte in the file: the chain answers CORRUPT (counted under
    ocxproxy_spill_failures_total{reason="corrupt"}), and `state verify` names it."""

    async def fill() -> str:
        store = new_store(tmp_path)
        await store.start()
        record = store.put(make_turn("r1", noise(40_000, 3)), None)
        await store.commit(record)
        await store.close()
        return record.segments[-1].key

    key = asyncio.run(fill())
    path = own_files(tmp_path)[key]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    assert main(["state", "verify", "--state-dir", str(tmp_path)]) == 1

    async def read() -> float:
        store = new_store(tmp_path)
        await store.start()
        try:
            with pytest.raises(StoreFailure) as failure:
                await history_of(store, "r1")
            assert failure.value.reason == FailureReason.CORRUPT
            return sample(store.metrics.spill_failures, reason="corrupt")
        finally:
            await store.close()

    assert asyncio.run(read()) == 1
    path.unlink()  # gone altogether: MISSING, as a journal file would be
    assert main(["state", "verify", "--state-dir", str(tmp_path)]) == 1


def test_verify_reads_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def fill() -> None:
        store = new_store(tmp_path)
        await store.start()
        await store.commit(store.put(make_turn("r1", noise(40_000, 4)), None))
        await store.flush()  # named by the checkpoint too
        await store.close()

    asyncio.run(fill())
    assert main(["state", "verify", "--state-dir", str(tmp_path)]) == 0
    assert "segment files  1 (" in capsys.readouterr().out


def test_a_file_goes_only_once_a_durable_checkpoint_no_longer_needs_it(tmp_path: Path) -> None:
    """A DELETE leaves the file until the next checkpoint is durable; then it is removed.
    A file that outlives its entry (a crash before the removal) is removed at start-up."""

    async def run() -> None:
        store = new_store(tmp_path)
        await store.start()
        keep = store.put(make_turn("keep", noise(40_000, 5)), None)
        gone = store.put(make_turn("gone", noise(40_000, 6)), None)
        await store.commit()
        assert len(own_files(tmp_path)) == 2
        assert store.delete_nowait("scope-a", "gone")
        await store.commit()
        assert gone.segments[-1].key in own_files(tmp_path)  # the index that drops it is not
        assert await store.flush()
        assert list(own_files(tmp_path)) == [keep.segments[-1].key]
        assert store.check() == []
        await store.close()

    asyncio.run(run())
    orphan = segment_files.path(tmp_path, "ab" * 32)
    orphan.write_bytes(b"left by a crash")

    async def restart() -> None:
        store = new_store(tmp_path)
        await store.start()
        assert store.check() == []
        await store.close()

    asyncio.run(restart())
    assert not orphan.exists()


def test_a_file_written_after_its_turn_was_deleted_goes_too(tmp_path: Path) -> None:
    """A turn deleted before its commit lands: the commit still writes the large
    segment's file, and that file is removed as any unneeded one is (after the next
    durable checkpoint), never left on disk unknown to the store."""

    async def run() -> None:
        store = new_store(tmp_path)
        await store.start()
        gone = store.put(make_turn("gone", noise(40_000, 8)), None)
        assert store.delete_nowait("scope-a", "gone")  # before its commit is written
        await store.commit()
        assert gone.segments[-1].key in own_files(tmp_path)
        assert store.check() == []
        assert await store.flush()
        assert own_files(tmp_path) == {}
        assert store.check() == []
        await store.close()

    asyncio.run(run())


def test_the_same_bytes_again_after_a_delete(tmp_path: Path) -> None:
    """The same large content deleted and stored again before the checkpoint: the
    checkpoint's removal leaves the file the new turn needs."""
    big = noise(40_000, 7)

    async def run() -> None:
        store = new_store(tmp_path)
        await store.start()
        await store.commit(store.put(make_turn("a", big, answer="same"), None))
        assert store.delete_nowait("scope-a", "a")
        await store.commit()
        await store.commit(store.put(make_turn("b", big, answer="same"), None))
        assert await store.flush()
        assert len(own_files(tmp_path)) == 1
        await store.close()
        store = new_store(tmp_path)
        await store.start()
        assert (await history_of(store, "b"))[0].startswith(b'{"role":"user"')
        assert store.check() == []
        await store.close()

    asyncio.run(run())


def test_compaction_never_copies_a_large_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Journal files made sparse by deletes are compacted (their live segments copied
    into the journal again): bytes of large segments copied = 0, and their files are the
    ones first written (same inode, same mtime)."""
    moved: dict[str, int] = {}  # key -> compressed bytes compaction copied
    move = SegmentTable.move

    def counted(self: SegmentTable, segment, blob, pack, offset):  # type: ignore[no-untyped-def]
        if blob is not None and segment.pack == pack and segment.offset == offset:
            moved[segment.key] = moved.get(segment.key, 0) + len(blob)
        move(self, segment, blob, pack, offset)

    monkeypatch.setattr(SegmentTable, "move", counted)

    async def run() -> None:
        store = new_store(tmp_path, checkpoint_bytes=4096)
        await store.start()
        records: list[Record] = []
        for i in range(60):
            text = noise(6_000, 100 + i) if i % 3 == 0 else f"small turn {i} " * 20
            records.append(store.put(make_turn(f"r{i}", text), None))
            await store.commit()
        before = {
            k: (p.stat().st_ino, p.stat().st_mtime_ns) for k, p in own_files(tmp_path).items()
        }
        assert len(before) == 20
        await store.flush()
        for i in range(60):
            if i % 3 and i % 4:  # most small ones go: their files turn sparse
                assert store.delete_nowait("scope-a", f"r{i}")
        await store.commit()
        for _ in range(3):
            await store.flush()
        after = {k: (p.stat().st_ino, p.stat().st_mtime_ns) for k, p in own_files(tmp_path).items()}
        assert after == before
        assert store.check() == []
        await store.close()

    asyncio.run(run())
    large = set(own_files(tmp_path))
    assert sum(moved.values()) > 0  # compaction ran
    assert sum(n for k, n in moved.items() if k in large) == 0


def test_state_gc_removes_only_files_nothing_needs(tmp_path: Path) -> None:
    """`ocxproxy state gc` on a stopped proxy's dir: a segment file no record needs goes,
    the one a record needs stays."""

    async def fill() -> str:
        store = new_store(tmp_path)
        await store.start()
        record = store.put(make_turn("r1", noise(40_000, 8)), None)
        await store.commit(record)
        await store.close()
        return record.segments[-1].key

    key = asyncio.run(fill())
    orphan = segment_files.path(tmp_path, "cd" * 32)
    orphan.write_bytes(b"named by no entry")
    assert main(["state", "gc", "--state-dir", str(tmp_path)]) == 0
    assert not orphan.exists()
    assert list(own_files(tmp_path)) == [key]


def test_a_large_response_is_its_own_file_not_in_its_record_entry(tmp_path: Path) -> None:
    """A response object that is a large segment's worth compressed (long instructions
    and tools echoed back) is not kept in its record's journal entry, which compaction
    copies, but as a segment with a file of its own; it reads back, also after a restart.
    One that compresses well below that stays in its record's entry."""
    turn = make_turn("big", "a short question")
    response = orjson.loads(turn.response)
    response["instructions"] = noise(6_000, 7)
    big = replace(turn, response=orjson.dumps(response))

    async def run() -> bytes:
        store = new_store(tmp_path)
        await store.start()
        record = store.put(big, None)
        small = store.put(make_turn("small", "another"), None)
        repetitive = orjson.loads(turn.response)
        repetitive["instructions"] = "Follow the repository's conventions. " * 80  # ~3 KB
        compressible = store.put(
            replace(turn, response_id="rep", response=orjson.dumps(repetitive)), None
        )
        await store.commit()
        assert isinstance(record.response, Segment) and record.response.key in own_files(tmp_path)
        assert type(small.response) is int  # a usual response stays in its record's entry
        assert type(compressible.response) is int  # and so does one that shrinks well
        answer = await store.response_bytes(record)
        await store.close()
        reopened = new_store(tmp_path)
        await reopened.start()
        again = await reopened.response_bytes(reopened.lookup_nowait("scope-a", "big"))
        assert reopened.check() == []
        await reopened.close()
        assert again == answer
        return answer

    assert orjson.loads(asyncio.run(run()))["instructions"] == response["instructions"]
