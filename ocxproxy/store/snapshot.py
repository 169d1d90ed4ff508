"""The snapshot: `state.json`, a versioned JSON index of the durable records (never of
segment bytes, which live in spill files). Linear in size: each segment's metadata once,
each chain as a node pointing at its parent chain, each record as one row.

    {"format": "ocxproxy-state", "version": 1, "written_at": <unix time>,
     "segments": [[key, size, n_items, [call_id, ...], [[item_id, start, end], ...]], ...],
     "chains":   [[parent chain index or -1, segment index], ...],   parents come first
     "strings":  [scope hash, backend, affinity key, ...],           shared by rows
     "fields":   ["id", "scope", "created_at", "expires_at", "durable", "chain",
                  "response", "output_at", "backend", "affinity_key", "n_items"],
     "records":  [[<one value per field; scope/backend/affinity_key index "strings">], ...]}

Pure encode/decode plus a blocking load/write; a bad file is a SnapshotError with a reason
(a metric label), never a crash. Older versions are migrated one step at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ocxproxy.model import Record, Segment
from ocxproxy.store import files
from ocxproxy.store.spill import is_key

FORMAT = "ocxproxy-state"
VERSION = 2
NAME = "state.json"
MAX_BYTES = 256 * 1024**2
FIELDS = (
    "id", "scope", "created_at", "expires_at", "durable", "chain", "response", "output_at",
    "backend", "affinity_key", "n_items",
)  # fmt: skip


def _v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 2 added the item ids of each segment (none known for older ones)."""
    segments = doc.get("segments")
    if isinstance(segments, list):
        doc["segments"] = [[*s, []] if isinstance(s, list) else s for s in segments]
    return {**doc, "version": 2}


# version n -> function turning a version-n document into a version n+1 one
_MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2}


class SnapshotError(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    key: str
    size: int
    n_items: int
    call_ids: frozenset[str]
    item_ids: tuple[tuple[str, int, int], ...] = ()  # (id, start, end) of items with one


@dataclass(frozen=True, slots=True)
class RecordInfo:
    id: str
    scope: str
    created_at: float
    expires_at: float
    chain: tuple[int, ...]  # segment indices, oldest first
    response: int
    output_at: tuple[int, int] | None
    backend: str | None
    affinity_key: str | None
    n_items: int


@dataclass(frozen=True, slots=True)
class Index:
    written_at: float
    segments: list[SegmentInfo]
    records: list[RecordInfo]


def encode(records: Iterable[Record], now: float) -> tuple[bytes, int]:
    """The snapshot bytes for `records` (all of whose segments are on disk), and the count."""
    seg_index: dict[str, int] = {}
    segments: list[list[Any]] = []
    chain_index: dict[tuple[int, int], int] = {}
    chains: list[tuple[int, int]] = []
    string_index: dict[str, int] = {}
    rows: list[list[Any]] = []

    def segment_id(seg: Segment) -> int:
        index = seg_index.get(seg.key)
        if index is None:
            index = seg_index[seg.key] = len(segments)
            call_ids = sorted(seg.call_ids) if seg.call_ids else []
            segments.append([seg.key, seg.size, seg.n_items, call_ids, list(seg.item_ids)])
        return index

    def string_id(value: str | None) -> int | None:
        if value is None:
            return None
        return string_index.setdefault(value, len(string_index))

    def extend(node: int, seg: Segment) -> int:
        link = (node, segment_id(seg))
        found = chain_index.get(link)
        if found is None:
            found = chain_index[link] = len(chains)
            chains.append(link)
        return found

    # A chain's node, by its segments: a child's chain is its parent's plus one segment, so
    # most records take one step from their parent's node instead of a walk from the root
    # (which made a snapshot cost the sum of all chain depths).
    node_of: dict[tuple[Segment, ...], int] = {}
    for record in records:
        chain = record.segments
        node = node_of.get(chain)
        if node is None:
            parent = node_of.get(chain[:-1]) if len(chain) > 1 else -1
            if parent is None:
                node = -1
                for seg in chain:
                    node = extend(node, seg)
            else:
                node = extend(parent, chain[-1]) if chain else -1
            node_of[chain] = node
        rows.append(
            [
                record.id,
                string_id(record.scope),
                record.created_at,
                record.expires_at,
                True,
                node,
                segment_id(record.response),
                record.output_at,
                string_id(record.backend),
                string_id(record.affinity_key),
                record.n_items,
            ]
        )
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "written_at": now,
        "segments": segments,
        "chains": chains,
        "strings": list(string_index),
        "fields": FIELDS,
        "records": rows,
    }
    return orjson.dumps(doc), len(rows)


def decode(raw: bytes) -> Index:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SnapshotError("corrupt", f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SnapshotError("corrupt", "not an ocxproxy state file")
    version = doc.get("version")
    while isinstance(version, int) and version in _MIGRATIONS:
        doc = _MIGRATIONS[version](doc)
        version = doc.get("version")
    if version != VERSION:
        raise SnapshotError("version", f"unsupported version {version!r}")
    try:
        return _parse(doc)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise SnapshotError("corrupt", f"bad index: {exc!r}") from None


def _parse(doc: dict[str, Any]) -> Index:
    segments = [
        SegmentInfo(
            _key(k),
            _count(size),
            _count(n),
            frozenset(_str(c) for c in _list(ids)),
            _item_ids(items, _count(size)),
        )
        for k, size, n, ids, items in _list(doc["segments"])
    ]
    chains: list[tuple[int, ...]] = []
    for parent, seg in _list(doc["chains"]):
        if not (-1 <= _int(parent) < len(chains)):
            raise ValueError(f"chain parent {parent} out of order")
        _ref(seg, segments)
        chains.append((*(chains[parent] if parent >= 0 else ()), seg))
    strings = [_str(v) for v in _list(doc["strings"])]
    fields = _list(doc["fields"])
    if tuple(fields) != FIELDS:
        raise ValueError(f"unexpected record fields {fields!r}")

    def string(value: Any) -> str:
        index = _int(value)
        if not 0 <= index < len(strings):
            raise ValueError(f"string index {index} out of range")
        return strings[index]

    records = []
    for row in _list(doc["records"]):
        r = dict(zip(FIELDS, _list(row), strict=True))
        chain, output_at = r["chain"], r["output_at"]
        if r["durable"] is not True or not 0 <= _int(chain) < len(chains):
            raise ValueError("record chain out of range")
        if output_at is not None:
            offset, length = _list(output_at)
            output_at = (_count(offset), _count(length))
        records.append(
            RecordInfo(
                id=_str(r["id"]),
                scope=string(r["scope"]),
                created_at=_float(r["created_at"]),
                expires_at=_float(r["expires_at"]),
                chain=chains[chain],
                response=_ref(r["response"], segments),
                output_at=output_at,
                backend=None if r["backend"] is None else string(r["backend"]),
                affinity_key=None if r["affinity_key"] is None else string(r["affinity_key"]),
                n_items=_count(r["n_items"]),
            )
        )
    return Index(_float(doc["written_at"]), segments, records)


def load(root: Path, limit: int = MAX_BYTES) -> Index | None:
    """The snapshot under `root`, None when there is none yet; SnapshotError when unusable."""
    try:
        raw = files.read_regular(root / NAME, limit)
    except FileNotFoundError:
        return None
    except files.UnsafePath as exc:
        raise SnapshotError("unsafe", str(exc)) from None
    except files.FileTooLarge as exc:
        raise SnapshotError("too_large", str(exc)) from None
    except OSError as exc:
        raise SnapshotError("read_failed", str(exc)) from None
    return decode(raw)


def write(root: Path, data: bytes) -> None:
    try:
        files.write_atomic(root / NAME, data)
    except OSError as exc:
        raise SnapshotError("write_failed", str(exc)) from None


# -- strict field readers: anything unexpected is a ValueError → "corrupt" ---------------


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _count(value: Any) -> int:
    if _int(value) < 0:
        raise ValueError(f"negative count {value}")
    return int(value)


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _key(value: Any) -> str:
    if not isinstance(value, str) or not is_key(value):
        raise ValueError("bad segment key")
    return value


def _item_ids(value: Any, size: int) -> tuple[tuple[str, int, int], ...]:
    entries = []
    for item_id, start, end in _list(value):
        if not _count(start) <= _count(end) <= size:
            raise ValueError(f"item span {start}..{end} outside its segment")
        entries.append((_str(item_id), int(start), int(end)))
    return tuple(entries)


def _ref(value: Any, segments: list[SegmentInfo]) -> int:
    if not 0 <= _int(value) < len(segments):
        raise ValueError(f"segment index {value} out of range")
    return int(value)
