//! A keyed request's life while the first attempt runs and after: duplicates that wait
//! for its outcome or time out into `409`, a client error that is not stored, a lease
//! lost to a long handler, a client that hangs up, and a handler that panics.

use std::{sync::Arc, time::Duration};

use http::StatusCode;
use tower_ids::idempotency::{store::ManualClock, IdempotencyLayer, InFlight, MokaStore, Policy};

use super::{start, try_send, until_runs, Logs, BODY, KEY};

#[tokio::test]
async fn waiting_mode_replays_the_first_outcome() {
    let layer = IdempotencyLayer::new()
        .policy(Policy::new().in_flight(InFlight::Wait {
            timeout: Duration::from_secs(5),
        }))
        .unwrap();
    let app = Arc::new(start(layer).await);

    let first = tokio::spawn({
        let app = app.clone();
        async move {
            app.post("/commands", &[KEY, ("x-delay-ms", "200")], BODY)
                .await
        }
    });
    until_runs(&app.runs, 1).await;
    let waiter = app.post("/commands", &[KEY], BODY).await;
    let first = first.await.unwrap();

    assert_eq!(app.runs.get(), 1);
    assert_eq!(waiter.status, StatusCode::CREATED);
    assert_eq!(waiter.body, first.body);
    assert_eq!(waiter.header("idempotent-replayed"), Some("true"));
}

#[tokio::test]
async fn waiting_mode_times_out_into_409() {
    let layer = IdempotencyLayer::new()
        .policy(Policy::new().in_flight(InFlight::Wait {
            timeout: Duration::from_millis(50),
        }))
        .unwrap();
    let app = Arc::new(start(layer).await);

    let first = tokio::spawn({
        let app = app.clone();
        async move {
            app.post("/commands", &[KEY, ("x-delay-ms", "400")], BODY)
                .await
        }
    });
    until_runs(&app.runs, 1).await;
    let waiter = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(waiter.status, StatusCode::CONFLICT);
    assert_eq!(waiter.header("retry-after"), Some("1"));
    first.await.unwrap();
    assert_eq!(app.runs.get(), 1);
}

#[tokio::test]
async fn a_client_error_is_not_stored_and_the_retry_runs_again() {
    let app = start(IdempotencyLayer::new()).await;

    app.post("/commands", &[KEY, ("x-status", "404")], BODY)
        .await;
    let retry = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("false"));
    assert_eq!(app.runs.get(), 2);
}

#[tokio::test]
async fn a_lost_lease_frees_the_key_and_the_late_outcome_is_not_stored() {
    let clock = ManualClock::default();
    let store = MokaStore::builder().clock(clock.clone()).build();
    let layer = IdempotencyLayer::with_store(store)
        .policy(Policy::new().lease(Duration::from_secs(60)))
        .unwrap();
    let app = Arc::new(start(layer).await);

    let slow = tokio::spawn({
        let app = app.clone();
        async move {
            app.post("/commands", &[KEY, ("x-delay-ms", "300")], BODY)
                .await
        }
    });
    until_runs(&app.runs, 1).await;
    // A claim holds its key for one and a half leases.
    clock.advance(Duration::from_secs(91));
    let takeover = app.post("/commands", &[KEY], BODY).await;
    slow.await.unwrap();
    let replay = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(app.runs.get(), 2);
    assert_eq!(
        replay.body, takeover.body,
        "the newer claim's record stands"
    );
}

#[tokio::test]
async fn a_client_that_hangs_up_still_gets_the_replay() {
    let (logs, _guard) = Logs::capture();
    let app = start(IdempotencyLayer::new()).await;

    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        app.post("/commands", &[KEY, ("x-delay-ms", "300")], BODY),
    )
    .await;
    assert!(gave_up.is_err(), "the client hung up before the response");
    assert_eq!(app.runs.get(), 1);

    // The handler finishes on its own and its outcome is stored.
    for _ in 0..100 {
        if !logs.events("idempotency.stored").is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let retry = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.runs.get(), 1);
    // The request that did the work has its line, when it settled.
    let detached = logs.events("idempotency.detached");
    assert_eq!(detached.len(), 1, "{}", logs.raw());
    assert_eq!(detached[0]["level"], "INFO");
    assert_eq!(detached[0]["span"]["idempotency_key"], KEY.1);
}

/// Every panic message seen by this test binary, with the default hook still printing.
fn panic_messages() -> &'static std::sync::Mutex<Vec<String>> {
    static MESSAGES: std::sync::OnceLock<std::sync::Mutex<Vec<String>>> =
        std::sync::OnceLock::new();
    MESSAGES.get_or_init(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if let Some(messages) = MESSAGES.get() {
                messages.lock().unwrap().push(info.to_string());
            }
            default(info);
        }));
        std::sync::Mutex::new(Vec::new())
    })
}

#[tokio::test]
async fn a_panicking_handler_releases_the_key() {
    let panics = panic_messages();
    let (logs, _guard) = Logs::capture();
    let layer = IdempotencyLayer::new()
        .policy(Policy::new().in_flight(InFlight::Wait {
            timeout: Duration::from_secs(5),
        }))
        .unwrap();
    let app = Arc::new(start(layer).await);

    let panicking = tokio::spawn({
        let app = app.clone();
        async move {
            try_send(
                &app.client,
                "POST",
                format!("{}/commands", app.url),
                &[KEY, ("x-panic", "1"), ("x-delay-ms", "100")],
                BODY,
            )
            .await
        }
    });
    until_runs(&app.runs, 1).await;
    let waiter = app.post("/commands", &[KEY], BODY).await;
    assert!(
        panicking.await.unwrap().is_err(),
        "the panic closes that connection"
    );

    assert_eq!(waiter.status, StatusCode::CONFLICT);
    assert_eq!(waiter.json()["code"], "idempotency.original_failed");
    assert_eq!(waiter.header("retry-after"), Some("1"));
    let released = logs.events("idempotency.released");
    assert_eq!(released[0]["fields"]["reason"], "handler_panicked");

    let retry = app.post("/commands", &[KEY], BODY).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(app.runs.get(), 2, "released, so the retry runs");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let panics = panics.lock().unwrap();
    assert!(
        !panics.iter().any(|m| m.contains("resumed after panicking")),
        "the panicked work was resumed: {panics:?}"
    );
}
