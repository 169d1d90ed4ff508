"""Value types shared by the layers: segments, records, and what a turn adds. Stdlib only."""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, TypeVar

_SPANS = struct.Struct("<QQ")  # an item's start and end in its segment's bytes
LONE_MAX = (1 << 30) - 1  # the largest start and end a lone item's span packs into one int

_T = TypeVar("_T")
_SHARED: dict[object, object] = {}
SHARED_MAX = 1 << 15  # distinct values kept


# A Segment's `at`: its sid above a lone item id's span (ItemIds) above a journal offset
# (up to 1 TiB) above a compressed length (up to 4 GiB).
LENGTH_BITS = 32
SPAN_SHIFT = LENGTH_BITS + 40
SID_SHIFT = SPAN_SHIFT + 60
LENGTH_MAX = (1 << LENGTH_BITS) - 1
OFFSET_MAX = (1 << 40) - 1
_PLACE = (1 << SPAN_SHIFT) - 1
SPAN_MAX = (1 << 60) - 1
_SPAN = SPAN_MAX << SPAN_SHIFT
_NO_SPAN = ~_SPAN
_BELOW_SID = (1 << SID_SHIFT) - 1

# A durable record's response once its journal entry is committed (`Record.response`, an
# int): its journal file above the offset (up to 1 TiB) and compressed length of its bytes
# there above their size (each up to 4 GiB).
SIZE_BITS = 32
SIZE_MAX = (1 << SIZE_BITS) - 1
PACK_SHIFT = SIZE_BITS + LENGTH_BITS + 40  # the journal file's, above offset and length


def place(pack: int, offset: int, length: int, size: int) -> int:
    """Where a response's `length` compressed bytes are (`offset` of journal file `pack`)
    and their `size` once decompressed, as one int; ValueError when out of range."""
    if not (
        pack >= 0 and 0 <= offset <= OFFSET_MAX and 0 <= length <= LENGTH_MAX
        and 0 <= size <= SIZE_MAX
    ):  # fmt: skip
        raise ValueError(f"response place out of range: {pack}, {offset}, {length}, {size}")
    return ((pack << 40 | offset) << LENGTH_BITS | length) << SIZE_BITS | size


def unplace(at: int) -> tuple[int, int, int, int]:
    """`place`'s (pack, offset, length, size)."""
    size, at = at & SIZE_MAX, at >> SIZE_BITS
    length, at = at & LENGTH_MAX, at >> LENGTH_BITS
    return at >> 40, at & OFFSET_MAX, length, size


def shared(value: _T) -> _T:
    """One object for each value that 100,000s of segments and records repeat: a size,
    a length, an output's place in its response (an int above 256 is an object of 28
    bytes, a pair of them 56 more). The first SHARED_MAX distinct values are kept; call
    it only for values that repeat, never for offsets or ids."""
    kept = _SHARED.get(value)
    if kept is None:
        if len(_SHARED) >= SHARED_MAX:
            return value
        kept = _SHARED[value] = value
    return kept  # type: ignore[return-value]


def forget_oldest(book: dict[Any, Any], size: int) -> None:
    """Keep only the `size` newest entries of `book` (a dict in insertion order). For a
    dict kept to a size as it grows: call it past a slack, so the oldest go in batches.
    Finding a dict's first key walks past every slot its deletes left empty since it was
    last resized, which, one delete a put, makes a put's cost grow with the book."""
    for key in list(islice(book, len(book) - size)):
        del book[key]


class ItemIds:
    """The ids of a segment's items that carry one, each with the item's byte span in the
    segment's bytes: what an `item_reference` resolves to. Compact (a tuple of ids and the
    spans packed in one bytes object, no object per item); an id given twice keeps its
    last item. The usual segment, one item with an id, keeps the id itself (a tuple is 56
    bytes) and its span as one int, `start << 30 | end` (32 bytes; packed, 64)."""

    __slots__ = ("_ids", "_spans")
    _ids: tuple[str, ...] | str
    _spans: bytes | int  # an int only beside a single id

    def __init__(self, entries: Sequence[tuple[str, int, int]] = ()) -> None:
        # Ids are interned: a history resent every turn (the AI SDK's way) holds the same
        # ids in segment after segment, and after a restart too.
        if len(entries) == 1:  # the usual turn: one output item with an id (5x faster)
            ((item_id, start, end),) = entries
            if 0 <= start <= end <= LONE_MAX:
                self._ids, self._spans = sys.intern(item_id), start << 30 | end
                return
        last = {sys.intern(item_id): (start, end) for item_id, start, end in entries}
        self._ids = tuple(last)
        self._spans = b"".join(_SPANS.pack(start, end) for start, end in last.values())

    @classmethod
    def lone(cls, item_id: str, span: int) -> ItemIds:
        """One id (interned already) with its span packed as one int (as `__init__` keeps
        the usual segment's)."""
        ids = cls.__new__(cls)
        ids._ids, ids._spans = item_id, span
        return ids

    def span(self, item_id: str) -> tuple[int, int] | None:
        """The (start, end) of the item with this id, or None."""
        ids, spans = self._ids, self._spans
        if type(spans) is int:
            return (spans >> 30, spans & LONE_MAX) if ids == item_id else None
        try:
            at = ids.index(item_id)
        except ValueError:
            return None
        start, end = _SPANS.unpack_from(spans, at * _SPANS.size)  # type: ignore[arg-type]
        return start, end

    @property
    def ids(self) -> tuple[str, ...]:
        ids = self._ids
        return (ids,) if type(ids) is str else ids  # type: ignore[return-value]

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        ids, spans = self._ids, self._spans
        if type(spans) is int:  # the usual segment (a generator over a zip costs more)
            return iter(((ids, spans >> 30, spans & LONE_MAX),))  # type: ignore[arg-type]
        pairs = _SPANS.iter_unpack(spans)  # type: ignore[arg-type]
        return ((i, s, e) for i, (s, e) in zip(ids, pairs, strict=True))

    def __len__(self) -> int:
        return 1 if type(self._ids) is str else len(self._ids)

    def __repr__(self) -> str:
        return f"ItemIds({list(self)!r})"


NO_ITEMS = ItemIds()
NO_CALLS: frozenset[str] = frozenset()  # shared: an empty frozenset is 216 bytes each


class Segment:
    """The serialized items one turn added to its chain: comma-joined JSON values.

    Immutable content, named by its SHA-256 (`digest`, 32 bytes: the maps of 100,000s of
    segments are keyed by it; `key` is its hex, the name on disk and in the journal);
    shared by every later record of the chain (a response object kept in memory only is
    named by a number instead: `private`).
    `data` is None while the bytes live only in the journal (or were lost: `lost` then
    holds the FailureReason value that chains needing it answer with). Where the journal
    holds them: file `pack`, `length` compressed bytes at `offset` (pack -1: nowhere).
    The journal's short name for it (`sid`), `offset`, `length` and a lone item id's span
    are kept as one int (`at`), and a lone item id as itself (`ids`; `item_ids` makes its
    ItemIds when asked): 100,000s of segments each save three int objects, an ItemIds and
    two slots (12 slots: 128 bytes).
    """

    __slots__ = (
        "at", "call_ids", "data", "digest", "durable", "durable_refs", "ids", "lost",
        "n_items", "pack", "refs", "size",
    )  # fmt: skip
    data: bytes | None
    lost: str | None
    at: int  # sid << SID_SHIFT | span << SPAN_SHIFT | offset << LENGTH_BITS | length
    ids: ItemIds | str  # a lone id (its span in `at`), or the ItemIds

    def __init__(
        self,
        data: bytes,
        n_items: int,
        call_ids: frozenset[str],
        *,
        durable: bool,
        item_ids: ItemIds = NO_ITEMS,
    ) -> None:
        self._init(hashlib.sha256(data).digest(), len(data), n_items, call_ids, durable)
        self.item_ids = item_ids
        self.data = data

    @classmethod
    def restore(
        cls,
        key: str,
        size: int,
        n_items: int,
        call_ids: frozenset[str],
        *,
        durable: bool,
        data: bytes | None = None,
        item_ids: ItemIds = NO_ITEMS,
    ) -> Segment:
        """A segment known by its digest, `key` in hex (from the index or another store);
        no rehash."""
        segment = cls.__new__(cls)
        segment._init(bytes.fromhex(key), size, n_items, call_ids, durable)
        segment.item_ids = item_ids
        segment.data = data
        return segment

    @classmethod
    def private(cls, name: bytes, data: bytes) -> Segment:
        """A segment of no items that one record alone holds and that never reaches disk
        (a response object kept in memory only), named `name` rather than by its bytes'
        digest: nothing to share, so nothing to hash. `name` is unique among its table's
        and shorter than a digest, so it is no segment's content address."""
        segment = cls.__new__(cls)
        segment._init(name, len(data), 0, NO_CALLS, False)
        segment.ids = NO_ITEMS
        segment.data = data
        return segment

    def _init(
        self, digest: bytes, size: int, n_items: int, call_ids: frozenset[str], durable: bool
    ) -> None:
        self.digest = digest
        self.data = None
        self.size = shared(size)
        self.n_items = n_items
        self.call_ids = call_ids or NO_CALLS
        self.durable = durable  # may this reach disk (no store:false content)?
        self.at = 0  # sid 0: not yet named; offset and length 0
        self.pack = -1  # journal file holding its bytes, durably
        self.lost = None
        self.refs = 0  # records holding it
        self.durable_refs = 0  # durable records holding it; `durable` while above 0 in a Store

    @property
    def key(self) -> str:
        """The digest in hex: the segment's name in the journal and on disk."""
        return self.digest.hex()

    @property
    def on_disk(self) -> bool:
        return self.pack >= 0

    @property
    def item_ids(self) -> ItemIds:
        """The ids of its items that carry one, with their spans."""
        ids = self.ids
        if type(ids) is str:
            return ItemIds.lone(ids, (self.at & _SPAN) >> SPAN_SHIFT)
        return ids  # type: ignore[return-value]

    @item_ids.setter
    def item_ids(self, item_ids: ItemIds) -> None:
        spans = item_ids._spans
        if type(spans) is int:  # a lone id: itself, its span in `at`
            self.ids = item_ids._ids  # type: ignore[assignment]
            self.at = self.at & _NO_SPAN | spans << SPAN_SHIFT
        else:  # (none at all: always NO_ITEMS)
            self.ids, self.at = item_ids if spans else NO_ITEMS, self.at & _NO_SPAN

    @property
    def item_id_list(self) -> tuple[str, ...]:
        """The ids of `item_ids` (the item index's: no ItemIds made)."""
        ids = self.ids
        return (ids,) if type(ids) is str else ids.ids  # type: ignore[union-attr]

    @property
    def sid(self) -> int:
        """The journal's short name for it (0: not yet named)."""
        return self.at >> SID_SHIFT

    @sid.setter
    def sid(self, sid: int) -> None:
        self.at = sid << SID_SHIFT | self.at & _BELOW_SID

    @property
    def offset(self) -> int:
        return self.at >> LENGTH_BITS & OFFSET_MAX

    @offset.setter
    def offset(self, offset: int) -> None:
        self.place(offset, self.length)

    @property
    def length(self) -> int:
        return self.at & LENGTH_MAX

    @length.setter
    def length(self, length: int) -> None:
        self.place(self.offset, length)

    def place(self, offset: int, length: int) -> None:
        """Its bytes are `length` compressed bytes at `offset` (of file `pack`)."""
        if not (0 <= offset <= OFFSET_MAX and 0 <= length <= LENGTH_MAX):
            raise ValueError(f"segment place out of range: {offset}, {length}")
        self.at = self.at & ~_PLACE | offset << LENGTH_BITS | length

    def __repr__(self) -> str:
        where = ("mem" if self.data is not None else "") + ("+disk" if self.on_disk else "")
        if self.lost:
            where += f" lost:{self.lost}"
        return f"<Segment {self.key[:12]} {self.size}B {where} refs={self.refs}>"


class Chain:
    """A record's segments as links: its own (last) segment on top of the chain it
    continues, which its parent and every sibling share. A record costs one link, not a
    tuple as long as its history (and the cyclic GC one object with two references)."""

    __slots__ = ("prev", "segment")

    def __init__(self, prev: Chain | None, segment: Segment) -> None:
        self.prev = prev
        self.segment = segment

    def segments(self) -> tuple[Segment, ...]:
        """Oldest first."""
        out: list[Segment] = []
        link: Chain | None = self
        while link is not None:
            out.append(link.segment)
            link = link.prev
        out.reverse()
        return tuple(out)


def chain_of(segments: Iterable[Segment], base: Chain | None = None) -> Chain | None:
    """`segments` (oldest first) as links on top of `base`."""
    for segment in segments:
        base = Chain(base, segment)
    return base


@dataclass(slots=True)
class Record:
    """One remembered response: its scope, lifetime, and the chain of segments behind it."""

    id: str
    scope: str
    created_at: float
    expires_at: float
    durable: bool  # store:true (may be written to disk)
    links: Chain | None  # its chain's segments, the last its own (None: none)
    # The response object as JSON, for GET /v1/responses/{id}: a durable record's is its
    # bytes until its journal entry, which holds them, is committed, then where they are
    # there (an int, `place`); any other's (memory-only, a kept record's, or one written
    # before responses were kept in their record's entry) is a Segment of its own.
    response: Segment | bytes | int
    backend: str | None = None
    affinity_key: str | None = None
    n_items: int = field(default=0)
    # When set, `response` holds the response with its output array's contents cut out at
    # byte offset [0]; they are the last [1] bytes of the record's own (last) segment, so
    # the output items are stored once. Store.response_bytes() puts them back.
    output_at: tuple[int, int] | None = None
    stored: bool = True  # the client asked for store:true (GET and input_items serve it)
    # The chain's segments, built: kept by the newest record of a chain being continued
    # (the store moves it from parent to child), so a turn costs no walk of its links.
    built: tuple[Segment, ...] | None = field(default=None, repr=False, compare=False)
    # A conversation's item ids, one list per segment of its chain (kept beside the items,
    # never in them). None for a response, and for a conversation written before they were
    # kept here: its response segment holds them (continuation/conversation.py's Meta).
    ids: list[list[str]] | None = field(default=None, repr=False, compare=False)
    # The number of the store index's chunk that holds it, in the order records came
    # (store/records.py); set and read there only.
    chunk: int = field(default=0, repr=False, compare=False)
    # When set, `response` (once its output is put back) lacks the members the proxy
    # filled in from the request (instructions, tools, ...): a segment every record of
    # the same fill shares, whose bytes go back in `fill_at` bytes before its end.
    fill: Segment | None = field(default=None, repr=False, compare=False)
    fill_at: int = field(default=0, repr=False, compare=False)

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The chain's segments, oldest first."""
        built = self.built
        if built is None:
            built = self.built = () if self.links is None else self.links.segments()
        return built

    @property
    def response_size(self) -> int:
        """The response object's bytes."""
        response = self.response
        if isinstance(response, Segment):
            return response.size
        return len(response) if isinstance(response, bytes) else response & SIZE_MAX

    @property
    def own(self) -> Segment | None:
        """The segment this record's turn added (the chain's last)."""
        return None if self.links is None else self.links.segment

    def has_call_id(self, call_id: str) -> bool:
        # Newest first: a tool output almost always answers the last turn's call.
        link = self.links
        while link is not None:
            if call_id in link.segment.call_ids:
                return True
            link = link.prev
        return False


@dataclass(frozen=True, slots=True)
class Turn:
    """What one finished turn adds: the new items (input tail + output) and the response."""

    response_id: str
    scope: str
    durable: bool
    items: bytes  # comma-joined serialized items
    n_items: int
    call_ids: frozenset[str]
    response: bytes
    item_ids: ItemIds = NO_ITEMS  # the items that carry an id, with their spans in `items`
    backend: str | None = None
    affinity_key: str | None = None
    stored: bool = True  # store:true; False for store:false turns kept in memory
    # The members the envelope filled in from the request, the bytes object every turn
    # with the same values for them shares, and where `response` holds them (-1: nowhere
    # known): the store keeps them once (Record.fill).
    fill: bytes = b""
    fill_at: int = -1
    # Where `response` holds the output items that end `items` (start, length), when
    # known (build_turn found them there); else the store looks (store/output.py).
    output_at: tuple[int, int] | None = None
