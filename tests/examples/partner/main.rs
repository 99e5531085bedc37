//! The `partner` example as a partner runs it: the planner and the executor as child
//! processes on free loopback ports, in memory or on a PostgreSQL database of their
//! own, killed and restarted; every row of the contract's table through the servers,
//! counted by what they stored.
//!
//! The Kafka path runs against a real broker (Tansu, `TANSU_BIN`) the test starts.
//!
//! The tests build the example binary first (`tests/examples/demo.rs`), so `cargo test
//! --test partner` runs alone.

use tower_ids_test_support::postgres as database;
#[path = "../demo.rs"]
mod demo;
use tower_ids_test_support as support;
use tower_ids_test_support::kafka;

mod dispatch;
mod realtime;
mod webhooks;

use std::time::Duration;

use database::TestDatabase;
use demo::Demo;
use http::StatusCode;
use serde_json::{json, Value};
use support::{client, send, try_send, HttpClient, Reply};

const ACME: &str = "Bearer acme-token";
const GLOBEX: &str = "Bearer globex-token";

/// Starts the planner (off the runtime's threads: it waits for the log line).
async fn planner(args: &[&str]) -> Demo {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Demo::example("partner", &args, &[])
    })
    .await
    .unwrap()
}

/// Starts an executor with `args` after the `executor` subcommand.
async fn executor(args: &[&str]) -> Demo {
    let mut all = vec!["executor".to_owned()];
    all.extend(args.iter().map(|a| (*a).to_owned()));
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = all.iter().map(String::as_str).collect();
        Demo::example("partner", &args, &[])
    })
    .await
    .unwrap()
}

async fn post(http: &HttpClient, url: &str, auth: &str, body: &Value) -> Reply {
    let headers = [
        ("content-type", "application/json"),
        ("authorization", auth),
    ];
    send(http, "POST", url.to_owned(), &headers, &body.to_string()).await
}

async fn get(http: &HttpClient, url: &str, auth: &str) -> Reply {
    send(http, "GET", url.to_owned(), &[("authorization", auth)], "").await
}

fn movement(partner: &str, correlation_id: &str, warehouse: &str) -> Value {
    json!({
        "partner_id": partner,
        "correlation_id": correlation_id,
        "warehouse_frn": warehouse,
        "sku": "SKU-1",
        "qty": 4,
    })
}

/// Books a realtime movement on `planner`, which must answer `201`.
async fn book(http: &HttpClient, planner: &Demo, auth: &str, call: &Value) {
    let booked = post(
        http,
        &format!("{}/wes/v1/realtime", planner.url),
        auth,
        call,
    )
    .await;
    assert_eq!(booked.status, StatusCode::CREATED, "{}", booked.text());
}

async fn counts(http: &HttpClient, planner: &Demo, auth: &str) -> Value {
    let reply = get(http, &format!("{}/wes/v1/counts", planner.url), auth).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    reply.json()
}

/// Sends `body` until the answer is not `409` (a duplicate in flight), waiting the
/// `Retry-After` it gives.
async fn until_settled(http: &HttpClient, url: &str, auth: &str, body: &Value) -> Reply {
    loop {
        let reply = post(http, url, auth, body).await;
        if reply.status != StatusCode::CONFLICT {
            return reply;
        }
        assert_eq!(reply.json()["code"], "idempotency.in_flight");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The executor's events, once it has `count` of them (waiting up to 40 s: a Kafka
/// consumer group takes seconds to form).
async fn events_once(http: &HttpClient, executor: &Demo, count: usize) -> Vec<Value> {
    for _ in 0..400 {
        let reply = get(http, &format!("{}/wes/v1/events", executor.url), "").await;
        let events = reply.json()["events"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if events.len() >= count {
            return events;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the executor did not receive {count} events");
}
