use std::{
    collections::HashMap,
    hash::{BuildHasherDefault, Hasher},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant, SystemTime},
};

use moka::{future::Cache, policy::EvictionPolicy, Expiry};
use tokio::sync::watch;

use super::{
    Begin, Claim, Clock, IdempotencyStore, Lease, Record, Settled, StoreError, SystemClock,
};
use crate::idempotency::{Fingerprint, ScopeKey};

/// Default bound on what the store holds: 64 MiB of weighed entries.
///
/// Room for about 34,000 records of 1 KiB responses; set it to what a TTL's worth of
/// protected requests needs. Past the bound the least recently used records go.
pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// What a stored record weighs beyond its response ([`Record::weight`]): the scope key,
/// the record (fingerprint, times, attempt ID, status), the slot, and moka's own
/// bookkeeping (key copy, access and write deques, timer wheel, frequency sketch).
/// Measured at 522 bytes by `tests/memory.rs` (a counting global allocator), and
/// charged to every entry, so the byte bound holds whatever the responses.
pub const ENTRY_OVERHEAD_BYTES: u32 = 768;

/// Shards of the map of requests in flight: enough that two workers rarely wait on one
/// lock, few enough to cost nothing idle.
const IN_FLIGHT_SHARDS: usize = 64;

/// A shard sweeps out claims whose lease ran out once it holds this many.
const IN_FLIGHT_SWEEP_AT: usize = 1024;

/// The embedded store: stored outcomes in a [`moka`] cache bounded in bytes, with the
/// TTL as per-entry expiry; requests in flight in a small sharded map beside it, each
/// claim holding its key for the lease.
///
/// Claiming, completing and releasing a key take a shard's lock for a few map
/// operations, never across an await; the record is written to moka once, when the
/// request completes. A duplicate of a stored record is a cache read and an atomic
/// increment of its request count.
///
/// # Memory
///
/// Each stored record weighs its response ([`Record::weight`]) plus
/// [`ENTRY_OVERHEAD_BYTES`]; the cache holds at most
/// [`max_bytes`](MokaStoreBuilder::max_bytes) of weight (default
/// [`DEFAULT_MAX_BYTES`]). A response larger than the whole bound is never stored. A
/// request in flight holds about 600 bytes outside that bound until it settles, so
/// that part is bounded by how many requests run at once.
///
/// # Clone
///
/// Clones share one cache and one map of requests in flight.
#[derive(Clone)]
pub struct MokaStore {
    cache: Cache<ScopeKey, Slot, BuildScopeHasher>,
    in_flight: Arc<[Mutex<HashMap<ScopeKey, InFlight, BuildScopeHasher>>]>,
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
    /// The bound on the weight of all stored records. Default [`DEFAULT_MAX_BYTES`].
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
        let cache = Cache::builder()
            // Least recently used goes first: retries come soon after the request they
            // repeat, so the newest records matter most. (moka's default, TinyLFU, can
            // refuse a brand-new record in favour of an old one seen twice.)
            .eviction_policy(EvictionPolicy::lru())
            .max_capacity(self.max_bytes)
            .weigher(|_scope: &ScopeKey, slot: &Slot| slot.weight)
            .expire_after(SlotExpiry)
            .build_with_hasher(BuildScopeHasher::default());
        let in_flight = (0..IN_FLIGHT_SHARDS)
            .map(|_| Mutex::new(HashMap::default()))
            .collect();
        MokaStore {
            cache,
            in_flight,
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

    /// Stored records (approximate until moka's pending tasks run).
    pub fn entry_count(&self) -> u64 {
        self.cache.entry_count()
    }

    /// Weighted bytes of the stored records (approximate until moka's pending tasks
    /// run).
    pub fn weighted_bytes(&self) -> u64 {
        self.cache.weighted_size()
    }

    /// Runs moka's pending maintenance, so counts and evictions are up to date.
    pub async fn run_pending_tasks(&self) {
        self.cache.run_pending_tasks().await;
    }

    /// The live stored record of `scope`.
    async fn record(&self, scope: &ScopeKey, now: SystemTime) -> Option<Slot> {
        self.cache
            .get(scope)
            .await
            .filter(|slot| slot.expires_at > now)
    }

    /// The shard of the map of requests in flight that holds `scope`.
    fn shard(
        &self,
        scope: &ScopeKey,
    ) -> MutexGuard<'_, HashMap<ScopeKey, InFlight, BuildScopeHasher>> {
        // The scope is a digest: any of its bytes picks a shard uniformly.
        let index = usize::from(scope.as_bytes()[31]) % self.in_flight.len();
        self.in_flight[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes the claim `lease` holds on `scope`, if it still holds it, and returns it.
    fn remove_claim(&self, scope: &ScopeKey, lease: &Lease) -> Option<InFlight> {
        let mut shard = self.shard(scope);
        match shard.get(scope) {
            Some(claim) if claim.token == lease.token => shard.remove(scope),
            _ => None,
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

/// A request in flight.
struct InFlight {
    token: u128,
    fingerprint: Fingerprint,
    first_seen: SystemTime,
    epoch: Option<u64>,
    expires_at: SystemTime,
    /// Set while the outcome is written to the cache: the claim cannot be taken over
    /// then, even if its lease runs out in that instant (until one more lease passes,
    /// in case the writer was cancelled).
    completing: bool,
    lease: Duration,
    /// Carried to the record, so requests are counted across claim and replay.
    request_count: Arc<AtomicU64>,
    /// Sends once when the request settles; waiters subscribe.
    settled: Arc<watch::Sender<()>>,
}

impl InFlight {
    fn holds(&self, now: SystemTime) -> bool {
        if self.completing {
            self.expires_at + self.lease > now
        } else {
            self.expires_at > now
        }
    }

    fn count_and_describe(&self) -> Begin {
        Begin::InFlight {
            fingerprint: self.fingerprint,
            first_seen: self.first_seen,
            epoch: self.epoch,
            request_count: self.request_count.fetch_add(1, Ordering::Relaxed) + 1,
        }
    }
}

/// A stored record.
#[derive(Clone)]
struct Slot {
    record: Arc<Record>,
    /// Shared by the slot's clones, so a duplicate is counted without a cache write.
    request_count: Arc<AtomicU64>,
    expires_at: SystemTime,
    /// `expires_at` as a duration from when the slot was written, for moka's timer.
    ttl: Duration,
    weight: u32,
}

impl Slot {
    fn count_and_describe(&self) -> Begin {
        Begin::Completed {
            record: self.record.clone(),
            request_count: self.request_count.fetch_add(1, Ordering::Relaxed) + 1,
        }
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
        // A duplicate of a stored record: a read and an atomic increment.
        if let Some(slot) = self.record(scope, now).await {
            return Ok(slot.count_and_describe());
        }
        let lease = {
            let mut shard = self.shard(scope);
            let carried = match shard.get(scope) {
                Some(running) if running.holds(now) => return Ok(running.count_and_describe()),
                // A lost worker's claim: taken over, its requests still counted.
                Some(lost) => lost.request_count.clone(),
                None => Arc::new(AtomicU64::new(0)),
            };
            carried.fetch_add(1, Ordering::Relaxed);
            if shard.len() >= IN_FLIGHT_SWEEP_AT {
                shard.retain(|_, claim| claim.holds(now));
            }
            let token = u128::from(self.next_token.fetch_add(1, Ordering::Relaxed));
            let (settled, _) = watch::channel(());
            shard.insert(
                *scope,
                InFlight {
                    token,
                    fingerprint: claim.fingerprint,
                    first_seen: now,
                    epoch: claim.epoch,
                    expires_at: now + claim.lease,
                    completing: false,
                    lease: claim.lease,
                    request_count: carried,
                    settled: Arc::new(settled),
                },
            );
            Lease {
                token,
                first_seen: now,
            }
        };
        // A request may have completed between the read above and the claim (its
        // record is written before its claim is removed): look again, and give the
        // claim back if so, so the request is replayed rather than run twice.
        if let Some(slot) = self.record(scope, now).await {
            if let Some(claim) = self.remove_claim(scope, &lease) {
                claim.settled.send_replace(());
            }
            return Ok(slot.count_and_describe());
        }
        Ok(Begin::Claimed { lease })
    }

    async fn complete(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        record: Record,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let now = self.clock.now();
        let request_count = {
            let mut shard = self.shard(scope);
            match shard.get_mut(scope) {
                Some(claim) if claim.token == lease.token => {
                    claim.completing = true;
                    claim.request_count.clone()
                }
                _ => return Ok(false),
            }
        };
        let weight = u32::try_from(record.weight())
            .unwrap_or(u32::MAX)
            .saturating_add(ENTRY_OVERHEAD_BYTES);
        let slot = Slot {
            record: Arc::new(record),
            request_count,
            expires_at: now + ttl,
            ttl,
            weight,
        };
        // The record first, then the claim goes: a request that finds no claim finds
        // the record.
        self.cache.insert(*scope, slot).await;
        if let Some(claim) = self.remove_claim(scope, lease) {
            claim.settled.send_replace(());
        }
        Ok(true)
    }

    async fn release(&self, scope: &ScopeKey, lease: &Lease) -> Result<bool, StoreError> {
        Ok(match self.remove_claim(scope, lease) {
            Some(claim) => {
                claim.settled.send_replace(());
                true
            }
            None => false,
        })
    }

    async fn wait(&self, scope: &ScopeKey, timeout: Duration) -> Result<Settled, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let now = self.clock.now();
            if let Some(slot) = self.record(scope, now).await {
                return Ok(Settled::Completed {
                    record: slot.record,
                });
            }
            let settled = {
                let shard = self.shard(scope);
                shard
                    .get(scope)
                    .filter(|claim| claim.holds(now))
                    .map(|claim| claim.settled.subscribe())
            };
            let Some(mut settled) = settled else {
                // No claim: either settled (a completed record is written before its
                // claim goes) or released.
                return Ok(match self.record(scope, now).await {
                    Some(slot) => Settled::Completed {
                        record: slot.record,
                    },
                    None => Settled::Released,
                });
            };
            match tokio::time::timeout_at(deadline, settled.changed()).await {
                Err(_elapsed) => return Ok(Settled::TimedOut),
                Ok(_) => continue,
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

#[cfg(test)]
mod eviction_tests {
    use http::Method;

    use super::*;
    use crate::idempotency::IdempotencyKey;

    fn scope(key: &str) -> ScopeKey {
        let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
        ScopeKey::new(None, &Method::POST, "/", None, &key)
    }

    async fn store_one(store: &MokaStore, key: &str) {
        let claim = Claim {
            fingerprint: Fingerprint::new(&Method::POST, "/", None, None, b""),
            lease: Duration::from_secs(60),
            epoch: None,
        };
        let Begin::Claimed { lease } = store.begin(&scope(key), claim.clone()).await.unwrap()
        else {
            panic!("{key} is new");
        };
        let record = Record {
            fingerprint: claim.fingerprint,
            first_seen: lease.first_seen,
            original_attempt: None,
            epoch: None,
            response: None,
        };
        let ttl = Duration::from_secs(3600);
        assert!(store
            .complete(&scope(key), &lease, record, ttl)
            .await
            .unwrap());
    }

    #[tokio::test]
    async fn a_full_store_keeps_the_newest_record_for_its_retry() {
        // Room for about 100 records.
        let store = MokaStore::builder()
            .max_bytes(100 * u64::from(ENTRY_OVERHEAD_BYTES))
            .build();
        for i in 0..100 {
            store_one(&store, &format!("old-{i}")).await;
        }
        // The old records are popular: each retried twice.
        for _ in 0..2 {
            for i in 0..100 {
                let claim = Claim {
                    fingerprint: Fingerprint::new(&Method::POST, "/", None, None, b""),
                    lease: Duration::from_secs(60),
                    epoch: None,
                };
                store
                    .begin(&scope(&format!("old-{i}")), claim)
                    .await
                    .unwrap();
            }
        }
        store_one(&store, "new").await;
        store.run_pending_tasks().await;

        let claim = Claim {
            fingerprint: Fingerprint::new(&Method::POST, "/", None, None, b""),
            lease: Duration::from_secs(60),
            epoch: None,
        };
        let retry = store.begin(&scope("new"), claim).await.unwrap();
        assert!(
            matches!(retry, Begin::Completed { .. }),
            "the newest record was evicted before its retry: {retry:?}"
        );
        assert!(store.weighted_bytes() <= 100 * u64::from(ENTRY_OVERHEAD_BYTES));
    }
}
