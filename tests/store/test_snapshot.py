"""The snapshot index: linear, versioned, strict; a bad file is a SnapshotError."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ocxproxy.model import ItemIds, Record, Segment
from ocxproxy.store import snapshot
from tests.store.helpers import HYPOTHESIS


def chain_records(n: int) -> list[Record]:
    records: list[Record] = []
    segments: tuple[Segment, ...] = ()
    for i in range(n):
        data = b'{"id":"msg_%d"}' % i
        ids = ItemIds([(f"msg_{i}", 0, len(data))])
        seg = Segment(data, 1, frozenset({f"call_{i}"}), durable=True, item_ids=ids)
        segments = (*segments, seg)
        response = Segment(b'{"id":"r%d"}' % i, 0, frozenset(), durable=True)
        records.append(
            Record(f"r{i}", "s", 1.0, 2.0, True, segments, response, "b", "k", i + 1, (3, 4))
        )
    return records


def test_round_trip_is_linear_in_the_chain() -> None:
    records = chain_records(50)
    blob, count = snapshot.encode(records, 10.0)
    assert count == 50
    doc = orjson.loads(blob)
    assert doc["format"] == "ocxproxy-state" and doc["version"] == 2
    assert len(doc["chains"]) == 50  # one node per turn, not one per (record, segment)
    index = snapshot.decode(blob)
    assert index.written_at == 10.0
    for record, info in zip(records, index.records, strict=True):
        keys = [index.segments[i].key for i in info.chain]
        assert keys == [s.key for s in record.segments]
        assert index.segments[info.response].key == record.response.key
        assert (info.id, info.scope, info.n_items, info.output_at) == (
            "r" + info.id[1:],
            "s",
            record.n_items,
            (3, 4),
        )
    assert index.segments[0].call_ids == frozenset({"call_0"})
    by_key = {s.key: s for s in index.segments}
    assert by_key[records[7].segments[7].key].item_ids == (("msg_7", 0, 14),)
    assert by_key[records[7].response.key].item_ids == ()


def test_a_version_1_snapshot_loads_without_item_ids() -> None:
    blob, _ = snapshot.encode(chain_records(3), 10.0)
    doc = orjson.loads(blob)
    doc["version"] = 1
    for row in doc["segments"]:
        del row[4]  # version 1 had no item ids
    index = snapshot.decode(orjson.dumps(doc))
    assert [r.id for r in index.records] == ["r0", "r1", "r2"]
    assert all(s.item_ids == () for s in index.segments)
    assert index.segments[0].call_ids == frozenset({"call_0"})


@HYPOTHESIS
@given(st.data())
def test_any_forest_of_chains_round_trips_in_any_order(data: st.DataObject) -> None:
    """Records that extend, fork from and repeat each other, listed in any order (children
    before parents too), and segments that are equal in content but distinct objects (as
    when a record is taken over from another store): every chain decodes as it was."""
    pool = [Segment(b'"s%d"' % i, 1, frozenset(), durable=True) for i in range(4)]
    twins = [Segment(b'"s%d"' % i, 1, frozenset(), durable=True) for i in range(4)]
    chains: list[tuple[Segment, ...]] = []
    for _ in range(data.draw(st.integers(1, 25))):
        parent = data.draw(st.sampled_from([(), *chains]))  # () : a new root
        seg = data.draw(st.sampled_from(pool + twins))
        chains.append((*parent, seg))
    response = Segment(b"{}", 0, frozenset(), durable=True)
    records = [
        Record(f"r{i}", "s", 1.0, 2.0, True, chain, response, None, None, len(chain), None)
        for i, chain in enumerate(chains)
    ]
    order = data.draw(st.permutations(records))
    index = snapshot.decode(snapshot.encode(order, 1.0)[0])
    for record, info in zip(order, index.records, strict=True):
        assert info.id == record.id
        assert [index.segments[i].key for i in info.chain] == [s.key for s in record.segments]


def test_write_and_load(tmp_path: Path) -> None:
    assert snapshot.load(tmp_path) is None
    blob, _ = snapshot.encode(chain_records(3), 1.0)
    snapshot.write(tmp_path, blob)
    assert oct(os.stat(tmp_path / "state.json").st_mode & 0o777) == "0o600"
    index = snapshot.load(tmp_path)
    assert index is not None and [r.id for r in index.records] == ["r0", "r1", "r2"]
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp left


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda b: b[: len(b) // 2], "corrupt"),
        (lambda b: b"", "corrupt"),
        (lambda b: b.replace(b'"version":2', b'"version":99'), "version"),
        (lambda b: b.replace(b'[["msg_0",0,', b'[["msg_0",-1,'), "corrupt"),
        (lambda b: b.replace(b'[["msg_0",0,14]]', b'[["msg_0",0,99]]'), "corrupt"),
        (lambda b: b.replace(b'[["msg_0",0,14]]', b"[[0,0,14]]"), "corrupt"),
        (lambda b: b.replace(b'"ocxproxy-state"', b'"other"'), "corrupt"),
        (lambda b: b.replace(b",true,0,", b",true,7,"), "corrupt"),
        (lambda b: b.replace(b"[3,4],1,2,1]", b"[3,4],1,2,-1]"), "corrupt"),
        (lambda b: b.replace(b'"n_items"]', b'"items"]'), "corrupt"),
        (lambda b: b.replace(b'"strings":["s"', b'"strings":[7'), "corrupt"),
        (lambda b: b"[1,2,3]", "corrupt"),
    ],
)
def test_a_damaged_snapshot_is_a_typed_error(tmp_path: Path, mangle, reason: str) -> None:
    blob, _ = snapshot.encode(chain_records(2), 1.0)
    (tmp_path / "state.json").write_bytes(mangle(blob))
    with pytest.raises(snapshot.SnapshotError) as info:
        snapshot.load(tmp_path)
    assert info.value.reason == reason


def test_oversized_symlinked_or_odd_snapshots_are_not_parsed(tmp_path: Path) -> None:
    blob, _ = snapshot.encode(chain_records(2), 1.0)
    (tmp_path / "state.json").write_bytes(blob)
    with pytest.raises(snapshot.SnapshotError) as info:
        snapshot.load(tmp_path, limit=len(blob) - 1)
    assert info.value.reason == "too_large"
    (tmp_path / "state.json").unlink()
    (tmp_path / "real.json").write_bytes(blob)
    (tmp_path / "state.json").symlink_to(tmp_path / "real.json")
    with pytest.raises(snapshot.SnapshotError) as info:
        snapshot.load(tmp_path)
    assert info.value.reason == "unsafe"
    (tmp_path / "state.json").unlink()
    (tmp_path / "state.json").mkdir()
    with pytest.raises(snapshot.SnapshotError) as info:
        snapshot.load(tmp_path)
    assert info.value.reason in ("unsafe", "read_failed")


@HYPOTHESIS
@given(st.binary(max_size=400))
def test_arbitrary_bytes_raise_only_snapshot_error(raw: bytes) -> None:
    with contextlib.suppress(snapshot.SnapshotError):
        snapshot.decode(raw)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 100)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


@HYPOTHESIS
@given(
    segments=json_values,
    chains=json_values,
    records=json_values,
)
def test_arbitrary_json_documents_raise_only_snapshot_error(segments, chains, records) -> None:
    doc = {"format": "ocxproxy-state", "version": 1, "written_at": 1.0}
    doc.update(segments=segments, chains=chains, records=records, strings=["s"])
    doc["fields"] = list(snapshot.FIELDS)
    with contextlib.suppress(snapshot.SnapshotError):
        snapshot.decode(orjson.dumps(doc))
