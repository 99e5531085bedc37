//! The store's Lua scripts, each one atomic on the server, and how they are called.

use redis::{Cmd, Script};

/// Bytes of fencing token at the head of a claim's value.
pub(super) const TOKEN_LEN: usize = 16;

/// The head of every script that changes state: refuses to act past the deadline in
/// `ARGV[$n]` (microseconds since the Unix epoch, by Redis's clock; see
/// [`StoreClock`](tower_ids_core::store::deadline::StoreClock) for how it is set without synchronised
/// clocks), so a command that reaches Redis after its caller gave up changes nothing.
macro_rules! refuse_when_late {
    ($n:literal) => {
        concat!(
            "local now = redis.call('TIME')\n",
            "if tonumber(now[1]) * 1000000 + tonumber(now[2]) > tonumber(ARGV[",
            $n,
            "]) then\n",
            "  return redis.error_reply('LATE the command reached Redis after its caller gave up; it changed nothing')\n",
            "end\n"
        )
    };
}

/// Claims the scope unless a record or a live claim holds it; counts the request. A
/// claim already carrying this value's token is this call repeated: claimed, not
/// counted again.
/// KEYS: record, claim, count. ARGV: claim value (token first), lease ms, deadline.
/// Returns {kind, value, count, record ms left}: kind 0 claimed, 1 record, 2 in flight.
pub(super) const BEGIN: &str = concat!(
    refuse_when_late!("3"),
    r"
local record = redis.call('GET', KEYS[1])
if record then
  local n = redis.call('INCR', KEYS[3])
  return {1, record, n, redis.call('PTTL', KEYS[1])}
end
local claim = redis.call('GET', KEYS[2])
if claim then
  if string.sub(claim, 1, 16) == string.sub(ARGV[1], 1, 16) then
    -- A write, so that a WAIT behind this repeat covers the claim it repeats.
    redis.call('PEXPIRE', KEYS[2], ARGV[2])
    return {0, '', tonumber(redis.call('GET', KEYS[3]) or '1'), 0}
  end
  return {2, claim, redis.call('INCR', KEYS[3]), 0}
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
local n = redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return {0, '', n, 0}
"
);

/// Extends the claim carrying this token; puts it back if it is gone and no record
/// took its place.
/// KEYS: record, claim, count. ARGV: claim value (token first), lease ms, deadline.
/// Returns 1 extended, 2 restored, 0 lost.
pub(super) const RENEW: &str = concat!(
    refuse_when_late!("3"),
    r"
local claim = redis.call('GET', KEYS[2])
if claim then
  if string.sub(claim, 1, 16) ~= string.sub(ARGV[1], 1, 16) then
    return 0
  end
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  return 1
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 2
"
);

/// Stores the record unless another claim or another record holds the scope. A record
/// already carrying this token is this call repeated. Every branch that answers
/// "claimed" or "stored" writes, even on a repeat: Redis's `WAIT` covers a connection's
/// last write, and a repeat on a new connection must not pass it for nothing.
/// KEYS: record, claim, count. ARGV: token, record (token first), ttl ms, deadline.
/// Returns 1 stored, 2 stored with the claim gone, 0 superseded by another record, 3
/// another claim holds the scope.
pub(super) const COMPLETE: &str = concat!(
    refuse_when_late!("4"),
    r"
local stored = redis.call('GETRANGE', KEYS[1], 0, 15)
if stored ~= '' then
  if stored == ARGV[1] then
    -- A write, so that a WAIT behind this repeat covers the record it repeats.
    redis.call('PEXPIRE', KEYS[3], ARGV[3])
    return 1
  end
  return 0
end
local claim = redis.call('GET', KEYS[2])
local result = 2
if claim then
  if string.sub(claim, 1, 16) ~= ARGV[1] then
    return 3
  end
  result = 1
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return result
"
);

/// Counts a request for a record this replica already holds; a count key that expired
/// or was evicted is recreated with the record's remaining time, never without expiry.
/// KEYS: count. ARGV: ms the record has left, deadline.
pub(super) const COUNT: &str = concat!(
    refuse_when_late!("2"),
    r"
local n = redis.call('INCR', KEYS[1])
if redis.call('PTTL', KEYS[1]) < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return n
"
);

/// Drops the claim if it still carries this token.
/// KEYS: claim. ARGV: token, deadline.
pub(super) const RELEASE: &str = concat!(
    refuse_when_late!("2"),
    r"
local claim = redis.call('GET', KEYS[1])
if not claim or string.sub(claim, 1, 16) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
"
);

/// One of the scripts: its source, to load it, and its digest, to call it.
pub(super) struct StoreScript {
    source: &'static str,
    hash: String,
}

impl StoreScript {
    pub(super) fn new(source: &'static str) -> Self {
        Self {
            source,
            hash: Script::new(source).get_hash().to_owned(),
        }
    }

    /// The script's source, for `SCRIPT LOAD` on a server that does not know it yet.
    pub(super) fn source(&self) -> &'static str {
        self.source
    }

    /// `EVALSHA` of the script on `keys`; its arguments follow.
    pub(super) fn call(&self, keys: &[&str]) -> Cmd {
        let mut call = redis::cmd("EVALSHA");
        call.arg(&self.hash).arg(keys.len()).arg(keys);
        call
    }
}
