//! The idempotency layer's metrics (feature `metrics`), read from a recorder after a
//! first run, a replay, a conflict and a refusal through a real axum server.
#![allow(missing_docs)]

#[path = "support/mod.rs"]
mod support;

use axum::{routing::post, Router};
use http::StatusCode;
use std::collections::HashMap;

use metrics_util::{
    debugging::{DebugValue, DebuggingRecorder, Snapshotter},
    MetricKind,
};
use support::{client, send, serve};
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        IdempotencyLayer, METRIC_REQUESTS, METRIC_REQUESTS_IN_FLIGHT, METRIC_STORE_CALL_DURATION,
    },
};

/// Totals since the recorder was installed: the debugging recorder hands out what
/// changed since its last snapshot.
struct Totals {
    snapshotter: Snapshotter,
    counters: HashMap<(String, String), u64>,
    latencies: HashMap<String, Vec<f64>>,
    in_flight: f64,
}

impl Totals {
    fn update(&mut self) -> &mut Self {
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let label = |name: &str| {
                key.key()
                    .labels()
                    .find(|l| l.key() == name)
                    .map(|l| l.value().to_owned())
                    .unwrap_or_default()
            };
            match (key.kind(), value) {
                (MetricKind::Counter, DebugValue::Counter(n))
                    if key.key().name() == METRIC_REQUESTS =>
                {
                    *self
                        .counters
                        .entry((key.key().name().to_owned(), label("outcome")))
                        .or_default() += n;
                }
                (MetricKind::Histogram, DebugValue::Histogram(samples))
                    if key.key().name() == METRIC_STORE_CALL_DURATION =>
                {
                    self.latencies
                        .entry(label("operation"))
                        .or_default()
                        .extend(samples.iter().map(|s| s.into_inner()));
                }
                (MetricKind::Gauge, DebugValue::Gauge(value))
                    if key.key().name() == METRIC_REQUESTS_IN_FLIGHT =>
                {
                    self.in_flight += value.into_inner();
                }
                _ => {}
            }
        }
        self
    }

    fn outcome(&mut self, outcome: &str) -> u64 {
        self.update();
        self.counters
            .get(&(METRIC_REQUESTS.to_owned(), outcome.to_owned()))
            .copied()
            .unwrap_or(0)
    }
}

#[tokio::test]
async fn counters_per_outcome_and_store_latency_after_a_replay() {
    let recorder = DebuggingRecorder::new();
    let mut totals = Totals {
        snapshotter: recorder.snapshotter(),
        counters: HashMap::new(),
        latencies: HashMap::new(),
        in_flight: 0.0,
    };
    recorder.install().unwrap();
    tower_ids::idempotency::describe_metrics();

    let app = Router::new()
        .route(
            "/commands",
            post(|| async { (StatusCode::CREATED, "made") }),
        )
        .layer(IdempotencyLayer::new().require_key(true))
        .layer(CorrelationLayer::new());
    let url = format!("http://{}/commands", serve(app).await);
    let client = client();
    let post = |key: &'static str, body: &'static str| {
        let client = client.clone();
        let url = url.clone();
        async move { send(&client, "POST", url, &[("idempotency-key", key)], body).await }
    };

    assert_eq!(post("k-1", "a").await.status, StatusCode::CREATED);
    assert_eq!(totals.outcome("executed"), 1);
    assert_eq!(totals.outcome("replayed"), 0);

    let replay = post("k-1", "a").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(totals.outcome("replayed"), 1, "goes up after a replay");
    assert_eq!(totals.outcome("executed"), 1, "the replay ran nothing");

    assert_eq!(
        post("k-1", "b").await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(totals.outcome("conflict"), 1);
    let missing = send(&client, "POST", url.clone(), &[], "a").await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(totals.outcome("rejected"), 1);

    totals.update();
    // Three requests reached the store: three claims (`begin`), one completion.
    let begin = &totals.latencies["begin"];
    assert_eq!(begin.len(), 3, "{begin:?}");
    assert!(begin.iter().all(|s| (0.0..1.0).contains(s)));
    assert_eq!(totals.latencies["complete"].len(), 1);
    assert_eq!(totals.in_flight, 0.0, "every request done");
}
