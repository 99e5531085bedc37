use std::{
    collections::{hash_map::Entry, HashMap},
    hash::{BuildHasherDefault, Hasher},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, PoisonError, Weak,
    },
    time::{Duration, SystemTime},
};

#[cfg(not(tower_ids_fifo_index))]
use moka::{policy::EvictionPolicy, sync::Cache, Expiry};
#[cfg(not(tower_ids_fifo_index))]
use std::time::Instant;
use tokio::sync::watch;

use super::{
    Begin, Claim, Clock, Completion, IdempotencyStore, Lease, Record, Renewal, Settled, StoreError,
    SystemClock,
};
use crate::idempotency::{Fingerprint, ScopeKey};

#[cfg(tower_ids_fifo_index)]
mod fifo;

/// Default bound on what the store holds: 64 MiB of weighed entries.
///
/// Room for about 33,000 records of 1 KiB responses; set it to what a TTL's worth of
/// protected requests needs. Past the bound the oldest records go.
pub const DEFAULT_MOKA_MAX_BYTES: usize = 64 * 1024 * 1024;

/// What a stored record weighs beyond its response ([`Record::weight`]): the scope key,
/// the record (fingerprint, times, attempt ID, status), its slot in the store's map and
/// moka's bookkeeping for its entry (key copy, access and write deques, timer wheel),
/// plus a share of the slots that records moka has dropped leave in the map until the
/// next sweep (a slot and a small allocation, about 150 bytes, for at most half as
/// many records as were live at the shard's last sweep). Charged to every entry, so
/// the byte bound holds whatever the responses. Measured with a counting global
/// allocator at 602 bytes with 5,000 records (`tests/memory.rs`), 640 with 1,000,000
/// and 696 with 1,000 (`benches/scale.rs`); both fail if an entry costs more than this.
pub const MOKA_ENTRY_OVERHEAD_BYTES: usize = 832;

/// Shards of the map of scopes: enough that two workers rarely wait on one lock, few
/// enough to cost nothing idle.
const SHARDS: usize = 64;

/// The fewest scopes a shard sweeps at (see `Shard::sweep_if_due`).
const SWEEP_SCOPES_AT: usize = 64;

/// The stored records, bounded in bytes and expired at their TTL.
#[cfg(not(tower_ids_fifo_index))]
type Records = Cache<ScopeKey, Arc<Stored>, BuildScopeHasher>;
/// A byte-bounded FIFO queue in place of moka, for measuring what moka costs
/// (`RUSTFLAGS='--cfg tower_ids_fifo_index'`; see `benches/README.md`). Not a
/// supported configuration: it never expires a record by time.
#[cfg(tower_ids_fifo_index)]
type Records = fifo::FifoIndex;

/// The embedded store: a sharded map of the scopes it knows, and a [`moka`] cache that
/// owns the stored records, bounds them in bytes and expires them at their TTL.
///
/// Claiming, completing and releasing a key take the lock of the key's shard for a few
/// map operations, never across an await. A duplicate of a stored record is one map
/// read under that lock, which finds the record through a weak pointer; moka is not
/// involved, so a replay costs the same with a thousand records stored or a million.
/// Completing a request turns its claim into that pointer and hands the record to
/// moka under the same lock, so a duplicate sees one or the other, never neither.
/// When moka evicts or expires a record, the pointer dies once moka lets go of it
/// (moka frees what it removes a little later, through its epoch-based reclamation),
/// so moka needs no eviction listener to tell the map (with one, it takes a lock per
/// key on every write). Dead pointers are swept out as the map grows.
///
/// # Memory
///
/// Each stored record weighs its response ([`Record::weight`]) plus
/// [`MOKA_ENTRY_OVERHEAD_BYTES`]; the store holds at most
/// [`max_bytes`](MokaStoreBuilder::max_bytes) of weight (default
/// [`DEFAULT_MOKA_MAX_BYTES`]), the least recently stored records evicted first. A
/// response larger than the whole bound is evicted as soon as it is written. The
/// overhead charged also covers the map's slots for records moka has dropped (about
/// 150 bytes each, for at most half as many records as were live at the last sweep,
/// plus 64 a shard). A request in flight holds about
/// 100 bytes outside that bound until it settles (`tests/memory.rs`), so that part is
/// bounded by how many requests run at once.
///
/// # Clone
///
/// Clones share one map and one cache.
#[derive(Clone)]
pub struct MokaStore {
    shards: Arc<[Mutex<Shard>]>,
    records: Records,
    clock: Arc<dyn Clock>,
    next_token: Arc<AtomicU64>,
}

impl std::fmt::Debug for MokaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MokaStore")
            .field("entries", &self.records.entry_count())
            .field("weighted_bytes", &self.records.weighted_size())
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
        MokaStore {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            records: records(self.max_bytes),
            clock: self.clock,
            next_token: Arc::new(AtomicU64::new(1)),
        }
    }
}

#[cfg(not(tower_ids_fifo_index))]
fn records(max_bytes: usize) -> Records {
    Cache::builder()
        // Oldest first: a record is written once and never read from the cache (a
        // replay finds it through the map), so least recently used is least recently
        // stored. Retries come soon after the request they repeat, so the newest
        // records matter most (moka's default, TinyLFU, could refuse a brand-new one).
        .eviction_policy(EvictionPolicy::lru())
        .max_capacity(u64::try_from(max_bytes).unwrap_or(u64::MAX))
        .weigher(|_scope: &ScopeKey, stored: &Arc<Stored>| stored.weight)
        .expire_after(RecordExpiry)
        .build_with_hasher(BuildScopeHasher::default())
}

#[cfg(tower_ids_fifo_index)]
fn records(max_bytes: usize) -> Records {
    fifo::FifoIndex::new(max_bytes)
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
        self.records.entry_count()
    }

    /// Weighted bytes of the stored records (approximate until moka's pending tasks
    /// run).
    pub fn weighted_bytes(&self) -> usize {
        usize::try_from(self.records.weighted_size()).unwrap_or(usize::MAX)
    }

    /// Runs moka's pending maintenance, so counts and evictions are up to date.
    pub async fn run_pending_tasks(&self) {
        self.records.run_pending_tasks();
    }

    fn shard(&self, scope: &ScopeKey) -> MutexGuard<'_, Shard> {
        // The scope is a digest: any of its bytes picks a shard uniformly.
        let index = usize::from(scope.as_bytes()[31]) % self.shards.len();
        // Every write leaves a shard consistent, so a panic elsewhere cannot poison it.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
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

/// One shard of the store's scopes.
#[derive(Default)]
struct Shard {
    scopes: HashMap<ScopeKey, Scope, BuildScopeHasher>,
    /// Scopes at which to sweep next; 0 until the first sweep.
    sweep_at: usize,
}

/// What the store knows of a scope.
enum Scope {
    /// Boxed: claims are few, records many, and the map's slots are as large as the
    /// larger variant.
    InFlight(Box<InFlight>),
    /// The record, which the cache owns: dead once the cache has evicted or expired it.
    Stored(Weak<Stored>),
}

impl Scope {
    /// Whether the scope still means something at `now`: a claim that holds, or a
    /// record the cache keeps and its TTL has not ended.
    fn is_live(&self, now: SystemTime) -> bool {
        match self {
            Self::InFlight(claim) => claim.holds(now),
            Self::Stored(record) => record.upgrade().is_some_and(|r| r.expires_at > now),
        }
    }
}

impl Shard {
    /// Sweeps out the scopes that mean nothing any more (lost claims, and records the
    /// cache dropped) once the shard holds half as many again as were live after the
    /// last sweep: dead slots stay below half the live ones (plus
    /// [`SWEEP_SCOPES_AT`] a shard), which the entry overhead charged covers. A swept
    /// claim drops its sender, which wakes its waiters.
    fn sweep_if_due(&mut self, now: SystemTime) {
        if self.scopes.len() < self.sweep_at.max(SWEEP_SCOPES_AT) {
            return;
        }
        self.scopes.retain(|_, scope| scope.is_live(now));
        self.sweep_at = self.scopes.len() + self.scopes.len() / 2;
    }

    /// The record stored for `scope`, unless the cache dropped it or its TTL ended.
    fn record(&self, scope: &ScopeKey, now: SystemTime) -> Option<Arc<Stored>> {
        match self.scopes.get(scope)? {
            Scope::Stored(record) => record.upgrade().filter(|r| r.expires_at > now),
            Scope::InFlight(_) => None,
        }
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

/// A stored record, as the cache owns it.
struct Stored {
    record: Arc<Record>,
    expires_at: SystemTime,
    /// The token of the claim that stored it: completing that claim again is a no-op.
    token: u64,
    request_count: AtomicU64,
    /// What the cache charges for it.
    weight: u32,
    #[cfg_attr(tower_ids_fifo_index, allow(dead_code))]
    ttl: Duration,
}

impl Stored {
    fn count_and_describe(&self) -> Begin {
        Begin::Completed {
            record: self.record.clone(),
            request_count: self.request_count.fetch_add(1, Ordering::Relaxed) + 1,
        }
    }
}

#[cfg(not(tower_ids_fifo_index))]
struct RecordExpiry;

#[cfg(not(tower_ids_fifo_index))]
impl Expiry<ScopeKey, Arc<Stored>> for RecordExpiry {
    fn expire_after_create(
        &self,
        _: &ScopeKey,
        stored: &Arc<Stored>,
        _: Instant,
    ) -> Option<Duration> {
        Some(stored.ttl)
    }

    fn expire_after_update(
        &self,
        _: &ScopeKey,
        stored: &Arc<Stored>,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(stored.ttl)
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
                // A duplicate of a request in flight.
                Scope::InFlight(running) if running.holds(now) => {
                    return Ok(running.count_and_describe())
                }
                // A lost worker's claim: taken over, its requests still counted.
                Scope::InFlight(lost) => lost.request_count,
                Scope::Stored(record) => match record.upgrade() {
                    // A duplicate of a stored record.
                    Some(stored) if stored.expires_at > now => {
                        return Ok(stored.count_and_describe())
                    }
                    // Evicted, or past its TTL: the key is new again.
                    _ => 0,
                },
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
        shard.sweep_if_due(now);
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
            // Another worker's claim that holds, or a record.
            Some(other) if other.is_live(now) => return Ok(Renewal::Lost),
            // Nothing that means anything: another worker's lost claim taken over, a
            // record past its TTL or evicted, or nothing at all.
            _ => {}
        }
        let restored = Scope::InFlight(Box::new(InFlight::restored(lease, claim, now)));
        let replaced = shard.scopes.insert(*scope, restored);
        shard.sweep_if_due(now);
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
        let mut guard = self.shard(scope);
        let shard = &mut *guard;
        let (completion, request_count) = match shard.scopes.get(scope) {
            Some(Scope::InFlight(claim)) if claim.token == token && claim.holds(now) => {
                (Completion::Stored, claim.request_count)
            }
            Some(Scope::InFlight(other)) if other.holds(now) => {
                return Ok(Completion::ClaimedByAnother)
            }
            // Our claim, or another's, lost and not taken over since.
            Some(Scope::InFlight(lost)) => (Completion::StoredWithoutClaim, lost.request_count),
            Some(Scope::Stored(record)) => match record.upgrade() {
                Some(stored) if stored.token == token => return Ok(Completion::Stored),
                Some(other) if other.expires_at > now => return Ok(Completion::Superseded),
                _ => (Completion::StoredWithoutClaim, 1),
            },
            None => (Completion::StoredWithoutClaim, 1),
        };
        let stored = Arc::new(Stored {
            record,
            expires_at: now + ttl,
            token,
            request_count: AtomicU64::new(request_count),
            weight,
            ttl,
        });
        // Under the lock, so that the cache and the map never disagree on which record
        // a scope has. The cache owns the record from here; the map only points to it.
        let settled = shard
            .scopes
            .insert(*scope, Scope::Stored(Arc::downgrade(&stored)));
        self.records.insert(*scope, stored);
        drop(guard);
        // Waiters wake now the record is there, and find it.
        if let Some(Scope::InFlight(claim)) = settled {
            claim.wake_waiters();
        }
        Ok(completion)
    }

    async fn release(&self, scope: &ScopeKey, lease: &Lease) -> Result<bool, StoreError> {
        let mut shard = self.shard(scope);
        let Entry::Occupied(entry) = shard.scopes.entry(*scope) else {
            return Ok(false);
        };
        match entry.get() {
            Scope::InFlight(claim) if u128::from(claim.token) == lease.token => {
                claim.wake_waiters();
            }
            _ => return Ok(false),
        }
        entry.remove();
        Ok(true)
    }

    async fn wait(&self, scope: &ScopeKey, timeout: Duration) -> Result<Settled, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let now = self.clock.now();
            let mut settled = {
                let mut shard = self.shard(scope);
                match shard.scopes.get_mut(scope) {
                    Some(Scope::InFlight(claim)) if claim.holds(now) => claim.subscribe(),
                    _ => {
                        return Ok(match shard.record(scope, now) {
                            Some(stored) => Settled::Completed {
                                record: stored.record.clone(),
                            },
                            None => Settled::Released,
                        })
                    }
                }
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
            expires_at: None,
        });
        let ttl = Duration::from_secs(60);
        assert!(!store.release(&scope("k"), &stranger).await.unwrap());
        assert_eq!(
            store
                .complete(&scope("k"), &stranger, record.clone(), ttl)
                .await
                .unwrap(),
            Completion::ClaimedByAnother
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
            expires_at: None,
        };
        let ttl = Duration::from_secs(3600);
        assert!(store
            .complete(&scope(key), &lease, Arc::new(record), ttl)
            .await
            .unwrap()
            .is_stored());
    }

    fn slots(store: &MokaStore) -> usize {
        store
            .shards
            .iter()
            .map(|shard| shard.lock().unwrap().scopes.len())
            .sum()
    }

    /// A store with room for about `room` records, after `stored` were stored.
    async fn overfilled(room: usize, stored: usize) -> MokaStore {
        let store = MokaStore::builder()
            .max_bytes(room * MOKA_ENTRY_OVERHEAD_BYTES)
            .build();
        for i in 0..stored {
            store_one(&store, &format!("key-{i}")).await;
        }
        store.run_pending_tasks().await;
        store
    }

    #[tokio::test]
    async fn an_evicted_record_is_gone_and_its_key_runs_again() {
        let store = overfilled(100, 300).await;

        assert!(store.entry_count() <= 100, "{}", store.entry_count());
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

    #[tokio::test]
    async fn the_slots_of_evicted_records_are_swept() {
        let store = overfilled(1_000, 20_000).await;
        let live = usize::try_from(store.entry_count()).unwrap();
        assert!(live <= 1_000, "{live}");
        let slots = slots(&store);
        assert!(
            slots <= live + live / 2 + SHARDS * SWEEP_SCOPES_AT,
            "{slots} slots for {live} records"
        );
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
