//! The decision every transport asks for: given a scope, a fingerprint and an epoch,
//! run (with a guard that completes or releases the claim), replay, or refuse, and
//! why. Every event and metric of the decision is recorded here, once.

use crate::code::event;
use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use super::{
    claimed::Claimed,
    detach::ClaimFlag,
    drain::Drain,
    kept::{KeptOutcomes, Waiting},
    lease::{self, Release},
    observe,
    settings::{InFlight, Policy, PolicyError, StoreFailure},
    transient::Transient,
};
use crate::{
    store::{
        Begin, Chain, Claim, HandlerTransaction, IdempotencyStore, Lease, Payload, Record,
        StoreError, Waited,
    },
    AttemptId, Fingerprint, ScopeKey,
};

/// A key this request holds: its scope, its claim, the lease, and the transaction that
/// holds it, if one does.
pub(super) type Held = (ScopeKey, Claim, Lease, Option<Box<dyn HandlerTransaction>>);

/// What is known of the work in flight a duplicate waits for.
struct Running {
    first_seen: Option<SystemTime>,
    request_count: Option<u64>,
}

/// The retry (or redelivery) delay after a wait for the work in flight timed out.
pub(super) const AFTER_WAIT: Duration = Duration::from_secs(1);

/// The deduplication engine of one layer (and its clones): the store, the outcomes
/// kept for it, and the settings every transport shares.
pub struct Engine<St> {
    store: Arc<St>,
    kept: Arc<KeptOutcomes>,
    policy: Policy,
    transient: Transient,
}

impl<St> Clone for Engine<St> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            kept: self.kept.clone(),
            policy: self.policy,
            transient: self.transient.clone(),
        }
    }
}

/// What to do with one protected request or message.
pub enum Decision<St: IdempotencyStore> {
    /// This request holds the key: run the handler, then complete or release it.
    Run(Claimed<St>),
    /// The store cannot answer: run without deduplication (fail open).
    FailOpen,
    /// Do not run the handler: answer this.
    Answer(Verdict),
}

impl<St: IdempotencyStore> Decision<St> {
    /// The outcome, as the metrics' `outcome` label and the span's field say it.
    fn outcome(&self) -> &'static str {
        match self {
            Decision::Run(_) => "executed",
            Decision::FailOpen => "fail_open",
            Decision::Answer(Verdict::Replay { .. }) => "replayed",
            Decision::Answer(Verdict::NotReplayable { .. }) => "not_replayable",
            Decision::Answer(Verdict::InFlight { .. }) => "in_flight",
            Decision::Answer(Verdict::Conflict | Verdict::EpochMismatch { .. }) => "conflict",
            Decision::Answer(Verdict::OriginalFailed) => "original_failed",
            Decision::Answer(Verdict::StoreUnavailable) => "store_unavailable",
            Decision::Answer(Verdict::PoolExhausted) => "pool_exhausted",
        }
    }

    /// Requests the store has seen with the key, when it said.
    fn request_count(&self) -> Option<u64> {
        match self {
            Decision::Answer(
                Verdict::Replay { request_count, .. }
                | Verdict::NotReplayable { request_count, .. },
            ) => Some(*request_count),
            Decision::Answer(Verdict::InFlight { request_count, .. }) => *request_count,
            _ => None,
        }
    }
}

/// What to answer instead of running the handler.
pub enum Verdict {
    /// A duplicate of work that completed: answer with its stored outcome.
    Replay {
        record: Arc<Record>,
        request_count: u64,
    },
    /// A duplicate of work that ran but whose outcome was too large to keep.
    NotReplayable {
        record: Arc<Record>,
        request_count: u64,
    },
    /// Work with this key is running (here or elsewhere): come back later.
    InFlight {
        /// When the work in flight arrived; `None` when the store cannot see it (held
        /// by another's open transaction).
        first_seen: Option<SystemTime>,
        /// `None` when this layer holds the outcome and the store was not asked.
        request_count: Option<u64>,
        retry_after: Duration,
    },
    /// The key came before with another fingerprint.
    Conflict,
    /// The key was first seen in another control epoch.
    EpochMismatch {
        recorded: Option<u64>,
        requested: Option<u64>,
    },
    /// The work this one waited for failed and stored nothing: retry to run it.
    OriginalFailed,
    /// The store cannot answer: nothing ran, and nothing will (fail closed).
    StoreUnavailable,
    /// The store had no free connection for as long as the request could wait:
    /// nothing ran, whatever the store-failure rule.
    PoolExhausted,
}

impl<St: IdempotencyStore> Engine<St> {
    /// Decides what becomes of the work scoped by `scope`; `claimed` is set when it
    /// claims the key, so that its response future finishes it if dropped.
    pub async fn decide(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        epoch: Option<u64>,
        claimed: &ClaimFlag,
    ) -> Decision<St> {
        let mut spent = Duration::ZERO;
        let mut decision = self
            .decide_timed(scope, fingerprint, epoch, claimed, &mut spent)
            .await;
        // A claimed request's store time is recorded when its guard settles, with the
        // completion's.
        let store_time = match &mut decision {
            Decision::Run(guard) => {
                guard.store_time = spent;
                None
            }
            _ => (!spent.is_zero()).then_some(spent),
        };
        let outcome = decision.outcome();
        observe::count(outcome);
        observe::record_decision(outcome, decision.request_count(), store_time);
        // After the span has the outcome, which the event carries.
        if let Decision::Answer(Verdict::Replay {
            record,
            request_count,
        }) = &decision
        {
            replayed(record, *request_count);
        }
        decision
    }

    /// [`decide`](Self::decide), adding the time spent in store calls to `spent`.
    async fn decide_timed(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        epoch: Option<u64>,
        claimed: &ClaimFlag,
        spent: &mut Duration,
    ) -> Decision<St> {
        let policy = &self.policy;
        let claim = lease::claim(
            fingerprint,
            policy.lease.unwrap_or(super::DEFAULT_LEASE),
            epoch,
        );
        if let Some(waiting) = self.kept.get(&scope) {
            // This layer ran the work and holds its outcome until the store takes
            // it: never run it again, whatever the store says.
            waiting.nudge();
            if let InFlight::Wait { timeout } = policy.in_flight {
                // Boxed, as every rarely taken await here: the future is as large as
                // its largest await, and it is moved on every request.
                Box::pin(waiting.settled(timeout)).await;
            }
            return Box::pin(self.ask_for_kept(scope, claim, fingerprint, epoch, waiting, spent))
                .await;
        }
        let begin =
            observe::timed_store_call("begin", spent, self.store.begin(&scope, claim.clone()));
        let begin = match begin.await {
            Ok(begin) => begin,
            Err(error) if error.is_exhausted() => return pool_exhausted(&error),
            Err(error) => return self.begin_failed(&error),
        };
        match begin {
            Begin::Claimed { lease } => {
                tracing::debug!(
                    target: "tower_ids::idempotency",
                    event = event::ACCEPTED,
                    "idempotency key accepted; running the handler"
                );
                self.run((scope, claim, lease, None), claimed)
            }
            Begin::ClaimedByTransaction { lease, transaction } => {
                tracing::debug!(
                    target: "tower_ids::idempotency",
                    event = event::ACCEPTED,
                    "idempotency key accepted; running the handler in the transaction that holds it"
                );
                self.run((scope, claim, lease, Some(transaction)), claimed)
            }
            Begin::Locked => {
                let running = Running {
                    first_seen: None,
                    request_count: None,
                };
                self.wait_for(running, scope, claim, claimed, spent).await
            }
            Begin::Completed {
                record,
                request_count,
            } => {
                if record.epoch != epoch {
                    return epoch_mismatch(record.epoch, epoch);
                }
                settled(record, fingerprint, request_count)
            }
            Begin::InFlight {
                fingerprint: running,
                first_seen,
                epoch: running_epoch,
                request_count,
            } => {
                if running_epoch != epoch {
                    return epoch_mismatch(running_epoch, epoch);
                }
                if running != fingerprint {
                    return conflict();
                }
                let running = Running {
                    first_seen: Some(first_seen),
                    request_count: Some(request_count),
                };
                self.wait_for(running, scope, claim, claimed, spent).await
            }
        }
    }

    /// The store failed to begin: the request is refused, or runs without
    /// deduplication, as the store-failure rule says.
    fn begin_failed(&self, error: &StoreError) -> Decision<St> {
        match self.policy.store_failure {
            StoreFailure::FailClosed => {
                tracing::warn!(
                    target: "tower_ids::idempotency",
                    event = event::STORE_FAILED,
                    error = %Chain(error),
                    phase = "begin",
                    mode = "fail_closed",
                    "idempotency store failed; nothing ran"
                );
                Decision::Answer(Verdict::StoreUnavailable)
            }
            StoreFailure::FailOpen => {
                tracing::warn!(
                    target: "tower_ids::idempotency",
                    event = event::STORE_FAILED,
                    error = %Chain(error),
                    phase = "begin",
                    mode = "fail_open",
                    "idempotency store failed; running without deduplication"
                );
                Decision::FailOpen
            }
        }
    }

    /// Work with this key is `running`: waits for it to end, as the in-flight rule
    /// says, or answers that it is in flight.
    async fn wait_for(
        &self,
        running: Running,
        scope: ScopeKey,
        claim: Claim,
        claimed: &ClaimFlag,
        spent: &mut Duration,
    ) -> Decision<St> {
        let timeout = match self.policy.in_flight {
            InFlight::Reject { retry_after } => {
                return in_flight(running.first_seen, running.request_count, retry_after)
            }
            InFlight::Wait { timeout } => timeout,
        };
        let wait = observe::timed_store_call("wait", spent, self.store.wait(&scope, timeout));
        let waited = Box::pin(wait).await;
        self.waited(waited, scope, claim, claimed, running)
    }

    /// The decision to run the work that holds `held` (its scope, claim, lease, and the
    /// transaction that holds it, if one does); `claimed` is set, so that the response
    /// future finishes it if dropped.
    fn run(&self, held: Held, claimed: &ClaimFlag) -> Decision<St> {
        claimed.set(&self.kept.outstanding);
        Decision::Run(Claimed::new(
            self.store.clone(),
            held,
            self.kept.clone(),
            &self.policy,
            self.transient.clone(),
        ))
    }

    /// The decision for a duplicate (of `claim`) that waited for the work in flight.
    fn waited(
        &self,
        waited: Result<Waited, StoreError>,
        scope: ScopeKey,
        claim: Claim,
        claimed: &ClaimFlag,
        running: Running,
    ) -> Decision<St> {
        let (fingerprint, epoch) = (claim.fingerprint, claim.epoch);
        let Running {
            first_seen,
            request_count,
        } = running;
        match waited {
            Ok(Waited::ClaimedByTransaction { lease, transaction }) => {
                tracing::debug!(
                    target: "tower_ids::idempotency",
                    event = event::ACCEPTED,
                    "the work this one waited for ended without an outcome; running the handler in the transaction that now holds the key"
                );
                self.run((scope, claim, lease, Some(transaction)), claimed)
            }
            // The key may have been released and run again, in another epoch, while
            // this one waited.
            Ok(Waited::Completed { record, .. }) if record.epoch != epoch => {
                epoch_mismatch(record.epoch, epoch)
            }
            Ok(Waited::Completed {
                record,
                request_count: counted,
            }) => settled(record, fingerprint, counted.or(request_count).unwrap_or(1)),
            Ok(Waited::TimedOut) => in_flight(first_seen, request_count, AFTER_WAIT),
            Ok(Waited::Released) => {
                tracing::debug!(
                    target: "tower_ids::idempotency",
                    event = event::ORIGINAL_FAILED,
                    "the work this one waited for did not complete; retry"
                );
                Decision::Answer(Verdict::OriginalFailed)
            }
            Err(error) if error.is_exhausted() => pool_exhausted(&error),
            Err(error) => {
                tracing::warn!(
                    target: "tower_ids::idempotency",
                    event = event::STORE_FAILED,
                    error = %Chain(&error),
                    phase = "wait",
                    "idempotency store failed while waiting"
                );
                Decision::Answer(Verdict::StoreUnavailable)
            }
        }
    }
}

impl<St: IdempotencyStore> Engine<St> {
    /// The decision for a duplicate of work whose outcome this layer keeps: the
    /// store's answer, as another replica would get it (the record once the outcome
    /// is stored there, even if the store has not confirmed it to this layer), but
    /// never a run: a key the store would let run is given back at once, and the
    /// duplicate is told the work is in flight, as it is.
    async fn ask_for_kept(
        &self,
        scope: ScopeKey,
        claim: super::super::store::Claim,
        fingerprint: Fingerprint,
        epoch: Option<u64>,
        waiting: Arc<Waiting>,
        spent: &mut Duration,
    ) -> Decision<St> {
        let retry_after = match self.policy.in_flight {
            InFlight::Reject { retry_after } => retry_after,
            InFlight::Wait { .. } => AFTER_WAIT,
        };
        let begin = observe::timed_store_call("begin", spent, self.store.begin(&scope, claim));
        match begin.await {
            Ok(Begin::Completed {
                record,
                request_count,
            }) if record.epoch == epoch => settled(record, fingerprint, request_count),
            Ok(Begin::Completed { record, .. }) => epoch_mismatch(record.epoch, epoch),
            Ok(Begin::InFlight {
                fingerprint: running,
                epoch: running_epoch,
                request_count,
                ..
            }) => {
                if running_epoch != epoch {
                    return epoch_mismatch(running_epoch, epoch);
                }
                if running != fingerprint {
                    return conflict();
                }
                in_flight(Some(waiting.first_seen), Some(request_count), retry_after)
            }
            Ok(Begin::Claimed { lease }) => {
                // The key was free (this layer's claim had lapsed): give the claim back
                // from a task of its own, so that no hang-up leaves it behind, then have
                // the kept outcome stored at once.
                let (store, outstanding) = (self.store.clone(), self.kept.outstanding.clone());
                let pending =
                    outstanding.enter(super::drain::Owed::Release, tracing::Span::current());
                let kept = waiting.clone();
                let give_back = async move {
                    let reason = Release::Abandoned;
                    lease::release(&store, &scope, &lease, kept.hold, reason, &outstanding).await;
                    kept.nudge();
                    drop(pending);
                };
                tokio::spawn(tracing::Instrument::instrument(
                    give_back,
                    tracing::Span::current(),
                ));
                self.kept_answer(fingerprint, epoch, &waiting, retry_after)
            }
            Ok(Begin::ClaimedByTransaction { transaction, .. }) => {
                // As above; a rollback gives this claim back.
                tokio::spawn(transaction.settle(scope, None));
                waiting.nudge();
                self.kept_answer(fingerprint, epoch, &waiting, retry_after)
            }
            Ok(Begin::Locked) | Err(_) => {
                self.kept_answer(fingerprint, epoch, &waiting, retry_after)
            }
        }
    }

    /// What a duplicate of a kept outcome gets when the store cannot say: `409`, or
    /// the refusal the store would give another payload or epoch.
    fn kept_answer(
        &self,
        fingerprint: Fingerprint,
        epoch: Option<u64>,
        waiting: &Waiting,
        retry_after: Duration,
    ) -> Decision<St> {
        if waiting.epoch != epoch {
            return epoch_mismatch(waiting.epoch, epoch);
        }
        if waiting.fingerprint != fingerprint {
            return conflict();
        }
        in_flight(Some(waiting.first_seen), None, retry_after)
    }

    /// An engine over `store`, with the default policy.
    pub fn new(store: Arc<St>) -> Self {
        observe::register();
        let mut engine = Self {
            store,
            kept: Arc::default(),
            policy: Policy::new(),
            transient: Transient::default(),
        };
        engine.policy.lease = Some(default_lease(&*engine.store));
        engine
    }

    /// Sets the policy. Its lease, if unset, is the default (10 seconds)
    /// or the shortest the store allows if that is longer; if set, it must be at least
    /// that shortest: a quarter of it must cover the store's
    /// [`recovery_time`](IdempotencyStore::recovery_time) and the pause before a failed
    /// renewal is tried again.
    ///
    /// # Errors
    ///
    /// If the lease set is shorter.
    pub fn set_policy(&mut self, mut policy: Policy) -> Result<(), PolicyError> {
        let shortest = shortest_lease(&*self.store);
        let lease = match policy.lease {
            Some(lease) if lease < shortest => return Err(PolicyError { lease, shortest }),
            Some(lease) => lease,
            None => default_lease(&*self.store),
        };
        policy.lease = Some(lease);
        self.policy = policy;
        Ok(())
    }

    /// Also counts as a passing fault a handler's error of type `E` that `hook` says
    /// is one.
    pub fn transient_if<E: std::fmt::Display + 'static>(
        &mut self,
        hook: impl Fn(&E) -> bool + Send + Sync + 'static,
    ) {
        self.transient.add(hook);
    }

    /// Also counts as a passing fault a handler's error, of any type, that `recognise`
    /// describes (a store crate's test for its database's faults).
    pub fn recognise_transient(
        &mut self,
        recognise: impl Fn(&dyn std::any::Any) -> Option<String> + Send + Sync + 'static,
    ) {
        self.transient.add_recogniser(recognise);
    }
}

/// The lease of a policy that sets none: the default (10 seconds), or
/// the shortest `store` allows if that is longer.
fn default_lease<St: IdempotencyStore>(store: &St) -> Duration {
    super::DEFAULT_LEASE.max(shortest_lease(store))
}

/// The shortest lease `store` allows: four times its recovery time and the pause
/// before a failed renewal is tried again.
fn shortest_lease<St: IdempotencyStore>(store: &St) -> Duration {
    (store.recovery_time() + lease::RENEWAL_RETRY_PAUSE) * 4
}

impl<St> Engine<St> {
    /// The policy, its lease resolved.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// A handle that waits, at shutdown, for what this engine still owes its store.
    pub fn drain(&self) -> Drain {
        Drain::new(self.kept.outstanding.clone())
    }

    /// Counts one protected request or message in flight until the guard is dropped.
    pub fn track(&self) -> observe::InFlight {
        observe::InFlight::enter()
    }
}

fn in_flight<St: IdempotencyStore>(
    first_seen: Option<SystemTime>,
    request_count: Option<u64>,
    retry_after: Duration,
) -> Decision<St> {
    tracing::debug!(
        target: "tower_ids::idempotency",
        event = event::IN_FLIGHT,
        request_count,
        retry_after_ms = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX),
        "work with this idempotency key is still running"
    );
    Decision::Answer(Verdict::InFlight {
        first_seen,
        request_count,
        retry_after,
    })
}

fn pool_exhausted<St: IdempotencyStore>(error: &StoreError) -> Decision<St> {
    tracing::warn!(
        target: "tower_ids::idempotency",
        event = event::POOL_EXHAUSTED,
        error = %Chain(error),
        "no database connection was free for this request in time; nothing ran"
    );
    Decision::Answer(Verdict::PoolExhausted)
}

fn conflict<St: IdempotencyStore>() -> Decision<St> {
    tracing::warn!(
        target: "tower_ids::idempotency",
        event = event::CONFLICT,
        "idempotency key reused with another request"
    );
    Decision::Answer(Verdict::Conflict)
}

fn epoch_mismatch<St: IdempotencyStore>(
    recorded: Option<u64>,
    requested: Option<u64>,
) -> Decision<St> {
    tracing::warn!(
        target: "tower_ids::idempotency",
        event = event::EPOCH_MISMATCH,
        recorded_epoch = recorded,
        request_epoch = requested,
        "idempotency key used in another epoch"
    );
    Decision::Answer(Verdict::EpochMismatch {
        recorded,
        requested,
    })
}

/// The decision for a duplicate of work that completed.
fn settled<St: IdempotencyStore>(
    record: Arc<Record>,
    fingerprint: Fingerprint,
    request_count: u64,
) -> Decision<St> {
    if record.fingerprint != fingerprint {
        return conflict();
    }
    if record.payload.is_none() {
        not_replayable(request_count);
        return Decision::Answer(Verdict::NotReplayable {
            record,
            request_count,
        });
    }
    Decision::Answer(Verdict::Replay {
        record,
        request_count,
    })
}

/// A duplicate answered with the stored outcome: its event.
fn replayed(record: &Record, request_count: u64) {
    tracing::debug!(
        target: "tower_ids::idempotency",
        event = event::REPLAYED,
        request_count,
        status = record.payload.as_ref().map(Payload::status),
        original_attempt = record.original_attempt.as_ref().map(AttemptId::as_str),
        "replayed the stored outcome"
    );
}

/// A duplicate the engine decided to replay whose stored outcome this transport cannot
/// decode after all (an outcome type that changed since): its event, and the outcome
/// on the span. The decision was counted as a replay where it was made.
pub fn replay_failed(request_count: u64) {
    observe::record(observe::field::OUTCOME, "not_replayable");
    not_replayable(request_count);
}

/// A duplicate of work that ran, whose outcome this transport cannot hand back.
fn not_replayable(request_count: u64) {
    tracing::debug!(
        target: "tower_ids::idempotency",
        event = event::NOT_REPLAYABLE,
        request_count,
        "the work ran but its outcome was not kept, or cannot be handed back here"
    );
}
