use std::{
    collections::{hash_map::Entry, HashMap},
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
    Begin, Claim, Clock, Completion, IdempotencyStore, Lease, Record, Renewal, Settled, StoreError,
    SystemClock,
};
use crate::idempotency::{Fingerprint, ScopeKey};

/// Default bound on what the store holds: 64 MiB of weighed entries.
///
/// Room for about 34,000 records of 1 KiB responses; set it to what a TTL's worth of
/// protected requests needs. Past the bound the oldest records go.
pub const DEFAULT_MOKA_MAX_BYTES: usize = 64 * 1024 * 1024;

/// What a stored record weighs beyond its response ([`Record::weight`]): the scope key
/// (in the map and in the index), the record (fingerprint, times, attempt ID, status),
/// its slot in the map, and moka's bookkeeping for the index entry (key copy, access
/// and write deques, timer wheel). Measured with a counting global allocator at 602
/// bytes with 5,000 records (`tests/memory.rs`) and 634 with 1,000,000
/// (`benches/scale.rs`), and charged to every entry, so the byte bound holds whatever
/// the responses.
pub const MOKA_ENTRY_OVERHEAD_BYTES: usize = 768;

/// Shards of the map of scopes: enough that two workers rarely wait on one lock, few
/// enough to cost nothing idle.
const SHARDS: usize = 64;

/// A shard sweeps out claims whose lease ran out (and records past their TTL) once it
/// holds this many claims, or twice as many as were left after its last sweep.
const IN_FLIGHT_SWEEP_AT: usize = 1024;

/// The embedded store: requests in flight and stored outcomes in one sharded map, and a
/// [`moka`] cache beside it as the index that bounds the stored outcomes in bytes and
/// expires them at their TTL.
///
/// Claiming, completing and releasing a key take a shard's lock for a few map
/// operations, never across an await. A duplicate of a stored record is one map read
/// under that lock; moka is not involved, so a replay costs the same with a thousand
/// records stored or a million. Completing a request turns its claim into its record
/// under the same lock (a duplicate sees one or the other, never neither), then writes
/// the record's weight and TTL to moka; when moka evicts or expires that entry, its
/// eviction listener removes the record.
///
/// # Memory
///
/// Each stored record weighs its response ([`Record::weight`]) plus
/// [`MOKA_ENTRY_OVERHEAD_BYTES`]; the store holds at most
/// [`max_bytes`](MokaStoreBuilder::max_bytes) of weight (default
/// [`DEFAULT_MOKA_MAX_BYTES`]), oldest records evicted first. A response larger than the
/// whole bound is evicted as soon as it is written. A request in flight holds about 500
/// bytes outside that bound until it settles, so that part is bounded by how many
/// requests run at once.
///
/// # Clone
///
/// Clones share one map and one index.
#[derive(Clone)]
pub struct MokaStore {
    shards: Arc<[Mutex<Shard>]>,
    /// What bounds and expires the stored records: their weights and TTLs.
    index: Cache<ScopeKey, IndexEntry, BuildScopeHasher>,
    clock: Arc<dyn Clock>,
    next_token: Arc<AtomicU64>,
}

impl std::fmt::Debug for MokaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MokaStore")
            .field("entries", &self.index.entry_count())
            .field("weighted_bytes", &self.index.weighted_size())
            .finish()
    }
}

/// Builds a [`MokaStore`].
#[must_use]
pub struct MokaStoreBuilder {
    max_bytes: usize,
    clock: Arc<dyn Clock>,
}

impl MokaStoreBuilder {
    /// The bound on the weight of all stored records. Default [`DEFAULT_MOKA_MAX_BYTES`].
    pub fn max_bytes(mut self, max_bytes: usize) -> Self {
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
        let shards: Arc<[Mutex<Shard>]> = (0..SHARDS).map(|_| Mutex::default()).collect();
        let evicted_from = Arc::clone(&shards);
        let index = Cache::builder()
            // Oldest first: the index is written once per record and never read, so
            // least recently used is least recently stored. Retries come soon after
            // the request they repeat, so the newest records matter most (moka's
            // default, TinyLFU, could refuse a brand-new record).
            .eviction_policy(EvictionPolicy::lru())
            .max_capacity(u64::try_from(self.max_bytes).unwrap_or(u64::MAX))
            .weigher(|_scope: &ScopeKey, entry: &IndexEntry| entry.weight)
            .expire_after(IndexExpiry)
            .eviction_listener(move |scope: Arc<ScopeKey>, entry: IndexEntry, _cause| {
                let removed = lock(&evicted_from, &scope).remove_record(&scope, entry.token);
                // The record's response is freed outside the lock.
                drop(removed);
            })
            .build_with_hasher(BuildScopeHasher::default());
        MokaStore {
            shards,
            index,
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
            max_bytes: DEFAULT_MOKA_MAX_BYTES,
            clock: Arc::new(SystemClock),
        }
    }

    /// Stored records (approximate until moka's pending tasks run).
    pub fn entry_count(&self) -> u64 {
        self.index.entry_count()
    }

    /// Weighted bytes of the stored records (approximate until moka's pending tasks
    /// run).
    pub fn weighted_bytes(&self) -> usize {
        usize::try_from(self.index.weighted_size()).unwrap_or(usize::MAX)
    }

    /// Runs moka's pending maintenance, so counts and evictions are up to date.
    pub async fn run_pending_tasks(&self) {
        self.index.run_pending_tasks().await;
    }

    fn shard(&self, scope: &ScopeKey) -> MutexGuard<'_, Shard> {
        lock(&self.shards, scope)
    }
}

impl Default for MokaStore {
    fn default() -> Self {
        Self::new()
    }
}

/// The shard that holds `scope`, locked.
fn lock<'a>(shards: &'a [Mutex<Shard>], scope: &ScopeKey) -> MutexGuard<'a, Shard> {
    // The scope is a digest: any of its bytes picks a shard uniformly.
    let index = usize::from(scope.as_bytes()[31]) % shards.len();
    // Every write leaves a shard consistent, so a panic elsewhere cannot poison it.
    shards[index].lock().unwrap_or_else(PoisonError::into_inner)
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

/// One shard of the store's scopes.
#[derive(Default)]
struct Shard {
    scopes: HashMap<ScopeKey, Scope, BuildScopeHasher>,
    /// Claims among `scopes`.
    in_flight: usize,
    /// Claims at which to sweep next; 0 until the first claim.
    sweep_at: usize,
}

/// What the store knows of a scope.
enum Scope {
    /// Boxed: claims are few, records many, and the map's slots are as large as the
    /// larger variant.
    InFlight(Box<InFlight>),
    Stored(Stored),
}

impl Shard {
    /// Counts a new claim, and sweeps out lost claims and expired records when claims
    /// pile up (a worker that never settles its claim leaves one behind).
    fn claimed(&mut self, now: SystemTime) {
        self.in_flight += 1;
        if self.in_flight < self.sweep_at.max(IN_FLIGHT_SWEEP_AT) {
            return;
        }
        self.scopes.retain(|_, scope| match scope {
            Scope::InFlight(claim) => claim.holds(now),
            Scope::Stored(record) => record.expires_at > now,
        });
        self.in_flight = self
            .scopes
            .values()
            .filter(|scope| matches!(scope, Scope::InFlight(_)))
            .count();
        self.sweep_at = self.in_flight * 2;
    }

    /// Releases the claim `token` holds on `scope`, if it still holds it: its waiters
    /// wake, and find the key free.
    fn release_claim(&mut self, scope: &ScopeKey, token: u128) -> bool {
        let Entry::Occupied(entry) = self.scopes.entry(*scope) else {
            return false;
        };
        match entry.get() {
            Scope::InFlight(claim) if u128::from(claim.token) == token => claim.wake_waiters(),
            _ => return false,
        }
        entry.remove();
        self.in_flight -= 1;
        true
    }

    /// Removes the record `token`'s request stored for `scope`, if it is still there.
    fn remove_record(&mut self, scope: &ScopeKey, token: u64) -> Option<Scope> {
        let Entry::Occupied(entry) = self.scopes.entry(*scope) else {
            return None;
        };
        matches!(entry.get(), Scope::Stored(record) if record.token == token)
            .then(|| entry.remove())
    }
}

/// A request in flight.
struct InFlight {
    token: u64,
    fingerprint: Fingerprint,
    first_seen: SystemTime,
    epoch: Option<u64>,
    expires_at: SystemTime,
    /// Requests for the scope so far, carried to the record.
    request_count: u64,
    /// Sends once when the request settles; made by the first waiter, as most requests
    /// have none (a channel is an allocation and a free on every first execution).
    settled: Option<watch::Sender<()>>,
}

impl InFlight {
    /// The claim `lease` held, put back after it was lost.
    fn restored(lease: &Lease, claim: &Claim, now: SystemTime) -> Self {
        Self {
            token: u64::try_from(lease.token).unwrap_or(0),
            fingerprint: claim.fingerprint,
            first_seen: lease.first_seen,
            epoch: claim.epoch,
            expires_at: now + claim.lease,
            request_count: 1,
            settled: None,
        }
    }

    fn holds(&self, now: SystemTime) -> bool {
        self.expires_at > now
    }

    /// A receiver that wakes when this request settles (or its claim is dropped).
    fn subscribe(&mut self) -> watch::Receiver<()> {
        self.settled
            .get_or_insert_with(|| watch::channel(()).0)
            .subscribe()
    }

    fn wake_waiters(&self) {
        if let Some(settled) = &self.settled {
            settled.send_replace(());
        }
    }

    fn count_and_describe(&mut self) -> Begin {
        self.request_count += 1;
        Begin::InFlight {
            fingerprint: self.fingerprint,
            first_seen: self.first_seen,
            epoch: self.epoch,
            request_count: self.request_count,
        }
    }
}

/// A stored record.
struct Stored {
    record: Arc<Record>,
    expires_at: SystemTime,
    /// The token of the claim that stored it, which its index entry carries.
    token: u64,
    request_count: u64,
}

impl Stored {
    fn count_and_describe(&mut self) -> Begin {
        self.request_count += 1;
        Begin::Completed {
            record: self.record.clone(),
            request_count: self.request_count,
        }
    }
}

/// A stored record's entry in the index.
#[derive(Clone, Copy)]
struct IndexEntry {
    token: u64,
    weight: u32,
    ttl: Duration,
}

struct IndexExpiry;

impl Expiry<ScopeKey, IndexEntry> for IndexExpiry {
    fn expire_after_create(
        &self,
        _: &ScopeKey,
        entry: &IndexEntry,
        _: Instant,
    ) -> Option<Duration> {
        Some(entry.ttl)
    }

    fn expire_after_update(
        &self,
        _: &ScopeKey,
        entry: &IndexEntry,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(entry.ttl)
    }
}

impl IdempotencyStore for MokaStore {
    async fn begin(&self, scope: &ScopeKey, claim: Claim) -> Result<Begin, StoreError> {
        let now = self.clock.now();
        let mut guard = self.shard(scope);
        let shard = &mut *guard;
        let mut entry = shard.scopes.entry(*scope);
        let carried = match &mut entry {
            Entry::Occupied(occupied) => match occupied.get_mut() {
                // A duplicate of a stored record, or of a request in flight.
                Scope::Stored(record) if record.expires_at > now => {
                    return Ok(record.count_and_describe())
                }
                Scope::InFlight(running) if running.holds(now) => {
                    return Ok(running.count_and_describe())
                }
                // A lost worker's claim: taken over, its requests still counted.
                Scope::InFlight(lost) => {
                    shard.in_flight -= 1;
                    lost.request_count
                }
                // A record past its TTL is gone: the key is new again.
                Scope::Stored(_) => 0,
            },
            Entry::Vacant(_) => 0,
        };
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        entry.insert_entry(Scope::InFlight(Box::new(InFlight {
            token,
            fingerprint: claim.fingerprint,
            first_seen: now,
            epoch: claim.epoch,
            expires_at: now + claim.lease,
            request_count: carried + 1,
            settled: None,
        })));
        shard.claimed(now);
        Ok(Begin::Claimed {
            lease: Lease {
                token: u128::from(token),
                first_seen: now,
            },
        })
    }

    async fn renew(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        claim: &Claim,
    ) -> Result<Renewal, StoreError> {
        let now = self.clock.now();
        let mut guard = self.shard(scope);
        let shard = &mut *guard;
        match shard.scopes.get_mut(scope) {
            Some(Scope::InFlight(held)) if u128::from(held.token) == lease.token => {
                let renewal = if held.holds(now) {
                    Renewal::Extended
                } else {
                    Renewal::Restored
                };
                held.expires_at = now + claim.lease;
                return Ok(renewal);
            }
            Some(Scope::InFlight(other)) if other.holds(now) => return Ok(Renewal::Lost),
            Some(Scope::Stored(stored)) if stored.expires_at > now => return Ok(Renewal::Lost),
            // Another worker's lost claim, taken over.
            Some(Scope::InFlight(_)) => shard.in_flight -= 1,
            // Nothing, or a record past its TTL.
            _ => {}
        }
        let restored = Scope::InFlight(Box::new(InFlight::restored(lease, claim, now)));
        let replaced = shard.scopes.insert(*scope, restored);
        shard.claimed(now);
        drop(guard);
        drop(replaced);
        Ok(Renewal::Restored)
    }

    async fn complete(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Result<Completion, StoreError> {
        let now = self.clock.now();
        // Tokens are this store's counter, so they fit; a foreign lease matches nothing.
        let token = u64::try_from(lease.token).unwrap_or(0);
        let weight = u32::try_from(record.weight().saturating_add(MOKA_ENTRY_OVERHEAD_BYTES))
            .unwrap_or(u32::MAX);
        let (entry, replaced, completion) = {
            let mut guard = self.shard(scope);
            let shard = &mut *guard;
            let completion = match shard.scopes.get(scope) {
                Some(Scope::InFlight(claim)) if claim.token == token && claim.holds(now) => {
                    Completion::Stored
                }
                Some(Scope::Stored(stored)) if stored.token == token => {
                    return Ok(Completion::Stored)
                }
                Some(Scope::InFlight(other)) if other.holds(now) => {
                    return Ok(Completion::Superseded)
                }
                Some(Scope::Stored(other)) if other.expires_at > now => {
                    return Ok(Completion::Superseded)
                }
                _ => Completion::StoredWithoutClaim,
            };
            let request_count = match shard.scopes.get(scope) {
                Some(Scope::InFlight(claim)) => {
                    // Waiters wake once the lock is released, and find the record.
                    claim.wake_waiters();
                    shard.in_flight -= 1;
                    claim.request_count
                }
                _ => 1,
            };
            let entry = IndexEntry { token, weight, ttl };
            let stored = Scope::Stored(Stored {
                record,
                expires_at: now + ttl,
                token,
                request_count,
            });
            (entry, shard.scopes.insert(*scope, stored), completion)
        };
        // What the record replaced, freed outside the lock.
        drop(replaced);
        self.index.insert(*scope, entry).await;
        Ok(completion)
    }

    async fn release(&self, scope: &ScopeKey, lease: &Lease) -> Result<bool, StoreError> {
        Ok(self.shard(scope).release_claim(scope, lease.token))
    }

    async fn wait(&self, scope: &ScopeKey, timeout: Duration) -> Result<Settled, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let now = self.clock.now();
            let mut settled = match self.shard(scope).scopes.get_mut(scope) {
                Some(Scope::Stored(stored)) if stored.expires_at > now => {
                    return Ok(Settled::Completed {
                        record: stored.record.clone(),
                    })
                }
                Some(Scope::InFlight(claim)) if claim.holds(now) => claim.subscribe(),
                _ => return Ok(Settled::Released),
            };
            // A lost claim taken over drops its sender: look again then too.
            if tokio::time::timeout_at(deadline, settled.changed())
                .await
                .is_err()
            {
                return Ok(Settled::TimedOut);
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
        let record = Arc::new(Record {
            fingerprint: claim().fingerprint,
            first_seen: lease.first_seen,
            original_attempt: None,
            epoch: None,
            payload: None,
        });
        let ttl = Duration::from_secs(60);
        assert!(!store.release(&scope("k"), &stranger).await.unwrap());
        assert_eq!(
            store
                .complete(&scope("k"), &stranger, record.clone(), ttl)
                .await
                .unwrap(),
            Completion::Superseded
        );
        assert_eq!(
            store.renew(&scope("k"), &stranger, &claim()).await.unwrap(),
            Renewal::Lost
        );
        assert!(store.release(&scope("k"), &lease).await.unwrap());
        // Released and not taken: a late outcome is still stored, so its key never
        // runs again.
        assert_eq!(
            store
                .complete(&scope("k"), &lease, record.clone(), ttl)
                .await
                .unwrap(),
            Completion::StoredWithoutClaim
        );
        assert_eq!(
            store
                .complete(&scope("k"), &lease, record, ttl)
                .await
                .unwrap(),
            Completion::Stored,
            "completing again is completing once"
        );
        assert!(matches!(
            store.begin(&scope("k"), claim()).await.unwrap(),
            Begin::Completed { .. }
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
            payload: None,
        };
        let ttl = Duration::from_secs(3600);
        assert!(store
            .complete(&scope(key), &lease, Arc::new(record), ttl)
            .await
            .unwrap()
            .is_stored());
    }

    #[tokio::test]
    async fn an_evicted_record_leaves_the_map_and_its_key_runs_again() {
        // Room for about 100 records; 300 stored.
        let store = MokaStore::builder()
            .max_bytes(100 * MOKA_ENTRY_OVERHEAD_BYTES)
            .build();
        for i in 0..300 {
            store_one(&store, &format!("key-{i}")).await;
        }
        store.run_pending_tasks().await;

        let held: usize = store
            .shards
            .iter()
            .map(|shard| lock_shard(shard).scopes.len())
            .sum();
        assert!(store.entry_count() <= 100, "{}", store.entry_count());
        assert_eq!(
            held as u64,
            store.entry_count(),
            "the map holds exactly what the index holds"
        );
        let claim = Claim {
            fingerprint: Fingerprint::new(&Method::POST, "/", None, None, b""),
            lease: Duration::from_secs(60),
            epoch: None,
        };
        assert!(matches!(
            store.begin(&scope("key-0"), claim).await.unwrap(),
            Begin::Claimed { .. }
        ));
    }

    fn lock_shard(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
        shard.lock().unwrap()
    }

    #[tokio::test]
    async fn a_full_store_keeps_the_newest_record_for_its_retry() {
        // Room for about 100 records.
        let store = MokaStore::builder()
            .max_bytes(100 * MOKA_ENTRY_OVERHEAD_BYTES)
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
        assert!(store.weighted_bytes() <= 100 * MOKA_ENTRY_OVERHEAD_BYTES);
    }
}
