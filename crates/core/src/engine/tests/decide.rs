//! What the engine decides for each answer the store gives `begin` and `wait`.

use super::*;

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
    wait: Option<Result<Waited, StoreError>>,
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
fn waited(name: &'static str, wait: Result<Waited, StoreError>, expected: Decided) -> DecideCase {
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
        first_seen: Some(first_seen()),
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
            Ok(Waited::Completed {
                record: stored(this_request(), None),
                request_count: None,
            }),
            replay(2),
        ),
        waited(
            "a wait that times out answers in flight, retry after a second",
            Ok(Waited::TimedOut),
            in_flight(2, AFTER_WAIT),
        ),
        waited(
            "a wait on work that was released tells the duplicate to retry",
            Ok(Waited::Released),
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
