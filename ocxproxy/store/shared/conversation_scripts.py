"""The server-side scripts of shared conversations, their lease and Idempotency-Keys
(store/shared/conversations.py runs them; Lua by EVALSHA, Redis 7.0 and Valkey alike).

What is kept (a conversation's hash and items list, a completed Idempotency-Key) counts
in the byte budget (--shared-max-bytes) beside the response chains, in four keys of the
layout's reserved scope (shared_keys.kept_keys): what is kept by expiry, each one's bytes, their
total, and the budget's total that the COMMIT script evicts chains by. So past the budget
a commit evicts response chains, never a conversation; a conversation write that the
budget could only take by dropping kept bytes is refused instead (as the single-node
store does). A conversation never expires (as on one node, and as OpenAI keeps them): its
keys have no TTL, so only DELETE or the budget bound it. A completed Idempotency-Key does
expire: each write first takes the entries whose TTL passed out of the count, by the
server's clock (TIME), which is the one that expires keys.

Every script may run twice (Server.round_trip tries again on a fresh connection after a
connection error, when the first may have run): each recognizes its own earlier run.
"""

from __future__ import annotations

import hashlib

from ocxproxy.store.shared import layout

# The write scripts' shared part. KEYS[1..4]: kept (by expiry), their bytes, their total,
# the budget's total. ARGV[1..3]: the TTL (ms) of what the write keeps (0: it never
# expires), the budget (0: none), '1' to write even past it (a turn already answered).
_KEPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local pxat = false
if ARGV[1] ~= '0' then pxat = now + tonumber(ARGV[1]) end
local function keep(key)
  if pxat then redis.call('PEXPIREAT', key, pxat) else redis.call('PERSIST', key) end
end
local function sweep()
  local expired = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 64)) do
    local b = tonumber(redis.call('HGET', KEYS[2], m) or 0)
    redis.call('DECRBY', KEYS[3], b)
    redis.call('DECRBY', KEYS[4], b)
    redis.call('HDEL', KEYS[2], m)
    redis.call('ZREM', KEYS[1], m)
    expired = expired + 1
  end
  return expired
end
local function fits(delta)
  local budget = tonumber(ARGV[2])
  if ARGV[3] == '1' or delta <= 0 or budget <= 0 then return true end
  return tonumber(redis.call('GET', KEYS[3]) or 0) + delta <= budget
end
local function count(member, delta)
  if pxat then
    redis.call('ZADD', KEYS[1], pxat, member)
  else
    redis.call('ZREM', KEYS[1], member)  -- swept by expiry only while it had a TTL
  end
  redis.call('HINCRBY', KEYS[2], member, delta)
  redis.call('INCRBY', KEYS[3], delta)
  redis.call('INCRBY', KEYS[4], delta)
end
local function forget(member)
  local b = tonumber(redis.call('HGET', KEYS[2], member) or 0)
  redis.call('DECRBY', KEYS[3], b)
  redis.call('DECRBY', KEYS[4], b)
  redis.call('HDEL', KEYS[2], member)
  redis.call('ZREM', KEYS[1], member)
end
local function answer(result, expired)
  return {result, tonumber(redis.call('GET', KEYS[4]) or 0), expired}
end
local expired = sweep()
"""

# A lease lives in the server's memory only (`redis.set_repl(redis.REPL_NONE)`: never in
# the AOF, never replicated), so taking one costs no fsync before the backend is called.
# It is an exclusion between live turns, not state: a server restart or a failover drops
# the leases of turns in flight, and then each turn's append is still fenced by the
# version it read (TURN, WRITE): the first to commit wins, the other is refused, 409.
_MEMORY_ONLY = "redis.set_repl(redis.REPL_NONE)\n"

# KEYS: head, items, lease, kept total. ARGV: the version and entry count this replica
# holds (0 0: none), a token to take the lease with for a TTL (ms) ('' '': a read without
# it), the layout's key base of the scope. A hit: {head, version, from, the entries from
# index `from`, top, kept bytes}: from 0 unless only appends happened since the version
# held (`base`: the last rewrite's version); top: {response id, chain token} of the last
# turn's record when its chain holds exactly the conversation's items (a turn's record
# chains on it), else false. A miss: nil (no lease taken); 0 while another token holds
# the lease.
LOAD = (
    _MEMORY_ONLY
    + """
local taken = false
if ARGV[3] ~= '' then
  local held = redis.call('GET', KEYS[3])
  if held and held ~= ARGV[3] then return 0 end
  if not held then
    redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
    taken = true
  end
end
local h = redis.call('HMGET', KEYS[1], 'head', 'ver', 'base', 'resp')
if not h[1] then
  if taken then redis.call('DEL', KEYS[3]) end
  return false
end
local from = 0
if tonumber(h[3] or '1') <= tonumber(ARGV[1]) then from = tonumber(ARGV[2]) end
local top = false
local v = h[4] and redis.call('GET', ARGV[5] .. 'r' .. h[4])
if v then
  local at = string.find(v, ':', 1, true)
  local n = tonumber(string.sub(v, 1, at - 1))
  local token = string.sub(v, at + 1, at + 8)
  if n == redis.call('LLEN', KEYS[2]) and redis.call('LLEN', ARGV[5] .. 'c' .. token) >= n then
    top = {h[4], token}
  end
end
local kept = tonumber(redis.call('GET', KEYS[4]) or 0)
return {h[1], h[2], from, redis.call('LRANGE', KEYS[2], from, -1), top, kept}
"""
)

# KEYS: the four kept keys, head, items. ARGV: the three budget ones, head, then the first
# entry (if any). {1 | 0 the id is taken | -2 no room, total bytes, expired}.
CREATE = (
    _KEPT
    + """
local old = redis.call('HGET', KEYS[5], 'head')
if old then
  if old == ARGV[4] then return answer(1, expired) end
  return answer(0, expired)
end
local delta = #KEYS[5] + #KEYS[6] + #ARGV[4] + 16
if ARGV[5] then delta = delta + #ARGV[5] end
if not fits(delta) then return answer(-2, expired) end
redis.call('HSET', KEYS[5], 'head', ARGV[4], 'ver', 1)
keep(KEYS[5])
if ARGV[5] then
  redis.call('RPUSH', KEYS[6], ARGV[5])
  keep(KEYS[6])
end
count(KEYS[5], delta)
return answer(1, expired)
"""
)

# KEYS: the four kept keys, head, items, lease. ARGV: the three budget ones, the version
# the write was computed from, the lease token to release with it ('' none), op, head (''
# unchanged), this write's id, the response id of a turn's append ('' none), then the op's
# arguments:
#   append  entry                     a segment appended (a turn, or items added)
#   replace index, entry ('' drop)    a segment rewritten (an item deleted)
#   meta                              the head alone
#   delete                            the whole conversation
# {the new version (0: the conversation changed or is gone, nothing written; -1:
# deleted; -2: no room in the budget, nothing written), total bytes, expired}.
WRITE = (
    _KEPT
    + """
local head, items = KEYS[5], KEYS[6]
if ARGV[5] ~= '' and redis.call('GET', KEYS[7]) == ARGV[5] then redis.call('DEL', KEYS[7]) end
local h = redis.call('HMGET', head, 'ver', 'last', 'head')
local ver, op = h[1], ARGV[6]
if ver ~= ARGV[4] then
  if h[2] == ARGV[8] then return answer(tonumber(ver), expired) end  -- run twice
  if op == 'delete' and not ver then return answer(-1, expired) end  -- gone already
  return answer(0, expired)
end
if op == 'delete' then
  redis.call('DEL', head, items)
  forget(head)
  return answer(-1, expired)
end
local delta = 0
if ARGV[7] ~= '' then delta = #ARGV[7] - #h[3] end
if op == 'append' then
  delta = delta + #ARGV[10]
elseif op == 'replace' then
  delta = delta + #ARGV[11] - #(redis.call('LINDEX', items, tonumber(ARGV[10])) or '')
end
if not fits(delta) then return answer(-2, expired) end
if op == 'append' then
  redis.call('RPUSH', items, ARGV[10])
elseif op == 'replace' then
  local at = tonumber(ARGV[10])
  if ARGV[11] == '' then
    redis.call('LSET', items, at, '')
    redis.call('LREM', items, 1, '')
  else
    redis.call('LSET', items, at, ARGV[11])
  end
end
if ARGV[7] ~= '' then redis.call('HSET', head, 'head', ARGV[7]) end
if ARGV[9] ~= '' then
  redis.call('HSET', head, 'resp', ARGV[9])
elseif op ~= 'meta' then
  redis.call('HDEL', head, 'resp')  -- the last turn's chain no longer holds every item
end
redis.call('HSET', head, 'last', ARGV[8])
local new = redis.call('HINCRBY', head, 'ver', 1)
if op == 'replace' then redis.call('HSET', head, 'base', new) end
keep(head)
keep(items)
count(head, delta)
return answer(new, expired)
"""
)

# KEYS: a lease. ARGV: a token, a TTL (ms). The token holds it for the TTL from now
# (taken when free, extended when the token holds it): 1; 0 while another token holds it.
LEASE_HOLD = (
    _MEMORY_ONLY
    + """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
)

# KEYS: an in-flight key (`idempotency_hold`), or a lease (`lease_drop`: memory only). ARGV:
# its token, and a TTL (ms) to renew it by ('' to release it). 1 while the token holds it.
HOLD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""

# A turn's record and its conversation's append, both or neither, in one script (one
# round trip and, with appendfsync always, one fsync): shared_layout.COMMIT and WRITE
# (append) as they are, each over its own KEYS and ARGV. First what can refuse the turn
# without writing: the conversation moved on (its version, unless this is this write's
# own earlier run) or is no hash and list, then COMMIT (its parent's chain gone: OCXLOST,
# before its first write); only then the writes, COMMIT's and the append's.
# KEYS: COMMIT's, then WRITE's (the four kept keys, head, items, lease).
# ARGV: how many of KEYS and ARGV are COMMIT's, COMMIT's, then WRITE's (an append).
# {chain key ('': the conversation changed, nothing written), total bytes, chains
# evicted, expired, the conversation's new version (0: changed)}.
TURN = (
    "local function commit(KEYS, ARGV)\n"
    + layout.COMMIT
    + "end\nlocal function write(KEYS, ARGV)\n"
    + WRITE
    + """end
local function slice(t, from, to)
  local s = {}
  for i = from, to do s[#s + 1] = t[i] end
  return s
end
local nk, na = tonumber(ARGV[1]), tonumber(ARGV[2])
local ck, ca = slice(KEYS, 1, nk), slice(ARGV, 3, 2 + na)
local wk, wa = slice(KEYS, nk + 1, #KEYS), slice(ARGV, 3 + na, #ARGV)
local h = redis.call('HMGET', wk[5], 'ver', 'last')
if h[1] ~= wa[4] and h[2] ~= wa[8] then
  if wa[5] ~= '' and redis.call('GET', wk[7]) == wa[5] then redis.call('DEL', wk[7]) end
  return {'', tonumber(redis.call('GET', wk[4]) or 0), 0, 0, 0}
end
local kind = redis.call('TYPE', wk[6])['ok']
if kind ~= 'list' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE the conversation items are not a list')
end
local c = commit(ck, ca)
if c['err'] then return c end
local w = write(wk, wa)
return {c[1], w[2], c[3], c[4] + w[3], w[1]}
"""
)

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

# KEYS: the four kept keys, completed key, in-flight key. ARGV: the three budget ones, the
# entry, this request's marker. {1, total bytes, expired}.
IDEM_DONE = (
    _KEPT
    + """
local old = redis.call('GET', KEYS[5])
redis.call('SET', KEYS[5], ARGV[4], 'PXAT', pxat)
if redis.call('GET', KEYS[6]) == ARGV[5] then redis.call('DEL', KEYS[6]) end
local delta = #ARGV[4] + #KEYS[5]
if old then delta = #ARGV[4] - #old end
count(KEYS[5], delta)
return answer(1, expired)
"""
)

SCRIPTS = {
    "conversation_load": LOAD,
    "conversation_create": CREATE,
    "conversation_write": WRITE,
    "conversation_turn": TURN,
    "lease_hold": LEASE_HOLD,
    "lease_drop": _MEMORY_ONLY + HOLD,
    "idempotency_hold": HOLD,
    "idempotency_begin": IDEM_BEGIN,
    "idempotency_done": IDEM_DONE,
}
SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SCRIPTS.items()}
WRITES = {"conversation_create", "conversation_write", "conversation_turn", "idempotency_done"}
