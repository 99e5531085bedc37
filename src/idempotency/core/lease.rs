//! The completion path of a claimed request: its claim kept alive while the handler
//! runs, its outcome stored when it ends, and, if the store cannot take the outcome
//! now, stored later from a task of its own. Once the handler has produced an outcome,
//! the key is never released.

use std::{
    collections::HashMap,
    future::Future,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, PoisonError,
    },
    task::Poll,
    time::{Duration, SystemTime},
};

use tokio::sync::{watch, Notify};
use tracing::Instrument as _;

use super::{
    drain::{Owed, Settling},
    observe,
    settings::Policy,
};
use crate::idempotency::{
    store::{
        Chain, Claim, Completion, HandlerTransaction, IdempotencyStore, Lease, Payload, Record,
        Renewal, Settlement, StoreError,
    },
    AttemptId, Fingerprint, ScopeKey,
};

/// The first pause before storing a kept outcome again; it doubles up to
/// [`MAX_STORE_RETRY_PAUSE`].
const FIRST_STORE_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The longest pause between two attempts to store a kept outcome: short, because a
/// retry of the request gets `409` until the outcome is stored, and a store that is
/// down answers an attempt at once.
const MAX_STORE_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// The pause before renewing again after a renewal failed: 50 ms, not the quarter
/// lease between healthy renewals. A claim lives through a store outage only if a
/// renewal lands soon after the store answers again, and a store that is down answers
/// each attempt at once (a paused one within its command timeout).
pub(crate) const RENEWAL_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The claim a request makes under `lease`.
///
/// Each write of the claim (the claim itself and every renewal) holds the key for the
/// lease and half again, and a running request renews it every quarter of the lease.
/// So at any moment a live worker's claim has at least the lease left, give or take
/// the renewal's own round trip (a quarter of the lease is kept for it; it is bounded
/// by the store's command timeout): a store outage shorter than the lease, counted from
/// when it began, never lets the claim run out. The cost: a dead worker's key stays
/// locked for up to one and a half leases after its last renewal.
pub(crate) fn claim(fingerprint: Fingerprint, lease: Duration, epoch: Option<u64>) -> Claim {
    Claim {
        fingerprint,
        lease: lease + lease / 2,
        epoch,
    }
}

/// Why a claimed request's outcome does not stand, as far as the layer knows.
pub(crate) enum Unsettled {
    /// Nothing the handler wrote in its transaction stands, and the key is released.
    NotCommitted(StoreError),
    /// The commit's answer was lost, and whether it landed is not known; the key is
    /// released in the background, which removes nothing if the commit landed.
    Unknown(StoreError),
}

/// Holds a claimed lease; released on drop unless settled, so a handler that panics or
/// a task that is cancelled before the handler produced anything never leaves its key
/// locked until the lease runs out.
pub(crate) struct LeaseGuard<St: IdempotencyStore> {
    store: Arc<St>,
    scope: ScopeKey,
    claim: Claim,
    lease: Option<Lease>,
    kept: Arc<KeptOutcomes>,
    /// How long the outcome is kept, and how many bytes kept outcomes may hold.
    ttl: Duration,
    max_kept_bytes: usize,
    /// The transaction the store offers the handler, if it can commit the record in it.
    transaction: Option<Box<dyn HandlerTransaction>>,
    /// Time spent in store calls on the request's path so far.
    pub(super) store_time: Duration,
    /// When the outcome's record expires, once [`complete`](Self::complete) made it.
    expires_at: Option<SystemTime>,
}

impl<St: IdempotencyStore> LeaseGuard<St> {
    pub(crate) fn new(
        store: Arc<St>,
        scope: ScopeKey,
        claim: Claim,
        lease: Lease,
        kept: Arc<KeptOutcomes>,
        policy: &Policy,
    ) -> Self {
        let transaction = store.handler_transaction();
        Self {
            store,
            scope,
            claim,
            lease: Some(lease),
            kept,
            ttl: policy.ttl,
            max_kept_bytes: policy.max_kept_bytes,
            transaction,
            store_time: Duration::ZERO,
            expires_at: None,
        }
    }

    /// When the record [`complete`](Self::complete) stored expires (its TTL from then);
    /// `None` if it is not stored (yet).
    pub(crate) fn expires_at(&self) -> Option<SystemTime> {
        self.expires_at
    }

    /// Whether the handler began the store's transaction ([`HandlerTransaction::taken`]).
    pub(crate) fn transaction_taken(&self) -> bool {
        self.transaction
            .as_ref()
            .is_some_and(|transaction| transaction.taken())
    }

    /// Offers the store's transaction, if any, to the handler in `extensions`.
    pub(crate) fn offer_transaction(&self, extensions: &mut http::Extensions) {
        if let Some(transaction) = &self.transaction {
            transaction.offer(extensions);
        }
    }

    /// Runs `work`, renewing the claim every quarter of the lease (a sixth of the
    /// claim's hold, see [`claim`]) until it ends, so a handler longer than the lease
    /// keeps its key while its worker lives.
    pub(crate) async fn renewing<F: Future>(&self, work: F) -> F::Output {
        let Some(lease) = &self.lease else {
            return work.await;
        };
        let period = (self.claim.lease / 6).max(Duration::from_millis(1));
        let mut pause = period;
        // Renewals failed in a row: the first is a WARN, the rest, 50 ms apart, DEBUG.
        let mut failed = 0;
        tokio::pin!(work);
        // A handler that is ready at once never makes a timer.
        let first = std::future::poll_fn(|cx| Poll::Ready(work.as_mut().poll(cx))).await;
        if let Poll::Ready(output) = first {
            return output;
        }
        loop {
            // `work` first: once it is done, no renewal starts.
            tokio::select! {
                biased;
                output = &mut work => return output,
                () = tokio::time::sleep(pause) => {}
            }
            let renewal = renew(&*self.store, &self.scope, lease, &self.claim, failed);
            tokio::pin!(renewal);
            let renewed = tokio::select! {
                biased;
                output = &mut work => {
                    // A renewal already sent finishes (it is bounded) before the key is
                    // completed or released: on a store with more than one connection,
                    // a late renewal could otherwise put the claim back after a release.
                    let _ = renewal.await;
                    return output;
                }
                renewed = &mut renewal => renewed,
            };
            pause = match renewed {
                Renewed::Held => {
                    failed = 0;
                    period
                }
                // Until one lands: the claim outlives an outage only if a renewal lands
                // soon after the store is back.
                Renewed::Failed => {
                    failed += 1;
                    RENEWAL_RETRY_PAUSE.min(period)
                }
                Renewed::Lost => return work.await,
            };
        }
    }

    /// Stores the outcome (the payload, `None` when it was too large to keep, and the
    /// attempt that ran): in the handler's transaction if it took one (committing its
    /// writes with it), else in the store; if the store fails, keeps it and stores it
    /// from a task of its own (see [`KeptOutcomes`]). Never releases the key, but for
    /// a handler's transaction that did not commit: then nothing the handler wrote in
    /// it stands, the key is released, and the error is returned.
    pub(crate) async fn complete(
        &mut self,
        original_attempt: Option<AttemptId>,
        payload: Option<Payload>,
    ) -> Result<(), Unsettled> {
        let Some(lease) = self.lease.take() else {
            return Ok(());
        };
        let (ttl, max_kept_bytes) = (self.ttl, self.max_kept_bytes);
        let expires_at = SystemTime::now() + ttl;
        let record = Record {
            fingerprint: self.claim.fingerprint,
            first_seen: lease.first_seen,
            original_attempt,
            epoch: self.claim.epoch,
            payload,
            expires_at: Some(expires_at),
        };
        let record = Arc::new(record);
        if let Some(transaction) = self.transaction.take() {
            let outcome = Some((record.clone(), ttl));
            let started = std::time::Instant::now();
            let settlement = transaction.settle(self.scope, lease.clone(), outcome).await;
            self.store_time += started.elapsed();
            // Recorded once: below, or by `complete` when the transaction was not taken.
            if !matches!(settlement, Settlement::NotTaken) {
                observe::store_time(self.store_time);
            }
            match settlement {
                Settlement::Committed(completion) => {
                    if completion.is_stored() {
                        self.expires_at = Some(expires_at);
                    }
                    report(completion, &record, ttl, 1);
                    return Ok(());
                }
                Settlement::NotTaken => {}
                Settlement::RolledBack => {
                    let error = StoreError::new("the request's transaction was rolled back");
                    release(
                        &self.store,
                        &self.scope,
                        &lease,
                        self.claim.lease,
                        "rolled_back",
                        &self.kept.settling,
                    )
                    .await;
                    return Err(Unsettled::NotCommitted(error));
                }
                Settlement::Failed(error) => {
                    tracing::warn!(
                        event = "idempotency.commit_failed",
                        error = %Chain(&error),
                        "the request's transaction did not commit: nothing it wrote stands, and a retry runs again"
                    );
                    release(
                        &self.store,
                        &self.scope,
                        &lease,
                        self.claim.lease,
                        "commit_failed",
                        &self.kept.settling,
                    )
                    .await;
                    return Err(Unsettled::NotCommitted(error));
                }
                Settlement::Unknown(error) => {
                    tracing::warn!(
                        event = "idempotency.outcome_unknown",
                        error = %Chain(&error),
                        "the commit's answer was lost and the store could not tell whether it landed; a retry with this key replays the outcome if it did, and runs again once the store confirms it did not"
                    );
                    // A release never removes a stored outcome (the store's contract),
                    // and the commit, until it ends, holds what the release would
                    // change: so releasing is right whichever way the commit went,
                    // and frees the key as soon as the store can tell.
                    let (store, scope, hold) = (self.store.clone(), self.scope, self.claim.lease);
                    let settling = self.kept.settling.clone();
                    let pending = settling.enter(Owed::Release, tracing::Span::current());
                    let release = async move {
                        release(&store, &scope, &lease, hold, "outcome_unknown", &settling).await;
                        drop(pending);
                    };
                    tokio::spawn(release.instrument(tracing::Span::current()));
                    return Err(Unsettled::Unknown(error));
                }
            }
        }
        let completed = observe::timed_store_call(
            "complete",
            &mut self.store_time,
            self.store
                .complete(&self.scope, &lease, record.clone(), ttl),
        )
        .await;
        observe::store_time(self.store_time);
        match completed {
            Ok(Completion::ClaimedByAnother) => tracing::warn!(
                event = "idempotency.claim_lapsed",
                "this request's claim ran out while it ran and another request holds the key now; keeping the outcome and storing it once that claim is settled (dropped only if a record takes the key)"
            ),
            Ok(completion) => {
                if completion.is_stored() {
                    self.expires_at = Some(expires_at);
                }
                report(completion, &record, ttl, 1);
                return Ok(());
            }
            Err(error) => tracing::warn!(
                event = "idempotency.store_failed",
                error = %Chain(&error),
                phase = "complete",
                "could not store the response; keeping it and storing it in the background (the key stays claimed)"
            ),
        }
        let outcome = Outcome {
            lease,
            claim: self.claim.clone(),
            record,
            ttl,
        };
        self.kept
            .keep(self.store.clone(), self.scope, outcome, max_kept_bytes);
        Ok(())
    }

    /// Gives the key up so a retry runs again: for a request that produced nothing to
    /// keep (the handler failed, or its response is not stored).
    pub(crate) async fn release(&mut self, reason: &'static str) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let started = std::time::Instant::now();
        if let Some(transaction) = self.transaction.take() {
            // Nothing to store: whatever the handler wrote in it is rolled back.
            transaction.settle(self.scope, lease.clone(), None).await;
        }
        release(
            &self.store,
            &self.scope,
            &lease,
            self.claim.lease,
            reason,
            &self.kept.settling,
        )
        .await;
        observe::store_time(self.store_time + started.elapsed());
    }
}

impl<St: IdempotencyStore> Drop for LeaseGuard<St> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.store.clone();
        let scope = self.scope;
        let hold = self.claim.lease;
        let reason = if std::thread::panicking() {
            "handler_panicked"
        } else {
            "abandoned"
        };
        let settling = self.kept.settling.clone();
        let pending = settling.enter(Owed::Release, tracing::Span::current());
        runtime.spawn(
            async move {
                release(&store, &scope, &lease, hold, reason, &settling).await;
                drop(pending);
            }
            .instrument(tracing::Span::current()),
        );
    }
}

/// What one renewal did.
enum Renewed {
    /// The claim holds (it was extended, or put back).
    Held,
    /// The store did not answer: try again soon.
    Failed,
    /// Another request holds the scope: renewing is over.
    Lost,
}

/// One renewal, after `failed` renewals that failed in a row.
async fn renew<St: IdempotencyStore>(
    store: &St,
    scope: &ScopeKey,
    lease: &Lease,
    claim: &Claim,
    failed: u32,
) -> Renewed {
    match observe::store_call("renew", store.renew(scope, lease, claim)).await {
        Ok(Renewal::Extended) => {
            tracing::trace!(event = "idempotency.lease_renewed", "renewed the claim");
            Renewed::Held
        }
        Ok(Renewal::Restored) => {
            tracing::warn!(
                event = "idempotency.claim_restored",
                "the store had lost this request's claim (restarted without persistence, or the lease ran out unrenewed); it is back, but a duplicate may have run meanwhile"
            );
            Renewed::Held
        }
        Ok(Renewal::Lost) => {
            tracing::warn!(
                event = "idempotency.lease_lost",
                "another request holds this key now: this request's claim ran out while it was running; its outcome is stored once that request's claim is settled, unless a record takes the key first"
            );
            Renewed::Lost
        }
        Err(error) if failed == 0 => {
            tracing::warn!(
                event = "idempotency.store_failed",
                error = %Chain(&error),
                phase = "renew",
                "could not renew the claim; trying again every 50 ms until a renewal lands"
            );
            Renewed::Failed
        }
        Err(error) => {
            tracing::debug!(
                event = "idempotency.store_failed",
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
    reason: &'static str,
    settling: &Arc<Settling>,
) {
    if try_release(&**store, scope, lease, reason, 1).await {
        return;
    }
    let (store, scope, lease) = (store.clone(), *scope, lease.clone());
    let until = tokio::time::Instant::now() + hold;
    let pending = settling.enter(Owed::Release, tracing::Span::current());
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

/// One attempt at a release; `false` if the store did not answer.
async fn try_release<St: IdempotencyStore>(
    store: &St,
    scope: &ScopeKey,
    lease: &Lease,
    reason: &'static str,
    attempts: u32,
) -> bool {
    match observe::store_call("release", store.release(scope, lease)).await {
        Ok(true) => {
            tracing::debug!(
                event = "idempotency.released",
                reason,
                attempts,
                "released the idempotency key; a retry runs again"
            );
            observe::released(reason);
            true
        }
        Ok(false) if reason == "outcome_unknown" => {
            tracing::debug!(
                event = "idempotency.nothing_to_release",
                reason,
                "nothing to release: the commit whose answer was lost landed (its record answers retries), or the claim had run out and another request holds the key"
            );
            true
        }
        Ok(false) => {
            tracing::warn!(
                event = "idempotency.lease_lost",
                reason,
                "nothing to release: this request's claim had run out and another request holds the key"
            );
            true
        }
        Err(error) if attempts == 1 => {
            tracing::warn!(
                event = "idempotency.store_failed",
                error = %Chain(&error),
                phase = "release",
                reason,
                "could not release the key; trying again until the store answers or the claim runs out"
            );
            false
        }
        Err(error) => {
            tracing::debug!(
                event = "idempotency.store_failed",
                error = %Chain(&error),
                phase = "release",
                reason,
                attempts,
                "still cannot release the key; trying again"
            );
            false
        }
    }
}

/// The event for a completion the store answered.
fn report(completion: Completion, record: &Record, ttl: Duration, attempts: u32) {
    let status = record.response().map(|r| r.status.as_u16());
    let bytes = record.weight();
    match completion {
        Completion::Stored => tracing::debug!(
            event = "idempotency.stored",
            status,
            bytes,
            ttl_secs = ttl.as_secs(),
            attempts,
            "stored the response for replay"
        ),
        Completion::StoredWithoutClaim => tracing::warn!(
            event = "idempotency.stored",
            status,
            bytes,
            ttl_secs = ttl.as_secs(),
            attempts,
            claim = "missing",
            "stored the response, but the store had lost this request's claim (restarted without persistence, or the lease ran out): a duplicate may have run meanwhile"
        ),
        Completion::Superseded => tracing::warn!(
            event = "idempotency.lease_lost",
            status,
            attempts,
            "another request stored its outcome for this key: this request's claim ran out while it was running, and its outcome was not stored"
        ),
        // Kept and tried again by the caller, never reported as settled.
        Completion::ClaimedByAnother => {}
    }
}

/// An outcome the store could not take yet.
struct Outcome {
    lease: Lease,
    claim: Claim,
    record: Arc<Record>,
    ttl: Duration,
}

/// Outcomes waiting to be stored, one task each, shared by the clones of one layer.
///
/// A task tries again with backoff ([`FIRST_STORE_RETRY_PAUSE`] doubling to
/// [`MAX_STORE_RETRY_PAUSE`]) and renews the claim between attempts, until the outcome
/// is stored or the process ends. Duplicates that reach this layer meanwhile get
/// `409` (or wait, with `InFlight::Wait`) and nudge it to try at once; duplicates on
/// other replicas find the claim and get `409` too.
#[derive(Default)]
pub(crate) struct KeptOutcomes {
    /// The layer's register of unsettled work, which [`Drain`](super::Drain) reads.
    pub(crate) settling: Arc<Settling>,
    by_scope: Mutex<HashMap<ScopeKey, Arc<Waiting>>>,
    /// Entries in `by_scope`, read without the lock on every request.
    count: AtomicUsize,
    /// Response bytes held by the kept outcomes.
    bytes: AtomicUsize,
}

/// What a duplicate needs of a kept outcome.
pub(crate) struct Waiting {
    /// When the original request arrived.
    pub(crate) first_seen: SystemTime,
    /// The fingerprint and epoch of the request that ran, which a duplicate must match.
    pub(crate) fingerprint: Fingerprint,
    pub(crate) epoch: Option<u64>,
    /// How long the claim of the request that ran held its key, for a release of a
    /// claim a duplicate took meanwhile.
    pub(crate) hold: Duration,
    /// Wakes the storing task for an attempt now.
    nudge: Notify,
    /// Sends once the outcome is stored (or superseded).
    settled: watch::Sender<()>,
}

impl Waiting {
    /// Asks for an attempt to store the outcome now.
    pub(crate) fn nudge(&self) {
        self.nudge.notify_one();
    }

    /// Waits until the outcome is settled in the store, or `timeout`; `false` on the
    /// timeout.
    pub(crate) async fn settled(&self, timeout: Duration) -> bool {
        let mut settled = self.settled.subscribe();
        tokio::time::timeout(timeout, settled.changed())
            .await
            .is_ok()
    }
}

impl KeptOutcomes {
    /// The kept outcome of `scope`, if this layer holds one.
    pub(crate) fn get(&self, scope: &ScopeKey) -> Option<Arc<Waiting>> {
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
    fn keep<St: IdempotencyStore>(
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
                event = "idempotency.kept_over_budget",
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
        let (settled, _) = watch::channel(());
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
        let pending = self.settling.enter(Owed::Outcome, tracing::Span::current());
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
            waiting.settled.send_replace(());
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
                    event = "idempotency.claim_lapsed",
                    attempts,
                    "another request's claim holds the key; trying again once it is settled"
                );
            }
            Ok(completion) => return report(completion, &outcome.record, outcome.ttl, attempts),
            Err(error) => {
                tracing::debug!(
                    event = "idempotency.store_failed",
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
                        event = "idempotency.claim_restored",
                        "the store had lost this request's claim (restarted without persistence?); it is back, but a duplicate may have run meanwhile"
                    );
                }
            }
        }
        pause = (pause * 2).min(MAX_STORE_RETRY_PAUSE);
    }
}
