//! The demo service as a user runs it: the `commands` example binary on a free port,
//! driven over HTTP, its JSON log read from stdout.

#[path = "demo.rs"]
mod demo;
use tower_ids_test_support as support;

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

    // Each attempt's access line says what the idempotency layer did; the delivery's
    // lines share the first attempt's ID as a prefix.
    let first = access_lines(&demo, "demo-attempt-1", 1).await;
    assert_eq!(first[0]["span"]["idempotency_outcome"], "executed");
    assert_eq!(first[0]["fields"]["status"], 201);
    let second = access_lines(&demo, "demo-attempt-2", 1).await;
    assert_eq!(second[0]["span"]["idempotency_outcome"], "replayed");
    assert_eq!(second[0]["span"]["idempotency_request_count"], 2);
    assert_eq!(second[0]["fields"]["status"], 201);
    let published = &demo.events("commands.published").await[0];
    let delivery = published["span"]["correlation_id"].as_str().unwrap();
    assert!(delivery.starts_with("demo-attempt-1."), "{delivery}");
    assert_eq!(published["fields"]["command_id"], id.as_str());
}

/// The access lines of the demo's log for correlation ID `id`, waiting up to 5 s for
/// `count` of them (the log is read on another thread) and a little more for extras.
async fn access_lines(demo: &Demo, id: &str, count: usize) -> Vec<serde_json::Value> {
    let of_id = || {
        demo.logged("http.access")
            .into_iter()
            .filter(|line| line["span"]["correlation_id"] == id)
            .collect::<Vec<_>>()
    };
    for _ in 0..500 {
        if of_id().len() >= count {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    of_id()
}

#[tokio::test]
async fn the_demo_logs_one_access_line_per_request_refusals_included() {
    let demo = Demo::start(&[]);
    let client = client();
    let listed = send(
        &client,
        "GET",
        format!("{}/commands", demo.url),
        &[("x-correlation-id", "access-get-1")],
        "",
    )
    .await;
    assert_eq!(listed.status, StatusCode::OK);
    let lines = access_lines(&demo, "access-get-1", 1).await;
    assert_eq!(lines.len(), 1, "exactly one: {lines:?}");
    assert_eq!(lines[0]["level"], "INFO");
    assert_eq!(lines[0]["fields"]["status"], 200);
    assert_eq!(lines[0]["span"]["method"], "GET");
    assert_eq!(lines[0]["span"]["path"], "/commands");

    // Refused by the idempotency layer (no key): one line as well, with its status.
    let refused = send(
        &client,
        "POST",
        format!("{}/commands", demo.url),
        &[
            ("x-correlation-id", "access-post-1"),
            ("x-api-key", "demo-client"),
            ("content-type", "application/json"),
        ],
        "{}",
    )
    .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    let lines = access_lines(&demo, "access-post-1", 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["fields"]["status"], 400);
}

/// The value of `tower_ids_idempotency_requests_total{outcome="replayed"}` in the
/// demo's `/metrics`, 0 before the first replay.
#[cfg(feature = "metrics")]
async fn replays(client: &support::HttpClient, url: &str) -> u64 {
    let metrics = send(client, "GET", format!("{url}/metrics"), &[], "").await;
    assert_eq!(metrics.status, StatusCode::OK);
    metrics
        .text()
        .lines()
        .find(|line| {
            line.starts_with("tower_ids_idempotency_requests_total{")
                && line.contains(r#"outcome="replayed""#)
        })
        .map_or(0, |line| line.rsplit(' ').next().unwrap().parse().unwrap())
}

#[cfg(feature = "metrics")]
#[tokio::test]
async fn the_demos_metrics_count_a_replay() {
    let demo = Demo::start(&[]);
    let client = client();
    // Every outcome's series is there, at 0, before the first request.
    let fresh = send(&client, "GET", format!("{}/metrics", demo.url), &[], "").await;
    for outcome in [
        "executed",
        "replayed",
        "in_flight",
        "conflict",
        "not_replayable",
        "original_failed",
        "rejected",
        "store_unavailable",
        "fail_open",
    ] {
        let series = format!(r#"tower_ids_idempotency_requests_total{{outcome="{outcome}"}} 0"#);
        assert!(
            fresh.text().lines().any(|line| line == series),
            "{series} missing from:\n{}",
            fresh.text()
        );
    }
    let before = replays(&client, &demo.url).await;
    let create = || {
        send(
            &client,
            "POST",
            format!("{}/commands", demo.url),
            &[
                ("content-type", "application/json"),
                ("x-api-key", "demo-client"),
                ("idempotency-key", "metrics-1"),
            ],
            r#"{"device_id":"d-1","name":"reboot","payload":{}}"#,
        )
    };
    assert_eq!(create().await.status, StatusCode::CREATED);
    assert_eq!(
        replays(&client, &demo.url).await,
        before,
        "a first run is no replay"
    );
    let replay = create().await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replays(&client, &demo.url).await, before + 1);

    let metrics = send(&client, "GET", format!("{}/metrics", demo.url), &[], "").await;
    let text = metrics.text();
    assert!(
        text.contains("# HELP tower_ids_idempotency_requests_total"),
        "{text}"
    );
    assert!(
        text.contains(r#"tower_ids_idempotency_store_call_duration_seconds{operation="begin""#),
        "{text}"
    );
}

#[cfg(feature = "opentelemetry")]
#[tokio::test]
async fn the_demo_continues_an_incoming_trace_in_its_logs() {
    let demo = Demo::start(&[]);
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let reply = send(
        &client(),
        "GET",
        format!("{}/commands", demo.url),
        &[
            ("traceparent", &format!("00-{trace_id}-00f067aa0ba902b7-01")),
            ("x-correlation-id", "traced-1"),
        ],
        "",
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let lines = access_lines(&demo, "traced-1", 1).await;
    assert_eq!(lines[0]["span"]["trace_id"], trace_id);
}

/// Every INFO line logged for correlation ID `id` (a line of the request's spans).
fn info_lines_of(demo: &Demo, id: &str) -> Vec<serde_json::Value> {
    demo.lines()
        .into_iter()
        .filter(|line| line["level"] == "INFO")
        .filter(|line| line["span"]["correlation_id"] == id)
        .collect()
}

async fn create_with(
    client: &support::HttpClient,
    url: &str,
    correlation_id: &str,
    key: &str,
) -> support::Reply {
    send(
        client,
        "POST",
        format!("{url}/commands"),
        &[
            ("content-type", "application/json"),
            ("x-correlation-id", correlation_id),
            ("x-api-key", "demo-client"),
            ("idempotency-key", key),
        ],
        r#"{"device_id":"d-canon","name":"reboot","payload":{}}"#,
    )
    .await
}

#[tokio::test]
async fn a_request_writes_one_info_line_that_says_what_the_idempotency_layer_did() {
    let demo = Demo::start(&[]);
    let client = client();
    let first = create_with(&client, &demo.url, "canon-1", "canon-key").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = create_with(&client, &demo.url, "canon-2", "canon-key").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let conflict = send(
        &client,
        "POST",
        format!("{}/commands", demo.url),
        &[
            ("content-type", "application/json"),
            ("x-correlation-id", "canon-3"),
            ("x-api-key", "demo-client"),
            ("idempotency-key", "canon-key"),
        ],
        r#"{"device_id":"d-other","name":"reboot","payload":{}}"#,
    )
    .await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    access_lines(&demo, "canon-3", 1).await;

    for (id, outcome, status) in [
        ("canon-1", "executed", 201),
        ("canon-2", "replayed", 201),
        ("canon-3", "conflict", 422),
    ] {
        let lines = info_lines_of(&demo, id);
        assert_eq!(lines.len(), 1, "one INFO line for {id}: {lines:#?}");
        let line = &lines[0];
        assert_eq!(line["fields"]["event"], "http.access");
        assert_eq!(line["fields"]["status"], status);
        assert!(line["fields"]["latency_ms"].is_number());
        let span = &line["span"];
        assert_eq!(span["idempotency_outcome"], outcome, "{line}");
        assert_eq!(span["idempotency_key"], "canon-key");
        assert!(span["idempotency_scope"].is_string());
        assert!(span["idempotency_client"].is_string());
        assert!(
            span["idempotency_store_ms"]
                .as_f64()
                .is_some_and(|ms| ms > 0.0),
            "{line}"
        );
    }
    assert_eq!(
        info_lines_of(&demo, "canon-2")[0]["span"]["idempotency_request_count"],
        2
    );
    assert!(
        info_lines_of(&demo, "canon-1")[0]["span"]["idempotency_request_count"].is_null(),
        "a first execution has no count"
    );
    // The conflict's WARN line carries the key through the same span.
    let conflict = &demo.events("idempotency.conflict").await[0];
    assert_eq!(conflict["level"], "WARN");
    assert_eq!(conflict["span"]["idempotency_key"], "canon-key");
}

#[tokio::test]
async fn in_the_pretty_format_the_one_line_carries_the_outcome_too() {
    let demo = Demo::start_with_env(&["--log-format", "pretty"], &[]);
    let client = client();
    create_with(&client, &demo.url, "pretty-1", "pretty-key").await;
    let replay = create_with(&client, &demo.url, "pretty-2", "pretty-key").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let lines_of = |id: &str| -> Vec<String> {
        let needle = format!(r#"correlation_id="{id}" "#);
        demo.lines()
            .into_iter()
            .filter_map(|line| line.as_str().map(str::to_owned))
            .filter(|line| line.contains(&needle))
            .collect()
    };
    for _ in 0..500 {
        if !lines_of("pretty-2").is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    for (id, outcome) in [("pretty-1", "executed"), ("pretty-2", "replayed")] {
        let lines = lines_of(id);
        assert_eq!(lines.len(), 1, "one line for {id}: {lines:#?}");
        let line = &lines[0];
        assert!(line.contains(" INFO "), "{line}");
        assert!(line.contains(r#"event="http.access""#), "{line}");
        assert!(
            line.contains(&format!(r#"idempotency_outcome="{outcome}""#)),
            "{line}"
        );
        assert!(line.contains(r#"idempotency_key="pretty-key""#), "{line}");
        assert_eq!(line.matches("idempotency_store_ms=").count(), 1, "{line}");
        assert!(line.contains("status=201"), "{line}");
    }
    assert!(lines_of("pretty-2")[0].contains("idempotency_request_count=2"));
}

/// The demo's OpenAPI document (feature `openapi`): it parses as OpenAPI 3.1 with the
/// `oas3` crate, and each protected operation says what a generated client needs.
#[cfg(feature = "openapi")]
#[tokio::test]
async fn the_demo_serves_an_openapi_document_of_its_protected_operations() {
    let demo = Demo::start(&[]);
    let reply = send(
        &client(),
        "GET",
        format!("{}/openapi.json", demo.url),
        &[],
        "",
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let text = String::from_utf8(reply.body.to_vec()).unwrap();
    let spec = oas3::from_json(&text).expect("a valid OpenAPI 3.1 document");
    assert!(spec.openapi.starts_with("3.1"), "{}", spec.openapi);
    let document = reply.json();

    let create = &document["paths"]["/commands"]["post"];
    let cancel = &document["paths"]["/commands/{id}/cancel"]["post"];
    let key = |operation: &serde_json::Value| {
        operation["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "Idempotency-Key")
            .cloned()
            .expect("the key parameter")
    };
    assert_eq!(key(create)["in"], "header");
    assert_eq!(
        key(create)["required"],
        true,
        "the create route requires a key"
    );
    assert_eq!(key(cancel)["required"], false);
    assert_eq!(key(create)["schema"]["type"], "string");

    let codes = |operation: &serde_json::Value, status: &str| -> Vec<String> {
        operation["responses"][status]["content"]["application/problem+json"]["schema"]
            ["properties"]["code"]["enum"]
            .as_array()
            .unwrap_or_else(|| panic!("{status}: {operation}"))
            .iter()
            .map(|code| code.as_str().unwrap().to_owned())
            .collect()
    };
    assert!(codes(create, "409").contains(&"idempotency.in_flight".to_owned()));
    assert!(codes(create, "422").contains(&"idempotency.fingerprint_mismatch".to_owned()));
    assert!(codes(create, "400").contains(&"idempotency.key_repeated".to_owned()));
    assert!(codes(create, "401").contains(&"idempotency.client_missing".to_owned()));
    assert!(codes(create, "503").contains(&"idempotency.store_unavailable".to_owned()));
    for status in ["409", "503"] {
        assert!(
            create["responses"][status]["headers"]["Retry-After"].is_object(),
            "{status}"
        );
    }
    // The operation's own answers keep their description and gain the layer's headers.
    assert_eq!(
        create["responses"]["201"]["description"],
        "The command, created"
    );
    assert!(create["responses"]["201"]["headers"]["idempotent-replayed"].is_object());
    assert!(cancel["responses"]["404"]["headers"]["idempotent-replayed"].is_object());
}
