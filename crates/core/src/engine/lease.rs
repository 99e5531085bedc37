//! The claim of a request that runs: how long it holds its key, how it is renewed
//! while the handler runs, and how it is given back.

use crate::code::event;
use std::{sync::Arc, time::Duration};

use tracing::Instrument as _;

use super::{
    drain::{Outstanding, Owed},
    kept::{FIRST_STORE_RETRY_PAUSE, MAX_STORE_RETRY_PAUSE},
    observe,
};
use crate::{
    store::{Chain, Claim, IdempotencyStore, Lease, Renewal},
    Fingerprint, ScopeKey,
};

/// The pause before renewing again after a renewal failed: 50 ms, not the quarter
/// lease between healthy renewals. A claim lives through a store outage only if a
/// renewal lands soon after the store answers again, and a store that is down answers
/// each attempt at once (a paused one within its command timeout).
pub(super) const RENEWAL_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The claim a request makes under `lease`.
///
/// Each write of the claim (the claim itself and every renewal) holds the key for the
/// lease and half again, and a running request renews it every quarter of the lease.
/// So at any moment a live worker's claim has at least the lease left, give or take
/// the renewal's own round trip (a quarter of the lease is kept for it; it is bounded
/// by the store's command timeout): a store outage shorter than the lease, counted from
/// when it began, never lets the claim run out. The cost: a dead worker's key stays
/// locked for up to one and a half leases after its last renewal.
pub(super) fn claim(fingerprint: Fingerprint, lease: Duration, epoch: Option<u64>) -> Claim {
    Claim {
        fingerprint,
        lease: lease + lease / 2,
        epoch,
    }
}

/// Why a claimed key is given back, so that a retry runs again: the `reason` of the
/// `idempotency.released` event and of the released-keys metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The handler returned an error (the service's, not a response).
    HandlerError,
    /// The handler panicked.
    HandlerPanicked,
    /// The work was dropped before the handler produced anything.
    Abandoned,
    /// The storage rule does not keep this outcome.
    NotStored,
    /// The response failed while it was read.
    ResponseFailed,
    /// The handler's transaction was rolled back: nothing it wrote stands.
    RolledBack,
    /// The handler's transaction did not commit.
    CommitFailed,
    /// The handler's transaction broke under it (its connection lost, its backend
    /// terminated, the server gone): nothing it wrote stands.
    TransactionBroke,
    /// The handler failed on a passing fault (its database unreachable, a deadlock).
    Transient,
}

impl Release {
    /// Every reason, for the metric series registered at 0.
    #[cfg(feature = "metrics")]
    pub const ALL: [Release; 9] = [
        Release::HandlerError,
        Release::NotStored,
        Release::ResponseFailed,
        Release::HandlerPanicked,
        Release::Abandoned,
        Release::RolledBack,
        Release::CommitFailed,
        Release::TransactionBroke,
        Release::Transient,
    ];

    /// The reason as events and metrics say it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Release::HandlerError => "handler_error",
            Release::HandlerPanicked => "handler_panicked",
            Release::Abandoned => "abandoned",
            Release::NotStored => "not_stored",
            Release::ResponseFailed => "response_failed",
            Release::RolledBack => "rolled_back",
            Release::CommitFailed => "commit_failed",
            Release::TransactionBroke => "transaction_broke",
            Release::Transient => "transient",
        }
    }
}

/// What one renewal did.
pub(super) enum Renewed {
    /// The claim holds (it was extended, or put back).
    Held,
    /// The store did not answer: try again soon.
    Failed,
    /// Another request holds the scope: renewing is over.
    Lost,
}

/// One renewal, after `failed` renewals that failed in a row.
pub(super) async fn renew<St: IdempotencyStore>(
    store: &St,
    scope: &ScopeKey,
    lease: &Lease,
    claim: &Claim,
    failed: u32,
) -> Renewed {
    match observe::store_call("renew", store.renew(scope, lease, claim)).await {
        Ok(Renewal::Extended) => {
            tracing::trace!(target: "tower_ids::idempotency", event = event::LEASE_RENEWED, "renewed the claim");
            Renewed::Held
        }
        Ok(Renewal::Restored) => {
            tracing::warn!(
                target: "tower_ids::idempotency",
                event = event::CLAIM_RESTORED,
                "the store had lost this request's claim (restarted without persistence, or the lease ran out unrenewed); it is back, but a duplicate may have run meanwhile"
            );
            Renewed::Held
        }
        Ok(Renewal::Lost) => {
            tracing::warn!(
                target: "tower_ids::idempotency",
                event = event::LEASE_LOST,
                "another request holds this key now: this request's claim ran out while it was running; its outcome is stored once that request's claim is settled, unless a record takes the key first"
            );
            Renewed::Lost
        }
        Err(error) if failed == 0 => {
            tracing::warn!(
                target: "tower_ids::idempotency",
                event = event::STORE_FAILED,
                error = %Chain(&error),
                phase = "renew",
                "could not renew the claim; trying again every 50 ms until a renewal lands"
            );
            Renewed::Failed
        }
        Err(error) => {
            tracing::debug!(
                target: "tower_ids::idempotency",
                event = event::STORE_FAILED,
                error = %Chain(&error),
                phase = "renew",
                attempts = failed + 1,
                "still cannot renew the claim; trying again"
            );
            Renewed::Failed
        }
    }
}

/// Gives the key up. If the store cannot answer now, keeps trying from a task of its
/// own (backing off as kept outcomes do) until it answers or the claim, held for
/// `hold`, would have run out anyway: a retry then runs as soon as the store is back,
/// not a claim's length later. However late, a release is harmless: it is fenced by
/// the lease's token and refused past its deadline.
pub(super) async fn release<St: IdempotencyStore>(
    store: &Arc<St>,
    scope: &ScopeKey,
    lease: &Lease,
    hold: Duration,
    reason: Release,
    outstanding: &Arc<Outstanding>,
) {
    if try_release(&**store, scope, lease, reason, 1).await {
        return;
    }
    let (store, scope, lease) = (store.clone(), *scope, lease.clone());
    let until = tokio::time::Instant::now() + hold;
    let pending = outstanding.enter(Owed::Release, tracing::Span::current());
    let retry = async move {
        let _pending = pending;
        let mut pause = FIRST_STORE_RETRY_PAUSE;
        for attempts in 2.. {
            if tokio::time::Instant::now() + pause >= until {
                return;
            }
            tokio::time::sleep(pause).await;
            if try_release(&*store, &scope, &lease, reason, attempts).await {
                return;
            }
            pause = (pause * 2).min(MAX_STORE_RETRY_PAUSE);
        }
    };
    tokio::spawn(retry.instrument(tracing::Span::current()));
}

/// A claim held by a transaction was given up by rolling it back (or its commit
/// failed): the key is free, with no store call to make. Its event and metric, as a
/// release's.
pub(super) fn released_with_transaction(reason: Release) {
    let reason = reason.as_str();
    tracing::debug!(
        target: "tower_ids::idempotency",
        event = event::RELEASED,
        reason,
        "released the idempotency key with its transaction; a retry runs again"
    );
    observe::released(reason);
}

/// One attempt at a release; `false` if the store did not answer.
async fn try_release<St: IdempotencyStore>(
    store: &St,
    scope: &ScopeKey,
    lease: &Lease,
    reason: Release,
    attempts: u32,
) -> bool {
    let reason_str = reason.as_str();
    match observe::store_call("release", store.release(scope, lease)).await {
        Ok(true) => {
            tracing::debug!(
                target: "tower_ids::idempotency",
                event = event::RELEASED,
                reason = reason_str,
                attempts,
                "released the idempotency key; a retry runs again"
            );
            observe::released(reason_str);
            true
        }
        Ok(false) => {
            tracing::warn!(
                target: "tower_ids::idempotency",
                event = event::LEASE_LOST,
                reason = reason_str,
                "nothing to release: this request's claim had run out and another request holds the key"
            );
            true
        }
        Err(error) if attempts == 1 => {
            tracing::warn!(
                target: "tower_ids::idempotency",
                event = event::STORE_FAILED,
                error = %Chain(&error),
                phase = "release",
                reason = reason_str,
                "could not release the key; trying again until the store answers or the claim runs out"
            );
            false
        }
        Err(error) => {
            tracing::debug!(
                target: "tower_ids::idempotency",
                event = event::STORE_FAILED,
                error = %Chain(&error),
                phase = "release",
                reason = reason_str,
                attempts,
                "still cannot release the key; trying again"
            );
            false
        }
    }
}
