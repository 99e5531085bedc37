//! A claim held by a store's transaction: never renewed, settled in the transaction
//! (committed with its outcome, rolled back to give the key up), and never a store
//! call of its own after the claim; a waiter handed the key runs in it.

use std::{future::Future, pin::Pin};

use super::finish::{ran, Ran, ReleaseReasons};
use super::*;
use crate::store::{HandlerTransaction, TransactionEnd, TransactionOffer};

/// What the scripted transaction was asked to do: commit with this payload, or roll
/// back (`None`).
type Settles = Arc<Mutex<Vec<Option<Bytes>>>>;

/// A [`HandlerTransaction`] that records each settle and answers from its script.
struct ScriptedTransaction {
    settles: Settles,
    answer: Mutex<Option<TransactionEnd>>,
}

impl HandlerTransaction for ScriptedTransaction {
    fn offer(&self) -> TransactionOffer {
        TransactionOffer::new("the scripted transaction")
    }

    fn settle(
        self: Box<Self>,
        _: ScopeKey,
        outcome: Option<(Arc<Record>, Duration)>,
    ) -> Pin<Box<dyn Future<Output = TransactionEnd> + Send>> {
        let payload = outcome.and_then(|(record, _)| {
            record
                .payload
                .as_ref()
                .map(|payload| payload.body().clone())
        });
        let committing = payload.is_some();
        lock(&self.settles).push(payload);
        let answer = lock(&self.answer).take();
        Box::pin(async move {
            answer.unwrap_or(if committing {
                TransactionEnd::Committed
            } else {
                TransactionEnd::RolledBack
            })
        })
    }
}

fn held_by_transaction(settles: &Settles, answer: Option<TransactionEnd>) -> Begin {
    Begin::ClaimedByTransaction {
        lease: Lease::new(TOKEN, first_seen()),
        transaction: Box::new(ScriptedTransaction {
            settles: settles.clone(),
            answer: Mutex::new(answer),
        }),
    }
}

async fn claim_held_by_transaction(
    settles: &Settles,
    answer: Option<TransactionEnd>,
) -> (
    Arc<ScriptedStore>,
    Engine<ScriptedStore>,
    Claimed<ScriptedStore>,
) {
    let store = Arc::new(ScriptedStore::default().begins(Ok(held_by_transaction(settles, answer))));
    let engine = engine(&store, Policy::new());
    let flag = ClaimFlag::default();
    let Decision::Run(claimed) = engine.decide(scope(), this_request(), None, &flag).await else {
        panic!("a claim held by a transaction runs");
    };
    (store, engine, claimed)
}

async fn drained(engine: &Engine<ScriptedStore>) {
    let drained = engine.drain().wait(Duration::from_secs(60)).await;
    assert!(drained.is_complete(), "the engine still owes the store");
}

// Paused time: six seconds of work would see two renewals of a lease claim.
#[tokio::test(start_paused = true)]
async fn a_claim_held_by_a_transaction_is_never_renewed_and_commits_its_outcome() {
    let settles = Settles::default();
    let (store, engine, mut claimed) = claim_held_by_transaction(&settles, None).await;
    let offered = claimed
        .transaction_offer()
        .expect("the handler is offered it");
    assert_eq!(offered.get::<&str>(), Some(&"the scripted transaction"));
    let work = async {
        tokio::time::sleep(Duration::from_secs(6)).await;
        // The handler finds it while it runs, whatever its input.
        assert!(TransactionOffer::current::<&str>().is_some());
        Ok(())
    };
    let stored = |_: &(), _| Classified::Store(message(b"done"));

    let result = claimed.run(std::pin::pin!(work), &stored, None).await;

    assert_eq!(ran(result), Ran::Kept { stored_now: true });
    drained(&engine).await;
    assert_eq!(store.calls(), [Call::Begin], "no renewal, no completion");
    assert_eq!(*lock(&settles), [Some(Bytes::from_static(b"done"))]);
}

#[tokio::test]
async fn a_transactional_claim_is_given_back_by_rolling_back_never_by_a_store_call() {
    /// What the work does (fail or not), what the transaction answers, what the run
    /// ends as, and the release's reason.
    type Case = (
        &'static str,
        Classified,
        bool,
        Option<TransactionEnd>,
        Ran,
        &'static str,
    );
    let failed = || Err("boom");
    let broke = || Some(TransactionEnd::Failed(StoreError::new("connection lost")));
    let cases: [Case; 5] = [
        (
            "an outcome the rule does not keep: its writes are rolled back",
            Classified::Release(Release::NotStored),
            false,
            None,
            Ran::RolledBack,
            "not_stored",
        ),
        (
            "work that fails",
            Classified::Store(message(b"done")),
            true,
            None,
            Ran::WorkFailed("boom"),
            "handler_error",
        ),
        (
            "work that fails on a transaction that broke: a passing fault, not its own",
            Classified::Store(message(b"done")),
            true,
            broke(),
            Ran::TransactionBroke("boom"),
            "transaction_broke",
        ),
        (
            "an outcome not kept, of a transaction that broke: not committed",
            Classified::Release(Release::NotStored),
            false,
            broke(),
            Ran::Uncommitted,
            "transaction_broke",
        ),
        (
            "a commit the database refuses",
            Classified::Store(message(b"done")),
            false,
            Some(TransactionEnd::Failed(StoreError::new("refused"))),
            Ran::Uncommitted,
            "commit_failed",
        ),
    ];
    for (name, classified, fails, answer, expected, reason) in cases {
        let reasons = ReleaseReasons::default();
        let _capture = reasons.capture();
        let settles = Settles::default();
        let (store, engine, mut claimed) = claim_held_by_transaction(&settles, answer).await;
        let work = async move {
            if fails {
                failed()
            } else {
                Ok(())
            }
        };

        let result = claimed
            .run(std::pin::pin!(work), &once(classified), None)
            .await;

        assert_eq!(ran(result), expected, "{name}");
        drained(&engine).await;
        assert_eq!(store.calls(), [Call::Begin], "{name}: no release call");
        assert_eq!(reasons.seen(), [reason], "{name}");
        let rolled_back = lock(&settles).iter().all(Option::is_none);
        assert_eq!(rolled_back, reason != "commit_failed", "{name}");
    }
}

#[tokio::test]
async fn a_dropped_transactional_claim_is_rolled_back_as_abandoned() {
    let reasons = ReleaseReasons::default();
    let _capture = reasons.capture();
    let settles = Settles::default();
    let (store, engine, claimed) = claim_held_by_transaction(&settles, None).await;

    drop(claimed);

    drained(&engine).await;
    assert_eq!(store.calls(), [Call::Begin]);
    assert_eq!(*lock(&settles), [None], "rolled back");
    assert_eq!(reasons.seen(), ["abandoned"]);
}

#[tokio::test]
async fn a_key_held_by_another_transaction_is_in_flight_and_a_waiter_handed_it_runs() {
    let store = Arc::new(ScriptedStore::default().begins(Ok(Begin::Locked)));
    let rejecting = engine(&store, Policy::new());
    let flag = ClaimFlag::default();
    let decision = rejecting.decide(scope(), this_request(), None, &flag).await;
    assert!(matches!(
        decided(&decision),
        Decided::InFlight {
            first_seen: None,
            request_count: None,
            retry_after: DEFAULT_RETRY_AFTER,
        }
    ));

    let settles = Settles::default();
    let handed = Waited::ClaimedByTransaction {
        lease: Lease::new(TOKEN, first_seen()),
        transaction: Box::new(ScriptedTransaction {
            settles: settles.clone(),
            answer: Mutex::new(None),
        }),
    };
    let store = Arc::new(
        ScriptedStore::default()
            .begins(Ok(Begin::Locked))
            .waits(Some(Ok(handed))),
    );
    let timeout = Duration::from_secs(5);
    let waiting = engine(&store, Policy::new().in_flight(InFlight::Wait { timeout }));
    let Decision::Run(mut claimed) = waiting.decide(scope(), this_request(), None, &flag).await
    else {
        panic!("the waiter handed the key runs");
    };
    let stored = |_: &(), _| Classified::Store(message(b"mine"));
    let result = claimed
        .run(std::pin::pin!(async { Ok(()) }), &stored, None)
        .await;
    assert_eq!(ran(result), Ran::Kept { stored_now: true });
    assert_eq!(store.calls(), [Call::Begin, Call::Wait { timeout }]);
    assert_eq!(*lock(&settles), [Some(Bytes::from_static(b"mine"))]);
}

#[tokio::test]
async fn an_exhausted_store_is_pool_exhausted_even_when_failing_open() {
    for policy in [
        Policy::new(),
        Policy::new().store_failure(StoreFailure::FailOpen),
    ] {
        let exhausted = StoreError::new("every connection in use").exhausted();
        let store = Arc::new(ScriptedStore::default().begins(Err(exhausted)));
        let engine = engine(&store, policy);
        let flag = ClaimFlag::default();
        let decision = engine.decide(scope(), this_request(), None, &flag).await;
        assert!(matches!(decision, Decision::Answer(Verdict::PoolExhausted)));
    }
}
