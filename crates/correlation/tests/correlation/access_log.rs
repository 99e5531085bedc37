//! One access line per request inside the correlation span (feature `access-log`): a
//! `GET`, a refusal of the correlation layer and one of the idempotency layer.

use axum::{routing::get, Router};
use http::StatusCode;
use tower_ids::{correlation::CorrelationLayer, idempotency::IdempotencyLayer};

use crate::support::{client, send, serve, Logs};

async fn app(layer: CorrelationLayer) -> String {
    let app = Router::new()
        .route(
            "/commands",
            get(|| async {
                tracing::info!(event = "test.handled", "handled");
                "[]"
            })
            .post(|| async { (StatusCode::CREATED, "made") })
            .layer(IdempotencyLayer::new().require_key(true)),
        )
        .route("/boom", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .layer(layer.access_log());
    format!("http://{}", serve(app).await)
}

#[tokio::test]
async fn a_get_logs_exactly_one_access_line_with_its_id_and_status() {
    let (logs, _guard) = Logs::capture();
    let url = app(CorrelationLayer::new()).await;
    let reply = send(
        &client(),
        "GET",
        format!("{url}/commands?token=secret"),
        &[("x-correlation-id", "get-1")],
        "",
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("x-correlation-id"), Some("get-1"));

    let lines = logs.events("http.access");
    assert_eq!(lines.len(), 1, "{}", logs.raw());
    let line = &lines[0];
    assert_eq!(line["level"], "INFO");
    assert_eq!(line["fields"]["status"], 200);
    assert!(line["fields"]["latency_ms"].as_f64().unwrap() >= 0.0);
    assert_eq!(line["span"]["name"], "request");
    assert_eq!(line["span"]["correlation_id"], "get-1");
    assert_eq!(line["span"]["method"], "GET");
    assert_eq!(line["span"]["path"], "/commands", "never the query");
    assert!(!logs.raw().contains("secret"));

    // The handler's own line is in the same span, with the same ID.
    let handled = &logs.events("test.handled")[0];
    assert_eq!(handled["span"]["correlation_id"], "get-1");
    // One span per request: no `correlation` span inside the `request` one.
    assert_eq!(handled["spans"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn a_400_from_enforce_logs_one_access_line_too() {
    let (logs, _guard) = Logs::capture();
    let url = app(CorrelationLayer::new().enforce(true)).await;
    let reply = send(&client(), "GET", format!("{url}/commands"), &[], "").await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let generated = reply.header("x-correlation-id").unwrap();

    let lines = logs.events("http.access");
    assert_eq!(lines.len(), 1, "{}", logs.raw());
    assert_eq!(lines[0]["fields"]["status"], 400);
    assert_eq!(lines[0]["span"]["correlation_id"], generated);
    let refused = &logs.events("correlation.missing")[0];
    assert_eq!(refused["span"]["correlation_id"], generated);
}

#[tokio::test]
async fn refusals_of_the_idempotency_layer_and_5xx_log_one_line_each() {
    let (logs, _guard) = Logs::capture();
    let url = app(CorrelationLayer::new()).await;
    let client = client();
    let missing_key = send(
        &client,
        "POST",
        format!("{url}/commands"),
        &[("x-correlation-id", "post-1")],
        "{}",
    )
    .await;
    assert_eq!(missing_key.status, StatusCode::BAD_REQUEST);
    let failed = send(
        &client,
        "GET",
        format!("{url}/boom"),
        &[("x-correlation-id", "boom-1")],
        "",
    )
    .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);

    let lines = logs.events("http.access");
    assert_eq!(lines.len(), 2, "{}", logs.raw());
    assert_eq!(lines[0]["fields"]["status"], 400);
    assert_eq!(lines[0]["span"]["correlation_id"], "post-1");
    assert_eq!(lines[1]["fields"]["status"], 500);
    assert_eq!(lines[1]["span"]["correlation_id"], "boom-1");
    assert!(
        logs.lines().iter().all(|line| line["level"] != "ERROR"),
        "the 500 is the access line's to tell, not a second ERROR line"
    );
}
