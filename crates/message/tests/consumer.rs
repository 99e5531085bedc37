//! The broker drivers against real brokers and a transactional inbox on PostgreSQL (a
//! database of each test's own): `AmqpConsumer` on RabbitMQ (a vhost of each test's
//! own) and `KafkaConsumer` on a Tansu broker of the test's own. Poison messages go to
//! the dead-letter queue or topic while the messages behind them are applied; every
//! RabbitMQ connection closed mid-stream loses and doubles nothing; a stop drains what
//! is in flight. Without a server (and outside CI) the tests say SKIPPED and pass.
#![allow(missing_docs)]

use tower_ids_test_support::kafka as kafka_broker;
use tower_ids_test_support::postgres as database;
use tower_ids_test_support::rabbitmq;
// The throwaway server the full trials crash; they use part of it.
use tower_ids_test_support as support;
#[allow(dead_code)]
use tower_ids_test_support::postgres_server as server;
#[path = "consumer/trials.rs"]
mod trials;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use database::TestDatabase;
use futures_util::StreamExt as _;
use lapin::{
    options::{BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable, LongString},
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tower::{service_fn, ServiceBuilder};
use tower_ids::idempotency::{
    message::{
        amqp::AmqpConsumer, kafka::KafkaConsumer, MessageIdempotencyLayer, MessageKey, Received,
        ERROR_HEADER, SOURCE_HEADER,
    },
    store::{PostgresMode, PostgresStore, Transaction},
    IdempotencyKey,
};

/// How long the handler takes for the account `slow`.
const SLOW: Duration = Duration::from_millis(1500);

#[derive(Serialize, Deserialize, Clone, Debug)]
struct Payment {
    account: String,
    /// Negative: the handler fails.
    amount: i64,
    /// The envelope's correlation ID, where a contract puts it rather than a header.
    #[serde(
        default,
        rename = "correlationId",
        skip_serializing_if = "Option::is_none"
    )]
    correlation_id: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Receipt {
    id: i64,
}

/// Handler runs per key.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, usize>>>);

impl Runs {
    fn of(&self, key: &str) -> usize {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// Keys whose handler ran more than once.
    fn repeated(&self) -> usize {
        self.0.lock().unwrap().values().filter(|n| **n > 1).count()
    }
}

/// The inbox: a payment's row in the delivery's transaction, or a failure for a
/// negative amount (after the write, which the rollback undoes).
fn inbox(
    pool: PgPool,
    runs: Runs,
) -> impl tower::Service<
    Received<Payment>,
    Response = tower_ids::idempotency::message::Handled<Receipt>,
    Error = Box<dyn std::error::Error + Send + Sync>,
    Future = impl Send,
> + Clone
       + Send
       + 'static {
    let own = pool.clone();
    let store = PostgresStore::builder(pool)
        .mode(PostgresMode::Transactional)
        .build()
        .unwrap();
    ServiceBuilder::new()
        .layer(
            MessageIdempotencyLayer::with_store(store)
                .require_key(true)
                .key(|r: &Received<Payment>| {
                    Ok(IdempotencyKey::from_carrier(r)?.map(MessageKey::new))
                }),
        )
        .service(service_fn(move |received: Received<Payment>| {
            let runs = runs.clone();
            let own = own.clone();
            async move {
                let key = received.header("idempotency-key").unwrap_or("").to_owned();
                let run = {
                    let mut runs = runs.0.lock().unwrap();
                    let run = runs.entry(key.clone()).or_default();
                    *run += 1;
                    *run
                };
                let payment = received.into_message();
                // The database's passing faults, on the handler's first three runs: a
                // serialization failure and a deadlock on the delivery's transaction,
                // a backend terminated under a query on a pool of the handler's own.
                if run <= 3 {
                    let refused: Option<&'static str> = match payment.account.as_str() {
                        "conflicted" => Some(
                            "DO $$ BEGIN RAISE EXCEPTION 'emulated' USING ERRCODE = '40001'; END $$",
                        ),
                        "deadlocked" => Some(
                            "DO $$ BEGIN RAISE EXCEPTION 'emulated' USING ERRCODE = '40P01'; END $$",
                        ),
                        _ => None,
                    };
                    if let Some(statement) = refused {
                        let transaction =
                            Transaction::current().ok_or("no delivery transaction")?;
                        let mut connection = transaction.lock().await?;
                        sqlx::query(statement).execute(&mut *connection).await?;
                    }
                    if payment.account == "unreachable" {
                        sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
                            .execute(&own)
                            .await?;
                    }
                }
                if payment.account == "slow" {
                    tokio::time::sleep(SLOW).await;
                }
                if payment.account == "paused" {
                    // Idle in its transaction, where a flapping database terminates it.
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                if payment.account == "held" {
                    // Longer than the full trials' flap interval.
                    tokio::time::sleep(Duration::from_millis(400)).await;
                }
                if payment.account.starts_with("ordered") {
                    // Some take longer than the ones behind them.
                    let pause = payment.amount.rem_euclid(4).unsigned_abs() * 15;
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
                let transaction = Transaction::current().ok_or("no delivery transaction")?;
                let mut connection = transaction.lock().await?;
                let id: i64 = sqlx::query_scalar(
                    "INSERT INTO payments (key, account, amount) VALUES ($1, $2, $3) RETURNING id",
                )
                .bind(&key)
                .bind(&payment.account)
                .bind(payment.amount)
                .fetch_one(&mut *connection)
                .await?;
                if payment.amount < 0 {
                    return Err(NotApplied(std::io::Error::other(
                        "a negative amount cannot be applied",
                    ))
                    .into());
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Receipt { id })
            }
        }))
}

/// A handler's failure with a cause: a dead letter's reason carries the chain.
#[derive(Debug)]
struct NotApplied(std::io::Error);

impl std::fmt::Display for NotApplied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the payment was not applied")
    }
}

impl std::error::Error for NotApplied {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

struct Setup {
    _db: TestDatabase,
    pool: PgPool,
    vhost: rabbitmq::Vhost,
    _connection: Connection,
    channel: Channel,
    queue: String,
}

/// The store's table and the inbox's `payments`.
async fn tables(pool: &PgPool) {
    PostgresStore::builder(pool.clone())
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE payments (id bigserial PRIMARY KEY, key text NOT NULL, account text NOT NULL, amount bigint NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

async fn setup(name: &str) -> Option<Setup> {
    let db = TestDatabase::create().await?;
    let vhost = rabbitmq::Vhost::create(name).await?;
    let pool = db.pool(16).await;
    tables(&pool).await;
    let connection = Connection::connect(&vhost.url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let queue = "payments".to_owned();
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    Some(Setup {
        _db: db,
        pool,
        vhost,
        _connection: connection,
        channel,
        queue,
    })
}

/// Runs `consumer` over the inbox in a task, until `stop` is sent.
fn running(
    consumer: AmqpConsumer,
    pool: &PgPool,
    runs: &Runs,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<tower_ids::idempotency::Stopped>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(inbox(pool.clone(), runs.clone()), async {
        let _ = stopped.await;
    }));
    (stop, running)
}

/// Publishes `body` with `key` (if any) as its `idempotency-key` header.
async fn publish(channel: &Channel, queue: &str, key: Option<&str>, body: &[u8]) {
    publish_with(channel, queue, key, &[], body).await;
}

/// Publishes `body` with `key` (if any) and the `extra` headers.
async fn publish_with(
    channel: &Channel,
    queue: &str,
    key: Option<&str>,
    extra: &[(&str, &str)],
    body: &[u8],
) {
    let mut headers = FieldTable::default();
    if let Some(key) = key {
        headers.insert(
            "idempotency-key".into(),
            AMQPValue::LongString(LongString::from(key)),
        );
    }
    for (name, value) in extra {
        headers.insert(
            (*name).into(),
            AMQPValue::LongString(LongString::from(*value)),
        );
    }
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_headers(headers),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

fn payment(amount: i64) -> Vec<u8> {
    payment_of("acct-1", amount)
}

fn payment_of(account: &str, amount: i64) -> Vec<u8> {
    serde_json::to_vec(&Payment {
        account: account.into(),
        amount,
        correlation_id: None,
    })
    .unwrap()
}

/// Rows per key in the payments table.
async fn rows(pool: &PgPool) -> HashMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT key, count(*) FROM payments GROUP BY key")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// Waits until `done` says the table is as wanted, or fails after 30 s.
async fn until(pool: &PgPool, what: &str, done: impl Fn(&HashMap<String, i64>) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let rows = rows(pool).await;
        if done(&rows) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} within 30 s: {} keys",
            rows.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many dead letters `queue`'s dead-letter queue holds (the driver declared it).
async fn dead_letter_count(channel: &Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            format!("{queue}.dead").as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("the driver declared the dead-letter queue")
        .message_count()
}

/// The dead letters: their `idempotency-key` and reason.
async fn dead_letters(channel: &Channel, queue: &str, count: usize) -> Vec<(String, String)> {
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut letters = Vec::new();
    while letters.len() < count {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{} of {count} dead letters", letters.len()))
            .unwrap()
            .unwrap();
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let text = |name: &str| match headers.inner().get(name) {
            Some(AMQPValue::LongString(text)) => text.to_string(),
            _ => String::new(),
        };
        assert_eq!(
            text(SOURCE_HEADER),
            queue.trim_end_matches(".dead"),
            "a dead letter names the queue it came from"
        );
        letters.push((text("idempotency-key"), text(ERROR_HEADER)));
    }
    letters.sort();
    letters
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_while_the_messages_behind_them_are_applied() {
    let Some(setup) = setup("consumer-poison").await else {
        return;
    };
    let Setup {
        pool,
        vhost,
        channel,
        queue,
        ..
    } = &setup;
    // First the poison: a body that is not a payment, a payment the handler always
    // fails, one without a key; then 30 good ones.
    publish(channel, queue, Some("undecodable"), b"not json").await;
    publish(channel, queue, Some("fails"), &payment(-1)).await;
    publish(channel, queue, None, &payment(5)).await;
    for n in 0..30 {
        publish(channel, queue, Some(&format!("good-{n}")), &payment(n)).await;
    }
    let runs = Runs::default();
    let consumer = AmqpConsumer::new(&vhost.url, queue.as_str())
        .prefetch(4)
        .max_attempts(3);
    let (stop, running) = running(consumer, pool, &runs);

    until(pool, "every good payment applied", |rows| {
        (0..30).all(|n| rows.contains_key(&format!("good-{n}")))
    })
    .await;
    let letters = dead_letters(channel, &format!("{queue}.dead"), 3).await;
    stop.send(()).unwrap();
    let stopped = running.await.unwrap();

    let rows = rows(pool).await;
    eprintln!(
        "dead letters {letters:?}; handler runs of the failing one {}",
        runs.of("fails")
    );
    assert!(stopped.is_complete(), "nothing left in flight: {stopped:?}");
    assert!(
        rows.values().all(|n| *n == 1) && rows.len() == 30,
        "each good payment once, nothing of the poison: {rows:?}"
    );
    assert_eq!(
        runs.of("fails"),
        3,
        "the failing message had its three attempts"
    );
    assert_eq!(letters.len(), 3);
    assert_eq!(letters[0].0, "", "the message without a key");
    assert!(
        letters[0].1.starts_with("idempotency.key_missing"),
        "{letters:?}"
    );
    assert_eq!(letters[1].0, "fails");
    assert_eq!(
        letters[1].1,
        "handler_failed: the payment was not applied: a negative amount cannot be applied",
        "the reason, with the error's chain"
    );
    assert_eq!(letters[2].0, "undecodable");
    assert!(letters[2].1.starts_with("undecodable"), "{letters:?}");
}

/// A database that terminates every transaction idle in it, ten times a second for three
/// seconds: each handler then fails on its insert, but what failed was its transaction,
/// not the handler. Requeued uncounted, no payment reaches the dead-letter queue (with
/// two attempts, a counted failure would put one there at its second), and each is
/// applied once when the database settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_database_dead_letters_nothing_and_applies_each_message_once() {
    let Some(setup) = setup("consumer-flapping").await else {
        return;
    };
    let Setup {
        pool,
        vhost,
        channel,
        queue,
        ..
    } = &setup;
    for n in 0..12 {
        let body = serde_json::to_vec(&Payment {
            account: "paused".into(),
            amount: n,
            correlation_id: None,
        })
        .unwrap();
        publish(channel, queue, Some(&format!("flap-{n}")), &body).await;
    }
    let flapping = tokio::spawn({
        let pool = pool.clone();
        async move {
            let mut terminated = 0;
            let until = tokio::time::Instant::now() + Duration::from_secs(3);
            while tokio::time::Instant::now() < until {
                let killed: Vec<bool> = sqlx::query_scalar(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = current_database() AND state = 'idle in transaction'",
                )
                .fetch_all(&pool)
                .await
                .unwrap_or_default();
                terminated += killed.iter().filter(|k| **k).count();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            terminated
        }
    });
    let runs = Runs::default();
    let consumer = AmqpConsumer::new(&vhost.url, queue.as_str())
        .prefetch(4)
        .max_attempts(2)
        .retry_pause(Duration::from_millis(50));
    let (stop, running) = running(consumer, pool, &runs);
    let terminated = flapping.await.unwrap();
    until(
        pool,
        "every payment applied once the database settles",
        |rows| rows.len() == 12,
    )
    .await;
    stop.send(()).unwrap();
    let stopped = running.await.unwrap();

    let rows = rows(pool).await;
    let repeated = runs.repeated();
    let dead = dead_letter_count(channel, queue).await;
    eprintln!("12 payments, {terminated} transactions terminated: {repeated} handlers ran again, {dead} dead letters");
    assert!(
        terminated > 0 && repeated > 0,
        "the database's faults reached the handlers"
    );
    assert_eq!(dead, 0, "a passing fault dead-letters nothing");
    assert!(stopped.is_complete(), "{stopped:?}");
    assert!(
        rows.values().all(|n| *n == 1),
        "each payment applied once: {rows:?}"
    );
}

/// A handler that fails on the database's passing faults (not its transaction broken,
/// but its statements refused: a serialization failure, a deadlock, a backend
/// terminated on its own pool) three times, with two attempts allowed: requeued
/// uncounted each time, applied once, nothing dead-lettered.
// One thread: the log capture is the test thread's.
#[tokio::test]
async fn a_handler_failing_on_the_databases_passing_faults_is_requeued_uncounted() {
    let Some(setup) = setup("consumer-transient").await else {
        return;
    };
    let Setup {
        pool,
        vhost,
        channel,
        queue,
        ..
    } = &setup;
    let accounts = ["conflicted", "deadlocked", "unreachable"];
    for account in accounts {
        let body = serde_json::to_vec(&Payment {
            account: account.into(),
            amount: 1,
            correlation_id: None,
        })
        .unwrap();
        publish(channel, queue, Some(account), &body).await;
    }
    let runs = Runs::default();
    let consumer = AmqpConsumer::new(&vhost.url, queue.as_str())
        .max_attempts(2)
        .retry_pause(Duration::from_millis(20));
    let (logs, _capture) = support::Logs::capture();
    let (stop, running) = running(consumer, pool, &runs);
    until(pool, "every payment applied", |rows| rows.len() == 3).await;
    stop.send(()).unwrap();
    assert!(running.await.unwrap().is_complete());

    for account in accounts {
        assert_eq!(
            runs.of(account),
            4,
            "{account}: three passing faults, then applied"
        );
    }
    assert!(rows(pool).await.values().all(|n| *n == 1));
    let dead = dead_letter_count(channel, queue).await;
    assert_eq!(dead, 0, "a passing fault dead-letters nothing");
    let faults: Vec<String> = (logs.events("idempotency.transient_failure").iter())
        .map(|line| line["fields"]["error"].to_string())
        .collect();
    assert_eq!(faults.len(), 9, "one WARN per passing fault: {faults:?}");
    for fault in ["40001", "40P01", "terminating connection"] {
        assert!(
            faults.iter().any(|error| error.contains(fault)),
            "the WARN names the fault ({fault}): {faults:?}"
        );
    }
    let requeued = (logs.events("message.settled").iter())
        .filter(|line| {
            line["fields"]["outcome"] == "requeued"
                && line["fields"]["reason"] == "idempotency.handler_unavailable"
        })
        .count();
    assert_eq!(requeued, 9, "each requeue's line says why");
}

/// A consumer started before its first publisher: its queue does not exist yet, and the
/// consumer declares it (durable), so what is published later is applied at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_started_before_its_queue_exists_declares_it_and_consumes() {
    let Some(setup) = setup("consumer-declares").await else {
        return;
    };
    let Setup {
        pool,
        vhost,
        channel,
        ..
    } = &setup;
    let queue = "declared-by-the-consumer";
    let runs = Runs::default();
    let (stop, running) = running(AmqpConsumer::new(&vhost.url, queue), pool, &runs);
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = async {
        loop {
            // A passive declare of a missing queue closes its channel: one each time.
            let probe = setup._connection.create_channel().await.unwrap();
            if let Ok(found) = probe
                .queue_declare(queue.into(), passive, FieldTable::default())
                .await
            {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), declared)
        .await
        .expect("the consumer declared its queue");
    publish(channel, queue, Some("first"), &payment(1)).await;
    until(pool, "the payment applied", |rows| rows.len() == 1).await;
    stop.send(()).unwrap();
    assert!(running.await.unwrap().is_complete());
    let listed =
        rabbitmq::rabbitmqctl(&["list_queues", "-q", "-p", &vhost.name, "name", "durable"])
            .expect("rabbitmqctl list_queues");
    assert!(
        listed
            .lines()
            .any(|line| line.split_whitespace().eq([queue, "true"])),
        "declared durable: {listed}"
    );
}

/// A signal whose contract puts its correlation ID in the envelope, not in a header:
/// with `correlation_from`, every line of its delivery (the layer's and the driver's)
/// is under that ID, extended for the delivery, so the sender's ID finds its story.
/// (Current-thread: the log capture is the thread's, and the consumer runs on it.)
#[tokio::test]
async fn a_correlation_id_only_in_the_envelope_is_the_deliverys() {
    let Some(setup) = setup("consumer-envelope").await else {
        return;
    };
    let Setup {
        pool,
        vhost,
        channel,
        queue,
        ..
    } = &setup;
    let (logs, _capture) = support::Logs::capture();
    let body = serde_json::to_vec(&Payment {
        account: "acct-1".into(),
        amount: 7,
        correlation_id: Some("signal-7".into()),
    })
    .unwrap();
    publish(channel, queue, Some("enveloped"), &body).await;
    let runs = Runs::default();
    let consumer = AmqpConsumer::new(&vhost.url, queue.as_str())
        .correlation_from(|payment: &Payment| payment.correlation_id.as_deref());
    let (stop, running) = running(consumer, pool, &runs);
    until(pool, "the signal applied", |rows| rows.len() == 1).await;
    stop.send(()).unwrap();
    assert!(running.await.unwrap().is_complete());

    let settled = logs.events("message.settled");
    assert_eq!(settled.len(), 1, "{}", logs.raw());
    let id = settled[0]["fields"]["correlation_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        id.starts_with("signal-7."),
        "the envelope's ID, extended: {id}"
    );
    let stored = logs.events("idempotency.stored");
    assert_eq!(stored.len(), 1, "{}", logs.raw());
    assert!(
        stored[0].to_string().contains(&id),
        "the layer's line is under it too: {}",
        stored[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_closed_mid_stream_loses_and_doubles_nothing() {
    let Some(setup) = setup("consumer-closed").await else {
        return;
    };
    let Setup {
        pool,
        vhost,
        channel,
        queue,
        ..
    } = &setup;
    for n in 0..300 {
        publish(channel, queue, Some(&format!("p-{n}")), &payment(n)).await;
    }
    let runs = Runs::default();
    let consumer = AmqpConsumer::new(&vhost.url, queue.as_str()).prefetch(8);
    let (stop, running) = running(consumer, pool, &runs);
    until(pool, "100 applied", |rows| rows.len() >= 100).await;
    // The broker closes every connection of the vhost, the test's publisher's too.
    vhost.close_all_connections();
    until(pool, "every payment applied after the reconnect", |rows| {
        rows.len() == 300
    })
    .await;
    stop.send(()).unwrap();
    let stopped = running.await.unwrap();
    let rows = rows(pool).await;
    let ran_twice = runs.repeated();
    eprintln!("300 payments, every connection closed once: {ran_twice} handler runs repeated (rolled back or replayed)");
    assert!(stopped.is_complete(), "{stopped:?}");
    assert!(
        rows.values().all(|n| *n == 1),
        "each payment applied once: {rows:?}"
    );
}

/// At start, the Kafka driver says whether the dead-letter topic exists: a WARN when it
/// does not (and nothing is created), the topic created when asked, then found.
// One thread: the log capture is the test thread's.
#[tokio::test]
async fn the_kafka_consumer_says_at_start_whether_its_dead_letter_topic_exists() {
    use rdkafka::{
        consumer::{BaseConsumer, Consumer as _},
        ClientConfig,
    };

    let Some(broker) = kafka_broker::Broker::start() else {
        return;
    };
    let topic = broker.topic("signals", 3).await;
    let dead = format!("{topic}.dead");
    let topics = || {
        let reader: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &broker.addr)
            .create()
            .unwrap();
        let metadata = reader.fetch_metadata(None, Duration::from_secs(5)).unwrap();
        (metadata.topics().iter())
            .map(|topic| (topic.name().to_owned(), topic.partitions().len()))
            .collect::<HashMap<_, _>>()
    };
    let (logs, _capture) = support::Logs::capture();
    for create in [false, true, true] {
        let mut config = rdkafka::ClientConfig::new();
        config
            .set("bootstrap.servers", &broker.addr)
            .set("group.id", format!("g-{}", uuid::Uuid::now_v7()));
        let consumer = KafkaConsumer::new(config, [topic.clone()])
            .unwrap()
            .create_dead_letter_topics(create);
        let service = service_fn(|_: Received<Payment>| async {
            Ok::<_, std::io::Error>(tower_ids::idempotency::message::Handled::Ran(()))
        });
        // Started and stopped: the check is the start's.
        consumer
            .run(service, tokio::time::sleep(Duration::from_millis(300)))
            .await;
        if !create {
            assert!(!topics().contains_key(&dead), "nothing created unasked");
        }
    }
    let missing = logs.events("message.dead_letter_topic_missing");
    assert_eq!(missing.len(), 1, "{}", logs.raw());
    assert_eq!(missing[0]["level"], "WARN");
    assert_eq!(missing[0]["fields"]["dead_letter_topic"], dead.as_str());
    let ready: Vec<_> = (logs.events("message.dead_letter_topic").iter())
        .map(|line| {
            line["fields"]["status"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(ready, ["created", "exists"]);
    assert_eq!(
        topics().get(&dead),
        Some(&3),
        "created with the topic's partitions"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_poison_records_are_dead_lettered_while_the_records_behind_them_are_applied() {
    use rdkafka::{
        consumer::{Consumer as _, StreamConsumer},
        message::{Header, Headers as _, OwnedHeaders},
        producer::{FutureProducer, FutureRecord},
        ClientConfig, Message as _,
    };

    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let Some(broker) = kafka_broker::Broker::start() else {
        return;
    };
    let pool = db.pool(16).await;
    tables(&pool).await;
    // The dead-letter topic is the consumer's to create.
    let topic = broker.topic("payments", 2).await;
    let dead = format!("{topic}.dead");
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &broker.addr)
        .create()
        .unwrap();
    // To `partition`, else the partitioner's pick; the partition it went to.
    let send = |key: Option<String>, account: String, body: Vec<u8>, partition: Option<i32>| {
        let (producer, topic) = (producer.clone(), topic.clone());
        async move {
            let mut headers = OwnedHeaders::new();
            if let Some(key) = &key {
                headers = headers.insert(Header {
                    key: "idempotency-key",
                    value: Some(key.as_str()),
                });
            }
            let mut record = FutureRecord::to(&topic)
                .key(&account)
                .payload(&body)
                .headers(headers);
            if let Some(partition) = partition {
                record = record.partition(partition);
            }
            producer
                .send(record, Duration::from_secs(5))
                .await
                .unwrap()
                .partition
        }
    };
    send(
        Some("undecodable".into()),
        "acct-0".into(),
        b"not json".to_vec(),
        None,
    )
    .await;
    // The failing record goes to the partition librdkafka's partitioner would not pick
    // for its key (as a producer that partitions otherwise would send it): its retried
    // copies must stay there.
    let picked = send(Some("good-30".into()), "acct-1".into(), payment(30), None).await;
    let foreign = 1 - picked;
    send(
        Some("fails".into()),
        "acct-1".into(),
        payment(-1),
        Some(foreign),
    )
    .await;
    send(None, "acct-2".into(), payment(5), None).await;
    for n in 0..30 {
        send(
            Some(format!("good-{n}")),
            format!("acct-{}", n % 4),
            payment(n),
            None,
        )
        .await;
    }
    let runs = Runs::default();
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &broker.addr)
        .set("group.id", format!("g-{}", uuid::Uuid::now_v7()))
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = KafkaConsumer::new(config, [topic.clone()])
        .unwrap()
        .max_attempts(3)
        .create_dead_letter_topics(true);
    let running = tokio::spawn(consumer.run(inbox(pool.clone(), runs.clone()), async {
        let _ = stopped.await;
    }));
    until(&pool, "every good payment applied", |rows| {
        (0..31).all(|n| rows.contains_key(&format!("good-{n}")))
    })
    .await;
    let reader: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &broker.addr)
        .set("group.id", format!("g-{}", uuid::Uuid::now_v7()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000")
        .create()
        .unwrap();
    reader.subscribe(&[&dead]).unwrap();
    let mut letters = Vec::new();
    while letters.len() < 3 {
        let record = tokio::time::timeout(Duration::from_secs(30), reader.recv())
            .await
            .unwrap_or_else(|_| panic!("{} of 3 dead letters", letters.len()))
            .unwrap();
        let headers = record.headers().map(|h| h.detach()).unwrap_or_default();
        let text = |name: &str| {
            headers
                .iter()
                .find(|h| h.key == name)
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default()
        };
        letters.push((
            text("idempotency-key"),
            text(ERROR_HEADER),
            text(SOURCE_HEADER),
        ));
    }
    letters.sort();
    stop.send(()).unwrap();
    let stopped = running.await.unwrap();
    let rows = rows(&pool).await;
    eprintln!(
        "Kafka dead letters {letters:?}; handler runs of the failing one {}",
        runs.of("fails")
    );
    assert!(stopped.is_complete(), "{stopped:?}");
    assert!(
        letters[1].2.starts_with(&format!("{topic}:{foreign}:")),
        "the failing record's copies stayed on its partition {foreign}, not the partitioner's {picked}: {letters:?}"
    );
    assert!(
        rows.values().all(|n| *n == 1) && rows.len() == 31,
        "each good payment once, nothing of the poison: {rows:?}"
    );
    assert_eq!(
        runs.of("fails"),
        3,
        "the failing record had its three attempts"
    );
    assert_eq!(letters[0].0, "");
    assert!(
        letters[0].1.starts_with("idempotency.key_missing"),
        "{letters:?}"
    );
    assert_eq!(letters[1].0, "fails");
    assert_eq!(
        letters[1].1,
        "handler_failed: the payment was not applied: a negative amount cannot be applied",
        "the reason, with the error's chain"
    );
    assert_eq!(letters[2].0, "undecodable");
    assert!(letters[2].1.starts_with("undecodable"), "{letters:?}");
}

/// Messages sharing an `x-partition-key` are applied in the queue's order, while the
/// keys go on beside each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_sharing_a_partition_key_are_applied_in_the_queues_order() {
    let Some(setup) = setup("consumer-ordered").await else {
        return;
    };
    let Setup {
        pool,
        vhost,
        channel,
        queue,
        ..
    } = &setup;
    const ACCOUNTS: i64 = 3;
    const MESSAGES: i64 = 60;
    for n in 0..MESSAGES {
        let account = format!("ordered-{}", n % ACCOUNTS);
        let body = serde_json::to_vec(&Payment {
            account: account.clone(),
            amount: n,
            correlation_id: None,
        })
        .unwrap();
        let key = format!("o-{n}");
        publish_with(
            channel,
            queue,
            Some(&key),
            &[("x-partition-key", &account)],
            &body,
        )
        .await;
    }
    let runs = Runs::default();
    let consumer = AmqpConsumer::new(&vhost.url, queue.as_str())
        .prefetch(12)
        .ordered_by("x-partition-key");
    let (stop, running) = running(consumer, pool, &runs);
    until(pool, "every payment applied", |rows| {
        rows.len() == MESSAGES as usize
    })
    .await;
    stop.send(()).unwrap();
    let stopped = running.await.unwrap();
    assert!(stopped.is_complete(), "{stopped:?}");
    // Each account's payments in the order their rows were written.
    let written: Vec<(String, i64)> =
        sqlx::query_as("SELECT account, amount FROM payments ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap();
    let mut interleaved = false;
    for account in 0..ACCOUNTS {
        let amounts: Vec<i64> = written
            .iter()
            .filter(|(a, _)| *a == format!("ordered-{account}"))
            .map(|(_, amount)| *amount)
            .collect();
        let published: Vec<i64> = (0..MESSAGES).filter(|n| n % ACCOUNTS == account).collect();
        assert_eq!(amounts, published, "ordered-{account} in the queue's order");
    }
    // The accounts went on beside each other (not one message at a time).
    for pair in written.windows(2) {
        interleaved |= pair[0].1 > pair[1].1;
    }
    assert!(interleaved, "the accounts were handled side by side");
}

/// A stop finishes what is in flight within the drain timeout; past it, the consumer
/// says how many it left, they go back to the queue, and the next consumer settles
/// them: each payment once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_drains_what_is_in_flight_and_what_it_leaves_comes_back() {
    let Some(setup) = setup("consumer-drain").await else {
        return;
    };
    let Setup {
        pool,
        vhost,
        channel,
        queue,
        ..
    } = &setup;
    let slow = |n: i64| {
        serde_json::to_vec(&Payment {
            account: "slow".into(),
            amount: n,
            correlation_id: None,
        })
        .unwrap()
    };
    let runs = Runs::default();
    let started = |count: usize| {
        let runs = runs.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while runs.0.lock().unwrap().values().sum::<usize>() < count {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{count} handler runs within 30 s: {:?}",
                    runs.0.lock().unwrap()
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    // A stop returns within its drain and the broker's answers, or the test fails.
    let stopped = |running: tokio::task::JoinHandle<tower_ids::idempotency::Stopped>| async move {
        tokio::time::timeout(Duration::from_secs(30), running)
            .await
            .expect("the consumer stops within 30 s")
            .unwrap()
    };
    let run = |drain: Duration| {
        let consumer = AmqpConsumer::new(&vhost.url, queue.as_str())
            .prefetch(4)
            .drain_timeout(drain);
        let (stop, running) = running(consumer, pool, &runs);
        (stop, running)
    };

    // Drained in time: all four in flight settle before the consumer returns.
    for n in 0..4 {
        publish(channel, queue, Some(&format!("d-{n}")), &slow(n)).await;
    }
    let (stop, running) = run(Duration::from_secs(10));
    started(4).await;
    stop.send(()).unwrap();
    let left = stopped(running).await.left;
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(
        rows(pool).await.len(),
        4,
        "all four committed before the stop returned"
    );

    // Past a 100 ms drain: four left, named; they come back to the next consumer.
    for n in 4..8 {
        publish(channel, queue, Some(&format!("d-{n}")), &slow(n)).await;
    }
    let (stop, running) = run(Duration::from_millis(100));
    started(8).await;
    stop.send(()).unwrap();
    let mut left = stopped(running).await.left;
    left.sort();
    assert_eq!(
        left.len(),
        4,
        "the four in flight were left, by name: {left:?}"
    );
    assert!(
        left.iter().all(|name| name.starts_with("tag-")),
        "named by delivery tag (these have no message ID): {left:?}"
    );
    let (stop, running) = run(Duration::from_secs(10));
    until(pool, "the left ones settled by the next consumer", |rows| {
        rows.len() == 8
    })
    .await;
    stop.send(()).unwrap();
    stopped(running).await;
    let rows = rows(pool).await;
    assert!(
        rows.values().all(|n| *n == 1),
        "each payment once: {rows:?}"
    );
}
