"""Conversations, their lease and Idempotency-Keys on the shared Valkey/Redis server
(--shared-store), so that every replica serves them alike.

Keys, under the caller's scope hash (CONTRACT.md C5), beside shared_layout.py's:

    {prefix}{scope}:conv:{id}          hash: `head` (created_at, metadata, backend), `ver`
    {prefix}{scope}:conv:{id}:items    list: one entry per append (a segment and its items'
                                       ids), in the order the server took the appends
    {prefix}{scope}:lock:{id}          the conversation's lease: a token, with a TTL
    {prefix}{scope}:idem:{id}          a completed Idempotency-Key: fingerprint and response
    {prefix}{scope}:idemrun:{id}       an Idempotency-Key in flight: fingerprint and token

Every write to a conversation names the version it was computed from, and the script
refuses it when the conversation moved on (another writer, after this one's lease lapsed)
or is gone: that write is `conversation_changed`, nothing of it kept. A turn's append and
the release of its lease are one script. Leases and in-flight keys expire, so a replica
killed mid-turn holds nothing for longer than its lease. Conversations have no TTL and do
not count in the byte budget (like the single-node store, which pins them).
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import zstandard

from ocxproxy.errors import ConversationLocked, FailureReason, StoreFailure
from ocxproxy.model import NO_CALLS, ItemIds, Record, Segment, Turn, chain_of

if TYPE_CHECKING:
    from ocxproxy.store.shared_server import Server

# KEYS: head, items, lease. ARGV: the version and entry count this replica holds (0 0:
# none), and a token to take the lease with for a TTL (ms) ('' '': a read without it).
# A hit: {head, version, from, the entries from index `from`}: from 0 unless only appends
# happened since the version held (`base`: the last rewrite's version); a miss: nil (no
# lease taken); 0 while another token holds the lease.
LOAD = """
local taken = false
if ARGV[3] ~= '' then
  local held = redis.call('GET', KEYS[3])
  if held and held ~= ARGV[3] then return 0 end
  if not held then
    redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
    taken = true
  end
end
local h = redis.call('HMGET', KEYS[1], 'head', 'ver', 'base')
if not h[1] then
  if taken then redis.call('DEL', KEYS[3]) end
  return false
end
local from = 0
if tonumber(h[3] or '1') <= tonumber(ARGV[1]) then from = tonumber(ARGV[2]) end
return {h[1], h[2], from, redis.call('LRANGE', KEYS[2], from, -1)}
"""

# Every script may run twice (Server.round_trip tries again on a fresh connection after a
# connection error, when the first may have run): each recognizes its own earlier run.

# KEYS: head, items. ARGV: head, then the first entry (if any). 0 when the id is taken.
CREATE = """
local head = redis.call('HGET', KEYS[1], 'head')
if head then
  if head == ARGV[1] then return 1 end
  return 0
end
redis.call('HSET', KEYS[1], 'head', ARGV[1], 'ver', 1)
if #ARGV > 1 then redis.call('RPUSH', KEYS[2], ARGV[2]) end
return 1
"""

# KEYS: head, items, lease. ARGV: the version the write was computed from, the lease
# token to release with it ('' none), op, head ('' unchanged), this write's id, then the
# op's arguments:
#   append  entry                     a segment appended (a turn, or items added)
#   replace index, entry ('' drop)    a segment rewritten (an item deleted)
#   meta                              the head alone
#   delete                            the whole conversation
# The new version; 0 when the conversation changed (or is gone): nothing written.
WRITE = """
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) == ARGV[2] then redis.call('DEL', KEYS[3]) end
local h = redis.call('HMGET', KEYS[1], 'ver', 'last')
local ver, op = h[1], ARGV[3]
if ver ~= ARGV[1] then
  if h[2] == ARGV[5] then return tonumber(ver) end  -- run twice: written the first time
  if op == 'delete' and not ver then return -1 end  -- gone, by this write or another
  return 0
end
if op == 'delete' then
  redis.call('DEL', KEYS[1], KEYS[2])
  return -1
elseif op == 'append' then
  redis.call('RPUSH', KEYS[2], ARGV[6])
elseif op == 'replace' then
  local at = tonumber(ARGV[6])
  if ARGV[7] == '' then
    redis.call('LSET', KEYS[2], at, '')
    redis.call('LREM', KEYS[2], 1, '')
  else
    redis.call('LSET', KEYS[2], at, ARGV[7])
  end
end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'head', ARGV[4]) end
redis.call('HSET', KEYS[1], 'last', ARGV[5])
local new = redis.call('HINCRBY', KEYS[1], 'ver', 1)
if op == 'replace' then redis.call('HSET', KEYS[1], 'base', new) end
return new
"""

# KEYS: a lease. ARGV: a new token, its TTL (ms). 1 when the token holds it now.
ACQUIRE = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then return 1 end
if held then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: a lease or in-flight key. ARGV: its token, and a TTL (ms) to renew it by ('' to
# release it). 1 while the token holds it.
HOLD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""

# KEYS: completed key, in-flight key. ARGV: this request's marker, TTL (ms).
# {1, entry}: completed; {0}: now in flight for this request; {2, marker}: another runs.
IDEM_BEGIN = """
local done = redis.call('GET', KEYS[1])
if done then return {1, done} end
local running = redis.call('GET', KEYS[2])
if running and running ~= ARGV[1] then return {2, running} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return {0}
"""

# KEYS: completed key, in-flight key. ARGV: the entry, its TTL (ms), this request's marker.
IDEM_DONE = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
"""

SCRIPTS = {
    "conversation_load": LOAD,
    "conversation_create": CREATE,
    "conversation_write": WRITE,
    "lease_acquire": ACQUIRE,
    "lease": HOLD,
    "idempotency_begin": IDEM_BEGIN,
    "idempotency_done": IDEM_DONE,
}
SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SCRIPTS.items()}
_WRITES = {"conversation_create", "conversation_write", "idempotency_done"}

_CACHED_BYTES = 64 * 1024 * 1024  # conversations' items a replica keeps between turns
_HEAD = struct.Struct("<BI")  # version, length of the entry's metadata JSON
_VERSION = 1
_compressor = zstandard.ZstdCompressor(level=3)
_decompressor = zstandard.ZstdDecompressor()


def _pack(data: bytes) -> bytes:
    compressed = _compressor.compress(data)
    return b"z" + compressed if len(compressed) < len(data) else b"r" + data


def _unpack(value: bytes) -> bytes:
    if value[:1] == b"z":
        return bytes(_decompressor.decompress(value[1:]))
    if value[:1] == b"r":
        return value[1:]
    raise ValueError("unknown packing")


def encode_entry(segment: Segment, ids: Sequence[str]) -> bytes:
    """One append: the segment (bytes as forwarded, its metadata) and its items' ids."""
    assert segment.data is not None
    meta = orjson.dumps(
        [list(ids), segment.n_items, sorted(segment.call_ids), list(segment.item_ids)]
    )
    return b"".join((_HEAD.pack(_VERSION, len(meta)), meta, _pack(segment.data)))


def decode_entry(value: bytes) -> tuple[Segment, list[str]]:
    try:
        version, size = _HEAD.unpack_from(value)
        if version != _VERSION:
            raise ValueError(f"unknown entry version {version}")
        ids, n_items, call_ids, spans = orjson.loads(value[_HEAD.size : _HEAD.size + size])
        data = _unpack(value[_HEAD.size + size :])
    except (struct.error, orjson.JSONDecodeError, zstandard.ZstdError, ValueError, TypeError):
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


def new_token() -> str:
    return secrets.token_hex(12)


def shared_conversations(store: object) -> SharedConversations | None:
    """The store's shared conversations (a SharedStore's), or None (single-node)."""
    found = getattr(store, "conversations", None)
    return found if isinstance(found, SharedConversations) else None


def conversation_record(
    conversation_id: str,
    scope: str,
    head: bytes,
    version: int,
    entries: Sequence[tuple[Segment, list[str]]],
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
    )


def flatten(turn: Turn, parent: Record) -> Turn:
    """A turn on a conversation as a turn of its own: its segment the conversation's items
    followed by its own (the bytes the backend was sent, in order), so the response is
    retrievable and continuable from any replica without the conversation."""
    datas = [s.data for s in parent.segments if s.data]
    if not datas:
        return turn
    offset = sum(len(d) + 1 for d in datas)
    spans = [(i, s + at, e + at) for seg, at in _offsets(parent) for i, s, e in seg.item_ids]
    spans += [(i, s + offset, e + offset) for i, s, e in turn.item_ids]
    call_ids = frozenset().union(*(s.call_ids for s in parent.segments), turn.call_ids)
    return Turn(
        response_id=turn.response_id,
        scope=turn.scope,
        durable=turn.durable,
        items=b",".join((*datas, turn.items)),
        n_items=parent.n_items + turn.n_items,
        call_ids=call_ids or NO_CALLS,
        response=turn.response,
        item_ids=ItemIds(spans),
        backend=turn.backend,
        affinity_key=turn.affinity_key,
        stored=turn.stored,
    )


def _offsets(record: Record) -> list[tuple[Segment, int]]:
    out, at = [], 0
    for segment in record.segments:
        if segment.data:
            out.append((segment, at))
            at += len(segment.data) + 1
    return out


class SharedConversations:
    """The round trips for conversations, leases and Idempotency-Keys (one each)."""

    def __init__(self, server: Server, prefix: str) -> None:
        self.server = server
        self.prefix = prefix
        # The conversations read last (LRU, by bytes): a load then fetches only the entries
        # appended since (entries are rewritten only by a deleted item, which `base` says).
        self._cache: OrderedDict[tuple[str, str], ConversationRecord] = OrderedDict()
        self._cached_bytes = 0

    def _base(self, scope: str) -> str:
        return f"{self.prefix}{scope}:"

    def _keys(self, scope: str, conversation_id: str) -> list[str]:
        base = self._base(scope)
        head = f"{base}conv:{conversation_id}"
        return [head, head + ":items", f"{base}lock:{conversation_id}"]

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One script (registered with the server's own: shared_server.register_scripts);
        a write of conversation state waits for replicas like a turn's commit."""
        if name in _WRITES:
            sha = SHAS[name]
            return await self.server.write(name, lambda: ("EVALSHA", sha, len(keys), *keys, *args))
        return await self.server.script(name, keys, args)

    # -- conversations -------------------------------------------------------------------

    async def load(
        self, scope: str, conversation_id: str, token: str = "", ttl: float = 0.0
    ) -> ConversationRecord | None:
        """The conversation (one round trip), or None; only entries this replica has not
        read before are sent. With a `token`, its lease is taken for `ttl` seconds in the
        same round trip (ConversationLocked while another holds it)."""
        held = self._forget(scope, conversation_id)
        args: list[int | str] = [held.version, len(held.ids)] if held else [0, 0]
        args += [token, max(1, int(ttl * 1000))] if token else ["", ""]
        found = await self._run("conversation_load", self._keys(scope, conversation_id), args)
        if found == 0:
            raise ConversationLocked()
        if found is None:
            return None
        head, version, start, values = found
        entries = []
        if int(start) and held is not None:
            entries = list(zip(held.segments, held.ids, strict=True))[: int(start)]
        entries += [decode_entry(value) for value in values]
        record = conversation_record(conversation_id, scope, head, int(version), entries)
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
        args = [head] if first is None else [head, encode_entry(*first)]
        keys = self._keys(scope, conversation_id)[:2]
        if not await self._run("conversation_create", keys, args):
            raise StoreFailure(FailureReason.WRITE_FAILED, "conversation id taken")
        return conversation_record(conversation_id, scope, head, 1, [first] if first else [])

    async def write(
        self,
        record: ConversationRecord,
        op: str,
        *args: Any,
        head: bytes = b"",
        lease: str = "",
    ) -> int:
        """A write computed from `record` (op and its arguments as WRITE takes them),
        releasing `lease` with it; the new version (-1: deleted), or 0 when the
        conversation changed."""
        keys = self._keys(record.scope, record.id)
        write_id = secrets.token_hex(8)
        args = (record.version, lease, op, head, write_id, *args)
        return int(await self._run("conversation_write", keys, args))

    # -- the lease -----------------------------------------------------------------------

    async def acquire(self, scope: str, conversation_id: str, ttl: float) -> str | None:
        """A token holding the conversation's lease for `ttl` seconds, or None while
        another holder's is live."""
        token = new_token()
        key = self._keys(scope, conversation_id)[2]
        taken = await self._run("lease_acquire", [key], [token, max(1, int(ttl * 1000))])
        return token if taken else None

    async def renew(self, scope: str, conversation_id: str, token: str, ttl: float) -> bool:
        key = self._keys(scope, conversation_id)[2]
        return bool(await self._run("lease", [key], [token, max(1, int(ttl * 1000))]))

    async def release(self, scope: str, conversation_id: str, token: str) -> None:
        await self._run("lease", [self._keys(scope, conversation_id)[2]], [token, ""])

    # -- Idempotency-Keys ----------------------------------------------------------------

    def _idem_keys(self, scope: str, record_id: str) -> list[str]:
        base = self._base(scope)
        return [f"{base}idem:{record_id}", f"{base}idemrun:{record_id}"]

    async def idempotency_begin(
        self, scope: str, record_id: str, marker: str, ttl: float
    ) -> tuple[int, bytes]:
        """(1, the completed entry) | (0, b"") now in flight | (2, the other's marker)."""
        keys = self._idem_keys(scope, record_id)
        found = await self._run("idempotency_begin", keys, [marker, max(1, int(ttl * 1000))])
        state = int(found[0])
        value = bytes(found[1]) if len(found) > 1 else b""
        return state, _unpack(value) if state == 1 else value

    async def idempotency_done(
        self, scope: str, record_id: str, marker: str, entry: bytes, ttl: float
    ) -> None:
        keys = self._idem_keys(scope, record_id)
        await self._run("idempotency_done", keys, [_pack(entry), int(ttl * 1000), marker])

    async def idempotency_hold(
        self, scope: str, record_id: str, marker: str, ttl: float | None
    ) -> None:
        """Renew the in-flight key for `ttl` seconds (None: let it go)."""
        key = self._idem_keys(scope, record_id)[1]
        await self._run("lease", [key], [marker, "" if ttl is None else int(ttl * 1000)])


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
