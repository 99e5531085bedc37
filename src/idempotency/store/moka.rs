use std::{
    hash::{BuildHasherDefault, Hasher},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant, SystemTime},
};

use moka::{future::Cache, ops::compute::Op, Expiry};
use tokio::sync::watch;

use super::{
    Begin, Claim, Clock, IdempotencyStore, Lease, Record, Settled, StoreError, SystemClock,
};
use crate::idempotency::{Fingerprint, ScopeKey};

/// Default bound on what the store holds: 64 MiB of weighed entries.
///
/// Room for about 50,000 records of 1 KiB responses; set it to what a TTL's worth of
/// protected requests needs. moka evicts the least useful entries past the bound.
pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// What an entry weighs beyond its response ([`Record::weight`]): the scope key, the
/// record (fingerprint, times, attempt ID, status), the slot, and moka's own
/// bookkeeping (key copy, access and write deques, timer wheel, frequency sketch).
/// Measured at under 600 bytes by `tests/memory.rs` (a counting global allocator), and
/// charged to every entry, so the byte bound holds whatever the responses.
pub const ENTRY_OVERHEAD_BYTES: u32 = 768;

/// The embedded store: a [`moka`] cache bounded in bytes, with per-entry expiry (the
/// lease for requests in flight, the TTL for stored outcomes).
///
/// # Memory
///
/// Each entry weighs its response (body, header names and values) plus
/// [`ENTRY_OVERHEAD_BYTES`]; the cache holds at most
/// [`max_bytes`](MokaStoreBuilder::max_bytes) of weight (default
/// [`DEFAULT_MAX_BYTES`]). A response larger than the whole bound is never stored.
///
/// # Clone
///
/// Clones share one cache.
#[derive(Clone)]
pub struct MokaStore {
    cache: Cache<ScopeKey, Slot, BuildScopeHasher>,
    clock: Arc<dyn Clock>,
    next_token: Arc<AtomicU64>,
}

impl std::fmt::Debug for MokaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MokaStore")
            .field("entries", &self.cache.entry_count())
            .field("weighted_bytes", &self.cache.weighted_size())
            .finish()
    }
}

/// Builds a [`MokaStore`].
#[must_use]
pub struct MokaStoreBuilder {
    max_bytes: u64,
    clock: Arc<dyn Clock>,
}

impl MokaStoreBuilder {
    /// The bound on the weight of all entries. Default [`DEFAULT_MAX_BYTES`].
    pub fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The clock that decides expiry. Default the system clock; tests pass a
    /// [`ManualClock`](super::ManualClock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The store.
    pub fn build(self) -> MokaStore {
        // Buckets for as many 1 KiB records as the bound holds, so the table does not
        // rehash its way up while the store fills.
        let expected_entries = self.max_bytes / (u64::from(ENTRY_OVERHEAD_BYTES) + 1024);
        let cache = Cache::builder()
            .initial_capacity(usize::try_from(expected_entries.min(1 << 20)).unwrap_or(1 << 20))
            .max_capacity(self.max_bytes)
            .weigher(|_scope: &ScopeKey, slot: &Slot| slot.weight)
            .expire_after(SlotExpiry)
            .build_with_hasher(BuildScopeHasher::default());
        MokaStore {
            cache,
            clock: self.clock,
            next_token: Arc::new(AtomicU64::new(1)),
        }
    }
}

impl MokaStore {
    /// A store with the defaults.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder for a store with other bounds or another clock.
    pub fn builder() -> MokaStoreBuilder {
        MokaStoreBuilder {
            max_bytes: DEFAULT_MAX_BYTES,
            clock: Arc::new(SystemClock),
        }
    }

    /// Entries held (approximate until moka's pending tasks run).
    pub fn entry_count(&self) -> u64 {
        self.cache.entry_count()
    }

    /// Weighted bytes held (approximate until moka's pending tasks run).
    pub fn weighted_bytes(&self) -> u64 {
        self.cache.weighted_size()
    }

    /// Runs moka's pending maintenance, so counts and evictions are up to date.
    pub async fn run_pending_tasks(&self) {
        self.cache.run_pending_tasks().await;
    }

    fn live(&self, slot: Option<Slot>, now: SystemTime) -> Option<Slot> {
        slot.filter(|slot| slot.expires_at > now)
    }

    /// Ends the request in flight on `scope` with `op` (given its request counter) if
    /// `lease` still holds it, then wakes its waiters; `false` if the lease was lost.
    async fn settle(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        now: SystemTime,
        op: impl FnOnce(Arc<AtomicU64>) -> Op<Slot>,
    ) -> bool {
        let mut waiters = None;
        self.cache
            .entry(*scope)
            .and_compute_with(|existing| {
                let op = match self.live(existing.map(|entry| entry.into_value()), now) {
                    Some(Slot {
                        state: State::InFlight { token, settled, .. },
                        request_count,
                        ..
                    }) if token == lease.token => {
                        waiters = Some(settled);
                        op(request_count)
                    }
                    _ => Op::Nop,
                };
                std::future::ready(op)
            })
            .await;
        // Only now is the new state in the cache for a woken waiter to read.
        match waiters {
            Some(settled) => {
                settled.send_replace(());
                true
            }
            None => false,
        }
    }
}

impl Default for MokaStore {
    fn default() -> Self {
        Self::new()
    }
}

/// Hashes a [`ScopeKey`] by taking 8 of its bytes: it is already a SHA-256 digest,
/// so running SipHash over it again would buy nothing.
#[derive(Default)]
struct ScopeHasher(u64);

impl Hasher for ScopeHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached by a key type other than `ScopeKey`; FNV-1a keeps it correct.
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type BuildScopeHasher = BuildHasherDefault<ScopeHasher>;

#[derive(Clone)]
struct Slot {
    state: State,
    /// Shared by the slot's clones and carried from the claim to the record, so a
    /// duplicate is counted without writing to the cache.
    request_count: Arc<AtomicU64>,
    expires_at: SystemTime,
    /// `expires_at` as a duration from when the slot was written, for moka's timer.
    ttl: Duration,
    weight: u32,
}

#[derive(Clone)]
enum State {
    InFlight {
        token: u64,
        fingerprint: Fingerprint,
        first_seen: SystemTime,
        epoch: Option<u64>,
        /// Sends once when the request settles; waiters subscribe.
        settled: Arc<watch::Sender<()>>,
    },
    Completed(Arc<Record>),
}

impl Slot {
    /// Counts one more request and says what the scope holds.
    fn count_and_describe(&self) -> Begin {
        let request_count = self.request_count.fetch_add(1, Ordering::Relaxed) + 1;
        match &self.state {
            State::InFlight {
                fingerprint,
                first_seen,
                epoch,
                ..
            } => Begin::InFlight {
                fingerprint: *fingerprint,
                first_seen: *first_seen,
                epoch: *epoch,
                request_count,
            },
            State::Completed(record) => Begin::Completed {
                record: record.clone(),
                request_count,
            },
        }
    }

    fn with_expiry(mut self, expires_at: SystemTime, now: SystemTime) -> Self {
        self.expires_at = expires_at;
        self.ttl = expires_at.duration_since(now).unwrap_or_default();
        self
    }
}

struct SlotExpiry;

impl Expiry<ScopeKey, Slot> for SlotExpiry {
    fn expire_after_create(&self, _: &ScopeKey, slot: &Slot, _: Instant) -> Option<Duration> {
        Some(slot.ttl)
    }

    fn expire_after_update(
        &self,
        _: &ScopeKey,
        slot: &Slot,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(slot.ttl)
    }
}

impl IdempotencyStore for MokaStore {
    async fn begin(&self, scope: &ScopeKey, claim: Claim) -> Result<Begin, StoreError> {
        let now = self.clock.now();
        // A live slot only needs its counter bumped: a read, no cache write.
        if let Some(slot) = self.live(self.cache.get(scope).await, now) {
            return Ok(slot.count_and_describe());
        }
        let mut answer = None;
        self.cache
            .entry(*scope)
            .and_compute_with(|existing| {
                let op = match self.live(existing.map(|entry| entry.into_value()), now) {
                    // Claimed by another request since the read above.
                    Some(slot) => {
                        answer = Some(slot.count_and_describe());
                        Op::Nop
                    }
                    None => {
                        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
                        let (settled, _) = watch::channel(());
                        let slot = Slot {
                            state: State::InFlight {
                                token,
                                fingerprint: claim.fingerprint,
                                first_seen: now,
                                epoch: claim.epoch,
                                settled: Arc::new(settled),
                            },
                            request_count: Arc::new(AtomicU64::new(1)),
                            expires_at: now,
                            ttl: Duration::ZERO,
                            weight: ENTRY_OVERHEAD_BYTES,
                        }
                        .with_expiry(now + claim.lease, now);
                        let lease = Lease {
                            token,
                            first_seen: now,
                        };
                        answer = Some(Begin::Claimed { lease });
                        Op::Put(slot)
                    }
                };
                std::future::ready(op)
            })
            .await;
        answer.ok_or_else(|| StoreError::new("the cache skipped the claim"))
    }

    async fn complete(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        record: Record,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let now = self.clock.now();
        let weight = u32::try_from(record.weight())
            .unwrap_or(u32::MAX)
            .saturating_add(ENTRY_OVERHEAD_BYTES);
        let record = Arc::new(record);
        Ok(self
            .settle(scope, lease, now, |request_count| {
                let slot = Slot {
                    state: State::Completed(record),
                    request_count,
                    expires_at: now,
                    ttl: Duration::ZERO,
                    weight,
                };
                Op::Put(slot.with_expiry(now + ttl, now))
            })
            .await)
    }

    async fn release(&self, scope: &ScopeKey, lease: &Lease) -> Result<bool, StoreError> {
        let now = self.clock.now();
        Ok(self.settle(scope, lease, now, |_| Op::Remove).await)
    }

    async fn wait(&self, scope: &ScopeKey, timeout: Duration) -> Result<Settled, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let now = self.clock.now();
            let slot = self.live(self.cache.get(scope).await, now);
            let mut settled = match slot.map(|slot| slot.state) {
                None => return Ok(Settled::Released),
                Some(State::Completed(record)) => return Ok(Settled::Completed { record }),
                Some(State::InFlight { settled, .. }) => settled.subscribe(),
            };
            // The request may have settled between the read and the subscription: look
            // again before sleeping, so no wake-up is missed.
            if let Some(State::InFlight { .. }) = self
                .live(self.cache.get(scope).await, now)
                .map(|slot| slot.state)
            {
                match tokio::time::timeout_at(deadline, settled.changed()).await {
                    Err(_elapsed) => return Ok(Settled::TimedOut),
                    Ok(_) => continue,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use http::Method;

    use super::*;
    use crate::idempotency::IdempotencyKey;

    fn scope(key: &str) -> ScopeKey {
        let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
        ScopeKey::new(None, &Method::POST, "/", None, &key)
    }

    fn claim() -> Claim {
        Claim {
            fingerprint: Fingerprint::new(&Method::POST, "/", None, None, b""),
            lease: Duration::from_secs(60),
            epoch: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn of_concurrent_begins_exactly_one_claims() {
        let store = MokaStore::new();
        let begins: Vec<_> = (0..64)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.begin(&scope("k"), claim()).await.unwrap() })
            })
            .collect();
        let mut claimed = 0;
        let mut counts = Vec::new();
        for begin in begins {
            match begin.await.unwrap() {
                Begin::Claimed { .. } => claimed += 1,
                Begin::InFlight { request_count, .. } => counts.push(request_count),
                Begin::Completed { .. } => panic!("nothing was completed"),
            }
        }
        assert_eq!(claimed, 1);
        counts.sort_unstable();
        assert_eq!(
            counts,
            (2..=64).collect::<Vec<u64>>(),
            "every request counted once"
        );
    }

    #[tokio::test]
    async fn only_the_lease_holder_settles() {
        let store = MokaStore::new();
        let Begin::Claimed { lease } = store.begin(&scope("k"), claim()).await.unwrap() else {
            panic!("claimed");
        };
        let stranger = Lease {
            token: lease.token + 1000,
            first_seen: lease.first_seen,
        };
        let record = Record {
            fingerprint: claim().fingerprint,
            first_seen: lease.first_seen,
            original_attempt: None,
            epoch: None,
            response: None,
        };
        assert!(!store.release(&scope("k"), &stranger).await.unwrap());
        let ttl = Duration::from_secs(60);
        assert!(!store
            .complete(&scope("k"), &stranger, record.clone(), ttl)
            .await
            .unwrap());
        assert!(store.release(&scope("k"), &lease).await.unwrap());
        assert!(
            !store
                .complete(&scope("k"), &lease, record, ttl)
                .await
                .unwrap(),
            "released"
        );
        assert!(matches!(
            store.begin(&scope("k"), claim()).await.unwrap(),
            Begin::Claimed { .. }
        ));
    }
}
