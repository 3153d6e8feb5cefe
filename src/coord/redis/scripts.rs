//! The Lua scripts behind the Redis coordinator: each makes one multi-key change atomic.

use std::sync::LazyLock;

use redis::Script;

/// `put_hash`: replace the hash whole, like the in-process `DEL` + `HSET` + `PEXPIRE`.
/// KEYS[1] the key; ARGV[1] TTL in ms, then field, value, field, value… An empty field list
/// leaves no key (Redis has no empty hashes). HSET goes in slices so that `unpack` stays
/// within Lua's stack however many fields there are.
pub(super) static PUT_HASH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
redis.call('DEL', KEYS[1])
if #ARGV > 1 then
  for i = 2, #ARGV, 200 do
    redis.call('HSET', KEYS[1], unpack(ARGV, i, math.min(i + 199, #ARGV)))
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return 1
",
    )
});

/// The next fencing token of the counter at the given key, as a decimal string: one past
/// the last, and never below Redis's clock in microseconds. A counter alone restarts at 1
/// when Redis comes back empty (a node replaced, a pod rescheduled, no persistence), below
/// the tokens every replica remembers, and their owners' messages would be refused as old
/// for good; the clock makes a token issued after the restart larger than any issued
/// before it (tokens are issued far slower than one a microsecond), provided the clock of
/// the Redis that comes back is not behind its predecessor's by more than the outage lasted
/// (NTP keeps hosts within milliseconds; docs/operations.md says so). Microseconds since
/// 1970 stay below 2^53, so Lua's doubles hold them exactly.
const NEXT_FENCE: &str = r"
local function next_fence(key)
  local now = redis.call('TIME')
  local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local last = tonumber(redis.call('GET', key) or '0')
  local token = string.format('%d', math.max(last + 1, floor))
  redis.call('SET', key, token)
  return token
end
";

/// `acquire_lease`. KEYS[1] the lease, KEYS[2] its fencing counter; ARGV[1] owner, ARGV[2]
/// TTL in ms. Free: take it with the next fence ([`NEXT_FENCE`]). Held by the owner: renew, same token. Held by
/// another: nil. Any other kind at the key: an error (GET itself fails on a hash). A renewal
/// returns the stored digits as a string, so a token Lua's doubles cannot hold is an error
/// on parsing, never a rounded token.
pub(super) static ACQUIRE_LEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &(NEXT_FENCE.to_owned()
            + r"
local held = redis.call('GET', KEYS[1])
if held then
  local token, owner = string.match(held, '^lease:(%d+):(.*)$')
  if not token then
    return redis.error_reply('WRONGTYPE key holds a counter, not a lease')
  end
  if owner == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return token
  end
  return false
end
local token = next_fence(KEYS[2])
redis.call('SET', KEYS[1], 'lease:' .. token .. ':' .. ARGV[1], 'PX', ARGV[2])
return token
"),
    )
});

/// `release_lease`: compare-and-delete. KEYS[1] the lease; ARGV[1] owner. A late release
/// from a fenced-out owner leaves its successor's lease alone.
pub(super) static RELEASE_LEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local held = redis.call('GET', KEYS[1])
if not held then
  return 0
end
local token, owner = string.match(held, '^lease:(%d+):(.*)$')
if not token then
  return redis.error_reply('WRONGTYPE key holds a counter, not a lease')
end
if owner == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
",
    )
});

/// `incr`. KEYS[1] the counter; ARGV[1] the amount, ARGV[2] TTL in ms. A new counter is
/// created with its expiry (SET NX PX); an existing one only adds, keeping its expiry. The
/// sum goes back as a string: Lua numbers are doubles and would round counters above 2^53.
/// A counter found without expiry (written by something else) gets one rather than living
/// forever.
/// `acquire_slot`. KEYS[1] the set; ARGV[1] now ms, ARGV[2] member, ARGV[3] limit, ARGV[4]
/// TTL ms. Expired members (score <= now) leave first; a present member is renewed.
/// Returns {admitted, count, ms until the earliest member expires}.
pub(super) static ACQUIRE_SLOT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local admitted = 0
if redis.call('ZSCORE', KEYS[1], ARGV[2]) or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[2])
  admitted = 1
end
redis.call('PEXPIRE', KEYS[1], ttl)
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local wait = 0
if first[2] then wait = math.max(0, tonumber(first[2]) - now) end
return {admitted, redis.call('ZCARD', KEYS[1]), wait}
",
    )
});

/// `window_admit`: a sliding-window log. KEYS[1] the log; ARGV[1] now ms, ARGV[2] member,
/// ARGV[3] window ms, ARGV[4] limit. Returns {admitted, count, ms until the oldest entry
/// leaves the window}.
pub(super) static WINDOW_ADMIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local admitted = 0
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('ZADD', KEYS[1], now, ARGV[2])
  admitted = 1
end
redis.call('PEXPIRE', KEYS[1], window)
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local wait = 0
if first[2] then wait = math.max(0, tonumber(first[2]) + window - now) end
return {admitted, redis.call('ZCARD', KEYS[1]), wait}
",
    )
});

pub(super) static INCR: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return ARGV[1]
end
redis.call('INCRBY', KEYS[1], ARGV[1])
if redis.call('PTTL', KEYS[1]) == -1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return redis.call('GET', KEYS[1])
",
    )
});

/// `append_events`: KEYS[1] the journal (a stream whose ids are `0-<number + 1>`); ARGV[1]
/// TTL in ms, ARGV[2] the wake-up channel, ARGV[3] the first event's number, then the
/// events. Numbers at or below the stream's last are skipped (a retried append), so XADD
/// never sees an id it would refuse. One PUBLISH per append wakes blocked readers; it is
/// inside the script, so a reader that subscribed and then found nothing cannot miss it.
pub(super) static APPEND_EVENTS: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local next = 1
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if top[1] then
  next = tonumber(string.match(top[1][1], '^0%-(%d+)$')) + 1
end
local first = tonumber(ARGV[3]) + 1
local added = 0
for i = 4, #ARGV do
  local id = first + (i - 4)
  if id >= next then
    redis.call('XADD', KEYS[1], string.format('0-%d', id), 'e', ARGV[i])
    added = added + 1
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if added > 0 then
  redis.call('PUBLISH', ARGV[2], 'a')
end
return added
",
    )
});

/// `claim_hash`: a new owner takes the hash. KEYS[1] the hash, KEYS[2] its fencing counter
/// (shared with the leases of the same name); ARGV[1] TTL in ms, then field, value, …. The
/// counter moves to the next fence ([`NEXT_FENCE`]), the hash is replaced whole with the fields and `fence` = the new token,
/// which goes back as a string (Lua's doubles would round a large one).
pub(super) static CLAIM_HASH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &(NEXT_FENCE.to_owned()
            + r"
local fence = next_fence(KEYS[2])
redis.call('DEL', KEYS[1])
for i = 2, #ARGV, 200 do
  redis.call('HSET', KEYS[1], unpack(ARGV, i, math.min(i + 199, #ARGV)))
end
redis.call('HSET', KEYS[1], 'fence', fence)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return fence
"),
    )
});

/// `put_hash_fenced`: the holder of token ARGV[2] refreshes the hash; anyone else (a newer
/// claim moved the counter on) changes nothing. KEYS as [`CLAIM_HASH`]; ARGV[1] TTL in ms,
/// ARGV[2] the token, then field, value, …. 1 written, 0 fenced out.
pub(super) static PUT_HASH_FENCED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local latest = redis.call('GET', KEYS[2])
if not latest then
  -- Redis lost its data (restarted empty): no claim was made since, so the holder's token
  -- is still the latest, and a later claim goes past it (NEXT_FENCE).
  redis.call('SET', KEYS[2], ARGV[2])
elseif latest ~= ARGV[2] then
  return 0
end
redis.call('DEL', KEYS[1])
for i = 3, #ARGV, 200 do
  redis.call('HSET', KEYS[1], unpack(ARGV, i, math.min(i + 199, #ARGV)))
end
redis.call('HSET', KEYS[1], 'fence', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
",
    )
});

/// `delete_fenced`: KEYS as [`CLAIM_HASH`]; ARGV[1] the token. Deletes only while that token
/// is the latest claim. 1 deleted, 0 fenced out.
pub(super) static DELETE_FENCED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
",
    )
});
