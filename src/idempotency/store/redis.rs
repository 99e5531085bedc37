use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use moka::{future::Cache, policy::EvictionPolicy, Expiry};
use redis::{
    aio::{ConnectionManager, ConnectionManagerConfig},
    Script,
};
use serde::{Deserialize, Serialize};

use super::{
    codec::{decode, decode_record, encode, encode_record, from_millis, millis},
    deadline::{read_in_background, StoreClock},
    Begin, Claim, Clock, Completion, IdempotencyStore, Lease, Record, Renewal, Settled, StoreError,
    SystemClock,
};
use crate::idempotency::{Fingerprint, ScopeKey};

/// Default prefix of the store's Redis keys.
pub const DEFAULT_REDIS_PREFIX: &str = "tower-ids:idem:";

/// Default bound on one Redis command: 250 ms. Redis answers in well under a
/// millisecond on a healthy network; past this the store is failing, and the layer
/// answers by its store-failure rule rather than hang the request.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_millis(250);

/// Bytes of fencing token at the head of a claim's value.
const TOKEN_LEN: usize = 16;

/// The head of every script that changes state: refuses to act past the deadline in
/// `ARGV[$n]` (microseconds since the Unix epoch, by Redis's clock; see
/// [`StoreClock`](super::deadline::StoreClock) for how it is set without synchronised
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
const BEGIN: &str = concat!(
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
const RENEW: &str = concat!(
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
/// already carrying this token is this call repeated.
/// KEYS: record, claim, count. ARGV: token, record (token first), ttl ms, deadline.
/// Returns 1 stored, 2 stored with the claim gone, 0 superseded.
const COMPLETE: &str = concat!(
    refuse_when_late!("4"),
    r"
local stored = redis.call('GETRANGE', KEYS[1], 0, 15)
if stored ~= '' then
  if stored == ARGV[1] then
    return 1
  end
  return 0
end
local claim = redis.call('GET', KEYS[2])
local result = 2
if claim then
  if string.sub(claim, 1, 16) ~= ARGV[1] then
    return 0
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
const COUNT: &str = concat!(
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
const RELEASE: &str = concat!(
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

/// A store in Redis (or Valkey), shared by every replica of a service, so a retry that
/// lands on another replica is still a duplicate.
///
/// Every state change is one Lua script, atomic on the server: claiming a key (a claim
/// key with the lease as its expiry, holding a random 128-bit fencing token),
/// completing it and releasing it (both only while the claim still carries the
/// worker's token, so a worker whose lease ran out can never overwrite the record of
/// the one that took over), and counting requests. Records are encoded with postcard
/// (binary: status, every header in order, body, first-seen time, attempt ID, epoch,
/// fingerprint) and expire with the TTL. Keys are
/// `{prefix}{<scope digest in hex>}:r|c|n`: the scope digest, never the client's
/// identity or the raw key; the braces keep one scope's keys in one cluster slot.
///
/// Waiting for a request in flight polls with backoff (5 ms doubling to 100 ms) up to
/// the wait timeout, so it works across replicas without a subscription.
///
/// Every command is bounded by [`command_timeout`](RedisStoreBuilder::command_timeout);
/// a timeout or a lost connection is a [`StoreError`], and the connection manager
/// reconnects by itself when Redis comes back. Every script that changes state also
/// carries its caller's deadline by Redis's own clock and refuses to act past it, so a
/// command that reaches Redis after its caller gave up (it waited in a paused server's
/// socket, or went out on a connection re-made after the timeout) changes nothing.
/// The store reads Redis's clock (`TIME`) when it connects and once a second after, to
/// set those deadlines; the two clocks need not agree, only run at the same rate.
/// Needs Redis 5 or later (or Valkey), whose scripts may read the clock and write.
///
/// # Clone
///
/// Clones share one connection manager and the optional local cache.
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    prefix: Arc<str>,
    command_timeout: Duration,
    local: Option<Cache<ScopeKey, Local>>,
    clock: Arc<dyn Clock>,
    /// What Redis's clock is known to read, for the deadline every command carries.
    redis_clock: Arc<StoreClock>,
    begin: Arc<Script>,
    renew: Arc<Script>,
    complete: Arc<Script>,
    release: Arc<Script>,
    count: Arc<Script>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("command_timeout", &self.command_timeout)
            .field("local_cache", &self.local.is_some())
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisStore`].
#[must_use]
pub struct RedisStoreBuilder {
    url: String,
    prefix: String,
    command_timeout: Duration,
    local_cache_bytes: Option<u64>,
    clock: Arc<dyn Clock>,
}

impl RedisStoreBuilder {
    /// The prefix of every key the store writes. Default [`DEFAULT_REDIS_PREFIX`].
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest a Redis command may take. Default [`DEFAULT_COMMAND_TIMEOUT`].
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// Keep completed records in a local moka cache of at most `max_bytes` (weighed as
    /// the [`MokaStore`](super::MokaStore) weighs them), so a replay on this replica
    /// skips fetching and decoding the record; the request is still counted in Redis.
    /// A completed record never changes, so the cache is never stale; an entry lives no
    /// longer than the record's TTL in Redis. Off by default.
    pub fn local_cache(mut self, max_bytes: u64) -> Self {
        self.local_cache_bytes = Some(max_bytes);
        self
    }

    /// The clock for first-seen times. Default the system clock. (Expiry is Redis's
    /// own.)
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Connects. Fails if the URL is invalid or Redis cannot be reached now; once
    /// connected, the store reconnects by itself.
    pub async fn build(self) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(self.url.as_str())
            .map_err(|e| StoreError::with_source("invalid Redis URL", e))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.command_timeout))
            .set_response_timeout(Some(self.command_timeout))
            .set_max_delay(Duration::from_secs(1));
        let connection = tokio::time::timeout(
            self.command_timeout * 4,
            ConnectionManager::new_with_config(client, config),
        )
        .await
        .map_err(|_| StoreError::new("timed out connecting to Redis"))?
        .map_err(|e| StoreError::with_source("could not connect to Redis", e))?;
        let redis_clock = Arc::new(StoreClock::new(self.command_timeout));
        let read_clock = {
            let connection = connection.clone();
            move || read_time(connection.clone())
        };
        for _ in 0..3 {
            redis_clock.read(self.command_timeout, read_clock()).await?;
        }
        read_in_background(
            Arc::downgrade(&redis_clock),
            self.command_timeout,
            read_clock,
        );
        let local = self.local_cache_bytes.map(|max_bytes| {
            Cache::builder()
                .eviction_policy(EvictionPolicy::lru())
                .max_capacity(max_bytes)
                .weigher(|_: &ScopeKey, local: &Local| local.weight)
                .expire_after(LocalExpiry)
                .build()
        });
        Ok(RedisStore {
            connection,
            prefix: self.prefix.into(),
            command_timeout: self.command_timeout,
            local,
            clock: self.clock,
            redis_clock,
            begin: Arc::new(Script::new(BEGIN)),
            renew: Arc::new(Script::new(RENEW)),
            complete: Arc::new(Script::new(COMPLETE)),
            release: Arc::new(Script::new(RELEASE)),
            count: Arc::new(Script::new(COUNT)),
        })
    }
}

impl RedisStore {
    /// A builder for a store at `url` (`redis://host:port/db`).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            prefix: DEFAULT_REDIS_PREFIX.to_owned(),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            local_cache_bytes: None,
            clock: Arc::new(SystemClock),
        }
    }

    /// Connects to `url` with the defaults.
    pub async fn connect(url: impl Into<String>) -> Result<Self, StoreError> {
        Self::builder(url).build().await
    }

    fn keys(&self, scope: &ScopeKey) -> [String; 3] {
        let base = format!("{}{{{}}}", self.prefix, hex::encode(scope.as_bytes()));
        [
            format!("{base}:r"),
            format!("{base}:c"),
            format!("{base}:n"),
        ]
    }

    /// Runs one command under the command timeout, passing it the deadline (by
    /// Redis's clock) past which Redis refuses it. A command that fails because the
    /// connection broke (Redis restarted, a proxy cut it) is sent once more, with a
    /// deadline of its own: the connection manager reconnects as soon as it sees the
    /// failure, and every script here has the effect of one call when repeated with
    /// the same token.
    async fn bounded<T, F>(
        &self,
        what: &'static str,
        command: impl Fn(ConnectionManager, i64) -> F,
    ) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = redis::RedisResult<T>>,
    {
        match self.attempt(what, &command).await {
            Err(Failure::Connection(_)) => self
                .attempt(what, &command)
                .await
                .map_err(|failure| failure.into_error(what)),
            first => first.map_err(|failure| failure.into_error(what)),
        }
    }

    async fn attempt<T, F>(
        &self,
        what: &'static str,
        command: impl Fn(ConnectionManager, i64) -> F,
    ) -> Result<T, Failure>
    where
        F: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let give_up = Instant::now() + self.command_timeout;
        let deadline = self
            .redis_clock
            .deadline_or_read(give_up, self.command_timeout, || {
                read_time(self.connection.clone())
            })
            .await
            .map_err(Failure::Other)?;
        let command = command(self.connection.clone(), deadline);
        match tokio::time::timeout_at(give_up.into(), command).await {
            Ok(Ok(value)) => Ok(value),
            // A timeout is not a broken connection: Redis may be paused, and a second
            // attempt would only double the wait.
            Ok(Err(error))
                if (error.is_unrecoverable_error() || error.is_io_error())
                    && !error.is_timeout() =>
            {
                Err(Failure::Connection(error))
            }
            Ok(Err(error)) => Err(Failure::Other(StoreError::with_source(what, error))),
            Err(_) => Err(Failure::Other(StoreError::new(format!(
                "{what}: timed out after {:?}",
                self.command_timeout
            )))),
        }
    }

    fn remember(&self, scope: &ScopeKey, record: &Arc<Record>, ttl: Duration) {
        if let Some(local) = &self.local {
            let entry = Local {
                record: record.clone(),
                expires_at: Instant::now() + ttl,
                weight: u32::try_from(record.weight())
                    .unwrap_or(u32::MAX)
                    .saturating_add(super::ENTRY_OVERHEAD_BYTES),
            };
            let local = local.clone();
            let scope = *scope;
            // Filling the cache never delays the request.
            tokio::spawn(async move { local.insert(scope, entry).await });
        }
    }
}

/// Why one attempt at a command failed.
enum Failure {
    /// The connection broke: worth one more attempt on the new one.
    Connection(redis::RedisError),
    /// Anything else: Redis refused the command, or did not answer in time.
    Other(StoreError),
}

impl Failure {
    fn into_error(self, what: &'static str) -> StoreError {
        match self {
            Self::Connection(error) => StoreError::with_source(what, error),
            Self::Other(error) => error,
        }
    }
}

#[derive(Clone)]
struct Local {
    record: Arc<Record>,
    expires_at: Instant,
    weight: u32,
}

struct LocalExpiry;

impl Expiry<ScopeKey, Local> for LocalExpiry {
    fn expire_after_create(&self, _: &ScopeKey, local: &Local, now: Instant) -> Option<Duration> {
        Some(local.expires_at.saturating_duration_since(now))
    }
}

impl IdempotencyStore for RedisStore {
    async fn begin(&self, scope: &ScopeKey, claim: Claim) -> Result<Begin, StoreError> {
        let [record_key, claim_key, count_key] = self.keys(scope);
        if let Some(local) = &self.local {
            if let Some(hit) = local.get(scope).await {
                let left = hit.expires_at.saturating_duration_since(Instant::now());
                let left_ms = left.as_millis().max(1) as u64;
                let request_count: u64 = self
                    .bounded("counting a request in Redis", |mut connection, deadline| {
                        let mut count = self.count.prepare_invoke();
                        count.key(&count_key).arg(left_ms).arg(deadline);
                        async move { count.invoke_async(&mut connection).await }
                    })
                    .await?;
                return Ok(Begin::Completed {
                    record: hit.record,
                    request_count,
                });
            }
        }
        let now = self.clock.now();
        let lease = Lease {
            token: rand::random(),
            first_seen: now,
        };
        let value = claim_value(&lease, &claim)?;
        let lease_ms = millis_of(claim.lease);
        let (kind, data, request_count, record_ms): (i64, Vec<u8>, u64, i64) = self
            .bounded("claiming a key in Redis", |mut connection, deadline| {
                let mut begin = self.begin.prepare_invoke();
                begin
                    .key(&record_key)
                    .key(&claim_key)
                    .key(&count_key)
                    .arg(&value)
                    .arg(lease_ms)
                    .arg(deadline);
                async move { begin.invoke_async(&mut connection).await }
            })
            .await?;
        match kind {
            0 => Ok(Begin::Claimed { lease }),
            1 => {
                let record = Arc::new(decode_stored(&data)?);
                let ttl = Duration::from_millis(u64::try_from(record_ms).unwrap_or(0));
                self.remember(scope, &record, ttl);
                Ok(Begin::Completed {
                    record,
                    request_count,
                })
            }
            _ => {
                let info: ClaimInfo = decode(data.get(TOKEN_LEN..).unwrap_or_default())?;
                Ok(Begin::InFlight {
                    fingerprint: Fingerprint::from_bytes(info.fingerprint),
                    first_seen: from_millis(info.first_seen_ms),
                    epoch: info.epoch,
                    request_count,
                })
            }
        }
    }

    async fn renew(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        claim: &Claim,
    ) -> Result<Renewal, StoreError> {
        let [record_key, claim_key, count_key] = self.keys(scope);
        let value = claim_value(lease, claim)?;
        let lease_ms = millis_of(claim.lease);
        let renewed: i64 = self
            .bounded("renewing a claim in Redis", |mut connection, deadline| {
                let mut renew = self.renew.prepare_invoke();
                renew
                    .key(&record_key)
                    .key(&claim_key)
                    .key(&count_key)
                    .arg(&value)
                    .arg(lease_ms)
                    .arg(deadline);
                async move { renew.invoke_async(&mut connection).await }
            })
            .await?;
        Ok(match renewed {
            1 => Renewal::Extended,
            2 => Renewal::Restored,
            _ => Renewal::Lost,
        })
    }

    async fn complete(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Result<Completion, StoreError> {
        let [record_key, claim_key, count_key] = self.keys(scope);
        let token = lease_token(lease);
        let mut encoded = token.clone();
        encoded.extend(encode_record(&record)?);
        let ttl_ms = millis_of(ttl);
        let completed: i64 = self
            .bounded("storing a record in Redis", |mut connection, deadline| {
                let mut complete = self.complete.prepare_invoke();
                complete
                    .key(&record_key)
                    .key(&claim_key)
                    .key(&count_key)
                    .arg(&token)
                    .arg(&encoded)
                    .arg(ttl_ms)
                    .arg(deadline);
                async move { complete.invoke_async(&mut connection).await }
            })
            .await?;
        let completion = match completed {
            1 => Completion::Stored,
            2 => Completion::StoredWithoutClaim,
            _ => Completion::Superseded,
        };
        if completion.is_stored() {
            self.remember(scope, &record, ttl);
        }
        Ok(completion)
    }

    async fn release(&self, scope: &ScopeKey, lease: &Lease) -> Result<bool, StoreError> {
        let [_, claim_key, _] = self.keys(scope);
        let token = lease_token(lease);
        let released: i64 = self
            .bounded("releasing a key in Redis", |mut connection, deadline| {
                let mut release = self.release.prepare_invoke();
                release.key(&claim_key).arg(&token).arg(deadline);
                async move { release.invoke_async(&mut connection).await }
            })
            .await?;
        Ok(released == 1)
    }

    async fn wait(&self, scope: &ScopeKey, timeout: Duration) -> Result<Settled, StoreError> {
        let [record_key, claim_key, _] = self.keys(scope);
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pause = Duration::from_millis(5);
        loop {
            // A read: harmless when late, so its deadline is not checked.
            let poll = self.bounded("polling a key in Redis", |mut connection, _| {
                let mut mget = redis::cmd("MGET");
                mget.arg(&record_key).arg(&claim_key);
                async move { mget.query_async(&mut connection).await }
            });
            // The wait ends at its deadline even if Redis is slow to answer.
            let Ok(polled) = tokio::time::timeout_at(deadline, poll).await else {
                return Ok(Settled::TimedOut);
            };
            let (record, claim): (Option<Vec<u8>>, Option<Vec<u8>>) = polled?;
            match (record, claim) {
                (Some(record), _) => {
                    return Ok(Settled::Completed {
                        record: Arc::new(decode_stored(&record)?),
                    })
                }
                (None, None) => return Ok(Settled::Released),
                (None, Some(_)) => {}
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(Settled::TimedOut);
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }
}

/// Redis's clock, in microseconds since the Unix epoch.
async fn read_time(mut connection: ConnectionManager) -> Result<i64, StoreError> {
    let (seconds, micros): (i64, i64) = redis::cmd("TIME")
        .query_async(&mut connection)
        .await
        .map_err(|e| StoreError::with_source("reading Redis's clock", e))?;
    Ok(seconds.saturating_mul(1_000_000).saturating_add(micros))
}

/// A claim's value: the lease's token, then what a duplicate needs to know of the
/// request in flight.
fn claim_value(lease: &Lease, claim: &Claim) -> Result<Vec<u8>, StoreError> {
    let mut value = lease_token(lease);
    value.extend(encode(&ClaimInfo {
        fingerprint: *claim.fingerprint.as_bytes(),
        first_seen_ms: millis(lease.first_seen),
        epoch: claim.epoch,
    })?);
    Ok(value)
}

/// At least a millisecond: Redis refuses an expiry of zero.
fn millis_of(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The lease's fencing token as the 16 bytes the claim starts with.
fn lease_token(lease: &Lease) -> Vec<u8> {
    lease.token.to_be_bytes().to_vec()
}

#[derive(Serialize, Deserialize)]
struct ClaimInfo {
    fingerprint: [u8; 32],
    first_seen_ms: u64,
    epoch: Option<u64>,
}

/// Decodes a record as stored: the token of the lease that stored it, then the record.
fn decode_stored(stored: &[u8]) -> Result<Record, StoreError> {
    decode_record(stored.get(TOKEN_LEN..).unwrap_or_default())
}
