//! The demo service as a user runs it: the `commands` example binary on a free port,
//! driven over HTTP, its JSON log read from stdout.

#[path = "support/demo.rs"]
mod demo;
#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use demo::Demo;
use http::StatusCode;
use serde_json::json;
use support::{client, send};

#[tokio::test]
async fn the_demo_tells_one_story_per_correlation_id() {
    let demo = Demo::start(&[]);
    let client = client();
    let body =
        r#"{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}"#;

    let created = send(
        &client,
        "POST",
        format!("{}/commands", demo.url),
        &[
            ("content-type", "application/json"),
            ("x-correlation-id", "demo-attempt-1"),
            ("x-api-key", "demo-client"),
            ("idempotency-key", "create-1"),
        ],
        body,
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    assert_eq!(created.header("x-correlation-id"), Some("demo-attempt-1"));
    assert_eq!(created.header("idempotent-replayed"), Some("false"));

    // The retry of the same action: a new attempt, the same key, the same command.
    let retried = send(
        &client,
        "POST",
        format!("{}/commands", demo.url),
        &[
            ("content-type", "application/json"),
            ("x-correlation-id", "demo-attempt-2"),
            ("x-api-key", "demo-client"),
            ("idempotency-key", "create-1"),
        ],
        body,
    )
    .await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert_eq!(retried.header("idempotent-replayed"), Some("true"));
    assert_eq!(retried.header("x-correlation-id"), Some("demo-attempt-2"));
    assert_eq!(retried.body, created.body);
    let command = created.json();
    assert_eq!(command["status"], "queued");
    assert_eq!(command["payload"], json!({"celsius": 21.5}));
    let id = command["id"].as_str().unwrap().to_owned();
    assert_ne!(
        id, "demo-attempt-1",
        "the entity ID is not the correlation ID"
    );

    // The publisher moves it to `sent`.
    let mut status = String::new();
    for _ in 0..100 {
        let fetched = send(
            &client,
            "GET",
            format!("{}/commands/{id}", demo.url),
            &[],
            "",
        )
        .await;
        assert_eq!(fetched.status, StatusCode::OK);
        status = fetched.json()["status"].as_str().unwrap().to_owned();
        if status == "sent" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status, "sent");

    let listed = send(&client, "GET", format!("{}/commands", demo.url), &[], "").await;
    assert_eq!(listed.json().as_array().unwrap().len(), 1);

    let unknown = send(
        &client,
        "GET",
        format!("{}/commands/{}", demo.url, uuid::Uuid::now_v7()),
        &[],
        "",
    )
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(
        unknown.header("content-type"),
        Some("application/problem+json")
    );

    let malformed = send(
        &client,
        "POST",
        format!("{}/commands", demo.url),
        &[
            ("content-type", "application/json"),
            ("idempotency-key", "malformed-1"),
        ],
        r#"{"device_id":"#,
    )
    .await;
    assert_eq!(
        malformed.status,
        StatusCode::UNAUTHORIZED,
        "a key without a client is refused before the body is parsed"
    );
    assert_eq!(malformed.json()["code"], "idempotency.client_missing");
    assert_eq!(
        malformed.header("content-type"),
        Some("application/problem+json")
    );
    let malformed = send(
        &client,
        "POST",
        format!("{}/commands", demo.url),
        &[
            ("content-type", "application/json"),
            ("x-api-key", "demo-client"),
            ("idempotency-key", "malformed-1"),
        ],
        r#"{"device_id":"#,
    )
    .await;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
    assert_eq!(malformed.json()["code"], "body.invalid_json");

    // The request's lines and the delivery's lines share the ID as a prefix.
    // (The outermost span is the correlation span; the idempotency span nests in it.)
    let created_log = &demo.events("commands.created").await[0];
    assert_eq!(created_log["spans"][0]["correlation_id"], "demo-attempt-1");
    assert_eq!(
        demo.events("commands.created").await.len(),
        1,
        "created once"
    );
    let replayed = &demo.events("idempotency.replayed").await[0];
    assert_eq!(replayed["spans"][0]["correlation_id"], "demo-attempt-2");
    let published = &demo.events("commands.published").await[0];
    let delivery = published["span"]["correlation_id"].as_str().unwrap();
    assert!(delivery.starts_with("demo-attempt-1."), "{delivery}");
    assert_eq!(published["fields"]["command_id"], id.as_str());
}
