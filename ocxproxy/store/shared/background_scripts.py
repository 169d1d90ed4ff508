"""The server-side scripts of background responses on the shared store (background.py runs
them; Lua by EVALSHA, Redis 7.0 and Valkey alike). Keys: keys.py (`Keys.background`,
`background_log`, `background_keys`); a response's key is its member in the sorted sets
and the hash of log sizes, and its log's key is that key and a NUL byte.

Time is the server's (TIME), the clock every replica shares: a lease's end, a log's end.
Each script may run twice (Server.round_trip tries once more on a fresh connection): a
write names the sequence number of its first event, and events already in are skipped.
"""

from __future__ import annotations

import hashlib

_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local TERMINAL = {completed = true, incomplete = true, failed = true, cancelled = true}
"""

# KEYS: the response, running, ended logs, log sizes, log total (an open's with a parent:
# and the set of the responses continuing it, which takes its id). ARGV: mode ('open': a new
# one, 'own': its owner's write, 'cancel': another replica's cancel), the owner's token,
# the first event's sequence number (-1: each is numbered here, at the log's end: a
# cancel's `response.cancelled`), the status ('' for none), the Response ('' for
# none), the lease (ms), how long a log is kept after the end (ms), how long the response
# is (ms), the logs' byte budget, the channel, the id, the scope, '1' for a stream, its
# own input items and the id of the response whose chain comes before them ('' for none;
# both kept until the store holds the turn, completed or incomplete), the events. Answers
# {'ok', log total}, or {'ended'|'lost', status, Response} when the write
# is refused (it ended, or its lease went to another replica), or {'gone'}.
WRITE = (
    _COMMON
    + """
local job, running, ended, sizes, total = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local log = job .. '\\0'
local mode, status = ARGV[1], ARGV[4]
local current = redis.call('HGET', job, 'status')
if mode == 'open' then
  if not current then
    redis.call('HSET', job, 'owner', ARGV[2], 'id', ARGV[11], 'scope', ARGV[12],
      'stream', ARGV[13])
    if ARGV[14] ~= '' then redis.call('HSET', job, 'own', ARGV[14]) end
    if ARGV[15] ~= '' then
      redis.call('HSET', job, 'parent', ARGV[15])
      redis.call('SADD', KEYS[6], ARGV[11])
      redis.call('PEXPIRE', KEYS[6], ARGV[8])
    end
  end
elseif not current then
  return {'gone'}
elseif TERMINAL[current] then
  return {'ended', current, redis.call('HGET', job, 'response')}
elseif mode == 'own' and redis.call('HGET', job, 'owner') ~= ARGV[2] then
  return {'lost', current, redis.call('HGET', job, 'response')}
end
local n = redis.call('LLEN', log)
local added = 0
local start = tonumber(ARGV[3])
for i = 16, #ARGV do
  local event, seq = ARGV[i], start + i - 16
  if start < 0 then
    seq = n
    event = (string.gsub(event, '"sequence_number":%-?%d+', '"sequence_number":' .. n, 1))
  end
  if seq == n then
    redis.call('RPUSH', log, event)
    n = n + 1
    added = added + #event
  elseif seq > n then
    return redis.error_reply('ERR background log gap at ' .. seq .. ', log has ' .. n)
  end
end
if added > 0 then
  redis.call('HINCRBY', sizes, job, added)
  redis.call('INCRBY', total, added)
end
if status ~= '' then
  redis.call('HSET', job, 'status', status)
  if ARGV[5] ~= '' then redis.call('HSET', job, 'response', ARGV[5]) end
  if status == 'completed' or status == 'incomplete' then
    redis.call('HDEL', job, 'input', 'own', 'parent')
  end
end
local function drop(member)
  redis.call('DECRBY', total, tonumber(redis.call('HGET', sizes, member) or 0))
  redis.call('HDEL', sizes, member)
  redis.call('ZREM', ended, member)
  redis.call('DEL', member .. '\\0')
end
if TERMINAL[status] then
  redis.call('ZREM', running, job)
  redis.call('PEXPIRE', job, ARGV[8])
  if redis.call('EXISTS', log) == 1 then
    redis.call('PEXPIRE', log, ARGV[7])
    redis.call('ZADD', ended, now, job)
  end
elseif mode ~= 'cancel' then
  redis.call('ZADD', running, now + tonumber(ARGV[6]), job)
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', ended, '-inf', now - tonumber(ARGV[7]),
    'LIMIT', 0, 64)) do
  drop(m)
end
local budget = tonumber(ARGV[9])
while budget > 0 and tonumber(redis.call('GET', total) or 0) > budget do
  local oldest = redis.call('ZRANGE', ended, 0, 0)
  if #oldest == 0 then break end
  drop(oldest[1])
end
if added > 0 or status ~= '' then redis.call('PUBLISH', ARGV[10], 'e' .. job) end
if mode == 'cancel' then redis.call('PUBLISH', ARGV[10], 'c' .. job) end
return {'ok', tonumber(redis.call('GET', total) or 0)}
"""
)

# KEYS: running. ARGV: the owner's token, the lease (ms), the keys of the responses it
# runs. Each one still its own and running gets a new lease end; answers, for each other
# one, {key, status ('' when gone), Response ('' when gone)}.
RENEW = (
    _COMMON
    + """
local out = {}
for i = 3, #ARGV do
  local job = ARGV[i]
  local status = redis.call('HGET', job, 'status')
  if status and not TERMINAL[status] and redis.call('HGET', job, 'owner') == ARGV[1] then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), job)
  else
    table.insert(out, {job, status or '', redis.call('HGET', job, 'response') or ''})
  end
end
return out
"""
)

# KEYS: running. ARGV: the claimer's token, the lease (ms), how many at most. The responses
# whose lease ended become the claimer's (a new lease, so a claimer that dies before it
# fails them leaves them to the next); answers {key, id, scope, status, Response, stream,
# log length} for each.
CLAIM = (
    _COMMON
    + """
local out = {}
for _, job in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[3])) do
  local status = redis.call('HGET', job, 'status')
  if not status or TERMINAL[status] then
    redis.call('ZREM', KEYS[1], job)
  else
    redis.call('HSET', job, 'owner', ARGV[1])
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), job)
    local f = redis.call('HMGET', job, 'id', 'scope', 'response', 'stream')
    table.insert(out, {job, f[1], f[2], status, f[3], f[4], redis.call('LLEN', job .. '\\0')})
  end
end
return out
"""
)

# KEYS: the response, running, ended logs, log sizes, log total. ARGV: the channel. The
# response is deleted, its log with it (its followers read it gone: their streams end).
DROP = """
local job = KEYS[1]
redis.call('ZREM', KEYS[2], job)
redis.call('ZREM', KEYS[3], job)
redis.call('DECRBY', KEYS[5], tonumber(redis.call('HGET', KEYS[4], job) or 0))
redis.call('HDEL', KEYS[4], job)
redis.call('DEL', job, job .. '\\0')
redis.call('PUBLISH', ARGV[1], 'e' .. job)
return 1
"""

# KEYS: the response. ARGV: the id of the response it continues, its whole input. Kept as
# its own input (its parent forgotten) while it still names that parent (a turn stored
# meanwhile has neither).
KEEP_WHOLE = """
if redis.call('HGET', KEYS[1], 'parent') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'own', ARGV[2])
redis.call('HDEL', KEYS[1], 'parent')
return 1
"""

SCRIPTS = {
    "background_write": WRITE,
    "background_keep_whole": KEEP_WHOLE,
    "background_renew": RENEW,
    "background_claim": CLAIM,
    "background_drop": DROP,
}
SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SCRIPTS.items()}
