//! The idempotency layers' metrics (feature `metrics`), read from a recorder after a
//! first run, a replay, a conflict and a refusal: through a real axum server for HTTP,
//! and through the message layer for a consumer. The two transports share one engine,
//! so they report the same series.
#![allow(missing_docs)]

use tower_ids_test_support as support;

use axum::{routing::post, Router};
use http::StatusCode;
use std::{collections::HashMap, convert::Infallible, sync::OnceLock};

use metrics_util::{
    debugging::{DebugValue, DebuggingRecorder, Snapshotter},
    MetricKind,
};
use support::{client, send, serve};
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        extract::KeyRejection,
        message::{Handled, MessageIdempotencyLayer, MessageKey},
        metrics::{REQUESTS, REQUESTS_IN_FLIGHT, STORE_CALL_DURATION},
        IdempotencyKey, IdempotencyLayer,
    },
};

/// The recorder is global to the process, and its counters are not per layer: one
/// test at a time reads them.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn totals() -> Totals {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    let snapshotter = SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().unwrap();
        tower_ids::idempotency::metrics::describe();
        snapshotter
    });
    let mut totals = Totals {
        snapshotter: snapshotter.clone(),
        counters: HashMap::new(),
        latencies: HashMap::new(),
        in_flight: 0.0,
    };
    // What changed before this test is not its own.
    totals.update();
    totals.counters.clear();
    totals.latencies.clear();
    totals.in_flight = 0.0;
    totals
}

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
                (MetricKind::Counter, DebugValue::Counter(n)) if key.key().name() == REQUESTS => {
                    *self
                        .counters
                        .entry((key.key().name().to_owned(), label("outcome")))
                        .or_default() += n;
                }
                (MetricKind::Histogram, DebugValue::Histogram(samples))
                    if key.key().name() == STORE_CALL_DURATION =>
                {
                    self.latencies
                        .entry(label("operation"))
                        .or_default()
                        .extend(samples.iter().map(|s| s.into_inner()));
                }
                (MetricKind::Gauge, DebugValue::Gauge(value))
                    if key.key().name() == REQUESTS_IN_FLIGHT =>
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
            .get(&(REQUESTS.to_owned(), outcome.to_owned()))
            .copied()
            .unwrap_or(0)
    }
}

#[tokio::test]
async fn counters_per_outcome_and_store_latency_after_a_replay() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut totals = totals();

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

struct Command {
    key: &'static str,
    body: &'static str,
}

#[tokio::test]
async fn a_message_consumer_reports_the_same_series() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut totals = totals();

    let key = |command: &Command| -> Result<Option<MessageKey>, KeyRejection> {
        if command.key.is_empty() {
            return Ok(None);
        }
        let key = IdempotencyKey::new(command.key)?;
        Ok(Some(MessageKey::new(key).fingerprint(command.body)))
    };
    let mut consumer = ServiceBuilder::new()
        .layer(MessageIdempotencyLayer::new().key(key).require_key(true))
        .service(service_fn(|command: Command| async move {
            Ok::<_, Infallible>(format!("done {}", command.body))
        }));
    async fn deliver<S>(consumer: &mut S, key: &'static str, body: &'static str) -> S::Response
    where
        S: Service<Command, Error = Infallible>,
    {
        let command = Command { key, body };
        consumer.ready().await.unwrap().call(command).await.unwrap()
    }

    assert!(matches!(
        deliver(&mut consumer, "k-1", "a").await,
        Handled::Ran(_)
    ));
    assert_eq!(totals.outcome("executed"), 1);
    assert_eq!(totals.outcome("replayed"), 0);

    assert!(deliver(&mut consumer, "k-1", "a").await.is_replay());
    assert_eq!(totals.outcome("replayed"), 1, "goes up after a replay");
    assert_eq!(totals.outcome("executed"), 1, "the replay ran nothing");

    let Handled::Refused(conflict) = deliver(&mut consumer, "k-1", "b").await else {
        panic!("another message under the same key is refused");
    };
    assert_eq!(conflict.code().as_str(), "idempotency.fingerprint_mismatch");
    assert_eq!(totals.outcome("conflict"), 1);
    let Handled::Refused(missing) = deliver(&mut consumer, "", "a").await else {
        panic!("a message without a key is refused");
    };
    assert_eq!(missing.code().as_str(), "idempotency.key_missing");
    assert_eq!(totals.outcome("rejected"), 1);

    totals.update();
    // Three messages reached the store: three claims (`begin`), one completion.
    let begin = &totals.latencies["begin"];
    assert_eq!(begin.len(), 3, "{begin:?}");
    assert!(begin.iter().all(|s| (0.0..1.0).contains(s)));
    assert_eq!(totals.latencies["complete"].len(), 1);
    assert_eq!(totals.in_flight, 0.0, "every message done");
}

use tower_ids_test_support::postgres as database;

/// The outbox relay's series: the backlog gauges, and publications, failures and dead
/// letters by destination.
#[tokio::test]
async fn the_outbox_relay_reports_its_backlog_publications_and_failures() {
    use tower_ids::outbox::{
        metrics as names, Confirm, Message, Outbox, Outgoing, Sink, SinkError,
    };

    /// Takes every message but those for `refused`.
    struct Refusing;
    impl Sink for Refusing {
        async fn publish(&self, message: &Outgoing<'_>) -> Result<Confirm, SinkError> {
            if message.destination() == "refused" {
                return Err(SinkError::rejected("no such queue"));
            }
            Ok(Confirm::taken())
        }
    }

    let _one = ONE_AT_A_TIME.lock().await;
    let Some(db) = database::TestDatabase::create().await else {
        return;
    };
    let totals = totals();
    let pool = db.pool(4).await;
    let outbox = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    let mut connection = pool.acquire().await.unwrap();
    for n in 0..3 {
        outbox
            .enqueue(&mut connection, Message::new("orders", format!("{n}")))
            .await
            .unwrap();
    }
    outbox
        .enqueue(&mut connection, Message::new("refused", "x"))
        .await
        .unwrap();
    sqlx::query("UPDATE tower_ids_outbox SET enqueued_at = now() - interval '90 seconds'")
        .execute(&mut *connection)
        .await
        .unwrap();

    let relay = outbox
        .relay(Refusing)
        .max_attempts(2)
        .retry_backoff(std::time::Duration::ZERO, std::time::Duration::ZERO)
        .build();
    let read = |totals: &Totals| {
        let mut series = HashMap::new();
        for (key, _, _, value) in totals.snapshotter.snapshot().into_vec() {
            let labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            let name = format!("{}{{{}}}", key.key().name(), labels.join(","));
            let value = match value {
                DebugValue::Counter(n) => n as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(_) => continue,
            };
            series.insert(name, value);
        }
        series
    };
    // Before any round: the backlog as the relay measures it at start.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await;
        relay
    });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    stop.send(()).unwrap();
    let _relay = running.await.unwrap();
    let series = read(&totals);
    assert_eq!(
        series[&format!("{}{{}}", names::BACKLOG)],
        4.0,
        "{series:?}"
    );
    let age = series[&format!("{}{{}}", names::OLDEST_PENDING_AGE)];
    assert!((89.0..120.0).contains(&age), "{age}");
    assert_eq!(
        series[&format!("{}{{destination=orders}}", names::PUBLISHED)],
        3.0,
        "{series:?}"
    );
    assert_eq!(
        series[&format!("{}{{destination=refused,reason=rejected}}", names::FAILURES)],
        2.0,
        "{series:?}"
    );
    assert_eq!(
        series[&format!("{}{{destination=refused}}", names::DEAD_LETTERED)],
        1.0,
        "{series:?}"
    );
}
