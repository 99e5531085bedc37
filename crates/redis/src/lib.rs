//! The Redis store: records and claims in Redis (one node or a cluster), optionally
//! acknowledged by replicas, with a local cache of records.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use moka::{future::Cache, policy::EvictionPolicy, Expiry};
use redis::{Cmd, FromRedisValue};
use serde::{Deserialize, Serialize};

use self::{
    connection::{Connection, Wait, WaitConnections, RECONNECT_MAX_DELAY},
    scripts::{StoreScript, BEGIN, COMPLETE, COUNT, RELEASE, RENEW, TOKEN_LEN},
};
use tower_ids_core::store::{
    codec::{decode, decode_record, encode, encode_record, from_millis, millis},
    deadline::{read_in_background, StoreClock},
    sent_claim::SentClaim,
    Begin, Claim, Clock, Completion, IdempotencyStore, Lease, Record, Renewal, StoreError,
    SystemClock, Waited,
};
use tower_ids_core::store::{Fingerprint, ScopeKey};

mod connection;
mod scripts;

// The defaults, which the builder's docs give with their reasons.
#[doc(hidden)]
pub const DEFAULT_REDIS_PREFIX: &str = "tower-ids:idem:";

#[doc(hidden)]
pub const DEFAULT_REDIS_COMMAND_TIMEOUT: Duration = Duration::from_millis(250);

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
/// On Redis Cluster ([`RedisStore::cluster`]) the same scripts run on the primary of
/// the scope's slot: the hash tag keeps one scope's keys in one slot, and the cluster
/// client follows the topology (`MOVED`, `ASK`, a replica promoted) by itself. A write
/// a primary acknowledged can still be lost if it dies before its replica has it and
/// the replica is promoted: [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas)
/// makes a claim and a completion count only once replicas acknowledged them.
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
/// Clones share one connection (manager, or cluster client), the connections lent to
/// calls that wait for replicas, and the optional local cache.
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    /// Connections of their own for the calls that wait for replicas, with
    /// [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas).
    wait_connections: Option<Arc<WaitConnections>>,
    prefix: Arc<str>,
    command_timeout: Duration,
    wait: Option<Wait>,
    local: Option<Cache<ScopeKey, Local>>,
    clock: Arc<dyn Clock>,
    /// What Redis's clock is known to read, for the deadline every command carries.
    redis_clock: Arc<StoreClock>,
    scripts: Arc<Scripts>,
}

struct Scripts {
    begin: StoreScript,
    renew: StoreScript,
    complete: StoreScript,
    release: StoreScript,
    count: StoreScript,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("command_timeout", &self.command_timeout)
            .field(
                "cluster",
                &matches!(self.connection, Connection::Cluster(_)),
            )
            .field("wait", &self.wait)
            .field("local_cache", &self.local.is_some())
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisStore`].
#[must_use]
pub struct RedisStoreBuilder {
    /// One node's URL, or a cluster's seed nodes.
    target: Target,
    prefix: String,
    command_timeout: Duration,
    wait: Option<Wait>,
    local_cache_bytes: Option<usize>,
    clock: Arc<dyn Clock>,
}

impl RedisStoreBuilder {
    /// The prefix of every key the store writes. Default `tower-ids:idem:`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest a Redis command may take. Default 250 ms: Redis answers in well
    /// under a millisecond on a healthy network; past this the store is failing, and
    /// the layer answers by its store-failure rule rather than hang the request.
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// Counts a claim and a completion only once `replicas` replicas acknowledged them
    /// (Redis's `WAIT`, sent right behind the write on the same connection), waiting
    /// at most `timeout` (on top of the command timeout). A `WAIT` holds up every
    /// command behind it on its connection, so each call that waits gets a connection
    /// no other call uses meanwhile (up to 64 at once, 8 kept between calls; on a
    /// cluster, each one reaches every node): a primary that lost its replicas delays
    /// only the calls waiting for them, never the rest. Not acknowledged in time is a
    /// store failure: a claim is given up and its request answered `503` without
    /// running; a completion is kept by the layer and stored again until it is
    /// acknowledged, never released. This closes the window in which a primary that
    /// dies right after acknowledging a write loses it to a replica promoted without
    /// it, at the cost of a replica round trip on every first execution, and on every
    /// duplicate too (the claiming script counts it, a write the `WAIT` behind it covers,
    /// unless the [`local_cache`](Self::local_cache) holds the record): on a primary that
    /// has lost its replicas, each of them waits out `timeout`. `0` (the default) waits
    /// for none.
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = (replicas > 0).then_some(Wait { replicas, timeout });
        self
    }

    /// Keep completed records in a local moka cache of at most `max_bytes` (weighed as
    /// the [`MokaStore`](tower_ids_moka::MokaStore) weighs them), so a replay on this replica
    /// skips fetching and decoding the record; the request is still counted in Redis.
    /// A completed record never changes, so the cache is never stale; an entry lives no
    /// longer than the record's TTL in Redis. Off by default.
    pub fn local_cache(mut self, max_bytes: usize) -> Self {
        self.local_cache_bytes = Some(max_bytes);
        self
    }

    /// The clock for first-seen times. Default the system clock. (Expiry is Redis's
    /// own.)
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Connects. Fails if a URL is invalid or Redis cannot be reached now; once
    /// connected, the store reconnects by itself.
    pub async fn build(self) -> Result<RedisStore, StoreError> {
        // The client's own bound on an answer leaves room for the replicas' wait; the
        // store bounds each command itself.
        let answer_within = self.command_timeout + self.wait.map_or(Duration::ZERO, |w| w.timeout);
        let (connection, wait_connections) = match &self.target {
            Target::Node(url) => {
                let connection = Connection::node(url, self.command_timeout, answer_within).await?;
                let waits = self.wait.map(|_| {
                    WaitConnections::node(
                        url,
                        self.command_timeout,
                        answer_within,
                        connection.clone(),
                    )
                });
                (connection, waits)
            }
            Target::Cluster(seeds) => {
                let connection =
                    Connection::cluster(seeds, self.command_timeout, answer_within).await?;
                let waits = self.wait.map(|_| {
                    WaitConnections::cluster(
                        seeds,
                        self.command_timeout,
                        answer_within,
                        connection.clone(),
                    )
                });
                (connection, waits)
            }
        };
        if let Some(waits) = &wait_connections {
            waits.open_one().await?;
        }
        let redis_clock = Arc::new(StoreClock::new(self.command_timeout));
        let read_clock = {
            let connection = connection.clone();
            move || connection.clone().time()
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
                .max_capacity(u64::try_from(max_bytes).unwrap_or(u64::MAX))
                .weigher(|_: &ScopeKey, local: &Local| local.weight)
                .expire_after(LocalExpiry)
                .build()
        });
        Ok(RedisStore {
            connection,
            wait_connections: wait_connections.map(Arc::new),
            prefix: self.prefix.into(),
            command_timeout: self.command_timeout,
            wait: self.wait,
            local,
            clock: self.clock,
            redis_clock,
            scripts: Arc::new(Scripts {
                begin: StoreScript::new(BEGIN),
                renew: StoreScript::new(RENEW),
                complete: StoreScript::new(COMPLETE),
                release: StoreScript::new(RELEASE),
                count: StoreScript::new(COUNT),
            }),
        })
    }
}

impl RedisStore {
    /// A builder for a store at `url` (`redis://host:port/db`).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        Self::builder_for(Target::Node(url.into()))
    }

    /// A builder for a store on the Redis Cluster that `seeds` (`redis://host:port`,
    /// one or more of its nodes) belong to; the client learns the rest of the cluster
    /// from them.
    pub fn cluster<I, S>(seeds: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::builder_for(Target::Cluster(seeds.into_iter().map(Into::into).collect()))
    }

    fn builder_for(target: Target) -> RedisStoreBuilder {
        RedisStoreBuilder {
            target,
            prefix: DEFAULT_REDIS_PREFIX.to_owned(),
            command_timeout: DEFAULT_REDIS_COMMAND_TIMEOUT,
            wait: None,
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

    /// Runs `script` under the command timeout (and the replicas' wait, if `durable`
    /// and the store waits for them), with the call `call` makes given its deadline by
    /// Redis's clock, past which Redis refuses it. A call that fails because the
    /// connection broke (Redis restarted, a proxy cut it) is sent once more, with a
    /// deadline of its own: the connection reconnects as soon as it sees the failure,
    /// and every script here has the effect of one call when repeated with the same
    /// token. Returns the answer and, when waited for, how many replicas acknowledged.
    async fn bounded<T: FromRedisValue>(
        &self,
        what: &'static str,
        script: &StoreScript,
        durable: bool,
        call: impl Fn(i64) -> Cmd,
    ) -> Result<(T, Option<u64>), StoreError> {
        let wait = self.wait.filter(|_| durable);
        match self.attempt(what, script, wait, &call).await {
            Err(Failure::Connection(_)) => self
                .attempt(what, script, wait, &call)
                .await
                .map_err(|failure| failure.into_error(what)),
            first => first.map_err(|failure| failure.into_error(what)),
        }
    }

    async fn attempt<T: FromRedisValue>(
        &self,
        what: &'static str,
        script: &StoreScript,
        wait: Option<Wait>,
        call: impl Fn(i64) -> Cmd,
    ) -> Result<(T, Option<u64>), Failure> {
        let timeout = self.command_timeout + wait.map_or(Duration::ZERO, |wait| wait.timeout);
        // A script the server had to be sent is called once more, with a deadline of
        // its own.
        for _ in 0..2 {
            let sent = Instant::now();
            let give_up = sent + timeout;
            // The script itself must run within the command timeout: run later, the
            // replicas' wait behind it could not end before the caller gives up.
            let deadline = self
                .redis_clock
                .deadline_or_read(sent + self.command_timeout, self.command_timeout, || {
                    self.connection.clone().time()
                })
                .await
                .map_err(Failure::Other)?;
            let run = async {
                match (&self.wait_connections, wait) {
                    // A connection of its own: its `WAIT` holds up no other command.
                    (Some(connections), Some(_)) => {
                        connections.run(script, call(deadline), wait).await
                    }
                    _ => {
                        self.connection
                            .clone()
                            .run(script, call(deadline), wait)
                            .await
                    }
                }
            };
            match tokio::time::timeout_at(give_up.into(), run).await {
                Ok(Ok(Some(answer))) => return Ok(answer),
                // Sent the script it lacked: once more.
                Ok(Ok(None)) => {}
                // A timeout is not a broken connection: Redis may be paused, and a
                // second attempt would only double the wait.
                Ok(Err(error))
                    if (error.is_unrecoverable_error() || error.is_io_error())
                        && !error.is_timeout() =>
                {
                    return Err(Failure::Connection(error))
                }
                Ok(Err(error)) => return Err(Failure::Other(StoreError::with_source(what, error))),
                Err(_) => {
                    return Err(Failure::Other(StoreError::new(format!(
                        "{what}: timed out after {timeout:?}"
                    ))))
                }
            }
        }
        Err(Failure::Other(StoreError::new(format!(
            "{what}: Redis does not keep the script it was sent"
        ))))
    }

    /// Fails unless `acknowledged` replicas are as many as the store waits for.
    fn acknowledged(
        &self,
        what: &'static str,
        acknowledged: Option<u64>,
    ) -> Result<(), StoreError> {
        match (self.wait, acknowledged) {
            (Some(wait), Some(acknowledged)) if acknowledged < u64::from(wait.replicas) => {
                Err(StoreError::new(format!(
                    "{what}: acknowledged by {acknowledged} of the {} replicas required within {:?}",
                    wait.replicas, wait.timeout
                )))
            }
            _ => Ok(()),
        }
    }

    fn remember(&self, scope: &ScopeKey, record: &Arc<Record>, ttl: Duration) {
        if let Some(local) = &self.local {
            let entry = Local {
                record: record.clone(),
                expires_at: Instant::now() + ttl,
                weight: u32::try_from(
                    record
                        .weight()
                        .saturating_add(tower_ids_moka::MOKA_ENTRY_OVERHEAD_BYTES),
                )
                .unwrap_or(u32::MAX),
            };
            let local = local.clone();
            let scope = *scope;
            // Filling the cache never delays the request.
            tokio::spawn(async move { local.insert(scope, entry).await });
        }
    }
}

/// What the store connects to.
enum Target {
    Node(String),
    Cluster(Vec<String>),
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
    fn recovery_time(&self) -> Duration {
        self.command_timeout
            + self.wait.map_or(Duration::ZERO, |wait| wait.timeout)
            + RECONNECT_MAX_DELAY
    }

    async fn begin(&self, scope: &ScopeKey, claim: Claim) -> Result<Begin, StoreError> {
        let [record_key, claim_key, count_key] = self.keys(scope);
        if let Some(local) = &self.local {
            if let Some(hit) = local.get(scope).await {
                let left = hit.expires_at.saturating_duration_since(Instant::now());
                let left_ms = left.as_millis().max(1) as u64;
                let script = &self.scripts.count;
                let (request_count, _): (u64, _) = self
                    .bounded("counting a request in Redis", script, false, |deadline| {
                        let mut call = script.call(&[&count_key]);
                        call.arg(left_ms).arg(deadline);
                        call
                    })
                    .await?;
                return Ok(Begin::Completed {
                    record: hit.record,
                    request_count,
                });
            }
        }
        let now = self.clock.now();
        let lease = Lease::new(rand::random(), now);
        let value = claim_value(&lease, &claim)?;
        let lease_ms = millis_of(claim.lease);
        let sent = SentClaim::new(self, *scope, lease.clone(), claim.lease);
        let script = &self.scripts.begin;
        let ((kind, data, request_count, record_ms), acknowledged): ((i64, Vec<u8>, u64, i64), _) =
            self.bounded("claiming a key in Redis", script, true, |deadline| {
                let mut call = script.call(&[&record_key, &claim_key, &count_key]);
                call.arg(&value).arg(lease_ms).arg(deadline);
                call
            })
            .await?;
        match kind {
            0 => {
                // Not acknowledged, nothing runs: `sent`, dropped, gives the claim up.
                self.acknowledged("claiming a key in Redis", acknowledged)?;
                sent.answered();
                Ok(Begin::Claimed { lease })
            }
            1 => {
                sent.answered();
                let record = Arc::new(decode_stored(&data)?);
                let ttl = Duration::from_millis(u64::try_from(record_ms).unwrap_or(0));
                self.remember(scope, &record, ttl);
                Ok(Begin::Completed {
                    record,
                    request_count,
                })
            }
            _ => {
                sent.answered();
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
        let script = &self.scripts.renew;
        let (renewed, acknowledged): (i64, _) = self
            .bounded("renewing a claim in Redis", script, true, |deadline| {
                let mut call = script.call(&[&record_key, &claim_key, &count_key]);
                call.arg(&value).arg(lease_ms).arg(deadline);
                call
            })
            .await?;
        if renewed != 0 {
            self.acknowledged("renewing a claim in Redis", acknowledged)?;
        }
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
        let script = &self.scripts.complete;
        let (completed, acknowledged): (i64, _) = self
            .bounded("storing a record in Redis", script, true, |deadline| {
                let mut call = script.call(&[&record_key, &claim_key, &count_key]);
                call.arg(&token).arg(&encoded).arg(ttl_ms).arg(deadline);
                call
            })
            .await?;
        let completion = match completed {
            1 => Completion::Stored,
            2 => Completion::StoredWithoutClaim,
            3 => Completion::ClaimedByAnother,
            _ => Completion::Superseded,
        };
        if completion.is_stored() {
            // Not acknowledged, it is a failure the layer answers by keeping the
            // outcome and completing again (the same token: stored once), until it is.
            self.acknowledged("storing a record in Redis", acknowledged)?;
            self.remember(scope, &record, ttl);
        }
        Ok(completion)
    }

    async fn release(&self, scope: &ScopeKey, lease: &Lease) -> Result<bool, StoreError> {
        let [_, claim_key, _] = self.keys(scope);
        let token = lease_token(lease);
        let script = &self.scripts.release;
        let (released, _): (i64, _) = self
            .bounded("releasing a key in Redis", script, false, |deadline| {
                let mut call = script.call(&[&claim_key]);
                call.arg(&token).arg(deadline);
                call
            })
            .await?;
        Ok(released == 1)
    }

    async fn wait(&self, scope: &ScopeKey, timeout: Duration) -> Result<Waited, StoreError> {
        let [record_key, claim_key, _] = self.keys(scope);
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pause = Duration::from_millis(5);
        loop {
            // A read: harmless when late, so it carries no deadline.
            let mut connection = self.connection.clone();
            let mut mget = redis::cmd("MGET");
            mget.arg(&record_key).arg(&claim_key);
            let poll = mget.query_async::<(Option<Vec<u8>>, Option<Vec<u8>>)>(&mut connection);
            let poll = tokio::time::timeout(self.command_timeout, poll);
            // The wait ends at its deadline even if Redis is slow to answer.
            let Ok(polled) = tokio::time::timeout_at(deadline, poll).await else {
                return Ok(Waited::TimedOut);
            };
            let (record, claim) = polled
                .map_err(|_| {
                    StoreError::new(format!(
                        "polling a key in Redis: timed out after {:?}",
                        self.command_timeout
                    ))
                })?
                .map_err(|e| StoreError::with_source("polling a key in Redis", e))?;
            match (record, claim) {
                (Some(record), _) => {
                    return Ok(Waited::Completed {
                        record: Arc::new(decode_stored(&record)?),
                        request_count: None,
                    })
                }
                (None, None) => return Ok(Waited::Released),
                (None, Some(_)) => {}
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(Waited::TimedOut);
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }
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
