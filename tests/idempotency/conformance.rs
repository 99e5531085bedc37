//! draft-ietf-httpapi-idempotency-key-header (-07) and RFC 8941, section by section:
//! one test per requirement a server can meet, named by its section. The conformance
//! table in the `idempotency` module's documentation lists them, with our defaults
//! and the options that depart from them.

use std::{sync::Arc, time::Duration};

use http::StatusCode;
use tower_ids::idempotency::{
    store::ManualClock, IdempotencyLayer, MokaStore, Policy, StorageRule,
};

use super::{start, support::Logs, until_runs, BODY, KEY};

/// Section 2.6: a request repeated after the first completed gets "the result of the
/// previously completed operation, success or an error": a `500` too, and the
/// handler does not run again.
#[tokio::test]
async fn draft_2_6_a_retry_after_an_error_gets_the_error_and_nothing_runs_again() {
    let app = start(IdempotencyLayer::new()).await;

    let failed = app
        .post("/commands", &[KEY, ("x-status", "500")], BODY)
        .await;
    let retry = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, failed.body, "the same error, byte for byte");
    assert_eq!(app.runs.get(), 1);
}

/// The departure, by default: a handler's own refusal (a 4xx) is not stored, so the
/// same request is refused again by the handler, and the corrected request under the
/// same key runs once; never `422 fingerprint_mismatch` for it.
#[tokio::test]
async fn draft_2_6_departure_a_refusal_is_not_stored_and_the_corrected_request_runs() {
    let app = start(IdempotencyLayer::new()).await;

    let refused = app
        .post("/commands", &[KEY, ("x-status", "422")], BODY)
        .await;
    let again = app
        .post("/commands", &[KEY, ("x-status", "422")], BODY)
        .await;
    let corrected = app
        .post("/commands", &[KEY], r#"{"device_id":"d-1","name":"fixed"}"#)
        .await;
    let retry = app
        .post("/commands", &[KEY], r#"{"device_id":"d-1","name":"fixed"}"#)
        .await;

    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(refused.header("idempotent-replayed"), Some("false"));
    assert_eq!(again.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(again.header("idempotent-replayed"), Some("false"));
    assert_eq!(corrected.status, StatusCode::CREATED);
    assert_eq!(corrected.header("idempotent-replayed"), Some("false"));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, corrected.body);
    assert_eq!(app.runs.get(), 3, "two refusals and one run");
}

/// The preset that stores refusals too: the refusal replays, and the handler runs once.
#[tokio::test]
async fn store_all_but_retryable_replays_a_refusal() {
    let app = start(
        IdempotencyLayer::new()
            .policy(Policy::new().storage(StorageRule::AllButRetryable))
            .unwrap(),
    )
    .await;

    let refused = app
        .post("/commands", &[KEY, ("x-status", "403")], BODY)
        .await;
    let retry = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(retry.status, StatusCode::FORBIDDEN);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, refused.body);
    assert_eq!(app.runs.get(), 1);
}

/// The other preset: with `StorageRule::SuccessesOnly` a 5xx releases the key and the retry
/// runs again.
#[tokio::test]
async fn draft_2_6_departure_store_successes_only_runs_the_retry_again() {
    let app = start(
        IdempotencyLayer::new()
            .policy(Policy::new().storage(StorageRule::SuccessesOnly))
            .unwrap(),
    )
    .await;

    app.post("/commands", &[KEY, ("x-status", "500")], BODY)
        .await;
    let retry = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("false"));
    assert_eq!(app.runs.get(), 2);
}

/// Sections 2.6 and 2.7: a request without the key, where the route requires one,
/// gets `400`, a problem with a link to its documentation.
#[tokio::test]
async fn draft_2_7_a_missing_key_where_required_gets_400_with_a_link() {
    let app = start(IdempotencyLayer::new().require_key(true)).await;

    let missing = app.post("/commands", &[], BODY).await;

    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.json()["code"], "idempotency.key_missing");
    assert!(missing
        .header("link")
        .is_some_and(|link| link.ends_with(r#"#idempotency.key_missing>; rel="describedby""#)));
    assert_eq!(app.runs.get(), 0);
}

/// Section 2.6: a duplicate of a request still being processed gets `409 Conflict`,
/// with `Retry-After`, and nothing runs twice.
#[tokio::test]
async fn draft_2_6_a_duplicate_while_the_first_runs_gets_409_with_retry_after() {
    let app = Arc::new(start(IdempotencyLayer::new()).await);

    let first = tokio::spawn({
        let app = app.clone();
        async move {
            app.post("/commands", &[KEY, ("x-delay-ms", "300")], BODY)
                .await
        }
    });
    until_runs(&app.runs, 1).await;
    let duplicate = app
        .post("/commands", &[KEY, ("attempt-id", "2")], BODY)
        .await;

    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.header("retry-after"), Some("1"));
    assert_eq!(duplicate.header("idempotent-replayed"), Some("false"));
    assert_eq!(duplicate.header("attempt-id"), Some("2"));
    assert_eq!(duplicate.json()["code"], "idempotency.in_flight");

    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = app.post("/commands", &[KEY], BODY).await;
    assert_eq!(retry.body, first.body);
    assert_eq!(app.runs.get(), 1);
}

/// Section 2.6: a key reused with another payload (or another media type) gets
/// `422`, and nothing runs twice.
#[tokio::test]
async fn draft_2_6_a_key_reused_with_another_payload_gets_422() {
    let (logs, _guard) = Logs::capture();
    let app = start(IdempotencyLayer::new()).await;

    app.post("/commands", &[KEY], BODY).await;
    let changed = app
        .post("/commands", &[KEY], r#"{"device_id":"d-2"}"#)
        .await;
    let changed_type = app
        .post("/commands", &[KEY, ("content-type", "text/plain")], BODY)
        .await;

    assert_eq!(app.runs.get(), 1, "never a second execution");
    for reply in [changed, changed_type] {
        assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(reply.json()["code"], "idempotency.fingerprint_mismatch");
    }
    assert_eq!(logs.events("idempotency.conflict")[0]["level"], "WARN");
}

/// Section 2.6, where the request was not processed: `503` and `429` (and `408`) are
/// not stored, so the retry runs.
#[tokio::test]
async fn draft_2_6_408_429_and_503_release_the_key() {
    let (logs, _guard) = Logs::capture();
    let app = start(IdempotencyLayer::new()).await;

    let failed = app
        .post("/commands", &[KEY, ("x-status", "503")], BODY)
        .await;
    let throttled = app
        .post("/commands", &[KEY, ("x-status", "429")], BODY)
        .await;
    let retry = app.post("/commands", &[KEY], BODY).await;
    let replay = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(throttled.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("false"));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.runs.get(), 3);
    let released = logs.events("idempotency.released");
    assert_eq!(released.len(), 2);
    assert_eq!(released[0]["fields"]["reason"], "not_stored");
}

/// Section 2.3: a key expires after the published time (the TTL), and then runs again.
#[tokio::test]
async fn draft_2_3_a_key_runs_again_after_it_expires() {
    let clock = ManualClock::default();
    let store = MokaStore::builder().clock(clock.clone()).build();
    let app = start(
        IdempotencyLayer::with_store(store)
            .policy(Policy::new().ttl(Duration::from_secs(3600)))
            .unwrap(),
    )
    .await;

    app.post("/commands", &[KEY], BODY).await;
    clock.advance(Duration::from_secs(3599));
    let within = app.post("/commands", &[KEY], BODY).await;
    clock.advance(Duration::from_secs(2));
    let after = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(within.header("idempotent-replayed"), Some("true"));
    assert_eq!(after.header("idempotent-replayed"), Some("false"));
    assert_eq!(app.runs.get(), 2, "an expired key runs again");
}

/// Draft section 2.7: the 400 and 422 answers carry a link to documentation. Every
/// problem's `type` is a URL that opens its row of the status table, and the response
/// links it as `describedby`; a service points both at its own pages.
#[tokio::test]
async fn draft_2_7_problems_link_to_their_documentation() {
    let default = start(IdempotencyLayer::new()).await;
    let own =
        start(IdempotencyLayer::new().problem_docs("https://api.example.com/problems/")).await;
    for (app, base) in [
        (&default, tower_ids::IDEMPOTENCY_PROBLEM_DOCS),
        (&own, "https://api.example.com/problems/"),
    ] {
        let bad_key = app
            .post("/commands", &[("idempotency-key", "\"open")], BODY)
            .await;
        app.post("/commands", &[KEY], BODY).await;
        let mismatch = app.post("/commands", &[KEY], "{\"other\":true}").await;
        for (reply, status, code) in [
            (&bad_key, 400, "idempotency.key_invalid"),
            (&mismatch, 422, "idempotency.fingerprint_mismatch"),
        ] {
            assert_eq!(reply.status, status);
            let url = format!("{base}{code}");
            assert_eq!(reply.json()["type"], url.as_str());
            assert_eq!(reply.json()["code"], code);
            assert_eq!(
                reply.header("link"),
                Some(format!("<{url}>; rel=\"describedby\"").as_str())
            );
        }
    }
}

/// RFC 8941 section 4.2 and RFC 9110 section 5.3: a field on two lines is one value,
/// `abc, abc`, which is not an Item, so it is never used as a key, even when both lines
/// say the same.
#[tokio::test]
async fn rfc8941_4_2_a_key_header_sent_twice_is_refused_even_with_one_key() {
    let app = start(IdempotencyLayer::new()).await;
    for lines in [["abc", "abc"], ["abc", "\"abc\""], ["abc", "def"]] {
        let reply = app
            .post(
                "/commands",
                &[("idempotency-key", lines[0]), ("idempotency-key", lines[1])],
                BODY,
            )
            .await;
        assert_eq!(reply.status, 400, "{lines:?}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(
            reply.json()["code"],
            "idempotency.key_repeated",
            "{lines:?}"
        );
    }
    assert_eq!(app.runs.get(), 0);
}

/// A replay never changes a stored status: the ready-made marker (`200` with
/// `"replay": true`) turns a stored `201` into `200`, but a stored `403` or `500`
/// replays with its own status, its problem's `status` member still equal to it.
#[tokio::test]
async fn a_replay_hook_never_turns_a_refusal_or_a_failure_into_a_success() {
    let app = start(
        IdempotencyLayer::new()
            .policy(Policy::new().storage(StorageRule::AllButRetryable))
            .unwrap()
            .on_replay(
                tower_ids::idempotency::JsonReplayMarker::new("replay").status(StatusCode::OK),
            ),
    )
    .await;

    for (n, stored) in [201u16, 403, 500].into_iter().enumerate() {
        let key = ("idempotency-key", ["k-201", "k-403", "k-500"][n]);
        let status = stored.to_string();
        let first = app
            .post("/commands", &[key, ("x-status", status.as_str())], BODY)
            .await;
        let replay = app.post("/commands", &[key], BODY).await;

        assert_eq!(first.status.as_u16(), stored);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.json()["replay"], true, "the body is marked");
        let expected = if stored == 201 { 200 } else { stored };
        assert_eq!(replay.status.as_u16(), expected, "stored {stored}");
    }
    assert_eq!(app.runs.get(), 3);
}
