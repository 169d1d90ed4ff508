"""The shared tier's layout on Valkey/Redis: key names, the encoding of segments and
records, and the server-side scripts (Lua, run by EVALSHA: Redis 7.0 and Valkey alike).

Every key starts with the prefix and the caller's scope hash (CONTRACT.md C5), so one
credential's keys never answer another's and a scan per scope is one pattern:

    {prefix}{scope}:s:{sha256}   a segment: its metadata and zstd bytes, written once
    {prefix}{scope}:c:{token}    a chain: the list of its segments' digests, oldest first
    {prefix}{scope}:r:{id}       a record (hash): chain key, chain length, meta (JSON)
    {prefix}{scope}:i:{item id}  the id of the newest record whose own segment holds it
    {prefix}_:chains, _:bytes, _:total   the byte budget's bookkeeping (no content)

A record reads the first `len` digests of its chain. A turn on a parent whose chain has
grown since (a sibling was appended) forks: a new chain with the parent's digests and its
own, so no record's history ever changes. Every key has a TTL; a commit extends the
chain's and its segments' TTL to its own record's expiry (never shortening one), so a
segment lives as long as the longest-lived record that needs it (plus a tenth of the TTL:
extending them all, O(chain), then happens once per tenth of a TTL, not every turn).

The byte budget counts what each chain's commits added (segments new to the server,
records, digests); past it, the commit that crossed it evicts the chains extended longest
ago, whole: their lists and segments (a fork sharing those segments loses them too:
its continuations answer `evicted`, like the records that named the chain).
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from dataclasses import dataclass
from typing import Any

import orjson
import zstandard

from ocxproxy.model import ItemIds, Record, Segment, chain_of

_HEAD = struct.Struct("<BI")  # version, length of the metadata JSON
_VERSION = 1

TAIL = 2  # the newest segments' values BEGIN sends along: what another replica just added

# KEYS[1] the record; ARGV: how many of the newest segments' values to send along, the
# segment key prefix. A hit: {meta, chain key, digests, values of the newest}; a miss: nil.
BEGIN = """
local r = redis.call('HMGET', KEYS[1], 'chain', 'len', 'meta')
if not r[3] then return false end
local digests = redis.call('LRANGE', r[1], 0, tonumber(r[2]) - 1)
local tail = {}
for i = math.max(1, #digests - tonumber(ARGV[1]) + 1), #digests do
  tail[#tail + 1] = redis.call('GET', ARGV[2] .. digests[i]) or false
end
return {r[3], r[1], digests, tail}
"""

# KEYS[1] the item index key; ARGV: the record and segment key prefixes of its scope.
# A hit: BEGIN's answer (the own segment's value alone), and the record's id.
ITEM = """
local id = redis.call('GET', KEYS[1])
if not id then return false end
local r = redis.call('HMGET', ARGV[1] .. id, 'chain', 'len', 'meta')
if not r[3] then return false end
local digests = redis.call('LRANGE', r[1], 0, tonumber(r[2]) - 1)
local own = digests[#digests]
local value = own and redis.call('GET', ARGV[2] .. own) or false
return {r[3], r[1], digests, {value}, id}
"""

# KEYS: record, parent chain, new chain, the budget's three keys (chains by expiry, bytes
#       per chain, total), k segments, then item index keys.
# ARGV: parent length (0: none), own digest, expiry (ms since epoch), meta, record id,
#       segment key prefix, k, now (ms), byte budget, slack (ms), the response object
#       (packed), then k segment values.
# Returns {chain key, total bytes, chains evicted, chains expired}.
COMMIT = """
if redis.call('HGET', KEYS[1], 'meta') == ARGV[4] then  -- run twice: already written
  return {redis.call('HGET', KEYS[1], 'chain'), tonumber(redis.call('GET', KEYS[6]) or 0), 0, 0}
end
local plen = tonumber(ARGV[1])
local pxat = ARGV[3]
local k = tonumber(ARGV[7])
local chain = KEYS[3]
local added = #ARGV[4] + #ARGV[11] + #KEYS[1] + 64
if plen > 0 then
  local n = redis.call('LLEN', KEYS[2])
  if n < plen then return redis.error_reply('OCXLOST the parent chain is gone') end
  if n == plen then
    chain = KEYS[2]
  else
    redis.call('DEL', chain)
    for i = 0, plen - 1, 1000 do
      local part = redis.call('LRANGE', KEYS[2], i, math.min(i + 999, plen - 1))
      redis.call('RPUSH', chain, unpack(part))
    end
    added = added + 72 * plen
  end
else
  redis.call('DEL', chain)
end
redis.call('RPUSH', chain, ARGV[2])
added = added + 72
local keep = tonumber(pxat) + tonumber(ARGV[10])
for i = 1, k do
  if redis.call('SET', KEYS[6 + i], ARGV[11 + i], 'NX', 'PXAT', keep) then
    added = added + #ARGV[11 + i] + #KEYS[6 + i]
  else
    redis.call('PEXPIREAT', KEYS[6 + i], keep, 'GT')
  end
end
-- A chain's segments expire no sooner than the chain: only when the chain itself must
-- live longer are they all extended (with slack, so not on every commit).
local expires = redis.call('PEXPIRETIME', chain)
if expires < tonumber(pxat) then
  for _, d in ipairs(redis.call('LRANGE', chain, 0, -1)) do
    redis.call('PEXPIREAT', ARGV[6] .. d, keep, 'GT')
  end
  if expires < 0 then
    redis.call('PEXPIREAT', chain, keep)
  else
    redis.call('PEXPIREAT', chain, keep, 'GT')
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'chain', chain, 'len', plen + 1, 'meta', ARGV[4], 'resp', ARGV[11])
redis.call('PEXPIREAT', KEYS[1], pxat)
for i = 7 + k, #KEYS do
  redis.call('SET', KEYS[i], ARGV[5], 'PXAT', pxat)
end
-- The budget: bytes per chain, chains by expiry. Expired chains leave the count; past
-- the budget the chain extended longest ago goes whole, with its segments.
redis.call('ZADD', KEYS[4], 'GT', pxat, chain)
redis.call('HINCRBY', KEYS[5], chain, added)
local total = redis.call('INCRBY', KEYS[6], added)
local expired = 0
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ARGV[8], 'LIMIT', 0, 64)) do
  total = redis.call('DECRBY', KEYS[6], tonumber(redis.call('HGET', KEYS[5], old) or 0))
  redis.call('HDEL', KEYS[5], old)
  redis.call('ZREM', KEYS[4], old)
  expired = expired + 1
end
local evicted = 0
local budget = tonumber(ARGV[9])
while budget > 0 and total > budget do
  local oldest = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
  if not oldest or oldest == chain then break end
  local segments = string.match(oldest, '^(.*):c:[^:]*$') .. ':s:'
  for _, d in ipairs(redis.call('LRANGE', oldest, 0, -1)) do
    redis.call('DEL', segments .. d)
  end
  redis.call('DEL', oldest)
  total = redis.call('DECRBY', KEYS[6], tonumber(redis.call('HGET', KEYS[5], oldest) or 0))
  redis.call('HDEL', KEYS[5], oldest)
  redis.call('ZREM', KEYS[4], oldest)
  evicted = evicted + 1
end
return {chain, total, evicted, expired}
"""

LOST = "OCXLOST"  # the commit script's error when the parent's chain expired meanwhile


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names of one scope."""

    prefix: str
    scope: str

    @property
    def base(self) -> str:
        return f"{self.prefix}{self.scope}:"

    def record(self, record_id: str) -> str:
        return f"{self.base}r:{record_id}"

    def chain(self, token: str) -> str:
        return f"{self.base}c:{token}"

    def segment(self, digest: str) -> str:
        return f"{self.base}s:{digest}"

    def item(self, item_id: str) -> str:
        return f"{self.base}i:{item_id}"


def budget_keys(prefix: str) -> tuple[str, str, str]:
    """The byte budget's keys: a reserved scope `_` (a scope is a hash or `anonymous`)."""
    return f"{prefix}_:chains", f"{prefix}_:bytes", f"{prefix}_:total"


@dataclass(slots=True)
class SharedRecord(Record):
    """A record of the shared tier: also where its history is (chain key, length)."""

    chain: str = ""
    length: int = 0


def commit_call(
    keys: Keys, record: SharedRecord, parent: Record | None, now_ms: int, budget: int
) -> tuple[list[str], list[Any]]:
    """COMMIT's keys and arguments for `record` (its own segment new on top of `parent`'s
    chain): the own segment's value, the response object, the item index, the budget."""
    own, response = record.segments[-1], record.response
    assert own.data is not None and response.data is not None
    new_chain = keys.chain(secrets.token_hex(8))
    parent_chain = parent.chain if isinstance(parent, SharedRecord) else new_chain
    plen = parent.length if isinstance(parent, SharedRecord) else 0
    script_keys = [keys.record(record.id), parent_chain, new_chain]
    script_keys += [*budget_keys(keys.prefix), keys.segment(own.key)]
    script_keys += [keys.item(item_id) for item_id in own.item_ids.ids]
    args: list[Any] = [plen, own.key, int(record.expires_at * 1000), record_meta(record)]
    slack = int((record.expires_at - record.created_at) * 100)  # a tenth of the TTL, in ms
    args += [record.id, keys.segment(""), 1, now_ms, budget, slack, pack(response.data)]
    args.append(encode_segment(own, own.data))
    return script_keys, args


_compressor = zstandard.ZstdCompressor(level=3)
_decompressor = zstandard.ZstdDecompressor()
_RAW, _ZSTD = b"r", b"z"


def pack(data: bytes) -> bytes:
    """`data` zstd-compressed when that makes it smaller (small items often do not)."""
    compressed = _compressor.compress(data)
    return _ZSTD + compressed if len(compressed) < len(data) else _RAW + data


def unpack(value: bytes) -> bytes:
    kind, body = value[:1], value[1:]
    if kind == _RAW:
        return body
    if kind == _ZSTD:
        return bytes(_decompressor.decompress(body))
    raise ValueError(f"unknown packing {kind!r}")


def encode_segment(segment: Segment, data: bytes) -> bytes:
    """A segment's value: version, metadata (items, call ids, item spans), packed bytes."""
    meta = orjson.dumps([segment.n_items, sorted(segment.call_ids), list(segment.item_ids)])
    return b"".join((_HEAD.pack(_VERSION, len(meta)), meta, pack(data)))


def decode_segment(digest: str, value: bytes) -> Segment:
    """The segment stored under `digest`; ValueError when it is not what it claims."""
    try:
        version, size = _HEAD.unpack_from(value)
        if version != _VERSION:
            raise ValueError(f"unknown segment version {version}")
        n_items, call_ids, spans = orjson.loads(value[_HEAD.size : _HEAD.size + size])
        data = unpack(value[_HEAD.size + size :])
    except (struct.error, orjson.JSONDecodeError, zstandard.ZstdError, TypeError) as exc:
        raise ValueError(f"segment {digest[:12]} unreadable: {exc}") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"segment {digest[:12]} failed its digest")
    return Segment.restore(
        digest,
        len(data),
        n_items,
        frozenset(call_ids),
        durable=True,
        data=data,
        item_ids=ItemIds([tuple(span) for span in spans]),
    )


def record_meta(record: Record) -> bytes:
    return orjson.dumps(
        {
            "t": record.created_at,
            "e": record.expires_at,
            "n": record.n_items,
            "l": len(record.segments),
            "o": record.output_at,
            "b": record.backend,
            "a": record.affinity_key,
            "s": record.stored,
        }
    )


def decode_record(
    record_id: str, scope: str, m: dict[str, Any], segments: tuple[Segment, ...], chain: str
) -> SharedRecord:
    """A record from its meta (JSON, decoded) and its segments; the response object is in
    the record's hash, read when asked for (`response` holds no bytes)."""
    response = Segment.restore("", 0, 0, frozenset(), durable=True)
    output_at = m["o"]
    return SharedRecord(
        id=record_id,
        scope=scope,
        created_at=m["t"],
        expires_at=m["e"],
        durable=True,
        links=chain_of(segments),
        built=segments,
        response=response,
        backend=m["b"],
        affinity_key=m["a"],
        n_items=m["n"],
        output_at=tuple(output_at) if output_at is not None else None,
        stored=m["s"],
        chain=chain,
        length=len(segments),
    )
