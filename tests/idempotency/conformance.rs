//! draft-ietf-httpapi-idempotency-key-header (-07) and RFC 8941, section by section:
//! one test per requirement a server can meet, named by its section. The conformance
//! table in the `idempotency` module's documentation lists them, with our defaults
//! and the options that depart from them. Requirements tested elsewhere in this suite
//! are named there.

use std::sync::Arc;

use http::StatusCode;
use tower_ids::idempotency::{release_server_errors, IdempotencyLayer};

use super::{start, until_runs, BODY, KEY};

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

/// The departure, as a named option: with `release_server_errors` a 5xx releases the
/// key and the retry runs again.
#[tokio::test]
async fn draft_2_6_departure_release_server_errors_runs_the_retry_again() {
    let app = start(IdempotencyLayer::new().store_if(release_server_errors)).await;

    app.post("/commands", &[KEY, ("x-status", "500")], BODY)
        .await;
    let retry = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("false"));
    assert_eq!(app.runs.get(), 2);
}

/// Section 2.6: a duplicate of a request still being processed gets `409 Conflict`.
#[tokio::test]
async fn draft_2_6_a_duplicate_while_the_first_runs_gets_409() {
    let app = Arc::new(start(IdempotencyLayer::new()).await);
    let first = tokio::spawn({
        let app = app.clone();
        async move {
            app.post("/commands", &[KEY, ("x-delay-ms", "300")], BODY)
                .await
        }
    });
    until_runs(&app.runs, 1).await;

    let duplicate = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.json()["code"], "idempotency.in_flight");
    assert_eq!(
        duplicate.header("content-type"),
        Some("application/problem+json")
    );
    first.await.unwrap();
    assert_eq!(app.runs.get(), 1);
}

/// Sections 2.6 and 2.7: a key reused with another payload gets `422`, a problem with
/// a link to its documentation, and nothing runs.
#[tokio::test]
async fn draft_2_7_a_key_reused_with_another_payload_gets_422_with_a_link() {
    let app = start(IdempotencyLayer::new()).await;

    app.post("/commands", &[KEY], BODY).await;
    let reused = app
        .post("/commands", &[KEY], r#"{"device_id":"d-2"}"#)
        .await;

    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.json()["code"], "idempotency.fingerprint_mismatch");
    assert!(reused.header("link").is_some_and(
        |link| link.ends_with(r#"#idempotency.fingerprint_mismatch>; rel="describedby""#)
    ));
    assert_eq!(app.runs.get(), 1);
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
