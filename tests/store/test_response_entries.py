"""A durable record's response is kept in its record's journal entry (REC), not as a
segment of its own, and in memory only as where it is once that entry is committed. State
dirs written before (each response a SEG entry that the record's PUT row names by sid, in
the journal and in the checkpoint) still load, serve and continue, and `state verify`
checks both kinds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import zstandard

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import Segment, Turn, unplace
from ocxproxy.store.compression import compressor
from ocxproxy.store.local import admin, codec
from ocxproxy.store.local.codec import PUT, SEG
from ocxproxy.store.local.journal import Journal
from ocxproxy.store.output import split_output
from tests.store.helpers import inline, journal_files, make_store, make_turn


def turn(chain: str, n: int) -> Turn:
    return make_turn(f"{chain}{n}", f"turn {n} of {chain}")


def write_legacy_state(root: Path, chains: int, turns: int) -> dict[str, bytes]:
    """A state dir in the format before REC entries, as that release wrote it: for each
    turn a SEG entry of its items and one of its response object, then a PUT row naming
    the response by sid (and its chain by its parent's row). The first half of each chain
    is in a checkpoint (its SEGS rows list the response segments too), the rest in the
    journal after it. Returns each record's response object."""
    j = Journal(root)
    j.prepare()
    j.open_next()
    now, sid = time.time(), 0
    responses: dict[str, bytes] = {}
    segs: list[list[Any]] = []
    recs: list[list[Any]] = []

    def commit(turns_here: range, into_checkpoint: bool) -> None:
        nonlocal sid
        jobs: list[tuple[int, Any]] = []
        rows: list[list[Any]] = []
        kept: list[Segment] = []
        for c in range(chains):
            for n in turns_here:
                t = turn(f"c{c}-", n)
                skeleton, output_at = split_output(t.response, t.items)
                own = Segment(t.items, t.n_items, t.call_ids, durable=True)
                response = Segment(skeleton, 0, frozenset(), durable=True)
                for segment in (own, response):
                    sid += 1
                    segment.sid = sid
                    jobs.append((SEG, (codec.segment_row(segment), segment.data, None)))
                    kept.append(segment)
                chain: Any = ["^", f"c{c}-{n - 1}", own.sid] if n else [own.sid]
                row = [t.response_id, t.scope, now, now + 3600, chain, response.sid,
                       output_at, None, None, 2 * (n + 1), True]  # fmt: skip
                jobs.append((PUT, orjson.dumps(row)))
                rows.append(row)
                responses[t.response_id] = t.response
        places = j.append(jobs)
        if into_checkpoint:
            seg_places = [p for p in places if p is not None]
            for segment, (pack, offset, length) in zip(kept, seg_places, strict=True):
                segs.append([*codec.segment_row(segment), pack, offset, length])
            recs.extend(rows)

    half = turns // 2
    commit(range(half), into_checkpoint=True)
    position = j.rotate()
    j.seal_retired()
    # The checkpoint's rows list their chains whole (each turn's own segment's sid).
    own_sids = {row[0]: row[4][-1] for row in recs}
    for row in recs:
        c, n = row[0].rsplit("-", 1)
        row[4] = [own_sids[f"{c}-{k}"] for k in range(int(n) + 1)]
    chunks = [
        codec.encode_head(position, time.time(), sid + 1),
        codec.encode_chunk(codec.SEGS, segs),
        codec.encode_chunk(codec.RECS, recs),
        codec.encode_end(len(segs), len(recs)),
    ]
    j.write_checkpoint(chunks)
    commit(range(half, turns), into_checkpoint=False)
    j.close()
    return responses


async def test_a_state_dir_with_responses_as_segments_loads_serves_and_continues(
    tmp_path: Path,
) -> None:
    expected = write_legacy_state(tmp_path, chains=3, turns=6)
    report, problems = admin.verify(tmp_path)
    assert problems == [] and not report.missing and len(report.loaded.records) == 18
    store = make_store(tmp_path, offload=inline)
    await store.start()
    assert len(store) == 18 and store.check() == []
    for rid, response in expected.items():
        record = store.lookup_nowait("scope-a", rid)
        assert isinstance(record.response, Segment)  # as it was written
        assert await store.response_bytes(record) == response
    # A new turn on an old chain: the history is the old turns' items, then its own.
    parent = store.lookup_nowait("scope-a", "c1-5")
    child = store.put(turn("c1-", 6), parent)
    await store.commit(child)
    assert type(child.response) is int  # the new turn's response: in its own entry
    history = orjson.loads(b"[" + b",".join(await store.history(child)) + b"]")
    assert [i["content"] for i in history[::2]] == [f"turn {n} of c1-" for n in range(7)]
    assert store.check() == []
    assert await store.flush()  # a checkpoint in the new format, of both kinds
    await store.close()

    reopened = make_store(tmp_path, offload=inline)
    await reopened.start()
    assert len(reopened) == 19 and reopened.check() == []
    for rid, response in expected.items():
        assert await reopened.response_bytes(reopened.lookup_nowait("scope-a", rid)) == response
    child = reopened.lookup_nowait("scope-a", "c1-6")
    assert await reopened.response_bytes(child) == turn("c1-", 6).response
    await reopened.close()
    report, problems = admin.verify(tmp_path)
    assert problems == [] and report.checked == 19 * 2  # each record's item and response


async def test_a_committed_response_is_only_its_place_in_memory(tmp_path: Path) -> None:
    store = make_store(tmp_path, offload=inline)
    await store.start()
    parent = None
    for n in range(5):
        parent = store.put(turn("r", n), parent)
        assert type(parent.response) is bytes  # its bytes, until its entry is committed
    await store.commit(parent)
    records = store.records()
    assert all(type(r.response) is int for r in records)
    assert len(store.segments()) == 5  # the turns' items only
    for n, record in enumerate(records):
        assert await store.response_bytes(record) == turn("r", n).response
    assert store.check() == []
    await store.close()


async def test_memory_only_records_keep_their_response_as_a_segment() -> None:
    store = make_store(None)
    record = store.put(turn("m", 0), None)
    assert isinstance(record.response, Segment) and record.response.data is not None
    assert await store.response_bytes(record) == turn("m", 0).response


async def test_compaction_moves_responses_and_the_sparse_file_goes(tmp_path: Path) -> None:
    """Responses in a sparse journal file are re-appended (RSP entries) before the file is
    removed; they read back, also after a restart, and `state verify` finds no problem."""
    store = make_store(tmp_path, offload=inline)
    await store.start()
    keep = [store.put(turn("keep", n), None) for n in range(3)]
    gone = [store.put(turn("gone", n), None) for n in range(30)]
    await store.commit()
    first = unplace(keep[0].response)[0]  # type: ignore[arg-type]
    await store.flush()
    for record in gone:
        assert store.delete_nowait("scope-a", record.id)
    await store.commit()
    await store.flush()  # compacts the sparse file
    await store.flush()  # and removes it once a checkpoint no longer needs it
    assert first not in journal_files(tmp_path)
    assert all(unplace(r.response)[0] != first for r in keep)  # type: ignore[arg-type]
    for n, record in enumerate(keep):
        assert await store.response_bytes(record) == turn("keep", n).response
    assert store.check() == []
    await store.close()
    report, problems = admin.verify(tmp_path)
    assert problems == [] and len(report.responses) == 3
    reopened = make_store(tmp_path, offload=inline)
    await reopened.start()
    for n in range(3):
        record = reopened.lookup_nowait("scope-a", f"keep{n}")
        assert await reopened.response_bytes(record) == turn("keep", n).response
    assert reopened.check() == []
    await reopened.close()


async def test_verify_finds_a_corrupt_response(tmp_path: Path) -> None:
    store = make_store(tmp_path, offload=inline)
    await store.start()
    record = store.put(turn("r", 0), None)
    await store.commit(record)
    pack, offset, length, _ = unplace(record.response)  # type: ignore[arg-type]
    await store.close()
    assert admin.verify(tmp_path)[1] == []
    path = journal_files(tmp_path)[pack]
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x01  # inside the response's compressed bytes
    path.write_bytes(bytes(data))
    # The entry's crc no longer matches: replay stops there (a torn or corrupt tail).
    _, problems = admin.verify(tmp_path)
    assert any("torn or corrupt journal" in p for p in problems)


@pytest.mark.parametrize("data", [b'{"id":"r","output":[]}', b'{"id":"r","output":[]}' * 60])
def test_a_response_blob_is_checked_by_its_checksum(data: bytes) -> None:
    """Read back at its place, a response whose bytes changed is CORRUPT, not served: a
    small one's (its bytes and their CRC-32) as a large one's (a zstd frame)."""
    blob = codec.response_blob(data)
    assert codec.decode_response(len(data), blob) == data
    for at in (0, len(blob) // 2, len(blob) - 6, len(blob) - 1):
        changed = bytearray(blob)
        changed[at] ^= 0x01
        with pytest.raises(StoreFailure) as failure:
            codec.decode_response(len(data), bytes(changed))
        assert failure.value.reason == FailureReason.CORRUPT
    with pytest.raises(StoreFailure):  # (another size than the entry says)
        codec.decode_response(len(data) + 1, blob)
    unchecked = compressor().compress(b"x" * 440)
    with pytest.raises(StoreFailure):
        codec.decode_response(440, unchecked)


def test_a_small_response_is_stored_as_it_is_a_large_one_compressed() -> None:
    """A turn's Response without its output (a few hundred bytes) costs the event loop
    little to store: its bytes as they are, checksummed. A large one is a zstd frame.
    Both are read back checked, and so are the blobs state dirs written before hold
    (zstd frames at level 1, or at its fastest level)."""
    small = orjson.dumps(
        {
            "id": "resp_0f3c9a1e",
            "object": "response",
            "created_at": 1764930000,
            "status": "completed",
            "model": "smollm2",
            "output": [],
            "usage": {
                "input_tokens": 8123,
                "input_tokens_details": {"cached_tokens": 8064},
                "output_tokens": 57,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 8180,
            },
            "previous_response_id": "resp_7d21b04c",
            "completed_at": 1764930002,
        }
    )
    large = small * 20
    assert len(small) < codec.SMALL_RESPONSE <= len(large)
    assert codec.response_blob(small)[: len(small)] == small  # its bytes, then 4 of CRC
    assert len(codec.response_blob(small)) == len(small) + 4
    assert zstandard.get_frame_parameters(codec.response_blob(large)).has_checksum
    assert len(codec.response_blob(large)) < len(large) // 10
    for data in (small, large):
        assert codec.decode_response(len(data), codec.response_blob(data)) == data
    for level in (1, -100):
        before = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
        assert codec.decode_response(len(small), before.compress(small)) == small
