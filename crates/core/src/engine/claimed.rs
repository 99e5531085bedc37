//! The life of a request that holds its key, from the decision to run it to its
//! record: the claim renewed while the handler runs, the outcome classified by the
//! adapter, then stored (in the handler's transaction if it took one) or the key given
//! back, and every event and metric of it recorded here, once, whatever the transport.

use crate::code::event;
use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::Poll,
    time::{Duration, SystemTime},
};

use tracing::Instrument as _;

use super::{
    decide::Held,
    drain::Owed,
    kept::{report, KeptOutcomes, Outcome},
    lease::{self, Release, Renewed, RENEWAL_RETRY_PAUSE},
    observe,
    settings::{OutcomeClass, Policy, StorageRule},
    transient::Transient,
};
use crate::{
    store::{
        Chain, Claim, Completion, HandlerTransaction, IdempotencyStore, Lease, Payload, Record,
        StoreError, TransactionEnd, TransactionOffer,
    },
    AttemptId, ScopeKey,
};
use tower_ids_correlation::CorrelationId;

/// What the adapter makes of the work that ran, for the engine to settle.
pub enum Classified {
    /// Store this payload; duplicates replay it.
    Store(Payload),
    /// The work ran, but its outcome is over the limit of what is kept: it is recorded
    /// as run without it, and duplicates are refused as not replayable, never run.
    TooLarge {
        /// The limit. (Not the outcome's size: a response over it is streamed on, and
        /// its size is never known.)
        max_bytes: usize,
    },
    /// The work ran, but its outcome cannot be encoded to be kept: recorded as run
    /// without it, as [`TooLarge`](Self::TooLarge).
    Unencodable(String),
    /// The response failed while it was read: nothing to keep, the key is given back.
    Failed(String),
    /// Nothing to keep: the key is given back, so a retry runs again.
    Release(Release),
}

/// What the adapter is told when it classifies an outcome.
#[derive(Debug, Clone, Copy)]
pub struct Classifying {
    /// The policy's storage rule.
    pub rule: StorageRule,
    /// Whether the handler began the store's transaction: a server error of such a
    /// handler is rolled back, so it must be released, whatever the rule.
    pub transaction_taken: bool,
}

impl Classifying {
    /// Whether an outcome of `class` is kept: as `overridden` says (a layer's
    /// `store_if`), else as the policy's rule says; never a server error of a handler
    /// that took the transaction, whose writes are rolled back.
    pub fn keeps(&self, class: OutcomeClass, server_error: bool, overridden: Option<bool>) -> bool {
        overridden.unwrap_or_else(|| self.rule.keeps(class))
            && !(server_error && self.transaction_taken)
    }
}

/// How an adapter classifies what its handler produced: the transport's half of the
/// completion, in the spirit of tower-http's response classifiers.
pub trait Classify<T> {
    /// What becomes of `produced`.
    fn classify(&self, produced: &T, context: Classifying) -> Classified;

    /// Whether `produced` says the work succeeded: a success whose transaction was
    /// rolled back is answered as not committed, never handed back.
    fn succeeded(&self, produced: &T) -> bool;
}

/// The engine's tests classify with a closure; every outcome of theirs is a success.
#[cfg(test)]
impl<T, F: Fn(&T, Classifying) -> Classified> Classify<T> for F {
    fn classify(&self, produced: &T, context: Classifying) -> Classified {
        self(produced, context)
    }

    fn succeeded(&self, _: &T) -> bool {
        true
    }
}

/// How the work that ran was settled, for the adapter's answer.
#[derive(Debug)]
pub enum Finished {
    /// The outcome is stored, or kept until the store takes it; `expires_at` when it
    /// is stored now.
    Kept { expires_at: Option<SystemTime> },
    /// The work ran, but its outcome is recorded without its payload.
    NotKept,
    /// The key was given back: a retry runs again.
    Released,
    /// The key was given back by rolling back the transaction that held it: nothing
    /// the work wrote in that transaction stands, whatever its output says. An adapter
    /// answers a success so settled as not committed (with this error), and passes a
    /// failure on.
    RolledBack(StoreError),
    /// The response failed while it was read; the key was given back.
    Failed,
    /// The outcome does not stand, or whether it does is not known.
    Uncommitted(Uncommitted),
}

/// A handler that failed (its service's error, not a response), as the engine settled
/// it: its key is given back either way.
#[derive(Debug)]
pub enum Failure<E> {
    /// The handler's own failure: the adapter passes its error on.
    Handler(E),
    /// The transaction the handler was given broke under it, which is most likely what
    /// it failed on: a passing fault, answered as not committed (a `503`, a message
    /// requeued uncounted), never as the handler's failure. Its error is kept for the
    /// adapter that logs it.
    TransactionBroke(E, StoreError),
    /// The handler failed on a passing fault (a database error `is_transient`
    /// recognises, or a `transient_if` hook): answered as unavailable (a `503`, a
    /// message requeued uncounted), never kept as the handler's failure.
    Transient(E),
}

/// How a claimed key was given back.
enum Released {
    /// Through the store (or it was settled already).
    Lease,
    /// By rolling back the transaction that held it.
    RolledBack,
    /// With the transaction that held it, which had broken.
    Broke(StoreError),
}

/// Why a claimed request's outcome does not stand, as far as the layer knows.
#[derive(Debug)]
pub enum Uncommitted {
    /// Nothing the handler wrote in its transaction stands, and the key is released.
    Failed(StoreError),
    /// The commit's answer was lost, and whether it landed is not known; the key is
    /// released in the background, which removes nothing if the commit landed.
    Unknown(StoreError),
}

/// A request that holds its key. Given back on drop unless settled, so a handler that
/// panics or a task that is cancelled before the handler produced anything never leaves
/// its key locked until the lease runs out.
pub struct Claimed<St: IdempotencyStore> {
    store: Arc<St>,
    scope: ScopeKey,
    claim: Claim,
    lease: Option<Lease>,
    kept: Arc<KeptOutcomes>,
    /// How long the outcome is kept, how many bytes kept outcomes may hold, and the
    /// storage rule.
    ttl: Duration,
    max_kept_bytes: usize,
    rule: StorageRule,
    /// The transaction that holds the claim, for a store whose claims are transactions:
    /// the handler is offered it, the record commits in it, and no lease is renewed.
    transaction: Option<Box<dyn HandlerTransaction>>,
    /// Which of the handler's errors are passing faults.
    transient: Transient,
    /// Time spent in store calls on the request's path so far.
    pub(super) store_time: Duration,
}

impl<St: IdempotencyStore> Claimed<St> {
    pub(super) fn new(
        store: Arc<St>,
        (scope, claim, lease, transaction): Held,
        kept: Arc<KeptOutcomes>,
        policy: &Policy,
        transient: Transient,
    ) -> Self {
        Self {
            store,
            scope,
            claim,
            lease: Some(lease),
            kept,
            ttl: policy.ttl,
            max_kept_bytes: policy.max_kept_bytes,
            rule: policy.storage,
            transaction,
            transient,
            store_time: Duration::ZERO,
        }
    }

    /// What the store offers the handler to run its writes in, if anything: the adapter
    /// hands it on where its handler finds it.
    pub fn transaction_offer(&self) -> Option<TransactionOffer> {
        self.transaction
            .as_ref()
            .map(|transaction| transaction.offer())
    }

    /// Runs `work`, renewing the claim while it runs; then has `classify` say what
    /// becomes of its output, and stores it or gives the key back. A `work` that fails
    /// gives the key back (`handler_error`, or `transient` for a passing fault) and
    /// returns its error, as the handler's or as a passing fault's. The attempt that
    /// ran, which replays name (`original-attempt-id`), is `attempt` (the attempt ID
    /// the request sent), else the correlation ID in scope.
    ///
    /// `work` comes pinned where it was made, so its future (as large as the
    /// handler's) is not moved again. The claim is borrowed, not taken: dropped
    /// unfinished, the caller drops the work first and then the claim, whose drop lets
    /// the key go once nothing of the handler is left.
    #[allow(clippy::manual_async_fn)] // See `Engine::handle`.
    pub fn run<'a, T, E: 'static, W>(
        &'a mut self,
        work: Pin<&'a mut W>,
        classify: &'a impl Classify<T>,
        attempt: Option<AttemptId>,
    ) -> impl Future<Output = Result<(T, Finished), Failure<E>>> + 'a
    where
        W: Future<Output = Result<T, E>>,
        St: 'a,
    {
        async move {
            let original_attempt = attempt.or_else(|| {
                CorrelationId::current()
                    .map(|id| AttemptId::from_header_value(id.to_header_value()))
            });
            let produced = match self.transaction_offer() {
                Some(offer) => offer.scope(self.renewing(work)).await,
                None => self.renewing(work).await,
            };
            let produced = match produced {
                Ok(produced) => produced,
                Err(error) => return Err(self.failed(error).await),
            };
            let context = Classifying {
                rule: self.rule,
                transaction_taken: self.transaction_taken(),
            };
            let finished = match classify.classify(&produced, context) {
                Classified::Store(payload) => self.complete(original_attempt, Some(payload)).await,
                Classified::TooLarge { max_bytes } => {
                    tracing::warn!(
                        target: "tower_ids::idempotency",
                        event = event::RESPONSE_TOO_LARGE,
                        max_bytes,
                        "outcome over the idempotency limit: handed to this caller, not kept; duplicates are refused as not replayable, never run again"
                    );
                    self.not_kept(original_attempt).await
                }
                Classified::Unencodable(error) => {
                    tracing::warn!(
                        target: "tower_ids::idempotency",
                        event = event::OUTCOME_UNSERIALISABLE,
                        error = %error,
                        "the outcome does not encode: not kept; duplicates are refused as not replayable, never run again"
                    );
                    self.not_kept(original_attempt).await
                }
                Classified::Failed(error) => {
                    tracing::warn!(
                        target: "tower_ids::idempotency",
                        event = event::RESPONSE_FAILED,
                        error = %error,
                        "the response failed while being read; nothing is stored, so a retry runs again"
                    );
                    self.release(Release::ResponseFailed).await;
                    Finished::Failed
                }
                Classified::Release(reason) => match self.release(reason).await {
                    Released::RolledBack => Finished::RolledBack(StoreError::new(
                        "its outcome is not kept, so the transaction that held its key was rolled back",
                    )),
                    Released::Broke(error) => Finished::Uncommitted(Uncommitted::Failed(error)),
                    Released::Lease => Finished::Released,
                },
            };
            Ok((produced, finished))
        }
    }

    /// Records the work as run without its outcome.
    async fn not_kept(&mut self, original_attempt: Option<AttemptId>) -> Finished {
        match self.complete(original_attempt, None).await {
            Finished::Kept { .. } => Finished::NotKept,
            other => other,
        }
    }

    /// Whether the handler began the store's transaction ([`HandlerTransaction::taken`]).
    fn transaction_taken(&self) -> bool {
        self.transaction
            .as_ref()
            .is_some_and(|transaction| transaction.taken())
    }

    /// Runs `work`, renewing the claim every quarter of the lease (a sixth of the
    /// claim's hold, see [`lease::claim`]) until it ends, so a handler longer than the
    /// lease keeps its key while its worker lives.
    async fn renewing<F: Future>(&self, work: F) -> F::Output {
        // A claim held by a transaction ends with it: there is no lease to renew.
        let Some(lease) = self.lease.as_ref().filter(|_| self.transaction.is_none()) else {
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
            let renewal = lease::renew(&*self.store, &self.scope, lease, &self.claim, failed);
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

    /// Stores the outcome (the payload, `None` when it is not kept, and the attempt
    /// that ran): in the handler's transaction if it took one (committing its writes
    /// with it), else in the store; if the store fails, keeps it and stores it from a
    /// task of its own (see [`KeptOutcomes`]). Never releases the key, but for a
    /// handler's transaction that did not commit: then nothing the handler wrote in it
    /// stands, and the key is released.
    async fn complete(
        &mut self,
        original_attempt: Option<AttemptId>,
        payload: Option<Payload>,
    ) -> Finished {
        let Some(lease) = self.lease.take() else {
            return Finished::Kept { expires_at: None };
        };
        let ttl = self.ttl;
        let expires_at = SystemTime::now() + ttl;
        let record = Arc::new(Record {
            fingerprint: self.claim.fingerprint,
            first_seen: lease.first_seen,
            original_attempt,
            epoch: self.claim.epoch,
            payload,
            expires_at: Some(expires_at),
        });
        let stored = |completion: Completion| Finished::Kept {
            expires_at: completion.is_stored().then_some(expires_at),
        };
        if let Some(transaction) = self.transaction.take() {
            // Boxed: the store path's future does not carry the commit's (an allocation
            // beside a COMMIT).
            return Box::pin(self.commit(transaction, record, ttl, expires_at)).await;
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
                target: "tower_ids::idempotency",
                event = event::CLAIM_LAPSED,
                "this request's claim ran out while it ran and another request holds the key now; keeping the outcome and storing it once that claim is settled (dropped only if a record takes the key)"
            ),
            Ok(completion) => {
                report(completion, &record, ttl, 1);
                return stored(completion);
            }
            Err(error) => tracing::warn!(
                target: "tower_ids::idempotency",
                event = event::STORE_FAILED,
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
            .keep(self.store.clone(), self.scope, outcome, self.max_kept_bytes);
        Finished::Kept { expires_at: None }
    }

    /// Commits the handler's transaction with the outcome's `record`: the writes and
    /// the record stand together, or neither does.
    async fn commit(
        &mut self,
        transaction: Box<dyn HandlerTransaction>,
        record: Arc<Record>,
        ttl: Duration,
        expires_at: SystemTime,
    ) -> Finished {
        let outcome = Some((record.clone(), ttl));
        let started = std::time::Instant::now();
        let ended = transaction.settle(self.scope, outcome).await;
        self.store_time += started.elapsed();
        observe::store_time(self.store_time);
        match ended {
            TransactionEnd::Committed => {
                report(Completion::Stored, &record, ttl, 1);
                Finished::Kept {
                    expires_at: Some(expires_at),
                }
            }
            TransactionEnd::RolledBack => {
                let error = StoreError::new("the request's transaction was rolled back");
                lease::released_with_transaction(Release::RolledBack);
                Finished::Uncommitted(Uncommitted::Failed(error))
            }
            TransactionEnd::Failed(error) => {
                tracing::warn!(
                    target: "tower_ids::idempotency",
                    event = event::COMMIT_FAILED,
                    error = %Chain(&error),
                    "the request's transaction did not commit: nothing it wrote stands, and a retry runs again"
                );
                lease::released_with_transaction(Release::CommitFailed);
                Finished::Uncommitted(Uncommitted::Failed(error))
            }
            TransactionEnd::Unknown(error) => {
                tracing::warn!(
                    target: "tower_ids::idempotency",
                    event = event::OUTCOME_UNKNOWN,
                    error = %Chain(&error),
                    "the commit's answer was lost and the store could not tell whether it landed; a retry with this key replays the outcome if it did, and runs again once the database has settled that it did not"
                );
                Finished::Uncommitted(Uncommitted::Unknown(error))
            }
        }
    }

    /// Gives the key back after the handler failed, and says whether it failed on a
    /// passing fault: its transaction broke under it, or its error is one.
    async fn failed<E: 'static>(&mut self, error: E) -> Failure<E> {
        let transient = self.transient.recognise(&error);
        let reason = match transient {
            Some(_) => Release::Transient,
            None => Release::HandlerError,
        };
        match (self.release(reason).await, transient) {
            (Released::Broke(broke), _) => Failure::TransactionBroke(error, broke),
            (Released::Lease | Released::RolledBack, Some(why)) => {
                tracing::warn!(
                    target: "tower_ids::idempotency",
                    event = event::TRANSIENT_FAILURE,
                    error = why.as_str(),
                    "the handler failed on a passing fault: nothing is kept, and a retry runs again"
                );
                Failure::Transient(error)
            }
            (Released::Lease | Released::RolledBack, None) => Failure::Handler(error),
        }
    }

    /// Gives the key up so a retry runs again: for a request that produced nothing to
    /// keep (the handler failed, or its response is not stored).
    async fn release(&mut self, reason: Release) -> Released {
        let Some(lease) = self.lease.take() else {
            return Released::Lease;
        };
        let started = std::time::Instant::now();
        if let Some(transaction) = self.transaction.take() {
            // Nothing to store: whatever the handler wrote in it is rolled back, and the
            // claim ends with it.
            let settlement = transaction.settle(self.scope, None).await;
            observe::store_time(self.store_time + started.elapsed());
            if let TransactionEnd::Failed(error) | TransactionEnd::Unknown(error) = settlement {
                tracing::warn!(
                    target: "tower_ids::idempotency",
                    event = event::TRANSACTION_BROKE,
                    error = %Chain(&error),
                    "the request's transaction broke under its handler: a passing fault, not the handler's; nothing it wrote stands, and a retry runs again"
                );
                lease::released_with_transaction(Release::TransactionBroke);
                return Released::Broke(error);
            }
            lease::released_with_transaction(reason);
            return Released::RolledBack;
        }
        self.give_back(&lease, reason).await;
        observe::store_time(self.store_time + started.elapsed());
        Released::Lease
    }

    async fn give_back(&self, lease: &Lease, reason: Release) {
        let (hold, outstanding) = (self.claim.lease, &self.kept.outstanding);
        lease::release(&self.store, &self.scope, lease, hold, reason, outstanding).await;
    }
}

impl<St: IdempotencyStore> Drop for Claimed<St> {
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
            Release::HandlerPanicked
        } else {
            Release::Abandoned
        };
        let outstanding = self.kept.outstanding.clone();
        let pending = outstanding.enter(Owed::Release, tracing::Span::current());
        let transaction = self.transaction.take();
        runtime.spawn(
            async move {
                match transaction {
                    Some(transaction) => {
                        // Rolled back now, not when the last clone the handler kept of
                        // it is dropped: the claim ends with it.
                        transaction.settle(scope, None).await;
                        lease::released_with_transaction(reason);
                    }
                    None => {
                        lease::release(&store, &scope, &lease, hold, reason, &outstanding).await
                    }
                }
                drop(pending);
            }
            .instrument(tracing::Span::current()),
        );
    }
}
