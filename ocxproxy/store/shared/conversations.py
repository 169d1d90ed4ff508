"""Conversations, their lease and Idempotency-Keys on the shared Valkey/Redis server
(--shared-store), so that every replica serves them alike.

Keys, under the caller's scope hash (CONTRACT.md C5), as keys.py names them: a
conversation's hash (`head`, `ver`, `resp`: the response id of the last turn appended)
and its items' list (one entry per append: a segment and its items' ids, in the order the
server took the appends); its lease (in the server's memory only: never in its AOF); a
completed Idempotency-Key (fingerprint and response) and one in flight (fingerprint and
token).

Every write to a conversation names the version it was computed from, and the script
refuses it when the conversation moved on (another writer, after this one's lease lapsed)
or is gone: that write is `conversation_changed`, nothing of it kept. A turn's append,
its response's record and the release of its lease are one script (TURN, `Joined`: the
store's COMMIT with the append), so the turn's items and its response are kept together
or not at all. Leases (in the server's memory only: no fsync) and in-flight keys expire,
so a replica killed mid-turn holds nothing for longer than its lease. A conversation
never expires (as on one node); it and completed keys count in the byte budget but are
never evicted by it (conversation_scripts.py, which holds the scripts).

A turn on a conversation is stored as a response whose chain is the conversation's last
turn's chain plus its own segment (`as_parent`), so a conversation costs its items' bytes
once in its list and once in its turns' segments, whatever its length.
"""

from __future__ import annotations

import secrets
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from ocxproxy.errors import ConversationLocked, FailureReason, StoreFailure
from ocxproxy.model import NO_CALLS, ItemIds, Record, Segment, chain_of
from ocxproxy.store.shared.conversation_scripts import SHAS, WRITES
from ocxproxy.store.shared.frame import ZstdError, frame, plain, unframe, unplain
from ocxproxy.store.shared.keys import LAYOUT, Keys, ScopeKeys, kept_keys
from ocxproxy.store.shared.layout import SharedRecord

if TYPE_CHECKING:
    from ocxproxy.store.shared.server import Server

_CACHED_BYTES = 64 * 1024 * 1024  # conversations' items a replica keeps between turns
_HEAD = struct.Struct("<BI")  # version, length of the entry's metadata JSON
_VERSION = 1
_FRAMED = b"\x02"  # an entry's first byte: framed as the layout's values (else _HEAD's)


def _pack(data: bytes) -> bytes:
    """A completed Idempotency-Key's value: zstd without the dictionary, or raw."""
    compressed = plain(data)
    return b"z" + compressed if len(compressed) < len(data) else b"r" + data


def _unpack(value: bytes) -> bytes:
    if value[:1] == b"z":
        return unplain(value[1:])
    if value[:1] == b"r":
        return value[1:]
    raise ValueError("unknown packing")


def encode_entry(segment: Segment, ids: Sequence[str]) -> bytes:
    """One append: the segment (bytes as forwarded, its metadata) and its items' ids,
    framed as the layout frames values (zstd with its dictionary: half the bytes of plain
    zstd for a turn's few hundred), after the layout's tag (its dictionary's)."""
    assert segment.data is not None
    meta = orjson.dumps(
        [list(ids), segment.n_items, sorted(segment.call_ids), list(segment.item_ids)]
    )
    return b"".join((_FRAMED, LAYOUT, frame(meta, segment.data)))


def decode_entry(value: bytes) -> tuple[Segment, list[str]]:
    try:
        if value[:1] == _FRAMED:
            if value[1:2] != LAYOUT:
                raise ValueError("an entry of another layout")
            (ids, n_items, call_ids, spans), data = unframe(value[2:])
        else:  # as written before entries were framed
            version, size = _HEAD.unpack_from(value)
            if version != _VERSION:
                raise ValueError(f"unknown entry version {version}")
            ids, n_items, call_ids, spans = orjson.loads(value[_HEAD.size : _HEAD.size + size])
            data = _unpack(value[_HEAD.size + size :])
    except (struct.error, orjson.JSONDecodeError, ZstdError, ValueError, TypeError):
        raise StoreFailure(FailureReason.CORRUPT, "conversation entry") from None
    segment = Segment(
        data,
        n_items,
        frozenset(call_ids) or NO_CALLS,
        durable=True,
        item_ids=ItemIds([tuple(span) for span in spans]),
    )
    return segment, ids


@dataclass(slots=True)
class SharedWrite(Record):
    """A write a turn staged (its conversation's append, its Idempotency-Key), run by
    `SharedStore.commit` before the turn is acknowledged."""

    pending: Callable[[], Awaitable[None]] | None = None


@dataclass(slots=True)
class ConversationRecord(SharedWrite):
    """A conversation as read from (or written to) the server: its segments, the ids of
    each one's items, its head and the version a write must name."""

    head: bytes = b"{}"
    version: int = 0
    ids: list[list[str]] = field(default_factory=list)
    top: tuple[str, bytes] | None = None  # the last turn's record and chain token (LOAD's)
    kept: int = 0  # the bytes kept on the server (conversations, keys) when it was read


def conversation_record(
    conversation_id: str,
    scope: str,
    head: bytes,
    version: int,
    entries: Sequence[tuple[Segment, list[str]]],
    top: tuple[str, bytes] | None = None,
    kept: int = 0,
) -> ConversationRecord:
    segments = tuple(segment for segment, _ in entries)
    doc = orjson.loads(head)
    return ConversationRecord(
        id=conversation_id,
        scope=scope,
        created_at=float(doc["created_at"]),
        expires_at=float("inf"),
        durable=True,
        links=chain_of(segments),
        built=segments,
        response=Segment(head, 0, NO_CALLS, durable=True),
        backend=doc.get("backend"),
        affinity_key=doc.get("affinity"),
        n_items=sum(segment.n_items for segment in segments),
        head=head,
        version=version,
        ids=[list(ids) for _, ids in entries],
        top=top,
        kept=kept,
    )


@dataclass(slots=True)
class Joined:
    """A turn's append, to run in one script with its record's COMMIT (TURN)."""

    keys: list[str | bytes]
    args: list[Any]
    version: int = 0  # the conversation's, once written (0: it had changed)

    @property
    def call(self) -> tuple[str, Callable[[Sequence[Any], Sequence[Any]], tuple[Any, ...]]]:
        """The operation's name and its command, for SharedStore._commit."""
        return "conversation_turn", self.command

    def command(self, commit_keys: Sequence[Any], commit_args: Sequence[Any]) -> tuple[Any, ...]:
        """TURN's EVALSHA: COMMIT's keys and arguments, then the append's."""
        n = len(commit_keys) + len(self.keys)
        counts = (len(commit_keys), len(commit_args))
        return ("EVALSHA", SHAS["conversation_turn"], n, *commit_keys, *self.keys, *counts,
                *commit_args, *self.args)  # fmt: skip


# The store's write of the record `put` staged for a response id with its conversation's
# append (SharedStore.commit_with): the conversation's new version (0: it changed, nothing
# written), or None when no record is staged for that id.
JoinWith = Callable[[str, Joined], Awaitable[int | None]]


@dataclass(slots=True)
class ConversationHead(SharedRecord):
    """A conversation's items as a turn's parent (`as_parent`)."""


def as_parent(conversation: ConversationRecord, keys: Keys) -> ConversationHead:
    """A turn's parent on a conversation: the conversation's last turn's record when its
    chain holds exactly the conversation's items (the turn's commit appends one digest),
    else a record on no chain (the commit writes a chain of every item's segment, the
    segments the server has already taken as they are; also when that chain is evicted
    while the turn runs: SharedStore._commit). Either way the turn's history is the
    conversation's segments, the bytes the backend was sent."""
    top = conversation.top
    return ConversationHead(
        id=top[0] if top else conversation.id,
        scope=conversation.scope,
        created_at=conversation.created_at,
        expires_at=conversation.expires_at,
        durable=True,
        links=conversation.links,
        built=conversation.segments,
        response=conversation.response,
        backend=conversation.backend,
        affinity_key=conversation.affinity_key,
        n_items=conversation.n_items,
        chain=keys.chain(top[1]) if top else b"",
        length=len(conversation.segments) if top else 0,
    )


class SharedConversations:
    """The round trips for conversations, leases and Idempotency-Keys (one each)."""

    def __init__(
        self,
        server: Server,
        prefix: str,
        *,
        budget: int = 0,
        counted: Callable[[int, int], None] = lambda total, expired: None,
    ) -> None:
        self.server = server
        self.prefix = prefix
        self.keys = ScopeKeys(prefix)
        self.budget = budget  # --shared-max-bytes (0: none)
        self._counted = counted  # the server's byte count after a write, and expiries
        self._kept = kept_keys(prefix)
        self.join: JoinWith | None = None  # the store's (SharedStore.commit_with)
        # The conversations read last (LRU, by bytes): a load then fetches only the entries
        # appended since (entries are rewritten only by a deleted item, which `base` says).
        self._cache: OrderedDict[tuple[str, str], ConversationRecord] = OrderedDict()
        self._cached_bytes = 0

    async def _run(self, name: str, keys: Sequence[str | bytes], args: Sequence[Any]) -> Any:
        """One script (registered with the server's own: shared_server.register_scripts);
        a write of conversation state waits for replicas like a turn's commit."""
        if name in WRITES:
            sha = SHAS[name]
            return await self.server.write(name, lambda: ("EVALSHA", sha, len(keys), *keys, *args))
        return await self.server.script(name, keys, args)

    async def _keep(
        self, name: str, keys: Sequence[str], args: Sequence[Any], *, ttl: float, force: bool
    ) -> int:
        """A write of something kept (counted in the budget, expiring `ttl` seconds after
        it, never when 0): its result; StoreFailure(FULL) when the budget could not take it."""
        result, total, expired = await self._run(name, *self._kept_call(keys, args, ttl, force))
        self._counted(int(total), int(expired))
        if int(result) == -2:
            raise StoreFailure(FailureReason.FULL, "the shared store's byte budget")
        return int(result)

    def _kept_call(
        self, keys: Sequence[str], args: Sequence[Any], ttl: float, force: bool
    ) -> tuple[list[str | bytes], list[Any]]:
        """A kept write's keys and arguments: the budget's, then its own."""
        budget_args = [max(1, int(ttl * 1000)) if ttl else 0, self.budget, "1" if force else "0"]
        return [*self._kept, *keys], [*budget_args, *args]

    # -- conversations -------------------------------------------------------------------

    async def load(
        self, scope: str, conversation_id: str, token: str = "", ttl: float = 0.0
    ) -> ConversationRecord | None:
        """The conversation (one round trip), or None; only entries this replica has not
        read before are sent. With a `token`, its lease is taken for `ttl` seconds in the
        same round trip (ConversationLocked while another holds it)."""
        held = self._forget(scope, conversation_id)
        args: list[int | str | bytes] = [held.version, len(held.ids)] if held else [0, 0]
        args += [token, max(1, int(ttl * 1000))] if token else ["", ""]
        names = self.keys(scope)
        args.append(names.base)
        keys: list[str | bytes] = [*names.conversation(conversation_id), self._kept[2]]
        found = await self._run("conversation_load", keys, args)
        if found == 0:
            raise ConversationLocked()
        if found is None:
            return None
        head, version, start, values, top, kept = found
        entries = []
        if int(start) and held is not None:
            entries = list(zip(held.segments, held.ids, strict=True))[: int(start)]
        entries += [decode_entry(value) for value in values]
        top = (top[0].decode(), bytes(top[1])) if top else None
        record = conversation_record(
            conversation_id, scope, head, int(version), entries, top, int(kept)
        )
        self._remember(record)
        return record

    def _forget(self, scope: str, conversation_id: str) -> ConversationRecord | None:
        held = self._cache.pop((scope, conversation_id), None)
        if held is not None:
            self._cached_bytes -= sum(s.size for s in held.segments)
        return held

    def _remember(self, record: ConversationRecord) -> None:
        self._cache[record.scope, record.id] = record
        self._cached_bytes += sum(s.size for s in record.segments)
        while self._cached_bytes > _CACHED_BYTES and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= sum(s.size for s in dropped.segments)

    async def create(
        self, scope: str, conversation_id: str, head: bytes, first: tuple[Segment, list[str]] | None
    ) -> ConversationRecord:
        """A new conversation; StoreFailure(FULL) when the byte budget cannot take it."""
        args = [head] if first is None else [head, encode_entry(*first)]
        keys = self.keys(scope).conversation(conversation_id)[:2]
        if not await self._keep("conversation_create", keys, args, ttl=0, force=False):
            raise StoreFailure(FailureReason.WRITE_FAILED, "conversation id taken")
        return conversation_record(conversation_id, scope, head, 1, [first] if first else [])

    async def write(
        self,
        record: ConversationRecord,
        op: str,
        *args: Any,
        head: bytes = b"",
        lease: str = "",
        response_id: str = "",
    ) -> int:
        """A write computed from `record` (op and its arguments as WRITE takes them),
        releasing `lease` with it; the new version (-1: deleted), or 0 when the
        conversation changed; StoreFailure(FULL) when the byte budget cannot take it. A
        turn's append names its `response_id` (the next turn's record chains on its) and
        is taken even past the budget (its room was checked before the turn); the record
        the store staged for that response is written in the same script (`join`)."""
        keys = self.keys(record.scope).conversation(record.id)
        write_id = secrets.token_hex(8)
        args = (record.version, lease, op, head, write_id, response_id, *args)
        force = bool(response_id)
        if response_id and self.join is not None:
            version = await self.join(response_id, Joined(*self._kept_call(keys, args, 0, True)))
            if version is not None:
                return version
        return await self._keep("conversation_write", keys, args, ttl=0, force=force)

    # -- the lease's two primitives (store/lease.py's `Slots`) ---------------------------

    def lease_key(self, scope: str, conversation_id: str) -> str:
        return self.keys(scope).conversation(conversation_id)[2]

    async def hold(self, key: str, token: str, ttl: float) -> bool:
        return bool(await self._run("lease_hold", [key], [token, max(1, int(ttl * 1000))]))

    async def drop(self, key: str, token: str) -> None:
        await self._run("lease_drop", [key], [token, ""])

    # -- Idempotency-Keys ----------------------------------------------------------------

    async def idempotency_begin(
        self, scope: str, record_id: str, marker: str, ttl: float
    ) -> tuple[int, bytes]:
        """(1, the completed entry) | (0, b"") now in flight | (2, the other's marker)."""
        keys = self.keys(scope).idempotency(record_id)
        found = await self._run("idempotency_begin", keys, [marker, max(1, int(ttl * 1000))])
        state = int(found[0])
        value = bytes(found[1]) if len(found) > 1 else b""
        return state, _unpack(value) if state == 1 else value

    async def idempotency_done(
        self, scope: str, record_id: str, marker: str, entry: bytes, ttl: float
    ) -> None:
        """Complete the key (for `ttl` seconds; counted in the budget, taken past it: its
        turn was answered)."""
        keys = self.keys(scope).idempotency(record_id)
        await self._keep("idempotency_done", keys, [_pack(entry), marker], ttl=ttl, force=True)

    async def idempotency_hold(
        self, scope: str, record_id: str, marker: str, ttl: float | None
    ) -> None:
        """Renew the in-flight key for `ttl` seconds (None: let it go)."""
        key = self.keys(scope).idempotency(record_id)[1]
        await self._run("idempotency_hold", [key], [marker, "" if ttl is None else int(ttl * 1000)])


def staged_write(record_id: str, scope: str, write: Callable[[], Awaitable[None]]) -> SharedWrite:
    """A write for `SharedStore.commit` to run (it holds no segments of its own)."""
    return SharedWrite(
        id=record_id,
        scope=scope,
        created_at=0.0,
        expires_at=float("inf"),
        durable=True,
        links=None,
        response=Segment(b"", 0, NO_CALLS, durable=True),
        pending=write,
    )
