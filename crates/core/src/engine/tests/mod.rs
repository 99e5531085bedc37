//! The engine on its own, over a scripted store: each case scripts what the store
//! answers, then checks what the engine decided or how it settled the work, and every
//! call it made to the store. No transport is involved, so a failure here is the
//! engine's.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use tracing_subscriber::layer::SubscriberExt as _;

use super::{
    claimed::{Claimed, Failure, Finished},
    decide::{Decision, Verdict, AFTER_WAIT},
    ClaimFlag, Classified, Engine, InFlight, Policy, Release, StoreFailure, DEFAULT_RETRY_AFTER,
};
use crate::{
    store::{
        Begin, Claim, Completion, IdempotencyStore, Lease, Payload, PayloadFormat, Record, Renewal,
        StoreError, Waited,
    },
    Fingerprint, ScopeKey,
};

mod decide;
mod finish;
mod transaction;

/// The fencing token of the lease the scripted store hands out.
const TOKEN: u128 = 7;

fn scope() -> ScopeKey {
    ScopeKey::from_bytes([9; 32])
}

fn this_request() -> Fingerprint {
    Fingerprint::from_bytes([1; 32])
}

fn another_request() -> Fingerprint {
    Fingerprint::from_bytes([2; 32])
}

/// A fixed arrival time, so a case can check it is handed through unchanged.
fn first_seen() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
}

/// A store call, as the scripted store saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Begin,
    Renew,
    Complete { token: u128, payload: Option<Bytes> },
    Release { token: u128 },
    Wait { timeout: Duration },
}

type Answers<T> = Mutex<VecDeque<Result<T, StoreError>>>;

/// An [`IdempotencyStore`] that answers each method from its script, in order, and
/// records every call. A call past its script gets the method's harmless answer
/// (renewed, stored, released), so a case scripts only the calls it is about; `begin`
/// and `wait` past their script fail, so an unexpected one shows in the decision.
#[derive(Default)]
struct ScriptedStore {
    begin: Answers<Begin>,
    renew: Answers<Renewal>,
    complete: Answers<Completion>,
    release: Answers<bool>,
    wait: Answers<Waited>,
    calls: Mutex<Vec<Call>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A case that failed must not hide the next one's failure behind a poisoned lock.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn next<T>(answers: &Answers<T>, unscripted: Result<T, StoreError>) -> Result<T, StoreError> {
    lock(answers).pop_front().unwrap_or(unscripted)
}

impl ScriptedStore {
    fn begins(self, answer: Result<Begin, StoreError>) -> Self {
        lock(&self.begin).push_back(answer);
        self
    }

    fn completes(self, answers: impl IntoIterator<Item = Result<Completion, StoreError>>) -> Self {
        lock(&self.complete).extend(answers);
        self
    }

    fn waits(self, answer: Option<Result<Waited, StoreError>>) -> Self {
        lock(&self.wait).extend(answer);
        self
    }

    fn called(&self, call: Call) {
        lock(&self.calls).push(call);
    }

    fn calls(&self) -> Vec<Call> {
        lock(&self.calls).clone()
    }
}

// `async fn`: a call is recorded when the engine awaits it, which it does at once.
impl IdempotencyStore for ScriptedStore {
    async fn begin(&self, _: &ScopeKey, _: Claim) -> Result<Begin, StoreError> {
        self.called(Call::Begin);
        next(&self.begin, Err(outage("begin")))
    }

    async fn renew(&self, _: &ScopeKey, _: &Lease, _: &Claim) -> Result<Renewal, StoreError> {
        self.called(Call::Renew);
        next(&self.renew, Ok(Renewal::Extended))
    }

    async fn complete(
        &self,
        _: &ScopeKey,
        lease: &Lease,
        record: Arc<Record>,
        _: Duration,
    ) -> Result<Completion, StoreError> {
        let payload = record
            .payload
            .as_ref()
            .map(|payload| payload.body().clone());
        let token = lease.token;
        self.called(Call::Complete { token, payload });
        next(&self.complete, Ok(Completion::Stored))
    }

    async fn release(&self, _: &ScopeKey, lease: &Lease) -> Result<bool, StoreError> {
        self.called(Call::Release { token: lease.token });
        next(&self.release, Ok(true))
    }

    async fn wait(&self, _: &ScopeKey, timeout: Duration) -> Result<Waited, StoreError> {
        self.called(Call::Wait { timeout });
        next(&self.wait, Err(outage("wait")))
    }

    // The trait's default is zero already; said here because `set_policy` reads it to
    // accept any lease a case sets.
    fn recovery_time(&self) -> Duration {
        Duration::ZERO
    }
}

fn outage(what: &str) -> StoreError {
    StoreError::new(format!("scripted outage ({what})"))
}

/// A message outcome: the simplest payload, and the engine reads none of it.
fn message(body: &'static [u8]) -> Payload {
    Payload::new(
        PayloadFormat::MESSAGE,
        0,
        Bytes::new(),
        Bytes::from_static(body),
    )
}

fn claimed(token: u128) -> Begin {
    Begin::Claimed {
        lease: Lease::new(token, first_seen()),
    }
}

fn record(
    fingerprint: Fingerprint,
    epoch: Option<u64>,
    payload: Option<&'static str>,
) -> Arc<Record> {
    let payload = payload.map(|body| message(body.as_bytes()));
    Arc::new(Record::new(fingerprint, first_seen(), None, epoch, payload))
}

fn completed(record: Arc<Record>, request_count: u64) -> Begin {
    Begin::Completed {
        record,
        request_count,
    }
}

fn running(fingerprint: Fingerprint, epoch: Option<u64>, request_count: u64) -> Begin {
    Begin::InFlight {
        fingerprint,
        first_seen: first_seen(),
        epoch,
        request_count,
    }
}

fn engine(store: &Arc<ScriptedStore>, policy: Policy) -> Engine<ScriptedStore> {
    let mut engine = Engine::new(store.clone());
    engine.set_policy(policy).unwrap();
    engine
}

/// A [`Decision`] reduced to what a case checks; `Run` holds a live claim, which the
/// case lets go of after checking.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Decided {
    Run,
    FailOpen,
    Replay {
        request_count: u64,
        body: Option<Bytes>,
    },
    NotReplayable {
        request_count: u64,
    },
    InFlight {
        first_seen: Option<SystemTime>,
        request_count: Option<u64>,
        retry_after: Duration,
    },
    Conflict,
    EpochMismatch {
        recorded: Option<u64>,
        requested: Option<u64>,
    },
    OriginalFailed,
    StoreUnavailable,
}

fn decided(decision: &Decision<ScriptedStore>) -> Decided {
    match decision {
        Decision::Run(_) => Decided::Run,
        Decision::FailOpen => Decided::FailOpen,
        Decision::Answer(verdict) => match verdict {
            Verdict::Replay {
                record,
                request_count,
            } => Decided::Replay {
                request_count: *request_count,
                body: record
                    .payload
                    .as_ref()
                    .map(|payload| payload.body().clone()),
            },
            Verdict::NotReplayable { request_count, .. } => Decided::NotReplayable {
                request_count: *request_count,
            },
            Verdict::InFlight {
                first_seen,
                request_count,
                retry_after,
            } => Decided::InFlight {
                first_seen: *first_seen,
                request_count: *request_count,
                retry_after: *retry_after,
            },
            Verdict::Conflict => Decided::Conflict,
            Verdict::EpochMismatch {
                recorded,
                requested,
            } => Decided::EpochMismatch {
                recorded: *recorded,
                requested: *requested,
            },
            Verdict::OriginalFailed => Decided::OriginalFailed,
            Verdict::StoreUnavailable | Verdict::PoolExhausted => Decided::StoreUnavailable,
        },
    }
}

/// Classifies the one outcome of a test's work as `classified`.
fn once(classified: Classified) -> impl super::Classify<()> {
    let classified = std::cell::Cell::new(Some(classified));
    move |_: &(), _| classified.take().expect("classified once")
}
