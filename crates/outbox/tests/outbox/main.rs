//! The outbox (`tower_ids::outbox`) through a real axum server, PostgreSQL, RabbitMQ and
//! a Kafka broker (Tansu): messages commit with the request's transaction or not at
//! all, relays share the work and keep each partition key's order, a refused message
//! is dead-lettered and stays readable, an outage backs off and resumes, published
//! messages are trimmed. Each test has a database and queues of its own. Without a
//! server the tests print `SKIPPED` and pass, except under CI, where they fail.
//! (`examples/outbox serve` against half-sent requests is an example trial:
//! `tests/examples/outbox_proof/serve.rs`.)

#![allow(clippy::unwrap_used)]

use tower_ids_test_support as support;
use tower_ids_test_support::kafka as kafka_broker;
use tower_ids_test_support::postgres as database;
use tower_ids_test_support::rabbitmq;

mod amqp;
mod kafka;
mod relays;

use std::{collections::HashMap, time::Duration};

use axum::{http::StatusCode, routing::post, Extension, Router};
use database::TestDatabase;
use futures_util::StreamExt as _;
use lapin::{
    options::{BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions},
    types::{AMQPValue, FieldTable},
    Channel,
};
use sqlx::PgPool;
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        store::{PostgresMode, PostgresStore, Transaction},
        IdempotencyLayer,
    },
    outbox::{Message, Outbox, Relay, Sink},
};

/// A message as a consumer received it.
#[derive(Debug, Clone)]
pub(crate) struct Received {
    pub(crate) headers: HashMap<String, String>,
    pub(crate) payload: String,
}

/// A queue of its own on the local RabbitMQ, deleted on [`Queue::delete`].
pub(crate) struct Queue {
    pub(crate) name: String,
    channel: Channel,
    _connection: lapin::Connection,
}

impl Queue {
    /// Declares one, or `None` (said loudly) without RabbitMQ outside CI.
    pub(crate) async fn declare(prefix: &str) -> Option<Self> {
        Self::declare_with(prefix, FieldTable::default()).await
    }

    /// [`declare`](Self::declare) with `arguments` (`x-max-length`, ...).
    pub(crate) async fn declare_with(prefix: &str, arguments: FieldTable) -> Option<Self> {
        let connection = rabbitmq::connect().await?;
        let channel = connection.create_channel().await.unwrap();
        let name = format!(
            "tower_ids_outbox_{prefix}_{}",
            uuid::Uuid::now_v7().simple()
        );
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::default(),
                arguments,
            )
            .await
            .unwrap();
        Some(Self {
            name,
            channel,
            _connection: connection,
        })
    }

    /// Receives `count` messages (auto-acked), or fails after `limit`.
    pub(crate) async fn receive(&self, count: usize, limit: Duration) -> Vec<Received> {
        let mut consumer = self
            .channel
            .basic_consume(
                self.name.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut received = Vec::with_capacity(count);
        let deadline = tokio::time::Instant::now() + limit;
        while received.len() < count {
            let delivery = tokio::time::timeout_at(deadline, consumer.next())
                .await
                .unwrap_or_else(|_| {
                    panic!("{} of {count} messages within {limit:?}", received.len())
                })
                .expect("the consumer stays open")
                .unwrap();
            let headers = delivery
                .properties
                .headers()
                .as_ref()
                .map(|table| {
                    table
                        .inner()
                        .iter()
                        .filter_map(|(name, value)| match value {
                            AMQPValue::LongString(text) => {
                                Some((name.to_string(), text.to_string()))
                            }
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            received.push(Received {
                headers,
                payload: String::from_utf8(delivery.data).unwrap(),
            });
        }
        self.channel
            .basic_cancel(consumer.tag(), Default::default())
            .await
            .unwrap();
        received
    }

    /// Messages waiting in the queue now.
    pub(crate) async fn waiting(&self) -> u32 {
        self.channel
            .queue_declare(
                self.name.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    }

    pub(crate) async fn delete(self) {
        let _ = self
            .channel
            .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

/// A relay running on a task of its own until [`stop`](Self::stop).
pub(crate) struct Running {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    pub(crate) fn start<S: Sink>(relay: Relay<S>) -> Self {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            relay
                .run(async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                })
                .await;
        });
        Self { stop, task }
    }

    /// Stops the relay and waits for it to finish its round.
    pub(crate) async fn stop(self) {
        self.stop.send(true).unwrap();
        self.task.await.unwrap();
    }
}

/// The outbox and the idempotency store (transactional mode) on one test database.
pub(crate) async fn outbox(db: &TestDatabase, connections: u32) -> (PgPool, Outbox, PostgresStore) {
    let pool = db.pool(connections).await;
    let store = PostgresStore::builder(pool.clone())
        .mode(PostgresMode::Transactional)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let outbox = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    sqlx::raw_sql("CREATE TABLE orders (id text PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    (pool, outbox, store)
}

/// `POST /orders/{id}`: writes the order and enqueues `order.created` to `queue`, keyed
/// by the order; `POST /failing/{id}` does the same, then answers 500.
fn app(store: PostgresStore, outbox: Outbox, queue: String) -> Router {
    async fn create(
        tx: Transaction,
        Extension(outbox): Extension<Outbox>,
        Extension(Destination(queue)): Extension<Destination>,
        axum::extract::Path(id): axum::extract::Path<String>,
    ) -> Result<(StatusCode, String), (StatusCode, String)> {
        let failed = |e: &dyn std::fmt::Display| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
        let mut connection = tx.lock().await.map_err(|e| failed(&e))?;
        sqlx::query("INSERT INTO orders (id) VALUES ($1)")
            .bind(&id)
            .execute(&mut *connection)
            .await
            .map_err(|e| failed(&e))?;
        let message = Message::new(queue, format!(r#"{{"order":"{id}"}}"#))
            .partition_key(id.clone())
            .header("content-type", "application/json");
        let enqueued = outbox
            .enqueue(&mut connection, message)
            .await
            .map_err(|e| failed(&e))?;
        Ok((
            StatusCode::CREATED,
            format!("order {id}, message {}", enqueued.0),
        ))
    }
    async fn failing(
        tx: Transaction,
        outbox: Extension<Outbox>,
        destination: Extension<Destination>,
        path: axum::extract::Path<String>,
    ) -> (StatusCode, String) {
        let _ = create(tx, outbox, destination, path).await;
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "failed after the writes".to_owned(),
        )
    }
    Router::new()
        .route("/orders/{id}", post(create))
        .route("/failing/{id}", post(failing))
        .layer(IdempotencyLayer::with_store(store))
        .layer(Extension(outbox))
        .layer(Extension(Destination(queue)))
        .layer(CorrelationLayer::new())
}

#[derive(Clone)]
struct Destination(String);

/// Rows of the outbox table: (pending, published, dead).
pub(crate) async fn rows(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL), \
                count(*) FILTER (WHERE published_at IS NOT NULL), \
                count(*) FILTER (WHERE dead_at IS NOT NULL) FROM tower_ids_outbox",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_message_commits_with_its_request_and_is_published_once_with_its_ids() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let Some(queue) = Queue::declare("commit").await else {
        return;
    };
    let (pool, outbox, store) = outbox(&db, 8).await;
    let addr = support::serve(app(store, outbox.clone(), queue.name.clone())).await;
    let client = support::client();

    let first = support::send(
        &client,
        "POST",
        format!("http://{addr}/orders/o-1"),
        &[("idempotency-key", "k-1"), ("x-correlation-id", "req-1")],
        "",
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    // The retry replays: no second order, no second message.
    let retry = support::send(
        &client,
        "POST",
        format!("http://{addr}/orders/o-1"),
        &[("idempotency-key", "k-1"), ("x-correlation-id", "req-2")],
        "",
    )
    .await;
    assert!(retry.replayed_created(), "{retry:?}");
    // A handler that fails after enqueueing: its writes and its message roll back.
    let failed = support::send(
        &client,
        "POST",
        format!("http://{addr}/failing/o-2"),
        &[("idempotency-key", "k-2")],
        "",
    )
    .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        rows(&pool).await,
        (1, 0, 0),
        "one message pending, none for the failure"
    );

    let relay = outbox
        .relay(tower_ids::outbox::amqp::AmqpSink::new(rabbitmq::url(), ""))
        .poll_interval(Duration::from_millis(20))
        .build();
    let round = relay.round().await.unwrap();
    assert_eq!((round.taken, round.published), (1, 1), "{round:?}");
    let received = queue.receive(1, Duration::from_secs(10)).await;
    let message = &received[0];
    assert_eq!(message.payload, r#"{"order":"o-1"}"#);
    assert_eq!(message.headers["content-type"], "application/json");
    assert_eq!(message.headers["x-partition-key"], "o-1");
    let key = &message.headers["idempotency-key"];
    assert!(
        uuid::Uuid::parse_str(key).is_ok(),
        "its own key, a UUID: {key}"
    );
    let correlation = &message.headers["x-correlation-id"];
    assert!(
        correlation.starts_with("req-1."),
        "the request's ID, extended for this publication: {correlation}"
    );
    assert_eq!(rows(&pool).await, (0, 1, 0));
    let again = relay.round().await.unwrap();
    assert_eq!(again.taken, 0, "published once");
    assert_eq!(queue.waiting().await, 0);
    queue.delete().await;
}

#[tokio::test]
async fn a_refused_message_is_dead_lettered_stays_readable_and_does_not_hold_its_key_back() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let Some(queue) = Queue::declare("dead").await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 4).await;
    let mut connection = pool.acquire().await.unwrap();
    // No queue is bound to this routing key: the broker returns the message.
    let nowhere = format!("{}-nowhere", queue.name);
    outbox
        .enqueue(
            &mut connection,
            Message::new(&nowhere, "lost?").partition_key("p"),
        )
        .await
        .unwrap();
    outbox
        .enqueue(
            &mut connection,
            Message::new(&queue.name, "after").partition_key("p"),
        )
        .await
        .unwrap();
    drop(connection);
    let relay = outbox
        .relay(tower_ids::outbox::amqp::AmqpSink::new(rabbitmq::url(), ""))
        .max_attempts(3)
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(50))
        .build();
    let (logs, _guard) = support::Logs::capture();
    let mut rounds = Vec::new();
    for _ in 0..40 {
        rounds.push(relay.round().await.unwrap());
        if rows(&pool).await.0 == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert_eq!(rows(&pool).await, (0, 1, 1), "{rounds:?}");
    // The later message of the key waited for the refused one to be given up.
    let received = queue.receive(1, Duration::from_secs(5)).await;
    assert_eq!(received[0].payload, "after");
    let dead = outbox.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(dead[0].payload, b"lost?");
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .unwrap_or_default()
            .contains("no queue is bound"),
        "{:?}",
        dead[0].last_error
    );
    assert_eq!(logs.events("outbox.rejected").len(), 3, "{}", logs.raw());
    let dead_line = logs.events("outbox.dead_lettered");
    assert_eq!(dead_line.len(), 1);
    assert_eq!(dead_line[0]["level"], "ERROR");
    // Requeued, it is tried again (and refused again: it is dead once more).
    assert!(outbox.requeue(dead[0].id).await.unwrap());
    assert_eq!(rows(&pool).await, (1, 1, 0));
    queue.delete().await;
}

#[tokio::test]
async fn published_messages_are_trimmed_after_the_retention_and_dead_letters_stay() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 4).await;
    let mut connection = pool.acquire().await.unwrap();
    for n in 0..3 {
        outbox
            .enqueue(&mut connection, Message::new("d", format!("{n}")))
            .await
            .unwrap();
    }
    sqlx::raw_sql(
        "UPDATE tower_ids_outbox SET published_at = now() - interval '2 hours' WHERE id = 1; \
         UPDATE tower_ids_outbox SET published_at = now() WHERE id = 2; \
         UPDATE tower_ids_outbox SET dead_at = now() - interval '2 hours' WHERE id = 3",
    )
    .execute(&mut *connection)
    .await
    .unwrap();
    let relay = outbox
        .relay(relays::Counting::default())
        .retention(Duration::from_secs(3600), Duration::from_secs(60))
        .build();
    assert_eq!(relay.trim().await.unwrap(), 1);
    assert_eq!(rows(&pool).await, (0, 1, 1));
}

#[tokio::test]
async fn a_retention_of_zero_deletes_each_message_as_it_is_published() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 4).await;
    let mut connection = pool.acquire().await.unwrap();
    for n in 0..3 {
        let message = Message::new("d", format!("{n}")).partition_key("k");
        outbox.enqueue(&mut connection, message).await.unwrap();
    }
    let sink = relays::Counting::default();
    let relay = outbox
        .relay(sink.clone())
        .retention(Duration::ZERO, Duration::from_secs(60))
        .build();
    let round = relay.round().await.unwrap();
    assert_eq!(round.published, 3);
    let published: Vec<String> = sink
        .published
        .lock()
        .unwrap()
        .iter()
        .map(|(_, payload)| payload.clone())
        .collect();
    assert_eq!(published, ["0", "1", "2"], "published once each, in order");
    assert_eq!(rows(&pool).await, (0, 0, 0), "no row left behind");
    assert_eq!(relay.trim().await.unwrap(), 0);
}
