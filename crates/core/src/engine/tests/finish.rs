//! How the engine settles the work that ran, for each classification and each
//! answer the store gives `complete`.

use super::*;

/// The `reason` of every `idempotency.released` event on this thread: a store is not
/// told why a key is given back, so the reason is read where the engine says it.
#[derive(Clone, Default)]
pub(super) struct ReleaseReasons(Arc<Mutex<Vec<String>>>);

impl ReleaseReasons {
    /// Captures until the guard drops. Scoped to the thread, which a current-thread
    /// runtime shares with the tasks it spawns.
    pub(super) fn capture(&self) -> tracing::subscriber::DefaultGuard {
        // tracing caches each callsite's interest for the whole process, computed on
        // the thread that first reaches it: a parallel test with no subscriber would
        // cache `never` and hide this thread's events. A global registry that is
        // interested in everything keeps every callsite live.
        static EVERY_CALLSITE_LIVE: std::sync::Once = std::sync::Once::new();
        EVERY_CALLSITE_LIVE.call_once(|| {
            let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry());
        });
        let guard =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()));
        tracing::callsite::rebuild_interest_cache();
        guard
    }

    pub(super) fn seen(&self) -> Vec<String> {
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
        if fields.event.as_deref() == Some(crate::code::event::RELEASED) {
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
pub(super) enum Ran {
    Kept { stored_now: bool },
    NotKept,
    Released,
    RolledBack,
    Failed,
    Uncommitted,
    WorkFailed(&'static str),
    TransactionBroke(&'static str),
    Transient(&'static str),
}

pub(super) fn ran(result: Result<((), Finished), Failure<&'static str>>) -> Ran {
    match result {
        Ok(((), Finished::Kept { expires_at })) => Ran::Kept {
            stored_now: expires_at.is_some(),
        },
        Ok(((), Finished::NotKept)) => Ran::NotKept,
        Ok(((), Finished::Released)) => Ran::Released,
        Ok(((), Finished::RolledBack(_))) => Ran::RolledBack,
        Ok(((), Finished::Failed)) => Ran::Failed,
        Ok(((), Finished::Uncommitted(_))) => Ran::Uncommitted,
        Err(Failure::Handler(error)) => Ran::WorkFailed(error),
        Err(Failure::TransactionBroke(error, _)) => Ran::TransactionBroke(error),
        Err(Failure::Transient(error)) => Ran::Transient(error),
    }
}

enum Work {
    Ready,
    Fails,
    /// Fails with an error the engine's `transient_if` hook recognises.
    FailsPassing,
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
            work: Work::FailsPassing,
            ..case(
                "work that fails on a passing fault gives the key back as transient",
                done(),
                vec![],
                Ran::Transient("deadlock"),
                &[Call::Begin, releases()],
                &["transient"],
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
        let mut engine = engine(&store, Policy::new());
        engine.transient_if(|error: &&'static str| *error == "deadlock");
        let mut claimed = claim(&engine).await;
        let work = async move {
            match case.work {
                Work::Ready => Ok(()),
                Work::Fails => Err("boom"),
                Work::FailsPassing => Err("deadlock"),
                Work::Takes(duration) => {
                    tokio::time::sleep(duration).await;
                    Ok(())
                }
            }
        };
        let classified = case.classified;
        let result = claimed
            .run(std::pin::pin!(work), &once(classified), None)
            .await;
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
    let (_, finished) = claim(&engine)
        .await
        .run(std::pin::pin!(work), &stored, None)
        .await
        .unwrap();
    assert!(matches!(finished, Finished::Kept { expires_at: None }));

    let flag = ClaimFlag::default();
    let duplicate = engine.decide(scope(), this_request(), None, &flag).await;
    assert_eq!(
        decided(&duplicate),
        Decided::InFlight {
            first_seen: Some(first_seen()),
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
