//! Both IDs in every outcome: problem details name the attempt and the key, protected
//! responses echo the key, JSON logs have the correlation ID in the innermost span, and
//! the wrong layer order is said once.

use axum::{routing::post, Router};
use http::StatusCode;
use tower::ServiceBuilder;
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{ClientFromHeader, IdempotencyLayer},
};

use super::{handler, start, support::Logs, Runs, BODY, KEY};
use crate::support::{client, send, serve};

#[tokio::test]
async fn every_problem_names_the_attempt_and_the_key() {
    let app = start(
        IdempotencyLayer::new()
            .client(ClientFromHeader::new(http::HeaderName::from_static(
                "x-api-key",
            )))
            .require_client(true),
    )
    .await;
    let client_a = ("x-api-key", "client-a");
    app.post("/commands", &[KEY, client_a], BODY).await;

    // 422: the same key with another body.
    let conflict = app
        .post(
            "/commands",
            &[KEY, client_a, ("x-correlation-id", "attempt-422")],
            "{}",
        )
        .await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    let problem = conflict.json();
    assert_eq!(problem["code"], "idempotency.fingerprint_mismatch");
    assert_eq!(problem["correlation_id"], "attempt-422");
    assert_eq!(problem["idempotency_key"], KEY.1);
    assert_eq!(conflict.header("idempotency-key"), Some(KEY.1));

    // 401, refused before the store: the key is known, so it is named.
    let anonymous = app
        .post(
            "/commands",
            &[KEY, ("x-correlation-id", "attempt-401")],
            BODY,
        )
        .await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(anonymous.json()["correlation_id"], "attempt-401");
    assert_eq!(anonymous.json()["idempotency_key"], KEY.1);
    assert_eq!(anonymous.header("idempotency-key"), Some(KEY.1));

    // 400 for an invalid key: no key to name, and none echoed; the attempt still is.
    let invalid = app
        .post(
            "/commands",
            &[
                ("idempotency-key", ""),
                client_a,
                ("x-correlation-id", "attempt-400"),
            ],
            BODY,
        )
        .await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST);
    let problem = invalid.json();
    assert_eq!(problem["correlation_id"], "attempt-400");
    assert!(problem.get("idempotency_key").is_none(), "{problem}");
    assert_eq!(invalid.header("idempotency-key"), None);

    // A generated correlation ID is the one named, as in the response header.
    let generated = app.post("/commands", &[KEY, client_a], "[]").await;
    assert_eq!(
        generated.json()["correlation_id"],
        generated.header("x-correlation-id").unwrap()
    );
}

#[tokio::test]
async fn protected_responses_echo_the_key_first_run_and_replay() {
    let app = start(IdempotencyLayer::new()).await;
    let first = app.post("/commands", &[KEY], BODY).await;
    let replay = app
        .post("/commands", &[("x-idempotency-key", KEY.1)], BODY)
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("idempotency-key"), Some(KEY.1));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        replay.header("idempotency-key"),
        Some(KEY.1),
        "echoed under the standard name, whichever header carried it"
    );
    // A request without a key passes through untouched.
    let unkeyed = app.post("/commands", &[], BODY).await;
    assert_eq!(unkeyed.header("idempotency-key"), None);
}

#[tokio::test]
async fn a_correlation_refusal_names_its_attempt() {
    let app = Router::new()
        .route("/", post(|| async { "ok" }))
        .layer(CorrelationLayer::new().enforce(true));
    let addr = serve(app).await;
    let reply = send(&client(), "POST", format!("http://{addr}/"), &[], "").await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let problem = reply.json();
    assert_eq!(problem["code"], "correlation_id.missing");
    assert_eq!(
        problem["correlation_id"],
        reply.header("x-correlation-id").unwrap()
    );
}

#[tokio::test]
async fn json_logs_have_the_correlation_id_and_the_key_in_the_request_span() {
    let (logs, _guard) = Logs::capture();
    let app = start(IdempotencyLayer::new()).await;
    app.post("/commands", &[KEY, ("x-correlation-id", "first-1")], BODY)
        .await;
    app.post("/commands", &[KEY, ("x-correlation-id", "retry-2")], BODY)
        .await;
    let stored = &logs.events("idempotency.stored")[0];
    assert_eq!(stored["span"]["name"], "correlation");
    assert_eq!(stored["span"]["correlation_id"], "first-1");
    assert_eq!(stored["span"]["idempotency_key"], KEY.1);
    let replayed = &logs.events("idempotency.replayed")[0];
    assert_eq!(replayed["span"]["correlation_id"], "retry-2");
    assert_eq!(replayed["span"]["idempotency_outcome"], "replayed");
}

#[tokio::test]
async fn the_wrong_layer_order_is_said_once_per_layer() {
    let (logs, _guard) = Logs::capture();
    let runs = Runs::default();
    // Wrong: the idempotency layer outside the correlation layer.
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new())
        .layer(CorrelationLayer::new())
        .service(
            Router::new()
                .route("/commands", post(handler))
                .with_state(runs.clone()),
        );
    let addr = serve(Router::new().fallback_service(service)).await;
    let client = client();
    let url = format!("http://{addr}/commands");
    let first = send(&client, "POST", url.clone(), &[KEY], BODY).await;
    let replay = send(&client, "POST", url, &[KEY], BODY).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        replay.header("x-correlation-id"),
        None,
        "what the warning is about"
    );
    assert_eq!(first.status, StatusCode::CREATED);

    let warnings = logs.events("idempotency.uncorrelated");
    assert_eq!(warnings.len(), 1, "once per layer, not per request");
    assert_eq!(warnings[0]["level"], "WARN");
    let message = warnings[0]["fields"]["message"].as_str().unwrap();
    assert!(
        message.contains("put CorrelationLayer outside"),
        "{message}"
    );

    // The right order says nothing.
    let (logs, _guard) = Logs::capture();
    let app = start(IdempotencyLayer::new()).await;
    app.post("/commands", &[KEY], BODY).await;
    app.post("/commands", &[KEY], BODY).await;
    assert!(logs.events("idempotency.uncorrelated").is_empty());
}

/// A span of the user's own gets the idempotency fields it declares, and only those.
#[tokio::test]
async fn a_custom_span_gets_the_fields_it_declares() {
    let (logs, _guard) = Logs::capture();
    let layer = CorrelationLayer::new().make_span(
        |_: &http::Request<axum::body::Body>, id: &tower_ids::correlation::CorrelationId| {
            tracing::info_span!(
                "mine",
                correlation_id = id.as_str(),
                idempotency_outcome = tracing::field::Empty,
            )
        },
    );
    let app = Router::new()
        .route(
            "/",
            post(|| async {
                tracing::info!(event = "test.handled", "handled");
                "ok"
            })
            .layer(IdempotencyLayer::new()),
        )
        .layer(layer);
    let addr = serve(app).await;
    let reply = send(&client(), "POST", format!("http://{addr}/"), &[KEY], "").await;
    assert_eq!(reply.status, StatusCode::OK);
    let handled = &logs.events("test.handled")[0];
    assert_eq!(handled["span"]["name"], "mine");
    assert_eq!(handled["span"]["idempotency_outcome"], "executed");
    assert!(handled["span"]["idempotency_key"].is_null(), "{handled}");
}
