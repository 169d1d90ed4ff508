"""The shared tier's layout on Valkey/Redis: the encoding of segments and records, and
the server-side scripts (Lua, run by EVALSHA: Redis 7.0 and Valkey alike) over the keys
keys.py names.

Values are zstd frames (without the magic number: the byte before says what follows)
with the dictionary in dictionary.py (the structure every
turn repeats: a turn of a few hundred bytes compresses to a third), raw when that is not
smaller; a segment's digest is over its raw items, so it is checked after decompressing.

A record reads the first `length` digests of its chain. A turn on a parent whose chain has
grown since (a sibling was appended) forks: a new chain with the parent's digests and its
own, so no record's history ever changes. Every key has a TTL; a commit extends the
chain's and its segments' TTL to its own record's expiry (never shortening one), so a
segment lives as long as the longest-lived record that needs it (plus a tenth of the TTL:
extending them all, O(chain), then happens once per tenth of a TTL, not every turn).

The byte budget counts what each chain's commits added (segments new to the server,
records, digests, index entries); past it, the commit that crossed it evicts the chains
extended longest ago, whole: their lists and segments (a fork sharing those segments loses them too:
its continuations answer `evicted`, like the records that named the chain).
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass
from typing import Any

import orjson

from ocxproxy.model import NO_CALLS, ItemIds, Record, Segment, chain_of
from ocxproxy.store.shared.frame import frame, unframe
from ocxproxy.store.shared.keys import Keys, bucket_end, budget_keys, item_field

# The dictionary of frame.py's values: a new one is a new keys.LAYOUT.
DICTIONARY_SHA256 = "9d345df9c26f62c57c3ebe023aa3d6e87a86dcccc4e3ce4e2c0a399f1e91842d"

TAIL = 2  # the newest segments' values BEGIN sends along: what another replica just added
WINDOW = 8  # the newest digests BEGIN sends: a replica knows the older ones (or asks)

# KEYS[1] the record; ARGV: how many of the newest segments' values to send along, the
# scope's key base, how many of the newest digests to send. A hit: {record, the newest
# digests (fewer: the chain is gone), values of the newest segments}; a miss: nil.
BEGIN = """
local v = redis.call('GET', KEYS[1])
if not v then return false end
local at = string.find(v, ':', 1, true)
local chain = ARGV[2] .. 'c' .. string.sub(v, at + 1, at + 8)
local n = tonumber(string.sub(v, 1, at - 1))
local digests = redis.call('LRANGE', chain, math.max(0, n - tonumber(ARGV[3])), n - 1)
local names = {}
for i = math.max(1, #digests - tonumber(ARGV[1]) + 1), #digests do
  names[#names + 1] = ARGV[2] .. 's' .. digests[i]
end
return {v, digests, #names > 0 and redis.call('MGET', unpack(names)) or {}}
"""

# KEYS[1] the scope's index buckets; ARGV: the item's field, the scope's key base. A hit:
# BEGIN's answer (the own segment's value alone), and the record's id.
ITEM = """
local id
for _, e in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1, 'REV')) do
  id = redis.call('HGET', ARGV[2] .. 'i' .. e, ARGV[1])
  if id then break end
end
if not id then return false end
local v = redis.call('GET', ARGV[2] .. 'r' .. id)
if not v then return false end
local at = string.find(v, ':', 1, true)
local chain = ARGV[2] .. 'c' .. string.sub(v, at + 1, at + 8)
local digests = redis.call('LRANGE', chain, 0, tonumber(string.sub(v, 1, at - 1)) - 1)
local own = digests[#digests]
local value = own and redis.call('GET', ARGV[2] .. 's' .. own) or false
return {v, digests, {value}, id}
"""

# KEYS: record, parent chain, new chain, the budget's three keys (chains by expiry, bytes
#       per chain, total), k segments, then (when the turn has item ids) the index bucket
#       and the scope's buckets.
# ARGV: parent length (0: none), the new digests (the own one last), expiry (ms since
#       epoch), the record's body, record id, the scope's key base, k, now (ms), byte
#       budget, slack (ms), k segment values, then the index bucket's end (ms) and the
#       item ids' fields.
# Returns {chain key, total bytes, chains evicted, chains expired}.
COMMIT = """
local plen = tonumber(ARGV[1])
local old = redis.call('GET', KEYS[1])
if old and string.sub(old, string.find(old, ':', 1, true) + 9) == ARGV[4] then
  -- run twice: already written
  local at = string.find(old, ':', 1, true)
  local chain = ARGV[6] .. 'c' .. string.sub(old, at + 1, at + 8)
  return {chain, tonumber(redis.call('GET', KEYS[6]) or 0), 0, 0}
end
local pxat = ARGV[3]
local k = tonumber(ARGV[7])
local chain = KEYS[3]
local added = #ARGV[4] + #KEYS[1] + 16
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
    added = added + 40 * plen
  end
else
  redis.call('DEL', chain)
end
local n = #ARGV[2] / 32
for i = 1, #ARGV[2], 32 do redis.call('RPUSH', chain, string.sub(ARGV[2], i, i + 31)) end
added = added + 40 * n
local keep = tonumber(pxat) + tonumber(ARGV[10])
for i = 1, k do
  if redis.call('SET', KEYS[6 + i], ARGV[10 + i], 'NX', 'PXAT', keep) then
    added = added + #ARGV[10 + i] + #KEYS[6 + i]
  else
    redis.call('PEXPIREAT', KEYS[6 + i], keep, 'GT')
  end
end
-- A chain's segments expire no sooner than the chain: only when the chain itself must
-- live longer are they all extended (with slack, so not on every commit).
local expires = redis.call('PEXPIRETIME', chain)
if expires < tonumber(pxat) then
  for _, d in ipairs(redis.call('LRANGE', chain, 0, -1)) do
    redis.call('PEXPIREAT', ARGV[6] .. 's' .. d, keep, 'GT')
  end
  if expires < 0 then
    redis.call('PEXPIREAT', chain, keep)
  else
    redis.call('PEXPIREAT', chain, keep, 'GT')
  end
end
redis.call('SET', KEYS[1], (plen + n) .. ':' .. string.sub(chain, -8) .. ARGV[4], 'PXAT', pxat)
if #ARGV > 11 + k then
  -- The item index: a field per item in the bucket of records expiring by its end; a
  -- new bucket gets its TTL and joins the scope's buckets (those past are dropped).
  local bucket, buckets, fields = KEYS[7 + k], KEYS[8 + k], {}
  for i = 12 + k, #ARGV do
    fields[#fields + 1] = ARGV[i]
    fields[#fields + 1] = ARGV[5]
    added = added + #ARGV[i] + #ARGV[5]
  end
  redis.call('HSET', bucket, unpack(fields))
  if redis.call('PEXPIRETIME', bucket) < 0 then
    local ends = ARGV[11 + k]
    redis.call('PEXPIREAT', bucket, ends)
    local now = redis.call('TIME')  -- the server's clock, which expires the buckets
    redis.call('ZREMRANGEBYSCORE', buckets, '-inf', now[1] .. string.format('%03d', now[2] / 1000))
    redis.call('ZADD', buckets, ends, ends)
    redis.call('PEXPIREAT', buckets, ends, 'GT')
    if redis.call('PEXPIRETIME', buckets) < 0 then redis.call('PEXPIREAT', buckets, ends) end
    added = added + #bucket + #buckets + 2 * #ends
  end
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
  local segments = string.sub(oldest, 1, -10) .. 's'  -- its scope's base: 'c' and a token off
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

LOST = "OCXLOST"  # the commit script's error when the parent's chain went meanwhile
# The chain token of a record kept alone (KEEP_LOST): no chain is ever written under it.
ALONE = bytes(8)

# KEYS: the record, a chain never written (its budget's name), the budget's three keys.
#       ARGV: the record's value, expiry (ms since epoch).
# A turn whose parent's chain went while it ran (evicted, expired: COMMIT answered OCXLOST)
# is kept all the same, as on one node: its record alone, its chain token ALONE, with its
# whole response object (no segment holds its output), so GET answers it and its
# continuations answer `evicted`. Its bytes count as a chain of their own (they leave the
# count when it expires, or is evicted). Returns the total bytes.
KEEP_LOST = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PXAT', ARGV[2])
  local added = #ARGV[1] + #KEYS[1] + 16
  redis.call('ZADD', KEYS[3], 'GT', ARGV[2], KEYS[2])
  redis.call('HINCRBY', KEYS[4], KEYS[2], added)
  redis.call('INCRBY', KEYS[5], added)
end
return tonumber(redis.call('GET', KEYS[5]) or 0)
"""
# Chain tokens need to be unique, not secret (a scope's keys answer only that scope): a
# generator seeded from the OS (again in a forked child), not a getrandom() a commit.
_tokens = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _tokens.seed(os.urandom(32)))


@dataclass(slots=True)
class SharedRecord(Record):
    """A record of the shared tier: also where its history is (chain key, length)."""

    chain: bytes = b""
    length: int = 0


def commit_call(
    keys: Keys, record: SharedRecord, parent: Record | None, now_ms: int, budget: int
) -> tuple[list[bytes], list[Any]]:
    """COMMIT's keys and arguments for `record` (its own segment new on top of `parent`'s
    chain): the new segments' values (the own one; every one of a conversation turn's
    record on no chain yet), the record's body, the item index, the budget."""
    own = record.segments[-1]
    new_chain = keys.chain(_tokens.randbytes(8))
    shared = parent if isinstance(parent, SharedRecord) else None
    plen = shared.length if shared else 0
    parent_chain = shared.chain if shared and plen else new_chain
    new = record.segments[plen:]
    script_keys = [keys.record(record.id), parent_chain, new_chain]
    script_keys += [*budget_keys(keys.prefix), *(keys.segment(s.key) for s in new)]
    digests = b"".join(bytes.fromhex(s.key) for s in new)
    expires = round(record.expires_at * 1000)
    args: list[Any] = [plen, digests, expires, record_body(record)]
    slack = int((record.expires_at - record.created_at) * 100)  # a tenth of the TTL, in ms
    args += [record.id, keys.base, len(new), now_ms, budget, slack]
    for segment in new:
        assert segment.data is not None
        args.append(encode_segment(segment, segment.data))
    fields = {item_field(item_id) for item_id in own.item_ids.ids}
    if fields:
        ends = bucket_end(expires, slack * 10)
        script_keys += [keys.bucket(ends), keys.buckets()]
        args += [ends, *sorted(fields)]
    return script_keys, args


def keep_lost_call(keys: Keys, record: SharedRecord) -> tuple[list[bytes], list[Any]]:
    """KEEP_LOST's keys and arguments: `record` (its whole length, its whole response)
    alone, on no chain (ALONE); counted in the budget as a chain never written."""
    value = b"%d:" % record.length + ALONE + record_body(record, whole=True)
    budget = keys.chain(_tokens.randbytes(8))
    script_keys = [keys.record(record.id), budget, *budget_keys(keys.prefix)]
    return script_keys, [value, round(record.expires_at * 1000)]


def encode_segment(segment: Segment, data: bytes) -> bytes:
    """A segment's value: its metadata (items, call ids, item spans) and its items."""
    meta = orjson.dumps([segment.n_items, sorted(segment.call_ids), list(segment.item_ids)])
    return frame(meta, data)


def decode_segment(digest: str, value: bytes) -> Segment:
    """The segment stored under `digest`; ValueError when it is not what it claims."""
    try:
        (n_items, call_ids, spans), data = unframe(value)
    except (ValueError, TypeError) as exc:
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


def response_of(record: Record) -> bytes:
    """A shared record's response object, its output items put back from its own segment
    when they were cut."""
    assert isinstance(record.response, Segment)  # (the shared tier's records keep theirs so)
    skeleton = record.response.data
    assert skeleton is not None  # in the record's value, as BEGIN returned it
    if record.output_at is None:
        return skeleton
    own = record.segments[-1].data
    assert own is not None
    offset, length = record.output_at
    return b"".join((skeleton[:offset], own[len(own) - length :], skeleton[offset:]))


def record_body(record: Record, *, whole: bool = False) -> bytes:
    """A record's value after `{length}:{chain token}`: its meta and the response object,
    its id cut out (the key has it) and put back where the meta says; `whole`, with its
    output (a record kept alone: no segment of it is written)."""
    assert isinstance(record.response, Segment)  # (the shared tier's records keep theirs so)
    skeleton = response_of(record) if whole else record.response.data
    assert skeleton is not None
    rid = record.id.encode()
    at = skeleton.find(b'"id":"' + rid + b'"')
    if at >= 0:
        at += 6
        skeleton = skeleton[:at] + skeleton[at + len(rid) :]
    meta = [
        round(record.created_at * 1000),
        record.expires_at,  # exactly: a replica's clock decides (the server's is in ms)
        record.n_items,
        None if whole else record.output_at,
        record.backend,
        record.affinity_key,
        record.stored,
        at,
    ]
    return frame(orjson.dumps(meta), skeleton)


@dataclass(frozen=True, slots=True)
class Head:
    """A record's value as BEGIN returns it: where its history is, and its body."""

    length: int
    chain: bytes  # the chain's token
    meta: list[Any]
    skeleton: bytes

    @property
    def expires_at(self) -> float:
        return float(self.meta[1])


def read_head(record_id: str, value: bytes) -> Head:
    """A record's value parsed; ValueError when it is not a record of this layout."""
    at = value.find(b":")
    try:
        length = int(value[:at])
        meta, skeleton = unframe(value[at + 9 :])
        if meta[7] >= 0:
            skeleton = b"".join((skeleton[: meta[7]], record_id.encode(), skeleton[meta[7] :]))
    except (ValueError, TypeError, IndexError) as exc:
        raise ValueError(f"record {record_id} unreadable: {exc}") from None
    return Head(length, value[at + 1 : at + 9], meta, skeleton)


def decode_record(
    keys: Keys, record_id: str, head: Head, segments: tuple[Segment, ...]
) -> SharedRecord:
    """A record from its parsed value and its segments."""
    created, expires, n_items, output_at, backend, affinity_key, stored, _ = head.meta
    skeleton = head.skeleton
    response = Segment.restore("", len(skeleton), 0, NO_CALLS, durable=True, data=skeleton)
    return SharedRecord(
        id=record_id,
        scope=keys.scope,
        created_at=created / 1000,
        expires_at=expires,
        durable=True,
        links=chain_of(segments),
        built=segments,
        response=response,
        backend=backend,
        affinity_key=affinity_key,
        n_items=n_items,
        output_at=tuple(output_at) if output_at is not None else None,
        stored=stored,
        chain=keys.chain(head.chain),
        length=len(segments),
    )
