//! The store's map of scopes, in shards: what it knows of each scope (a claim in
//! flight, with the channel its duplicates wait on, or a weak pointer to the record
//! moka owns), and the sweep that clears the slots of records moka dropped.

use std::{
    collections::HashMap,
    hash::{BuildHasherDefault, Hasher},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Weak,
    },
    time::{Duration, SystemTime},
};

use tokio::sync::watch;

use tower_ids_core::{
    store::{Begin, Claim, Lease, Record},
    Fingerprint, ScopeKey,
};

/// The fewest scopes a shard sweeps at (see `Shard::sweep_if_due`).
pub(super) const SWEEP_SCOPES_AT: usize = 64;

/// Hashes a [`ScopeKey`] by taking 8 of its bytes: it is already a SHA-256 digest,
/// so running SipHash over it again would buy nothing.
#[derive(Default)]
pub(super) struct ScopeHasher(u64);

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

pub(super) type BuildScopeHasher = BuildHasherDefault<ScopeHasher>;

/// One shard of the store's scopes.
#[derive(Default)]
pub(super) struct Shard {
    pub(super) scopes: HashMap<ScopeKey, Scope, BuildScopeHasher>,
    /// Scopes at which to sweep next; 0 until the first sweep.
    sweep_at: usize,
}

/// What the store knows of a scope.
pub(super) enum Scope {
    /// Boxed: claims are few, records many, and the map's slots are as large as the
    /// larger variant.
    InFlight(Box<InFlight>),
    /// The record, which the cache owns: dead once the cache has evicted or expired it.
    Stored(Weak<Stored>),
}

impl Scope {
    /// Whether the scope still means something at `now`: a claim that holds, or a
    /// record the cache keeps and its TTL has not ended.
    pub(super) fn is_live(&self, now: SystemTime) -> bool {
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
    pub(super) fn sweep_if_due(&mut self, now: SystemTime) {
        if self.scopes.len() < self.sweep_at.max(SWEEP_SCOPES_AT) {
            return;
        }
        self.scopes.retain(|_, scope| scope.is_live(now));
        self.sweep_at = self.scopes.len() + self.scopes.len() / 2;
    }

    /// The record stored for `scope`, unless the cache dropped it or its TTL ended.
    pub(super) fn record(&self, scope: &ScopeKey, now: SystemTime) -> Option<Arc<Stored>> {
        match self.scopes.get(scope)? {
            Scope::Stored(record) => record.upgrade().filter(|r| r.expires_at > now),
            Scope::InFlight(_) => None,
        }
    }
}

/// A request in flight.
pub(super) struct InFlight {
    pub(super) token: u64,
    pub(super) fingerprint: Fingerprint,
    pub(super) first_seen: SystemTime,
    pub(super) epoch: Option<u64>,
    pub(super) expires_at: SystemTime,
    /// Requests for the scope so far, carried to the record.
    pub(super) request_count: u64,
    /// Sends once when the request settles; made by the first waiter, as most requests
    /// have none (a channel is an allocation and a free on every first execution).
    pub(super) settled: Option<watch::Sender<()>>,
}

impl InFlight {
    /// The claim `lease` held, put back after it was lost.
    pub(super) fn restored(lease: &Lease, claim: &Claim, now: SystemTime) -> Self {
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

    pub(super) fn holds(&self, now: SystemTime) -> bool {
        self.expires_at > now
    }

    /// A receiver that wakes when this request settles (or its claim is dropped).
    pub(super) fn subscribe(&mut self) -> watch::Receiver<()> {
        self.settled
            .get_or_insert_with(|| watch::channel(()).0)
            .subscribe()
    }

    pub(super) fn wake_waiters(&self) {
        if let Some(settled) = &self.settled {
            settled.send_replace(());
        }
    }

    pub(super) fn count_and_describe(&mut self) -> Begin {
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
pub(super) struct Stored {
    pub(super) record: Arc<Record>,
    pub(super) expires_at: SystemTime,
    /// The token of the claim that stored it: completing that claim again is a no-op.
    pub(super) token: u64,
    pub(super) request_count: AtomicU64,
    /// What the cache charges for it.
    pub(super) weight: u32,
    #[cfg_attr(tower_ids_fifo_index, allow(dead_code))]
    pub(super) ttl: Duration,
}

impl Stored {
    pub(super) fn count_and_describe(&self) -> Begin {
        Begin::Completed {
            record: self.record.clone(),
            request_count: self.request_count.fetch_add(1, Ordering::Relaxed) + 1,
        }
    }
}
