//! Webhooks: the executor replays one within its window and runs it again after; the
//! planner delivers them one at a time per warehouse, a dead letter lets the next go,
//! and a real executor handles each once.

use std::time::Duration;

use http::StatusCode;
use serde_json::{json, Value};

use super::{
    book, client, events_once, executor, get, movement, planner, post, support, TestDatabase, ACME,
};

#[tokio::test]
async fn a_webhook_is_replayed_within_its_window_and_runs_again_after_it() {
    let executor = executor(&["--webhook-retention-secs", "1"]).await;
    let http = client();
    let url = format!("{}/wes/v1/webhooks/dispatch", executor.url);
    let webhook = json!({
        "planner_id": "planner-1",
        "correlation_id": "0190f5d8-2222-7000-8000-000000000001",
        "warehouse_frn": "frn:wh:1",
        "movement_id": "mv-1",
    });
    let auth = "Bearer planner-token";
    let first = post(&http, &url, auth, &webhook).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(first.json(), json!({"stored": true, "replay": false}));
    let replay = post(&http, &url, auth, &webhook).await;
    assert_eq!(replay.status, StatusCode::OK);
    assert_eq!(replay.json(), json!({"stored": true, "replay": true}));

    // Past the window the key is forgotten: the handler runs again, and the executor's
    // own table recognises the event.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = post(&http, &url, auth, &webhook).await;
    assert_eq!(late.status, StatusCode::CREATED);
    assert_eq!(late.json(), json!({"stored": false, "replay": false}));
    assert_eq!(late.header("idempotent-replayed"), Some("false"));

    let events = get(&http, &format!("{}/wes/v1/events", executor.url), auth).await;
    assert_eq!(events.json()["events"].as_array().unwrap().len(), 1);
    let unauthenticated = post(&http, &url, "Bearer wrong", &webhook).await;
    assert_eq!(unauthenticated.status, StatusCode::UNAUTHORIZED);
}

/// A stand-in for an executor's webhook: records each attempt's `correlation_id` per
/// warehouse, and answers `503` to the first `failures` attempts for `failing`.
#[derive(Clone, Default)]
struct WebhookStandIn {
    seen: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

async fn stand_in(failing: &'static str, failures: usize) -> (String, WebhookStandIn) {
    use axum::{extract::State, routing::post, Json, Router};
    let recorded = WebhookStandIn::default();
    let app = Router::new()
        .route(
            "/wes/v1/webhooks/dispatch",
            post(
                move |State(recorded): State<WebhookStandIn>, Json(body): Json<Value>| async move {
                    let warehouse = body["warehouse_frn"].as_str().unwrap().to_owned();
                    let mut seen = recorded.seen.lock().unwrap();
                    let before = seen.iter().filter(|(w, _)| *w == warehouse).count();
                    seen.push((
                        warehouse.clone(),
                        body["correlation_id"].as_str().unwrap().to_owned(),
                    ));
                    if warehouse == failing && before < failures {
                        StatusCode::SERVICE_UNAVAILABLE
                    } else {
                        StatusCode::CREATED
                    }
                },
            ),
        )
        .with_state(recorded.clone());
    (format!("http://{}", support::serve(app).await), recorded)
}

#[tokio::test]
async fn webhooks_go_one_at_a_time_per_warehouse_and_a_dead_letter_lets_the_next_go() {
    serialised_lanes(&[]).await;
    if let Some(database) = TestDatabase::create().await {
        serialised_lanes(&["--database-url", database.url()]).await;
    }
}

async fn serialised_lanes(extra: &[&str]) {
    let (url, recorded) = stand_in("frn:wh:A", 3).await;
    let webhook = format!("acme={url}");
    let mut args = vec![
        "--webhook",
        &webhook,
        "--webhook-attempts",
        "3",
        "--webhook-backoff-ms",
        "50",
    ];
    args.extend(extra);
    let planner = planner(&args).await;
    let http = client();
    for (n, warehouse) in ["frn:wh:A", "frn:wh:B", "frn:wh:A", "frn:wh:B"]
        .iter()
        .enumerate()
    {
        let call = movement("acme", &format!("c-hook-{n}"), warehouse);
        book(&http, &planner, ACME, &call).await;
    }
    let feed = get(
        &http,
        &format!("{}/wes/v1/dispatch/pending", planner.url),
        ACME,
    )
    .await;
    let feed: Vec<(String, String)> = feed.json()["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["warehouse_frn"].as_str().unwrap().to_owned(),
                e["correlation_id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let in_feed = |warehouse: &str| -> Vec<String> {
        feed.iter()
            .filter(|(w, _)| w == warehouse)
            .map(|(_, c)| c.clone())
            .collect()
    };
    let (a, b) = (in_feed("frn:wh:A"), in_feed("frn:wh:B"));

    // Warehouse A's first event fails three times and is dead-lettered; only then does
    // A's second go. B's go in order, whatever A does.
    for _ in 0..200 {
        if recorded.seen.lock().unwrap().len() >= 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = recorded.seen.lock().unwrap().clone();
    let lane = |warehouse: &str| -> Vec<String> {
        seen.iter()
            .filter(|(w, _)| w == warehouse)
            .map(|(_, c)| c.clone())
            .collect()
    };
    assert_eq!(seen.len(), 6, "{extra:?}: {seen:?}");
    assert_eq!(lane("frn:wh:A"), [a[0].as_str(), &a[0], &a[0], &a[1]]);
    assert_eq!(lane("frn:wh:B"), [b[0].as_str(), &b[1]]);
    let dead = get(
        &http,
        &format!("{}/wes/v1/webhooks/dead", planner.url),
        ACME,
    )
    .await;
    let dead = dead.json()["dead"].as_array().unwrap().clone();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["correlation_id"], a[0].as_str());
    assert!(dead[0]["error"].as_str().unwrap().contains("503"));
}

#[tokio::test]
async fn the_planner_delivers_webhooks_to_a_real_executor_once_each() {
    let executor = executor(&[]).await;
    let webhook = format!("acme={}", executor.url);
    // On PostgreSQL when there is one: the lanes are read with SQL there.
    let database = TestDatabase::create().await;
    let mut args = vec!["--webhook", webhook.as_str()];
    if let Some(database) = &database {
        args.extend(["--database-url", database.url()]);
    }
    let planner = planner(&args).await;
    let http = client();
    for n in 0..4 {
        let call = movement(
            "acme",
            &format!("c-real-hook-{n}"),
            &format!("frn:wh:{}", n % 2),
        );
        book(&http, &planner, ACME, &call).await;
    }
    let received = events_once(&http, &executor, 4).await;
    assert!(received.iter().all(|event| event["source"] == "webhook"));
    let feed = get(
        &http,
        &format!("{}/wes/v1/dispatch/pending", planner.url),
        ACME,
    )
    .await;
    let feed = feed.json()["events"].as_array().unwrap().clone();
    for warehouse in ["frn:wh:0", "frn:wh:1"] {
        let order = |events: &[Value]| -> Vec<String> {
            events
                .iter()
                .filter(|event| event["warehouse_frn"] == warehouse)
                .map(|event| event["correlation_id"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(order(&received), order(&feed), "{warehouse}");
    }
    assert_eq!(planner.logged("partner.webhook_delivered").len(), 4);
}
