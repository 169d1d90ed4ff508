"""The journal's files: framing, checksums, the checkpoint, reads, and what replay makes
of damaged or arbitrary bytes (it reports, never raises)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from pathlib import Path

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import NO_ITEMS, ItemIds, Segment
from ocxproxy.store.compression import SMALL
from ocxproxy.store.local import codec, journal
from ocxproxy.store.local.codec import DEL, PUT, SEG, Loaded
from ocxproxy.store.local.journal import Journal
from tests.store.helpers import HYPOTHESIS


def segment(data: bytes, sid: int) -> Segment:
    seg = Segment(data, 1, frozenset({"call_1"}), durable=True)
    seg.sid = sid
    return seg


def row(rid: str, sids: list[int], response: int) -> bytes:
    import orjson

    return orjson.dumps([rid, "s", 1.0, 2e10, sids, response, None, None, None, 1, True])


def opened(tmp_path: Path) -> Journal:
    j = Journal(tmp_path)
    j.prepare()
    j.open_next()
    return j


def test_append_read_back_and_replay(tmp_path: Path) -> None:
    j = opened(tmp_path)
    a, b = segment(b'{"a":1}' * 50, 1), segment(b'{"b":2}', 2)
    places = j.append(
        [
            (SEG, (codec.segment_row(a), a.data, None)),
            (SEG, (codec.segment_row(b), b.data, None)),
            (PUT, row("r1", [1], 2)),
            (PUT, row("r2", [1, 2], 2)),
            (DEL, b'"r1"'),
        ]
    )
    assert places[2:] == [None, None, None]
    (pack, offset, length) = places[0]
    assert pack == 1 and j.read(a.key, a.size, pack, offset, length) == a.data
    assert stat.S_IMODE(os.stat(j.path(1)).st_mode) == 0o600
    j.close()
    loaded = Journal(tmp_path).load(repair=False)
    assert list(loaded.records) == ["r2"] and loaded.cut == 0 and loaded.entries == 5
    info = loaded.segments[1]
    assert (info.key, info.size, info.call_ids) == (a.key, a.size, frozenset({"call_1"}))
    assert (info.pack, info.offset, info.length) == places[0]
    assert loaded.next_sid == 3


def test_a_small_segment_is_stored_raw_in_a_zstd_frame(tmp_path: Path) -> None:
    """Below SMALL bytes a segment is not compressed (a few dozen bytes saved are not
    worth its ~4 µs on the event loop), but still framed as zstd: read back, verified,
    and replayed like any other; from SMALL bytes on, it is compressed."""
    j = opened(tmp_path)
    short = segment(b'{"role":"user","content":"ls"}' * 8, 1)  # 240 bytes
    long = segment(b'{"role":"user","content":"ls"}' * 9, 2)  # 270 bytes
    assert short.size < SMALL <= long.size
    places = j.append([(SEG, (codec.segment_row(s), s.data, None)) for s in (short, long)])
    raw = j.path(1).read_bytes()
    for seg, (pack, offset, length) in zip((short, long), places, strict=True):
        blob = raw[offset : offset + length]
        assert zstandard.frame_content_size(blob) == seg.size
        assert j.read(seg.key, seg.size, pack, offset, length) == seg.data
    (_, _, short_length), (_, _, long_length) = places
    assert short_length == short.size + 9 and short.data in raw  # stored as it is
    assert long_length < long.size / 2 and long.data not in raw  # compressed
    j.close()
    loaded = Journal(tmp_path).load(repair=False)
    assert [(s.offset, s.length) for s in loaded.segments.values()] == [p[1:] for p in places]


def test_checkpoint_round_trip_and_replay_after_it(tmp_path: Path) -> None:
    j = opened(tmp_path)
    a = segment(b"[1]", 7)
    (place,) = [p for p in j.append([(SEG, (codec.segment_row(a), a.data, None))]) if p]
    position = j.rotate()
    j.write_checkpoint(
        [
            codec.encode_head(position, 123.0, 8),
            codec.encode_chunk(codec.SEGS, [[*codec.segment_row(a), *place]]),
            codec.encode_chunk(codec.RECS, [list(__import__("orjson").loads(row("r", [7], 7)))]),
            codec.encode_end(1, 1),
        ]
    )
    j.append([(PUT, row("later", [7], 7))])
    j.close()
    loaded = Journal(tmp_path).load(repair=False)
    assert loaded.error is None and loaded.replay_from == position
    assert list(loaded.records) == ["r", "later"] and loaded.entries == 1
    assert loaded.checkpoint_at == 123.0 and loaded.next_sid == 8


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "counts"])
def test_a_damaged_checkpoint_is_reported_not_used(tmp_path: Path, damage: str) -> None:
    head = codec.encode_head((1, 0), 1.0, 1)
    good = b"".join(
        codec.frame(*e) for e in [head, codec.encode_chunk(codec.RECS, []), codec.encode_end(0, 0)]
    )
    raw = {
        "truncated": good[:-3],
        "flipped": good[:10] + bytes([good[10] ^ 1]) + good[11:],
        "empty": b"",
        "counts": codec.frame(*head) + codec.frame(*codec.encode_end(5, 0)),
    }[damage]
    (tmp_path / journal.CHECKPOINT).write_bytes(raw)
    loaded = Journal(tmp_path).load(repair=False)
    assert loaded.error is not None and loaded.records == {}


def test_reads_check_the_digest_and_never_follow_a_symlink(tmp_path: Path) -> None:
    j = opened(tmp_path)
    a = segment(b"hello world", 1)
    (place,) = j.append([(SEG, (codec.segment_row(a), a.data, None))])
    with pytest.raises(StoreFailure) as info:
        j.read(hashlib.sha256(b"other").hexdigest(), a.size, *place)
    assert info.value.reason == FailureReason.CORRUPT
    with pytest.raises(StoreFailure) as info:
        j.read(a.key, a.size, 9, 0, 10)
    assert info.value.reason == FailureReason.MISSING
    j.close()
    target = tmp_path / "target"
    j.path(1).rename(target)
    j.path(1).symlink_to(target)
    with pytest.raises(StoreFailure) as info:
        Journal(tmp_path).read(a.key, a.size, *place)
    assert info.value.reason == FailureReason.READ_FAILED


@HYPOTHESIS
@given(blob=st.binary(max_size=200), size=st.integers(0, 1000))
def test_decode_of_arbitrary_bytes_raises_only_store_failure(blob: bytes, size: int) -> None:
    try:
        codec.decode(hashlib.sha256(b"x").hexdigest(), size, blob)
    except StoreFailure as failure:
        assert failure.reason == FailureReason.CORRUPT


@HYPOTHESIS
@given(raw=st.binary(max_size=300), cut=st.integers(0, 300))
def test_replay_of_arbitrary_bytes_never_raises(raw: bytes, cut: int) -> None:
    loaded = Loaded()
    end = codec.good_prefix(raw, 0, loaded, 1)
    assert 0 <= end <= len(raw)
    entries = codec.frame(PUT, row("r", [1], 1)) + codec.frame(DEL, b'"r"')
    damaged = entries[: min(cut, len(entries))] + raw
    loaded = Loaded()
    end = codec.good_prefix(damaged, 0, loaded, 1)
    assert 0 <= end <= len(damaged)
    if cut >= len(entries):  # both entries whole: put, then deleted, whatever follows
        assert end >= len(entries) and loaded.records == {}
    assert set(loaded.records) <= {"r"}


@HYPOTHESIS
@given(raw=st.binary(max_size=300))
def test_a_checkpoint_of_arbitrary_bytes_is_an_error_never_a_crash(raw: bytes) -> None:
    loaded = Loaded()
    with contextlib.suppress(ValueError, TypeError, KeyError, IndexError, AttributeError):
        codec.load_checkpoint(codec.frame(*codec.encode_head((1, 0), 1.0, 1)) + raw, loaded)


@pytest.mark.parametrize(
    "fields",
    [
        (7, "a" * 64, 10, 2, [], [], 3, 100, 40),
        (8, "b" * 64, 0, 0, ["call_1", "call_2"], [["msg_1", 0, 0]], 1, 5, 9),
        (9, "c" * 64, 30, 2, ["call_1"], [["fc_1", 0, 12], ["msg_2", 13, 30]], 2, 0, 17),
    ],
)
def test_a_restored_segment_is_the_one_segment_restore_builds(fields: tuple[object, ...]) -> None:
    """restore_segment sets Segment's slots itself (start-up's speed): every slot, to
    what Segment.restore and the location fields give, so a slot added to Segment and
    not to restore_segment fails here."""
    sid, key, size, n_items, ids, items, pack, offset, length = fields
    fast = codec.restore_segment(*fields)
    spans = [(str(i), int(start), int(end)) for i, start, end in items]  # type: ignore[attr-defined]
    slow = Segment.restore(
        key, size, n_items, frozenset(ids), durable=True,  # type: ignore[arg-type]
        data=None if size else b"", item_ids=ItemIds(spans) if spans else NO_ITEMS,
    )  # fmt: skip
    slow.sid, slow.pack, slow.offset, slow.length = sid, pack, offset, length  # type: ignore[assignment]
    for name in Segment.__slots__:
        got, want = getattr(fast, name), getattr(slow, name)
        if isinstance(got, ItemIds):
            got, want = list(got), list(want)
        assert got == want, name
        assert type(got) is type(want), name
    # the general path (coerced fields) agrees too, and a bad row is refused
    assert (
        codec.restore_segment(sid, key, float(size), n_items, ids, items, pack, offset, length).size
        == size
    )  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        codec.restore_segment(sid, key[:10], size, n_items, ids, items, pack, offset, length)
    with pytest.raises(ValueError):
        codec.restore_segment(str(sid), key, size, n_items, ids, items, pack, offset, length)
    if items:
        with pytest.raises(ValueError):
            codec.restore_segment(
                sid, key, size, n_items, ids, [["x", 0, size + 1]], pack, offset, length
            )
