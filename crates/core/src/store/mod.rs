//! Where the idempotency layer keeps its records: the [`IdempotencyStore`] trait, what
//! it keeps ([`Record`]), and what it answers. `tower-ids` implements it in memory
//! (`MokaStore`), on Redis and on PostgreSQL.

mod clock;
#[doc(hidden)]
pub mod codec;
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod contract;
#[doc(hidden)]
pub mod deadline;
mod error;
mod handler_transaction;
mod record;
#[doc(hidden)]
pub mod sent_claim;

use std::{
    future::Future,
    sync::Arc,
    time::{Duration, SystemTime},
};

#[cfg(any(test, feature = "test-util"))]
pub use self::clock::ManualClock;
pub use self::clock::{Clock, SystemClock};
#[doc(hidden)]
pub use self::error::Chain;
pub use self::error::StoreError;
pub use self::handler_transaction::{HandlerTransaction, TransactionEnd, TransactionOffer};
pub use self::record::{Payload, PayloadFormat, Record};
pub use crate::scope::{Fingerprint, ScopeKey};
use crate::AttemptId;

/// A record store for the idempotency layer, shared behind an `Arc`.
///
/// Every state change is atomic per scope: of any number of concurrent [`begin`]s for
/// one scope, exactly one gets [`Begin::Claimed`]; [`renew`], [`complete`] and
/// [`release`] act only for the lease that claim returned, so a worker whose lease ran
/// out can never overwrite the record of the one that took over. Each may be called
/// again with the same lease after an answer was lost (a timeout, a dropped
/// connection) with the effect of one call.
///
/// [`begin`]: Self::begin
/// [`renew`]: Self::renew
/// [`complete`]: Self::complete
/// [`release`]: Self::release
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Counts one more request for `scope` and claims it if no live record exists.
    fn begin(
        &self,
        scope: &ScopeKey,
        claim: Claim,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send;

    /// Keeps the claim `lease` holds on `scope` for another `claim.lease` from now,
    /// while its request runs. If the claim is gone and nothing took its place (the
    /// store lost it, or it ran out unrenewed), it is put back from `claim`.
    ///
    /// Must be safe to repeat: renewing twice with one lease is renewing once.
    fn renew(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        claim: &Claim,
    ) -> impl Future<Output = Result<Renewal, StoreError>> + Send;

    /// Stores the outcome of the claimed request for `ttl`, unless another request
    /// stored its outcome ([`Completion::Superseded`]) or holds the scope now
    /// ([`Completion::ClaimedByAnother`]: the layer tries again once that claim is
    /// settled). A claim that is gone with nothing in its place does not stop it: the
    /// request ran, and its outcome is what keeps it from running again.
    ///
    /// Must be safe to repeat: completing twice with one lease stores once, and the
    /// second call answers [`Completion::Stored`] (the layer retries a completion
    /// whose answer was lost).
    fn complete(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        record: Arc<Record>,
        ttl: Duration,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send;

    /// Gives the scope up so a retry runs again; `Ok(false)` if `lease` no longer
    /// holds it.
    fn release(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Waits up to `timeout` for the request in flight on `scope` to settle.
    fn wait(
        &self,
        scope: &ScopeKey,
        timeout: Duration,
    ) -> impl Future<Output = Result<Waited, StoreError>> + Send;

    /// The longest from this store answering again after an outage to one of its calls
    /// succeeding: a call's timeout (one sent just before the store came back may
    /// wait it out), plus the time to reconnect. The layers refuse a lease a quarter
    /// of which does not cover it, and the pause before a failed renewal is tried
    /// again (see the guarantees page of `tower_ids::guide`). Default zero, for a
    /// store in process.
    fn recovery_time(&self) -> Duration {
        Duration::ZERO
    }
}

/// What [`IdempotencyStore::begin`] is asked to claim.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Claim {
    /// The request's fingerprint, kept to refuse the key with another payload.
    pub fingerprint: Fingerprint,
    /// How long the claim holds the scope if it is never completed or released.
    pub lease: Duration,
    /// The control epoch the request belongs to, when the layer binds keys to one.
    pub epoch: Option<u64>,
}

impl Claim {
    /// A claim of the request with `fingerprint`, holding its scope for `lease`, in the
    /// control `epoch` if the layer binds keys to one.
    pub fn new(fingerprint: Fingerprint, lease: Duration, epoch: Option<u64>) -> Self {
        Self {
            fingerprint,
            lease,
            epoch,
        }
    }
}

/// The answer of [`IdempotencyStore::begin`].
#[derive(Debug)]
pub enum Begin {
    /// This request holds the scope: run it, then complete or release the lease.
    Claimed {
        /// Proof of the claim, for `complete` and `release`.
        lease: Lease,
    },
    /// This request holds the scope for as long as `transaction`, a database
    /// transaction the store opened, lives: no lease, no renewals. Settling it stores
    /// the outcome (committing with it whatever the handler wrote in it) or gives the
    /// key up (rolling back); a process, session or connection that dies ends it, and
    /// the key is free at once.
    ClaimedByTransaction {
        /// When the claiming request arrived, and the claim's token, for its record.
        lease: Lease,
        /// The transaction that holds the claim.
        transaction: Box<dyn HandlerTransaction>,
    },
    /// Another request's open transaction holds the scope
    /// ([`ClaimedByTransaction`](Self::ClaimedByTransaction)): what it runs is not
    /// visible until it commits, so neither its fingerprint nor the request count is
    /// known. Duplicates are told it is in flight; its record answers them once it
    /// commits.
    Locked,
    /// Another request holds the scope and has not finished.
    InFlight {
        /// The fingerprint of the request in flight.
        fingerprint: Fingerprint,
        /// When the request in flight arrived.
        first_seen: SystemTime,
        /// The epoch of the request in flight.
        epoch: Option<u64>,
        /// Requests seen for this scope, this one included.
        request_count: u64,
    },
    /// The scope has a stored outcome.
    Completed {
        /// The outcome.
        record: Arc<Record>,
        /// Requests seen for this scope, this one included.
        request_count: u64,
    },
}

/// The answer of [`IdempotencyStore::renew`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Renewal {
    /// The claim holds for another lease.
    Extended,
    /// The claim was gone, and nothing had taken its place: it is back. The store lost
    /// it (a restart without persistence) or it ran out unrenewed, so a duplicate may
    /// have run meanwhile.
    Restored,
    /// Another request holds the scope, or an outcome is stored for it.
    Lost,
}

/// The answer of [`IdempotencyStore::complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Completion {
    /// The outcome is stored (now, or by an earlier call with the same lease).
    Stored,
    /// The outcome is stored, but the claim had gone (the store lost it, or it ran
    /// out): a duplicate may have run meanwhile.
    StoredWithoutClaim,
    /// Another request stored its outcome; this one is not stored, and never will be.
    Superseded,
    /// Another request's claim holds the scope (this one's ran out and was taken),
    /// and no outcome is stored: this one is not stored now. The layer keeps it and
    /// tries again until that claim is settled: completed (then this one is
    /// [`Superseded`](Self::Superseded)) or released without running (then this one
    /// is stored, and keeps the handler from running again).
    ClaimedByAnother,
}

impl Completion {
    /// Whether the outcome is now in the store.
    pub fn is_stored(self) -> bool {
        matches!(self, Self::Stored | Self::StoredWithoutClaim)
    }
}

/// A claim on a scope, unique to one [`Begin::Claimed`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Lease {
    /// The claim's unique value (a fencing token): a counter in memory, 128 random
    /// bits in Redis.
    pub token: u128,
    /// When the claiming request arrived.
    pub first_seen: SystemTime,
}

impl Lease {
    /// The lease a store hands out: its fencing `token`, and when the claiming request
    /// arrived.
    pub fn new(token: u128, first_seen: SystemTime) -> Self {
        Self { token, first_seen }
    }
}

/// How a wait on a request in flight ended.
#[derive(Debug)]
pub enum Waited {
    /// It completed; here is its record.
    Completed {
        /// The outcome.
        record: Arc<Record>,
        /// Requests seen for this scope, this one included, if the store counted the
        /// waiting one as it read the record (else the count `begin` gave stands).
        request_count: Option<u64>,
    },
    /// It was released (failed, panicked, or was not storable): a retry runs again.
    Released,
    /// It ended without storing anything, and the store claimed the key for the one
    /// that waited, as [`Begin::ClaimedByTransaction`] does: that one runs now, in this
    /// transaction.
    ClaimedByTransaction {
        /// When the claim was made, and its token.
        lease: Lease,
        /// The transaction that holds the claim.
        transaction: Box<dyn HandlerTransaction>,
    },
    /// It is still running.
    TimedOut,
}
