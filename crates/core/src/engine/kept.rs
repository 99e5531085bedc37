//! Outcomes the store could not take when their request ended: kept by the layer,
//! stored from a task of their own as soon as the store answers, and never given up
//! for a retry to run again.

use crate::code::event;
use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, SystemTime},
};

use tokio::sync::{watch, Notify};
use tracing::Instrument as _;

use super::{
    drain::{Outstanding, Owed},
    observe,
};
use crate::{
    store::{Chain, Claim, Completion, IdempotencyStore, Lease, Payload, Record, Renewal},
    Fingerprint, ScopeKey,
};

/// The first pause before storing a kept outcome again; it doubles up to
/// [`MAX_STORE_RETRY_PAUSE`].
pub(super) const FIRST_STORE_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The longest pause between two attempts to store a kept outcome: short, because a
/// retry of the request gets `409` until the outcome is stored, and a store that is
/// down answers an attempt at once.
pub(super) const MAX_STORE_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// The event for a completion the store answered.
pub(super) fn report(completion: Completion, record: &Record, ttl: Duration, attempts: u32) {
    let status = record.payload.as_ref().map(Payload::status);
    let bytes = record.weight();
    match completion {
        Completion::Stored => tracing::debug!(
            target: "tower_ids::idempotency",
            event = event::STORED,
            status,
            bytes,
            ttl_secs = ttl.as_secs(),
            attempts,
            "stored the response for replay"
        ),
        Completion::StoredWithoutClaim => tracing::warn!(
            target: "tower_ids::idempotency",
            event = event::STORED,
            status,
            bytes,
            ttl_secs = ttl.as_secs(),
            attempts,
            claim = "missing",
            "stored the response, but the store had lost this request's claim (restarted without persistence, or the lease ran out): a duplicate may have run meanwhile"
        ),
        Completion::Superseded => tracing::warn!(
            target: "tower_ids::idempotency",
            event = event::LEASE_LOST,
            status,
            attempts,
            "another request stored its outcome for this key: this request's claim ran out while it was running, and its outcome was not stored"
        ),
        // Kept and tried again by the caller, never reported as settled.
        Completion::ClaimedByAnother => {}
    }
}

/// An outcome the store could not take yet.
pub(super) struct Outcome {
    pub(super) lease: Lease,
    pub(super) claim: Claim,
    pub(super) record: Arc<Record>,
    pub(super) ttl: Duration,
}

/// Outcomes waiting to be stored, one task each, shared by the clones of one layer.
///
/// A task tries again with backoff ([`FIRST_STORE_RETRY_PAUSE`] doubling to
/// [`MAX_STORE_RETRY_PAUSE`]) and renews the claim between attempts, until the outcome
/// is stored or the process ends. Duplicates that reach this layer meanwhile get
/// `409` (or wait, with `InFlight::Wait`) and nudge it to try at once; duplicates on
/// other replicas find the claim and get `409` too.
#[derive(Default)]
pub(super) struct KeptOutcomes {
    /// The layer's register of unsettled work, which [`Drain`](super::Drain) reads.
    pub outstanding: Arc<Outstanding>,
    by_scope: Mutex<HashMap<ScopeKey, Arc<Waiting>>>,
    /// Entries in `by_scope`, read without the lock on every request.
    count: AtomicUsize,
    /// Response bytes held by the kept outcomes.
    bytes: AtomicUsize,
}

/// What a duplicate needs of a kept outcome.
pub(super) struct Waiting {
    /// When the original request arrived.
    pub first_seen: SystemTime,
    /// The fingerprint and epoch of the request that ran, which a duplicate must match.
    pub fingerprint: Fingerprint,
    pub epoch: Option<u64>,
    /// How long the claim of the request that ran held its key, for a release of a
    /// claim a duplicate took meanwhile.
    pub hold: Duration,
    /// Wakes the storing task for an attempt now.
    nudge: Notify,
    /// `true` once the outcome is stored (or superseded): a waiter that subscribes
    /// after that sees it at once.
    settled: watch::Sender<bool>,
}

impl Waiting {
    /// Asks for an attempt to store the outcome now.
    pub(super) fn nudge(&self) {
        self.nudge.notify_one();
    }

    /// Waits until the outcome is settled in the store, or `timeout`; `false` on the
    /// timeout.
    pub(super) async fn settled(&self, timeout: Duration) -> bool {
        let mut settled = self.settled.subscribe();
        let done = tokio::time::timeout(timeout, settled.wait_for(|done| *done)).await;
        done.is_ok()
    }
}

impl KeptOutcomes {
    /// The kept outcome of `scope`, if this layer holds one.
    pub(super) fn get(&self, scope: &ScopeKey) -> Option<Arc<Waiting>> {
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.lock().get(scope).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ScopeKey, Arc<Waiting>>> {
        self.by_scope.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `outcome` and stores it from a task of its own. Past `max_bytes` of held
    /// responses, it is kept without its response: the request is recorded as run, and
    /// duplicates get `410` rather than a replay or a second run.
    pub(super) fn keep<St: IdempotencyStore>(
        self: &Arc<Self>,
        store: Arc<St>,
        scope: ScopeKey,
        mut outcome: Outcome,
        max_bytes: usize,
    ) {
        let mut weight = outcome.record.weight();
        let held = self.bytes.fetch_add(weight, Ordering::Relaxed) + weight;
        if held > max_bytes {
            self.bytes.fetch_sub(weight, Ordering::Relaxed);
            tracing::warn!(
                target: "tower_ids::idempotency",
                event = event::KEPT_OVER_BUDGET,
                bytes = weight,
                max_bytes,
                "outcomes waiting for the store hold too many bytes: this one is kept without its response, so duplicates get 410, never a second run"
            );
            outcome.record = Arc::new(Record {
                payload: None,
                ..Record::clone(&outcome.record)
            });
            weight = 0;
        }
        let (settled, _) = watch::channel(false);
        let waiting = Arc::new(Waiting {
            first_seen: outcome.lease.first_seen,
            fingerprint: outcome.record.fingerprint,
            epoch: outcome.record.epoch,
            hold: outcome.claim.lease,
            nudge: Notify::new(),
            settled,
        });
        if self.lock().insert(scope, waiting.clone()).is_none() {
            self.count.fetch_add(1, Ordering::Release);
        }
        let kept = self.clone();
        let pending = self
            .outstanding
            .enter(Owed::Outcome, tracing::Span::current());
        let task = async move {
            let _pending = pending;
            store_until_done(&*store, &scope, &outcome, &waiting).await;
            {
                // Only this outcome's entry: another kept for the scope since stays.
                let mut by_scope = kept.lock();
                if by_scope
                    .get(&scope)
                    .is_some_and(|entry| Arc::ptr_eq(entry, &waiting))
                {
                    by_scope.remove(&scope);
                    kept.count.fetch_sub(1, Ordering::Release);
                }
            }
            kept.bytes.fetch_sub(weight, Ordering::Relaxed);
            waiting.settled.send_replace(true);
        };
        // The same span as the request: its correlation ID and key are on every event.
        tokio::spawn(task.instrument(tracing::Span::current()));
    }
}

/// Tries to store `outcome` until the store takes it or a record holds the key,
/// renewing the claim between attempts so that no retry can take the key meanwhile. If
/// another request's claim holds the key (this one's ran out), waits for that claim to
/// be settled: it may be released without running (its own store call failed), and
/// then this outcome is what keeps the handler from running again.
async fn store_until_done<St: IdempotencyStore>(
    store: &St,
    scope: &ScopeKey,
    outcome: &Outcome,
    waiting: &Waiting,
) {
    let mut pause = FIRST_STORE_RETRY_PAUSE;
    let mut attempts = 1;
    loop {
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = waiting.nudge.notified() => {}
        }
        attempts += 1;
        let completed = observe::store_call(
            "complete",
            store.complete(scope, &outcome.lease, outcome.record.clone(), outcome.ttl),
        );
        match completed.await {
            Ok(Completion::ClaimedByAnother) => {
                tracing::debug!(
                    target: "tower_ids::idempotency",
                    event = event::CLAIM_LAPSED,
                    attempts,
                    "another request's claim holds the key; trying again once it is settled"
                );
            }
            Ok(completion) => return report(completion, &outcome.record, outcome.ttl, attempts),
            Err(error) => {
                tracing::debug!(
                    target: "tower_ids::idempotency",
                    event = event::STORE_FAILED,
                    error = %Chain(&error),
                    phase = "complete",
                    attempts,
                    "still cannot store the response; trying again"
                );
                // Keep the key claimed meanwhile; the next attempt to store decides the
                // rest, so only a lost claim is worth an event here.
                let renewed = observe::store_call(
                    "renew",
                    store.renew(scope, &outcome.lease, &outcome.claim),
                );
                if let Ok(Renewal::Restored) = renewed.await {
                    tracing::warn!(
                        target: "tower_ids::idempotency",
                        event = event::CLAIM_RESTORED,
                        "the store had lost this request's claim (restarted without persistence?); it is back, but a duplicate may have run meanwhile"
                    );
                }
            }
        }
        pause = (pause * 2).min(MAX_STORE_RETRY_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A duplicate that looks for the outcome just after it was stored (between finding
    /// it kept and subscribing) is told at once, not after its whole wait.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_comes_after_the_outcome_settled_is_told_at_once() {
        let (settled, _) = watch::channel(false);
        let waiting = Waiting {
            first_seen: SystemTime::now(),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            epoch: None,
            hold: Duration::from_secs(15),
            nudge: Notify::new(),
            settled,
        };
        waiting.settled.send_replace(true);
        let began = tokio::time::Instant::now();
        assert!(waiting.settled(Duration::from_secs(5)).await);
        assert_eq!(began.elapsed(), Duration::ZERO, "no wait at all");
    }
}
