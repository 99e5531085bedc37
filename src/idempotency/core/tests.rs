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
    engine::AFTER_WAIT, ClaimFlag, Claimed, Classified, Decision, Engine, Finished, InFlight,
    Policy, Release, StoreFailure, Verdict, DEFAULT_RETRY_AFTER,
};
use crate::idempotency::{
    store::{
        Begin, Claim, Completion, IdempotencyStore, Lease, Payload, PayloadFormat, Record, Renewal,
        Settled, StoreError,
    },
    Fingerprint, ScopeKey,
};

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
    wait: Answers<Settled>,
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

    fn waits(self, answer: Option<Result<Settled, StoreError>>) -> Self {
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

    async fn wait(&self, _: &ScopeKey, timeout: Duration) -> Result<Settled, StoreError> {
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
    engine.set_policy(policy);
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
        first_seen: SystemTime,
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
            Verdict::StoreUnavailable => Decided::StoreUnavailable,
        },
    }
}

/// How long a duplicate waits under [`waiting`].
const WAIT: Duration = Duration::from_secs(2);

fn waiting() -> Policy {
    Policy::new().in_flight(InFlight::Wait { timeout: WAIT })
}

struct DecideCase {
    name: &'static str,
    policy: Policy,
    /// The epoch the request asks in.
    epoch: Option<u64>,
    begin: Result<Begin, StoreError>,
    /// Scripted for a duplicate that waits, and only then: the engine must call `wait`
    /// exactly when a case scripts it.
    wait: Option<Result<Settled, StoreError>>,
    expected: Decided,
}

/// A request under the default policy, whose `begin` the store answers with `begin`.
fn asked(name: &'static str, begin: Result<Begin, StoreError>, expected: Decided) -> DecideCase {
    DecideCase {
        name,
        policy: Policy::new(),
        epoch: None,
        begin,
        wait: None,
        expected,
    }
}

/// A duplicate of this request in flight, waiting for it; the wait answers `wait`.
fn waited(name: &'static str, wait: Result<Settled, StoreError>, expected: Decided) -> DecideCase {
    DecideCase {
        policy: waiting(),
        wait: Some(wait),
        ..asked(name, Ok(running(this_request(), None, 2)), expected)
    }
}

impl DecideCase {
    fn under(self, policy: Policy) -> Self {
        Self { policy, ..self }
    }

    fn in_epoch(self, epoch: u64) -> Self {
        let epoch = Some(epoch);
        Self { epoch, ..self }
    }
}

#[tokio::test]
async fn decide_answers_what_the_store_says() {
    let in_flight = |request_count, retry_after| Decided::InFlight {
        first_seen: first_seen(),
        request_count: Some(request_count),
        retry_after,
    };
    let replay = |request_count| Decided::Replay {
        request_count,
        body: Some(Bytes::from_static(b"done")),
    };
    let stored = |fingerprint, epoch| record(fingerprint, epoch, Some("done"));
    let other_epoch = Decided::EpochMismatch {
        recorded: Some(1),
        requested: Some(2),
    };
    let cases = vec![
        asked("a free key runs", Ok(claimed(TOKEN)), Decided::Run),
        asked(
            "a duplicate of a stored outcome replays it, with the store's count",
            Ok(completed(stored(this_request(), None), 3)),
            replay(3),
        ),
        asked(
            "a duplicate of an outcome kept without payload is not replayable",
            Ok(completed(record(this_request(), None, None), 2)),
            Decided::NotReplayable { request_count: 2 },
        ),
        asked(
            "a stored outcome of another request is a conflict",
            Ok(completed(stored(another_request(), None), 2)),
            Decided::Conflict,
        ),
        asked(
            "a running request with another fingerprint is a conflict",
            Ok(running(another_request(), None, 2)),
            Decided::Conflict,
        ),
        asked(
            "a running duplicate is refused with the policy's retry delay",
            Ok(running(this_request(), None, 4)),
            in_flight(4, Duration::from_secs(7)),
        )
        .under(Policy::new().in_flight(InFlight::Reject {
            retry_after: Duration::from_secs(7),
        })),
        waited(
            "a waiting duplicate replays what completed meanwhile",
            Ok(Settled::Completed {
                record: stored(this_request(), None),
            }),
            replay(2),
        ),
        waited(
            "a wait that times out answers in flight, retry after a second",
            Ok(Settled::TimedOut),
            in_flight(2, AFTER_WAIT),
        ),
        waited(
            "a wait on work that was released tells the duplicate to retry",
            Ok(Settled::Released),
            Decided::OriginalFailed,
        ),
        waited(
            "a wait the store fails answers store unavailable",
            Err(outage("wait")),
            Decided::StoreUnavailable,
        ),
        asked(
            "a failed begin fails closed by default: nothing runs",
            Err(outage("begin")),
            Decided::StoreUnavailable,
        ),
        asked(
            "a failed begin under fail open runs without deduplication",
            Err(outage("begin")),
            Decided::FailOpen,
        )
        .under(Policy::new().store_failure(StoreFailure::FailOpen)),
        asked(
            "a stored outcome of another epoch is refused",
            Ok(completed(stored(this_request(), Some(1)), 2)),
            other_epoch.clone(),
        )
        .in_epoch(2),
        asked(
            "a running request of another epoch is refused, not waited for",
            Ok(running(this_request(), Some(1), 2)),
            other_epoch,
        )
        .in_epoch(2)
        .under(waiting()),
    ];
    for case in cases {
        let mut calls = vec![Call::Begin];
        calls.extend(case.wait.is_some().then_some(Call::Wait { timeout: WAIT }));
        let store = Arc::new(ScriptedStore::default().begins(case.begin).waits(case.wait));
        let engine = engine(&store, case.policy);
        let flag = ClaimFlag::default();
        let decision = engine
            .decide(scope(), this_request(), case.epoch, &flag)
            .await;
        assert_eq!(decided(&decision), case.expected, "{}", case.name);
        assert_eq!(store.calls(), calls, "{}", case.name);
    }
}

/// The `reason` of every `idempotency.released` event on this thread: a store is not
/// told why a key is given back, so the reason is read where the engine says it.
#[derive(Clone, Default)]
struct ReleaseReasons(Arc<Mutex<Vec<String>>>);

impl ReleaseReasons {
    /// Captures until the guard drops. Scoped to the thread, which a current-thread
    /// runtime shares with the tasks it spawns.
    fn capture(&self) -> tracing::subscriber::DefaultGuard {
        tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
    }

    fn seen(&self) -> Vec<String> {
        lock(&self.0).clone()
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ReleaseReasons {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        #[derive(Default)]
        struct Fields {
            event: Option<String>,
            reason: Option<String>,
        }
        impl tracing::field::Visit for Fields {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                match field.name() {
                    "event" => self.event = Some(value.to_owned()),
                    "reason" => self.reason = Some(value.to_owned()),
                    _ => {}
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        if fields.event.as_deref() == Some("idempotency.released") {
            lock(&self.0).extend(fields.reason);
        }
    }
}

/// Claims the key through the engine, as an adapter does before it runs the work.
async fn claim(engine: &Engine<ScriptedStore>) -> Claimed<ScriptedStore> {
    let flag = ClaimFlag::default();
    match engine.decide(scope(), this_request(), None, &flag).await {
        Decision::Run(claimed) => claimed,
        _ => panic!("the scripted store's claim did not make a run"),
    }
}

/// What [`Claimed::run`] returned, reduced to what a case checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ran {
    Kept { stored_now: bool },
    NotKept,
    Released,
    Failed,
    Unsettled,
    WorkFailed(&'static str),
}

fn ran(result: Result<((), Finished), &'static str>) -> Ran {
    match result {
        Ok(((), Finished::Kept { expires_at })) => Ran::Kept {
            stored_now: expires_at.is_some(),
        },
        Ok(((), Finished::NotKept)) => Ran::NotKept,
        Ok(((), Finished::Released)) => Ran::Released,
        Ok(((), Finished::Failed)) => Ran::Failed,
        Ok(((), Finished::Unsettled(_))) => Ran::Unsettled,
        Err(error) => Ran::WorkFailed(error),
    }
}

enum Work {
    Ready,
    Fails,
    /// Takes this long (in paused time).
    Takes(Duration),
}

struct RunCase {
    name: &'static str,
    work: Work,
    classified: Classified,
    complete: Vec<Result<Completion, StoreError>>,
    expected: Ran,
    /// Every store call, the background ones included, once the engine owes nothing.
    calls: Vec<Call>,
    released: &'static [&'static str],
}

/// The payload every run case stores, as the store sees it.
const DONE: Option<&[u8]> = Some(b"done");

fn completes(payload: Option<&'static [u8]>) -> Call {
    let payload = payload.map(Bytes::from_static);
    Call::Complete {
        token: TOKEN,
        payload,
    }
}

fn releases() -> Call {
    Call::Release { token: TOKEN }
}

// Paused time: the kept outcome's retry pauses and the renewals pass at once, in order.
#[tokio::test(start_paused = true)]
async fn run_settles_the_outcome_with_the_store() {
    let done = || Classified::Store(message(b"done"));
    let case = |name, classified, complete, expected, calls: &[Call], released| RunCase {
        name,
        work: Work::Ready,
        classified,
        complete,
        expected,
        calls: calls.to_vec(),
        released,
    };
    let (stored_now, stored_later) = (
        Ran::Kept { stored_now: true },
        Ran::Kept { stored_now: false },
    );
    let cases = vec![
        case(
            "a stored outcome is kept, with its expiry",
            done(),
            vec![Ok(Completion::Stored)],
            stored_now,
            &[Call::Begin, completes(DONE)],
            &[],
        ),
        case(
            "an outcome stored after the claim was lost is kept, with its expiry",
            done(),
            vec![Ok(Completion::StoredWithoutClaim)],
            stored_now,
            &[Call::Begin, completes(DONE)],
            &[],
        ),
        case(
            "a superseded outcome is reported, not tried again",
            done(),
            vec![Ok(Completion::Superseded)],
            stored_later,
            &[Call::Begin, completes(DONE)],
            &[],
        ),
        case(
            "an outcome the store failed to take is kept and stored in the background",
            done(),
            vec![Err(outage("complete")), Ok(Completion::Stored)],
            stored_later,
            &[Call::Begin, completes(DONE), completes(DONE)],
            &[],
        ),
        case(
            "an outcome refused for another's claim is kept and tried again",
            done(),
            vec![Ok(Completion::ClaimedByAnother), Ok(Completion::Stored)],
            stored_later,
            &[Call::Begin, completes(DONE), completes(DONE)],
            &[],
        ),
        case(
            "an outcome over the limit is recorded as run, without its payload",
            Classified::TooLarge { max_bytes: 4 },
            vec![],
            Ran::NotKept,
            &[Call::Begin, completes(None)],
            &[],
        ),
        case(
            "an outcome that does not encode is recorded as run, without its payload",
            Classified::Unencodable("not json".into()),
            vec![],
            Ran::NotKept,
            &[Call::Begin, completes(None)],
            &[],
        ),
        case(
            "an outcome the storage rule does not keep gives the key back",
            Classified::Release(Release::NotStored),
            vec![],
            Ran::Released,
            &[Call::Begin, releases()],
            &["not_stored"],
        ),
        case(
            "a response that failed while read gives the key back",
            Classified::Failed("body broke".into()),
            vec![],
            Ran::Failed,
            &[Call::Begin, releases()],
            &["response_failed"],
        ),
        RunCase {
            work: Work::Fails,
            ..case(
                "work that fails gives the key back and returns its error",
                done(),
                vec![],
                Ran::WorkFailed("boom"),
                &[Call::Begin, releases()],
                &["handler_error"],
            )
        },
        RunCase {
            // The claim is held for 15 s (10 s and half again) and renewed every sixth
            // of that: at 2.5 s and 5 s.
            work: Work::Takes(Duration::from_secs(6)),
            ..case(
                "work longer than a quarter lease renews its claim while it runs",
                done(),
                vec![],
                stored_now,
                &[Call::Begin, Call::Renew, Call::Renew, completes(DONE)],
                &[],
            )
        },
    ];
    for case in cases {
        let reasons = ReleaseReasons::default();
        let _capture = reasons.capture();
        let store = Arc::new(
            ScriptedStore::default()
                .begins(Ok(claimed(TOKEN)))
                .completes(case.complete),
        );
        let engine = engine(&store, Policy::new());
        let claimed = claim(&engine).await;
        let work = async move {
            match case.work {
                Work::Ready => Ok(()),
                Work::Fails => Err("boom"),
                Work::Takes(duration) => {
                    tokio::time::sleep(duration).await;
                    Ok(())
                }
            }
        };
        let classified = case.classified;
        let result = claimed.run(work, move |_: &(), _| classified, None).await;
        assert_eq!(ran(result), case.expected, "{}", case.name);
        let drained = engine.drain().wait(Duration::from_secs(60)).await;
        assert!(
            drained.is_complete(),
            "{}: the engine still owes the store",
            case.name
        );
        assert_eq!(store.calls(), case.calls, "{}", case.name);
        assert_eq!(reasons.seen(), case.released, "{}", case.name);
    }
}

#[tokio::test]
async fn a_claim_dropped_without_running_is_released_as_abandoned() {
    let reasons = ReleaseReasons::default();
    let _capture = reasons.capture();
    let store = Arc::new(ScriptedStore::default().begins(Ok(claimed(TOKEN))));
    let engine = engine(&store, Policy::new());
    drop(claim(&engine).await);
    assert!(engine
        .drain()
        .wait(Duration::from_secs(5))
        .await
        .is_complete());
    assert_eq!(store.calls(), [Call::Begin, Call::Release { token: TOKEN }]);
    assert_eq!(reasons.seen(), ["abandoned"]);
}

// A duplicate that arrives while this layer keeps an outcome the store has not taken
// must never run, even when the store would let it (the claim had lapsed there).
#[tokio::test(start_paused = true)]
async fn a_duplicate_of_a_kept_outcome_is_in_flight_never_run() {
    let store = Arc::new(
        ScriptedStore::default()
            .begins(Ok(claimed(TOKEN)))
            .begins(Ok(claimed(TOKEN + 1)))
            .completes([Err(outage("complete"))]),
    );
    let engine = engine(&store, Policy::new());
    let work = std::future::ready(Ok::<_, ()>(()));
    let stored = |_: &(), _| Classified::Store(message(b"done"));
    let (_, finished) = claim(&engine).await.run(work, stored, None).await.unwrap();
    assert!(matches!(finished, Finished::Kept { expires_at: None }));

    let flag = ClaimFlag::default();
    let duplicate = engine.decide(scope(), this_request(), None, &flag).await;
    assert_eq!(
        decided(&duplicate),
        Decided::InFlight {
            first_seen: first_seen(),
            request_count: None,
            retry_after: DEFAULT_RETRY_AFTER,
        }
    );
    assert!(engine
        .drain()
        .wait(Duration::from_secs(60))
        .await
        .is_complete());
    let calls = store.calls();
    let kept = completes(DONE);
    assert_eq!(calls[..3], [Call::Begin, kept.clone(), Call::Begin]);
    // The duplicate's claim is given back and the kept outcome stored, from two tasks
    // of their own, in either order.
    let mut background = calls[3..].to_vec();
    background.sort_by_key(|call| format!("{call:?}"));
    assert_eq!(background, [kept, Call::Release { token: TOKEN + 1 }]);
}
