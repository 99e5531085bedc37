//! The embedded store, [`MokaStore`]: its public type, its builder and its
//! [`IdempotencyStore`] implementation; the map it keeps is in `shard`.

use std::{
    collections::hash_map::Entry,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::Duration,
};

#[cfg(not(tower_ids_fifo_index))]
use moka::{policy::EvictionPolicy, sync::Cache, Expiry};
#[cfg(not(tower_ids_fifo_index))]
use std::time::Instant;

use self::shard::{BuildScopeHasher, InFlight, Scope, Shard, Stored};
use tower_ids_core::store::ScopeKey;
use tower_ids_core::store::{
    Begin, Claim, Clock, Completion, IdempotencyStore, Lease, Record, Renewal, StoreError,
    SystemClock, Waited,
};

#[cfg(tower_ids_fifo_index)]
mod fifo;
mod shard;

// The defaults and the weight charged per entry, which the builder's and the store's
// docs give with their reasons; `tower-ids-redis` weighs its local cache the same way.
#[doc(hidden)]
pub const DEFAULT_MOKA_MAX_BYTES: usize = 64 * 1024 * 1024;

#[doc(hidden)]
pub const MOKA_ENTRY_OVERHEAD_BYTES: usize = 832;

/// Shards of the map of scopes: enough that two workers rarely wait on one lock, few
/// enough to cost nothing idle.
const SHARDS: usize = 64;

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
/// Each stored record weighs its response ([`Record::weight`]) plus 832 bytes: the
/// scope key, the record (fingerprint, times, attempt ID, status), its slot in the
/// store's map and moka's bookkeeping for its entry (key copy, access and write deques,
/// timer wheel), plus a share of the slots that records moka has dropped leave in the
/// map until the next sweep. Measured with a counting global allocator at 602 bytes
/// with 5,000 records (`tests/memory.rs`), 640 with 1,000,000 and 696 with 1,000
/// (`benches/scale.rs`); both fail if an entry costs more than the 832 charged. The
/// store holds at most [`max_bytes`](MokaStoreBuilder::max_bytes) of weight (default
/// 64 MiB), the least recently stored records evicted first. A
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
    /// The bound on the weight of all stored records. Default 64 MiB: room for about
    /// 33,000 records of 1 KiB responses; set it to what a TTL's worth of protected
    /// requests needs. Past the bound the oldest records go.
    pub fn max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The clock that decides expiry. Default the system clock; tests pass a
    /// `ManualClock` (feature `test-util`).
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
            lease: Lease::new(u128::from(token), now),
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

    async fn wait(&self, scope: &ScopeKey, timeout: Duration) -> Result<Waited, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let now = self.clock.now();
            let mut settled = {
                let mut shard = self.shard(scope);
                match shard.scopes.get_mut(scope) {
                    Some(Scope::InFlight(claim)) if claim.holds(now) => claim.subscribe(),
                    _ => {
                        return Ok(match shard.record(scope, now) {
                            Some(stored) => Waited::Completed {
                                record: stored.record.clone(),
                                request_count: None,
                            },
                            None => Waited::Released,
                        })
                    }
                }
            };
            // A lost claim taken over drops its sender: look again then too.
            if tokio::time::timeout_at(deadline, settled.changed())
                .await
                .is_err()
            {
                return Ok(Waited::TimedOut);
            }
        }
    }
}

#[cfg(test)]
mod tests;
