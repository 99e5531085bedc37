//! The outbox's throughput and cost, by measurement: its `Relay` draining committed
//! messages beside a plain producer loop publishing the same messages, on RabbitMQ and
//! on Kafka, in the same run; how soon an idle relay publishes a commit, and what it
//! asks of the database while idle; and what `Outbox::enqueue` adds to a request's
//! transaction.
//!
//! The relay keeps a partition key's messages in flight together: a round sends each
//! key's messages in order without waiting, then awaits their confirms in order, and
//! marks what the broker took (`AmqpSink` on one channel, `KafkaSink` from one
//! idempotent, gapless producer). A round still ends with its last confirm, so its SQL
//! and its confirms alternate.
//!
//! Groups `outbox_amqp` and `outbox_kafka` (throughput in messages; `<shape>/<row>`):
//! - Shapes: `keys_100`, 5,000 messages over 100 partition keys (`key-0` ... `key-99`,
//!   round robin), and `keys_1`, 5,000 messages of one key, the relay's worst case (one
//!   chain per round: a batch in flight, then a pause for the round's SQL). Payloads
//!   are 200-byte JSON documents, with a `content-type` header. Each shape is enqueued
//!   once at the start through `Outbox::enqueue`, each message in a correlation scope of
//!   its own as a request would, into a template table.
//! - `relay`: before each iteration (untimed) the bench's outbox table is emptied and
//!   refilled from the template with the row's destination, all committed; the timing
//!   is `Relay::round` in a loop, as `Relay::run` does with a backlog, until every
//!   message is published and marked. Default settings (batch of 1,024); `KafkaSink::new`
//!   (`linger.ms=0`).
//! - `plain`: the same messages, with the same headers (`content-type`,
//!   `idempotency-key`, `x-correlation-id`, and `x-partition-key` on AMQP) and keys,
//!   published as a careful user would without an outbox: every message sent, then
//!   every acknowledgement awaited. On RabbitMQ, lapin on one channel in confirm mode,
//!   persistent and `mandatory` as `AmqpSink` publishes; on Kafka, an rdkafka
//!   `FutureProducer` configured as `KafkaSink::new` configures its own
//!   (`enable.idempotence`, `enable.gapless.guarantee`, `linger.ms=0`,
//!   `message.timeout.ms=5000`), every record queued with `send_result`, then every
//!   delivery awaited. The relay/plain ratio is against this row.
//! - `plain_linger_5` (Kafka): the plain loop with librdkafka's default `linger.ms` (5),
//!   to show how much the baseline's `linger.ms` matters.
//! - RabbitMQ: the default exchange and one durable queue of the bench's, purged after
//!   each iteration (untimed; the purge's count checks that every message arrived).
//!   Kafka: a Tansu broker of the bench's (`TANSU_BIN`, memory storage, a free loopback
//!   port) and one topic of 3 partitions.
//!
//! Besides the groups, a settings sweep (not criterion) drains the same backlogs
//! through `Relay::run`, one task per relay, stopped once every message is published,
//! with the sink wrapped in one that clocks every publication (from its send to its
//! confirm): the time with at least one publication in flight, the rest (the rounds'
//! SQL and the relay's own work), the mean number in flight and the mean time of one
//! publication. Each setting gets three drains, each beside a plain loop (in turn
//! first), and the ratio is the median of the three pairs', so that the VM's speed
//! moving between rows does not move it. Settings:
//! - `batch_size` 256 and 1,024 (the default); `retention 0`, a relay that deletes what
//!   it publishes instead of marking it (batch 1,024); on 100 keys, 2 relays of 256 and 4
//!   of 1,024 side by side; on Kafka, each with `linger.ms` 0 (the sink's) and 5
//!   (librdkafka's default);
//! - broker `none`: a sink that takes every message at once, which leaves the relay's
//!   floor (its SQL, its per-message work);
//! - `UNCONFIRMED (bound)`: NOT a safe sink. It sends as `AmqpSink` or `KafkaSink` does
//!   but returns `Confirm::taken()`, so the relay awaits no acknowledgement at all and
//!   marks what the broker may not have; the drain awaits them all at its end (inside
//!   its time). An upper bound: its gap to the real sink's row is what rounds spend
//!   waiting for their last confirms.
//!
//! Then, with `Relay::run` and default settings (5 s poll interval) on an empty table,
//! the latency of a commit to an idle relay: 200 messages (keyed, `key-0` ... `key-99`),
//! each enqueued and committed in a transaction of its own once the relay has gone idle
//! again (20 to 50 ms after the previous one's confirm, at random), each timed from
//! just before `COMMIT` to the moment the relay hands it to the sink, and to its
//! confirm; on a sink that takes it at once and on `AmqpSink`, after one message not
//! kept (it opens the sink's connection). p50, p99 and max; every message must arrive
//! once, in order.
//!
//! And an idle relay's statements: `Relay::run` (default settings) on an empty table in
//! a database of its own, for 30 s. Counted on the client, as sqlx's `sqlx::query`
//! events (one per statement it runs; its transaction manager sends `BEGIN` without
//! one, so each `COMMIT` counts for two) on the thread that runs the relay;
//! cross-checked on the server as the database's
//! `pg_stat_database.xact_commit + xact_rollback` over the relay's whole life (its
//! start, its LISTEN and first round, and the closing of its connections included).
//! Midway between two polls, the pool's connections it holds (`size - num_idle`).
//!
//! Group `outbox_enqueue`: one request's transaction on a pool connection, `BEGIN`, an
//! `INSERT` of a domain row (a UUID and the 200-byte document), then `COMMIT`:
//! - `commit_only`: nothing more;
//! - `enqueue`: `Outbox::enqueue` of a message without a partition key before the
//!   commit (one `INSERT ... RETURNING` that also notifies the table's channel);
//! - `enqueue_keyed`: with a partition key among 100 (the same statement, the key's
//!   `pg_advisory_xact_lock` taken inside its `INSERT ... SELECT`).
//!
//! Then 1,000 transactions of each, in turn, for the medians and the time added, with
//! two more rows that say where an enqueue's time goes: `select_1`, one more statement
//! (`SELECT 1`, a round trip) before the commit; `notify_only`, `SELECT pg_notify(...)`
//! on the table's channel (a round trip, and a notification at commit).
//!
//! Criterion reports means; the bench also keeps every iteration's time and prints at
//! the end the medians, messages per second, the relay/plain ratio beside the goal
//! the issue sets for its row, the latency's percentiles, the idle statements, and
//! the time the enqueue adds. Medians include criterion's warm-up iterations.
//!
//! Servers: PostgreSQL at `TOWER_IDS_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`; databases of the bench's own, dropped
//! at the end), RabbitMQ at `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! Tansu from `TANSU_BIN`. Without PostgreSQL the bench says `SKIPPED` and measures
//! nothing; without RabbitMQ or `TANSU_BIN` it says `SKIPPED` for that broker's rows.
//! Under `CI` a missing server fails it instead.
//!
//! Run: `cargo bench --bench outbox --features outbox,amqp,kafka` (about 3.5 minutes)
#![allow(missing_docs)]

use tower_ids_test_support::kafka as kafka_broker;
use tower_ids_test_support::postgres as database;
use tower_ids_test_support::rabbitmq;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput};
use database::TestDatabase;
use futures_util::future::join_all;
use lapin::{
    options::{
        BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
        QueuePurgeOptions,
    },
    types::{AMQPValue, FieldTable, LongString, ShortString},
    BasicProperties, Channel, Confirmation,
};
use rdkafka::{
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    message::{Header, OwnedHeaders},
    producer::{FutureProducer, FutureRecord},
    ClientConfig,
};
use sqlx::{PgPool, Row as _};
use tower_ids::{
    correlation::CorrelationId,
    outbox::{
        amqp::AmqpSink, kafka::KafkaSink, Confirm, Message, Outbox, Outgoing, Relay, Sink,
        SinkError,
    },
};

/// A backlog the relay drains.
#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    messages: usize,
    keys: usize,
}

/// Many keys, the common case; one key, the relay's worst.
const SHAPES: [Shape; 2] = [
    Shape {
        name: "keys_100",
        messages: 5_000,
        keys: 100,
    },
    Shape {
        name: "keys_1",
        messages: 5_000,
        keys: 1,
    },
];

/// The payload's size, a small JSON document.
const PAYLOAD_BYTES: usize = 200;

/// The table the relays drain, refilled before each iteration.
const OUTBOX_TABLE: &str = "bench_outbox";

/// The table the enqueue rows write to.
const ENQUEUE_TABLE: &str = "bench_enqueue";

/// Connections: a running relay holds one for its LISTEN (sqlx's
/// `PgListener::connect_with` takes it from the pool) and one for its round; four
/// relays of the sweep, the refill and the latency's enqueues fit.
const POOL_CONNECTIONS: u32 = 12;

/// The goal the issue sets for a relay row: its share of the plain loop's rate.
fn goal(group: &str, shape: &str) -> f64 {
    match (group, shape) {
        ("outbox_amqp", "keys_100") => 0.8,
        ("outbox_amqp", _) => 0.5,
        ("outbox_kafka", "keys_100") => 0.25,
        _ => 0.2,
    }
}

/// The goal the issue sets for a request's transaction with an enqueue: at most this
/// times one without.
const ENQUEUE_GOAL: f64 = 1.15;

/// Keys of the keyed enqueue row.
const ENQUEUE_KEYS: u64 = 100;

/// Transactions of each kind in the interleaved enqueue measurement.
const INTERLEAVED: usize = 1_000;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let Some(database) = runtime.block_on(TestDatabase::create()) else {
        eprintln!("SKIPPED outbox: every row of this bench needs PostgreSQL; nothing was measured");
        return;
    };
    let pool = runtime.block_on(database.pool(POOL_CONNECTIONS));
    let outbox = Outbox::new(pool.clone())
        .table(OUTBOX_TABLE)
        .expect("a plain table name");
    let templates: Vec<(Shape, Template)> = runtime.block_on(async {
        outbox.migrate().await.expect("migrate");
        let mut templates = Vec::new();
        for shape in SHAPES {
            templates.push((shape, Template::enqueue(&pool, shape).await));
        }
        templates
    });

    let mut criterion = Criterion::default().configure_from_args();
    let mut kept = Kept::default();
    let mut sweep = runtime.block_on(floor_sweep(&outbox, &templates));

    match runtime.block_on(Amqp::start()) {
        Some(amqp) => {
            amqp_group(
                &mut criterion,
                &runtime,
                &amqp,
                &outbox,
                &templates,
                &mut kept,
            );
            sweep.extend(runtime.block_on(amqp_sweep(&amqp, &outbox, &templates)));
            kept.latencies.push(runtime.block_on(async {
                let latency = idle_latency(&pool, "AmqpSink", amqp.sink(), &amqp.queue).await;
                amqp.purge(LATENCY_MESSAGES + 1).await;
                latency
            }));
            runtime.block_on(amqp.delete());
        }
        None => eprintln!("SKIPPED outbox_amqp: no RabbitMQ; its rows were not measured"),
    }
    match kafka_broker::Broker::start() {
        Some(broker) => {
            let kafka = runtime.block_on(Kafka::start(&broker));
            kafka_group(
                &mut criterion,
                &runtime,
                &kafka,
                &outbox,
                &templates,
                &mut kept,
            );
            sweep.extend(runtime.block_on(kafka_sweep(&kafka, &outbox, &templates)));
            drop(kafka);
            drop(broker);
        }
        None => eprintln!("SKIPPED outbox_kafka: TANSU_BIN is not set; its rows were not measured"),
    }
    enqueue_group(&mut criterion, &runtime, &pool, &mut kept);
    criterion.final_summary();
    kept.latencies.insert(
        0,
        runtime.block_on(idle_latency(&pool, "none (at once)", NullSink, "-")),
    );
    kept.idle = idle_statements(&runtime, &pool);
    report(&kept, &sweep);

    drop((outbox, pool));
    drop(runtime);
    drop(database);
}

// ---------------------------------------------------------------------------------
// The messages

/// A 200-byte JSON document.
fn payload(n: usize) -> Vec<u8> {
    let head = format!(r#"{{"order":{n},"note":""#);
    let mut body = head.into_bytes();
    body.resize(PAYLOAD_BYTES - 2, b'x');
    body.extend_from_slice(br#""}"#);
    body
}

/// A shape's messages, enqueued once into a table of their own; copied into the
/// relays' table before each iteration, and read back for the plain loops.
struct Template {
    table: String,
    messages: Vec<Plain>,
}

/// A message as the plain loops publish it: the stored one, with the headers the relay
/// would add.
struct Plain {
    key: String,
    headers: Vec<(String, String)>,
    payload: Vec<u8>,
}

impl Template {
    async fn enqueue(pool: &PgPool, shape: Shape) -> Self {
        let table = format!("bench_template_{}", shape.name);
        let outbox = Outbox::new(pool.clone())
            .table(&table)
            .expect("a plain table name");
        outbox.migrate().await.expect("migrate the template");
        let mut transaction = pool.begin().await.expect("begin");
        for n in 0..shape.messages {
            let message = Message::new("-", payload(n))
                .partition_key(format!("key-{}", n % shape.keys))
                .header("content-type", "application/json");
            CorrelationId::new()
                .task_local(outbox.enqueue(&mut transaction, message))
                .await
                .expect("enqueue");
        }
        transaction.commit().await.expect("commit");
        let rows = sqlx::query(&format!(
            "SELECT partition_key, idempotency_key, correlation_id, payload FROM {table} ORDER BY id"
        ))
        .fetch_all(pool)
        .await
        .expect("read the template");
        let messages = rows
            .iter()
            .map(|row| Plain {
                key: row.get(0),
                headers: vec![
                    ("content-type".to_owned(), "application/json".to_owned()),
                    ("idempotency-key".to_owned(), row.get(1)),
                    ("x-correlation-id".to_owned(), row.get(2)),
                ],
                payload: row.get(3),
            })
            .collect();
        Self { table, messages }
    }

    /// Empties the relays' table and fills it with these messages for `destination`,
    /// committed.
    async fn refill(&self, pool: &PgPool, destination: &str) {
        sqlx::query(&format!("TRUNCATE {OUTBOX_TABLE}"))
            .execute(pool)
            .await
            .expect("truncate");
        sqlx::query(&format!(
            "INSERT INTO {OUTBOX_TABLE} (id, destination, partition_key, idempotency_key, headers, \
               payload, correlation_id, traceparent, tracestate) \
             SELECT id, $1, partition_key, idempotency_key, headers, payload, correlation_id, \
               traceparent, tracestate FROM {} ORDER BY id",
            self.table
        ))
        .bind(destination)
        .execute(pool)
        .await
        .expect("refill");
        sqlx::query(&format!("ANALYZE {OUTBOX_TABLE}"))
            .execute(pool)
            .await
            .expect("analyze");
    }
}

// ---------------------------------------------------------------------------------
// Draining with the relay

/// Rounds until `expected` messages are published; returns the rounds.
async fn drain<S: Sink>(relay: &Relay<S>, expected: usize) -> usize {
    let mut published = 0;
    let mut rounds = 0;
    while published < expected {
        let round = relay.round().await.expect("a relay round");
        assert!(
            !round.unavailable && round.rejected == 0,
            "the broker refused or was unavailable: {round:?}"
        );
        assert!(
            round.taken > 0,
            "the relay found nothing with {published} of {expected} published"
        );
        published += round.published;
        rounds += 1;
    }
    assert_eq!(published, expected, "published once each");
    rounds
}

/// A drain in a task of its own, as a relay runs, timed inside it.
async fn timed_drain<S: Sink>(relay: &Arc<Relay<S>>, expected: usize) -> (Duration, usize) {
    let relay = relay.clone();
    tokio::spawn(async move {
        let started = Instant::now();
        let rounds = drain(&relay, expected).await;
        (started.elapsed(), rounds)
    })
    .await
    .expect("the drain's task")
}

/// A sink that clocks the publications of the sink it wraps (shared, so one connection
/// serves every relay of the sweep), and says when it has published `target`.
struct Clocked<S> {
    inner: Arc<S>,
    clock: Arc<Mutex<Clock>>,
    target: u64,
    done: Arc<tokio::sync::watch::Sender<bool>>,
}

/// Publications in flight, and for how long any was.
#[derive(Default, Clone, Copy)]
struct Clock {
    in_flight: usize,
    since: Option<Instant>,
    busy: Duration,
    latency: Duration,
    publications: u64,
}

impl<S: Sink> Sink for Clocked<S> {
    async fn publish(&self, message: &Outgoing<'_>) -> Result<Confirm, SinkError> {
        let started = Instant::now();
        {
            let mut clock = self.clock.lock().unwrap();
            if clock.in_flight == 0 {
                clock.since = Some(started);
            }
            clock.in_flight += 1;
        }
        let sent = self.inner.publish(message).await;
        let (clock, done, target) = (self.clock.clone(), self.done.clone(), self.target);
        // A publication ends with its acknowledgement (or a send that failed).
        let ended = move || {
            let ended = Instant::now();
            let all = {
                let mut clock = clock.lock().unwrap();
                clock.in_flight -= 1;
                clock.latency += ended - started;
                clock.publications += 1;
                if clock.in_flight == 0 {
                    let since = clock.since.take().expect("a publication in flight");
                    clock.busy += ended - since;
                }
                clock.publications >= target
            };
            if all {
                done.send_replace(true);
            }
        };
        match sent {
            Ok(confirm) => Ok(Confirm::later(async move {
                let acknowledged = confirm.await;
                ended();
                acknowledged
            })),
            Err(error) => {
                ended();
                Err(error)
            }
        }
    }
}

/// A broker that takes everything at once: what is left is the relay's own time (its
/// SQL, its per-message work).
struct NullSink;

impl Sink for NullSink {
    async fn publish(&self, _: &Outgoing<'_>) -> Result<Confirm, SinkError> {
        Ok(Confirm::taken())
    }
}

/// What a sink of the sweep does once the relays stopped, inside the drain's time.
trait Finish {
    async fn finish(&self) {}
}

impl Finish for NullSink {}
impl Finish for AmqpSink {}
impl Finish for KafkaSink {}

/// The headers `AmqpSink` sends.
fn amqp_headers(message: &Outgoing<'_>) -> FieldTable {
    let mut headers = FieldTable::default();
    for (name, value) in message.headers() {
        headers.insert(
            ShortString::from(name),
            AMQPValue::LongString(LongString::from(value)),
        );
    }
    if let Some(key) = message.partition_key() {
        headers.insert(
            ShortString::from("x-partition-key"),
            AMQPValue::LongString(LongString::from(key)),
        );
    }
    headers
}

/// NOT a safe sink: publishes as `AmqpSink` does but returns `Confirm::taken()`, so the
/// relay awaits no confirm at all and marks messages the broker has not confirmed;
/// [`Finish::finish`] awaits them all at the end of the drain. An upper bound: a round
/// that never waits for the broker.
struct AmqpUnconfirmed {
    channel: Channel,
    pending: Mutex<Vec<lapin::PublisherConfirm>>,
}

impl Sink for AmqpUnconfirmed {
    async fn publish(&self, message: &Outgoing<'_>) -> Result<Confirm, SinkError> {
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(amqp_headers(message));
        let confirm = self
            .channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from(message.destination()),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                message.payload(),
                properties,
            )
            .await
            .map_err(SinkError::unavailable)?;
        self.pending.lock().unwrap().push(confirm);
        Ok(Confirm::taken())
    }
}

impl Finish for AmqpUnconfirmed {
    async fn finish(&self) {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap());
        for confirmation in join_all(pending).await {
            assert!(
                matches!(confirmation.expect("a confirm"), Confirmation::Ack(None)),
                "acked and routed"
            );
        }
    }
}

/// NOT a safe sink: queues the record as `KafkaSink` does and returns; [`Finish::finish`]
/// awaits every delivery at the end of the drain. The Kafka counterpart of
/// [`AmqpUnconfirmed`].
struct KafkaUnconfirmed {
    producer: FutureProducer,
    pending: Mutex<Vec<rdkafka::producer::DeliveryFuture>>,
}

impl Sink for KafkaUnconfirmed {
    async fn publish(&self, message: &Outgoing<'_>) -> Result<Confirm, SinkError> {
        let mut headers = OwnedHeaders::new();
        for (name, value) in message.headers() {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let mut record = FutureRecord::<str, [u8]>::to(message.destination())
            .payload(message.payload())
            .headers(headers);
        if let Some(key) = message.partition_key() {
            record = record.key(key);
        }
        let delivery = self
            .producer
            .send_result(record)
            .map_err(|(error, _)| SinkError::unavailable(error))?;
        self.pending.lock().unwrap().push(delivery);
        Ok(Confirm::taken())
    }
}

impl Finish for KafkaUnconfirmed {
    async fn finish(&self) {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap());
        for delivery in join_all(pending).await {
            delivery
                .expect("the producer stays")
                .map_err(|(error, _)| error)
                .expect("delivered");
        }
    }
}

/// One setting of the sweep.
struct Swept {
    broker: &'static str,
    shape: Shape,
    setting: String,
    trials: Vec<Trial>,
}

/// A drain of the sweep, and the plain loop's time beside it.
#[derive(Clone, Copy)]
struct Trial {
    relay: Duration,
    clock: Clock,
    plain: Option<Duration>,
}

/// Pairs per setting: a plain loop and a drain, in turn first, so that the VM's speed
/// moving between rows does not move a ratio.
const PAIRS: usize = 3;

/// Where the sweep publishes, and the plain loop beside the relay.
trait Target {
    fn destination(&self) -> &str;
    /// The plain loop's time, if there is one.
    async fn time_plain(&self, messages: &[Plain]) -> Option<Duration>;
    /// After a drain: checks and removes what arrived.
    async fn settle(&self, expected: usize);
}

/// No broker: the relay's floor.
struct Floor;

impl Target for Floor {
    fn destination(&self) -> &str {
        "-"
    }
    async fn time_plain(&self, _: &[Plain]) -> Option<Duration> {
        None
    }
    async fn settle(&self, _: usize) {}
}

/// `PAIRS` trials of `setting` on `sink`.
async fn trials<T: Target, S: Sink + Finish>(
    target: &T,
    outbox: &Outbox,
    sink: &Arc<S>,
    setting: Setting,
    template: &Template,
) -> Vec<Trial> {
    let messages = template.messages.len();
    let mut trials = Vec::new();
    for pair in 0..PAIRS {
        let plain_first = pair % 2 == 0;
        let mut plain = None;
        if plain_first {
            plain = target.time_plain(&template.messages).await;
        }
        template.refill(outbox.pool(), target.destination()).await;
        let (relay, clock) = sweep_one(outbox, sink, setting, messages).await;
        target.settle(messages).await;
        if !plain_first {
            plain = target.time_plain(&template.messages).await;
        }
        trials.push(Trial {
            relay,
            clock,
            plain,
        });
    }
    trials
}

/// Drains the outbox of `messages` with the setting's relays on `sink`, each run by
/// `Relay::run` in a task of its own until every message is published (a round under
/// way finishes, so its marks are committed); clocked.
async fn sweep_one<S: Sink + Finish>(
    outbox: &Outbox,
    sink: &Arc<S>,
    setting: Setting,
    messages: usize,
) -> (Duration, Clock) {
    let clock = Arc::new(Mutex::new(Clock::default()));
    let (done, _) = tokio::sync::watch::channel(false);
    let done = Arc::new(done);
    let started = Instant::now();
    let running: Vec<_> = (0..setting.relays)
        .map(|_| {
            let relay = outbox
                .relay(Clocked {
                    inner: sink.clone(),
                    clock: clock.clone(),
                    target: messages as u64,
                    done: done.clone(),
                })
                .batch_size(setting.batch);
            let relay = if setting.forget {
                relay.retention(Duration::ZERO, Duration::from_secs(60))
            } else {
                relay
            }
            .build();
            let mut stop = done.subscribe();
            tokio::spawn(async move {
                relay
                    .run(async move {
                        let _ = stop.wait_for(|done| *done).await;
                    })
                    .await;
            })
        })
        .collect();
    for relay in join_all(running).await {
        relay.expect("a relay's task");
    }
    sink.finish().await;
    let elapsed = started.elapsed();
    let pending: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {OUTBOX_TABLE} WHERE published_at IS NULL"
    ))
    .fetch_one(outbox.pool())
    .await
    .expect("count");
    assert_eq!(pending, 0, "every message marked");
    let clock = *clock.lock().unwrap();
    assert_eq!(clock.publications, messages as u64, "published once each");
    (elapsed, clock)
}

/// One drain of the sweep: relays of a batch size, marking (the default) or deleting
/// (a retention of zero) what they publish.
#[derive(Clone, Copy)]
struct Setting {
    batch: usize,
    relays: usize,
    forget: bool,
}

const fn setting(batch: usize, relays: usize, forget: bool) -> Setting {
    Setting {
        batch,
        relays,
        forget,
    }
}

/// The settings tried on a shape: batch sizes, deleting at publish, and for many keys
/// several relays.
fn settings(shape: Shape) -> Vec<Setting> {
    let mut settings = vec![
        setting(256, 1, false),
        setting(1024, 1, false),
        setting(1024, 1, true),
    ];
    if shape.keys > 1 {
        settings.extend([setting(256, 2, false), setting(1024, 4, false)]);
    }
    settings
}

fn describe(setting: Setting) -> String {
    let mut text = format!("batch_size {}", setting.batch);
    if setting.relays > 1 {
        text.push_str(&format!(", {} relays", setting.relays));
    }
    if setting.forget {
        text.push_str(", retention 0");
    }
    text
}

/// The relay's floor on a broker that answers at once.
async fn floor_sweep(outbox: &Outbox, templates: &[(Shape, Template)]) -> Vec<Swept> {
    let sink = Arc::new(NullSink);
    let mut swept = Vec::new();
    for (shape, template) in templates {
        for setting in settings(*shape) {
            swept.push(Swept {
                broker: "none",
                shape: *shape,
                setting: describe(setting),
                trials: trials(&Floor, outbox, &sink, setting, template).await,
            });
        }
    }
    swept
}

// ---------------------------------------------------------------------------------
// RabbitMQ

struct Amqp {
    connection: lapin::Connection,
    /// For the plain loop: confirm mode.
    publisher: Channel,
    /// For purges.
    admin: Channel,
    queue: String,
}

impl Amqp {
    async fn start() -> Option<Self> {
        let connection = rabbitmq::connect().await?;
        let publisher = connection.create_channel().await.expect("a channel");
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        let admin = connection.create_channel().await.expect("a channel");
        let queue = format!("tower_ids_bench_outbox_{}", uuid::Uuid::now_v7().simple());
        admin
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare the queue");
        Some(Self {
            connection,
            publisher,
            admin,
            queue,
        })
    }

    /// Empties the queue; checks that it held `expected` messages.
    async fn purge(&self, expected: usize) {
        let purged = self
            .admin
            .queue_purge(self.queue.as_str().into(), QueuePurgeOptions::default())
            .await
            .expect("purge");
        assert_eq!(purged as usize, expected, "messages in the queue");
    }

    async fn delete(self) {
        let _ = self
            .admin
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }

    fn sink(&self) -> AmqpSink {
        AmqpSink::new(rabbitmq::url(), "")
    }

    /// Publishes every message, then awaits every confirm.
    async fn plain(&self, messages: &[Plain]) {
        let mut confirms = Vec::with_capacity(messages.len());
        for message in messages {
            let mut headers = FieldTable::default();
            for (name, value) in &message.headers {
                headers.insert(
                    ShortString::from(name.as_str()),
                    AMQPValue::LongString(LongString::from(value.as_str())),
                );
            }
            headers.insert(
                ShortString::from("x-partition-key"),
                AMQPValue::LongString(LongString::from(message.key.as_str())),
            );
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_headers(headers);
            let confirm = self
                .publisher
                .basic_publish(
                    ShortString::from(""),
                    ShortString::from(self.queue.as_str()),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &message.payload,
                    properties,
                )
                .await
                .expect("publish");
            confirms.push(confirm);
        }
        for confirmation in join_all(confirms).await {
            assert!(
                matches!(confirmation.expect("a confirm"), Confirmation::Ack(None)),
                "acked and routed"
            );
        }
    }
}

fn throughput_group<'a>(criterion: &'a mut Criterion, name: &str) -> Group<'a> {
    let mut group = criterion.benchmark_group(name);
    // An iteration is a whole drain (0.05 to 6 s): one per sample, ten samples, a
    // warm-up of one or two drains (which also opens the relay's connection).
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(2));
    group
}

type Group<'a> = BenchmarkGroup<'a, criterion::measurement::WallTime>;

fn amqp_group(
    criterion: &mut Criterion,
    runtime: &tokio::runtime::Runtime,
    amqp: &Amqp,
    outbox: &Outbox,
    templates: &[(Shape, Template)],
    kept: &mut Kept,
) {
    let relay = Arc::new(outbox.relay(amqp.sink()).build());
    let mut group = throughput_group(criterion, "outbox_amqp");
    for (shape, template) in templates {
        let n = shape.messages;
        group.throughput(Throughput::Elements(n as u64));
        let row = format!("{}/plain", shape.name);
        let times = kept.row("outbox_amqp", &row, n);
        group.bench_function(&row, |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let started = Instant::now();
                        amqp.plain(&template.messages).await;
                        let elapsed = started.elapsed();
                        amqp.purge(n).await;
                        times.push(elapsed);
                        total += elapsed;
                    }
                    total
                })
            })
        });
        let row = format!("{}/relay", shape.name);
        let times = kept.row("outbox_amqp", &row, n);
        group.bench_function(&row, |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        template.refill(outbox.pool(), &amqp.queue).await;
                        let (elapsed, _) = timed_drain(&relay, n).await;
                        amqp.purge(n).await;
                        times.push(elapsed);
                        total += elapsed;
                    }
                    total
                })
            })
        });
    }
    group.finish();
}

impl Target for Amqp {
    fn destination(&self) -> &str {
        &self.queue
    }
    async fn time_plain(&self, messages: &[Plain]) -> Option<Duration> {
        let started = Instant::now();
        self.plain(messages).await;
        let elapsed = started.elapsed();
        self.purge(messages.len()).await;
        Some(elapsed)
    }
    async fn settle(&self, expected: usize) {
        self.purge(expected).await;
    }
}

async fn amqp_sweep(amqp: &Amqp, outbox: &Outbox, templates: &[(Shape, Template)]) -> Vec<Swept> {
    let sink = Arc::new(amqp.sink());
    // Opens the sink's connection; not kept.
    let (shape, template) = &templates[0];
    trials(amqp, outbox, &sink, settings(*shape)[0], template).await;
    let mut swept = Vec::new();
    for (shape, template) in templates {
        for setting in settings(*shape) {
            swept.push(Swept {
                broker: "amqp",
                shape: *shape,
                setting: describe(setting),
                trials: trials(amqp, outbox, &sink, setting, template).await,
            });
        }
    }
    let channel = amqp.connection.create_channel().await.expect("a channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    let unconfirmed = Arc::new(AmqpUnconfirmed {
        channel,
        pending: Mutex::new(Vec::new()),
    });
    for (shape, template) in templates {
        for setting in [setting(256, 1, false), setting(1024, 1, false)] {
            swept.push(Swept {
                broker: "amqp",
                shape: *shape,
                setting: format!("{}, UNCONFIRMED (bound)", describe(setting)),
                trials: trials(amqp, outbox, &unconfirmed, setting, template).await,
            });
        }
    }
    swept
}

// ---------------------------------------------------------------------------------
// Kafka

struct Kafka {
    bootstrap: String,
    topic: String,
    /// For the plain loop: configured as `KafkaSink::new` configures its own.
    producer: FutureProducer,
    /// For the plain loop with librdkafka's default `linger.ms`.
    producer_linger_5: FutureProducer,
}

impl Kafka {
    async fn start(broker: &kafka_broker::Broker) -> Self {
        let topic = format!("tower-ids-bench-outbox-{}", uuid::Uuid::now_v7().simple());
        let admin: AdminClient<_> = ClientConfig::new()
            .set("bootstrap.servers", &broker.addr)
            .create()
            .expect("an admin client");
        let created = admin
            .create_topics(
                [&NewTopic::new(&topic, 3, TopicReplication::Fixed(1))],
                &AdminOptions::new(),
            )
            .await
            .expect("create the topic");
        for result in created {
            result.expect("the topic");
        }
        let producer = |linger| {
            Self::config(&broker.addr, linger)
                .create()
                .expect("a producer")
        };
        Self {
            bootstrap: broker.addr.clone(),
            topic,
            producer: producer(None),
            producer_linger_5: producer(Some(5)),
        }
    }

    /// What `KafkaSink::new` sets (`KafkaSink::from_config` on a configuration of the
    /// brokers alone), with `linger.ms` instead of its 0 if given.
    fn config(bootstrap: &str, linger_ms: Option<u32>) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", bootstrap)
            .set("enable.idempotence", "true")
            .set("enable.gapless.guarantee", "true")
            .set("linger.ms", linger_ms.unwrap_or(0).to_string())
            .set("message.timeout.ms", "5000");
        config
    }

    /// `KafkaSink::new`, or `KafkaSink::from_config` with `linger.ms`.
    fn sink(&self, linger_ms: Option<u32>) -> KafkaSink {
        match linger_ms {
            None => KafkaSink::new(&self.bootstrap).expect("a sink"),
            Some(linger) => {
                let mut config = ClientConfig::new();
                config
                    .set("bootstrap.servers", &self.bootstrap)
                    .set("linger.ms", linger.to_string());
                KafkaSink::from_config(config).expect("a sink")
            }
        }
    }

    /// Queues every record, then awaits every delivery.
    async fn plain(&self, messages: &[Plain]) {
        Self::produce(&self.producer, &self.topic, messages).await;
    }

    /// The same on `producer`.
    async fn produce(producer: &FutureProducer, topic: &str, messages: &[Plain]) {
        let mut deliveries = Vec::with_capacity(messages.len());
        for message in messages {
            let mut headers = OwnedHeaders::new();
            for (name, value) in &message.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_str()),
                });
            }
            let record = FutureRecord::<str, [u8]>::to(topic)
                .key(message.key.as_str())
                .payload(&message.payload)
                .headers(headers);
            let delivery = producer
                .send_result(record)
                .map_err(|(error, _)| error)
                .expect("queued");
            deliveries.push(delivery);
        }
        for delivery in join_all(deliveries).await {
            delivery
                .expect("the producer stays")
                .map_err(|(error, _)| error)
                .expect("delivered");
        }
    }
}

fn kafka_group(
    criterion: &mut Criterion,
    runtime: &tokio::runtime::Runtime,
    kafka: &Kafka,
    outbox: &Outbox,
    templates: &[(Shape, Template)],
    kept: &mut Kept,
) {
    let relay = Arc::new(outbox.relay(kafka.sink(None)).build());
    let mut group = throughput_group(criterion, "outbox_kafka");
    for (shape, template) in templates {
        let n = shape.messages;
        group.throughput(Throughput::Elements(n as u64));
        for (name, producer) in [
            ("plain", &kafka.producer),
            ("plain_linger_5", &kafka.producer_linger_5),
        ] {
            let row = format!("{}/{name}", shape.name);
            let times = kept.row("outbox_kafka", &row, n);
            group.bench_function(&row, |b| {
                b.iter_custom(|iters| {
                    runtime.block_on(async {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let started = Instant::now();
                            Kafka::produce(producer, &kafka.topic, &template.messages).await;
                            let elapsed = started.elapsed();
                            times.push(elapsed);
                            total += elapsed;
                        }
                        total
                    })
                })
            });
        }
        let row = format!("{}/relay", shape.name);
        let times = kept.row("outbox_kafka", &row, n);
        group.bench_function(&row, |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        template.refill(outbox.pool(), &kafka.topic).await;
                        let (elapsed, _) = timed_drain(&relay, n).await;
                        times.push(elapsed);
                        total += elapsed;
                    }
                    total
                })
            })
        });
    }
    group.finish();
}

impl Target for Kafka {
    fn destination(&self) -> &str {
        &self.topic
    }
    async fn time_plain(&self, messages: &[Plain]) -> Option<Duration> {
        let started = Instant::now();
        self.plain(messages).await;
        Some(started.elapsed())
    }
    async fn settle(&self, _: usize) {}
}

async fn kafka_sweep(
    kafka: &Kafka,
    outbox: &Outbox,
    templates: &[(Shape, Template)],
) -> Vec<Swept> {
    let mut swept = Vec::new();
    // The sink's own `linger.ms` (0), then librdkafka's default.
    for linger in [None, Some(5)] {
        let sink = Arc::new(kafka.sink(linger));
        // Connects the producer; not kept.
        let (shape, template) = &templates[0];
        template.refill(outbox.pool(), &kafka.topic).await;
        sweep_one(outbox, &sink, setting(1024, 1, false), shape.messages).await;
        for (shape, template) in templates {
            for setting in settings(*shape) {
                swept.push(Swept {
                    broker: "kafka",
                    shape: *shape,
                    setting: format!("{}, linger.ms {}", describe(setting), linger.unwrap_or(0)),
                    trials: trials(kafka, outbox, &sink, setting, template).await,
                });
            }
        }
    }
    let unconfirmed = Arc::new(KafkaUnconfirmed {
        producer: Kafka::config(&kafka.bootstrap, None)
            .create()
            .expect("a producer"),
        pending: Mutex::new(Vec::new()),
    });
    for (shape, template) in templates {
        for setting in [setting(256, 1, false), setting(1024, 1, false)] {
            swept.push(Swept {
                broker: "kafka",
                shape: *shape,
                setting: format!("{}, linger.ms 0, UNCONFIRMED (bound)", describe(setting)),
                trials: trials(kafka, outbox, &unconfirmed, setting, template).await,
            });
        }
    }
    swept
}

// ---------------------------------------------------------------------------------
// Enqueue inside a request's transaction

#[derive(Clone, Copy)]
enum Enqueue {
    None,
    Unkeyed,
    Keyed,
    /// Not an enqueue: one more statement, `SELECT 1` (a round trip's cost).
    RoundTrip,
    /// Not an enqueue: `SELECT pg_notify(...)` on the table's channel (a round trip,
    /// and the notification's cost at commit).
    Notify,
}

/// The rows of the interleaved measurement: the criterion rows, then two that say
/// where an enqueue's time goes.
const INTERLEAVED_ROWS: [(&str, Enqueue); 5] = [
    ("commit_only", Enqueue::None),
    ("enqueue", Enqueue::Unkeyed),
    ("enqueue_keyed", Enqueue::Keyed),
    ("select_1", Enqueue::RoundTrip),
    ("notify_only", Enqueue::Notify),
];

fn enqueue_group(
    criterion: &mut Criterion,
    runtime: &tokio::runtime::Runtime,
    pool: &PgPool,
    kept: &mut Kept,
) {
    let outbox = Outbox::new(pool.clone())
        .table(ENQUEUE_TABLE)
        .expect("a plain table name");
    runtime.block_on(async {
        outbox.migrate().await.expect("migrate");
        sqlx::raw_sql("CREATE TABLE bench_orders (id text PRIMARY KEY, body bytea NOT NULL)")
            .execute(pool)
            .await
            .expect("the domain table");
    });
    let mut group = criterion.benchmark_group("outbox_enqueue");
    group
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for (row, enqueue) in [
        ("commit_only", Enqueue::None),
        ("enqueue", Enqueue::Unkeyed),
        ("enqueue_keyed", Enqueue::Keyed),
    ] {
        let times = kept.row("outbox_enqueue", row, 1);
        group.bench_function(row, |b| {
            b.iter_custom(|iters| {
                let (pool, outbox) = (pool.clone(), outbox.clone());
                let elapsed = runtime.block_on(async move {
                    tokio::spawn(async move {
                        let started = Instant::now();
                        for n in 0..iters {
                            CorrelationId::new()
                                .task_local(request(&pool, &outbox, enqueue, n))
                                .await;
                        }
                        started.elapsed()
                    })
                    .await
                    .expect("the requests' task")
                });
                times.push(elapsed / u32::try_from(iters).unwrap_or(u32::MAX));
                elapsed
            })
        });
    }
    group.finish();

    // All in turn, one transaction each, so that the VM's speed moving during the run
    // moves them alike.
    if kept.rows.keys().any(|(group, _)| group == "outbox_enqueue") {
        let (pool, outbox) = (pool.clone(), outbox.clone());
        kept.interleaved = runtime.block_on(async move {
            tokio::spawn(async move {
                let rows = INTERLEAVED_ROWS.len();
                let mut times = vec![Vec::with_capacity(INTERLEAVED); rows];
                for n in 0..INTERLEAVED as u64 {
                    for turn in 0..rows {
                        let which = (turn + n as usize) % rows;
                        let enqueue = INTERLEAVED_ROWS[which].1;
                        let started = Instant::now();
                        CorrelationId::new()
                            .task_local(request(&pool, &outbox, enqueue, n))
                            .await;
                        times[which].push(started.elapsed());
                    }
                }
                Some(times)
            })
            .await
            .expect("the requests' task")
        });
    }
}

/// One request's transaction: a domain row, the message if any, the commit.
async fn request(pool: &PgPool, outbox: &Outbox, enqueue: Enqueue, n: u64) {
    let mut transaction = pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO bench_orders (id, body) VALUES ($1, $2)")
        .bind(uuid::Uuid::now_v7().to_string())
        .bind(payload(0))
        .execute(&mut *transaction)
        .await
        .expect("the domain row");
    let message =
        Message::new("order.created", payload(0)).header("content-type", "application/json");
    match enqueue {
        Enqueue::None => {}
        Enqueue::Unkeyed => {
            outbox
                .enqueue(&mut transaction, message)
                .await
                .expect("enqueue");
        }
        Enqueue::Keyed => {
            let message = message.partition_key(format!("key-{}", n % ENQUEUE_KEYS));
            outbox
                .enqueue(&mut transaction, message)
                .await
                .expect("enqueue");
        }
        Enqueue::RoundTrip => {
            sqlx::query("SELECT 1")
                .execute(&mut *transaction)
                .await
                .expect("select 1");
        }
        Enqueue::Notify => {
            sqlx::query(&format!("SELECT pg_notify('{ENQUEUE_TABLE}', '')"))
                .execute(&mut *transaction)
                .await
                .expect("notify");
        }
    }
    transaction.commit().await.expect("commit");
}

// ---------------------------------------------------------------------------------
// An idle relay: how soon it publishes a commit, and what it asks of the database

/// Messages of the latency measurement, each committed alone to an idle relay.
const LATENCY_MESSAGES: usize = 200;

/// The pause before each commit, in milliseconds, drawn at random: time for the relay
/// to mark the previous message, end its round and wait again.
const LATENCY_PAUSE_MS: std::ops::RangeInclusive<u64> = 20..=50;

/// The goals the issue sets for a commit's publication by an idle relay.
const LATENCY_P50_GOAL: Duration = Duration::from_millis(5);
const LATENCY_P99_GOAL: Duration = Duration::from_millis(20);

/// The latency measurement's outbox table.
const LATENCY_TABLE: &str = "bench_latency";

/// The header that numbers a latency message.
const SEQUENCE_HEADER: &str = "x-bench-sequence";

/// How long the idle relay runs while its statements are counted.
const IDLE_RUN: Duration = Duration::from_secs(30);

/// A message of the latency measurement, as the sink saw it.
struct Arrival {
    sequence: usize,
    /// When the relay handed it to the sink.
    handed: Instant,
    /// When its confirm resolved.
    confirmed: Instant,
}

/// A sink that reports when each message reaches it and when its confirm resolves.
struct Stamped<S> {
    inner: S,
    arrivals: tokio::sync::mpsc::UnboundedSender<Arrival>,
}

impl<S: Sink> Sink for Stamped<S> {
    async fn publish(&self, message: &Outgoing<'_>) -> Result<Confirm, SinkError> {
        let handed = Instant::now();
        let sequence = message
            .headers()
            .find(|(name, _)| *name == SEQUENCE_HEADER)
            .and_then(|(_, value)| value.parse().ok())
            .expect("a numbered message");
        let confirm = self.inner.publish(message).await?;
        let arrivals = self.arrivals.clone();
        Ok(Confirm::later(async move {
            let acknowledged = confirm.await;
            if acknowledged.is_ok() {
                let _ = arrivals.send(Arrival {
                    sequence,
                    handed,
                    confirmed: Instant::now(),
                });
            }
            acknowledged
        }))
    }
}

/// An idle relay's latency on one sink: from just before each `COMMIT`.
struct Latency {
    sink: &'static str,
    /// Until the relay handed the message to the sink.
    handed: Vec<Duration>,
    /// Until its confirm.
    confirmed: Vec<Duration>,
}

/// `LATENCY_MESSAGES` messages to `destination`, each committed alone once the relay
/// (`Relay::run`, default settings, an empty table) is idle.
async fn idle_latency<S: Sink>(
    pool: &PgPool,
    name: &'static str,
    sink: S,
    destination: &str,
) -> Latency {
    let outbox = Outbox::new(pool.clone())
        .table(LATENCY_TABLE)
        .expect("a plain table name");
    outbox.migrate().await.expect("migrate");
    sqlx::query(&format!("TRUNCATE {LATENCY_TABLE}"))
        .execute(pool)
        .await
        .expect("truncate");
    let (arrivals, mut arrived) = tokio::sync::mpsc::unbounded_channel();
    let relay = outbox
        .relay(Stamped {
            inner: sink,
            arrivals,
        })
        .build();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = stopped.await;
            })
            .await;
    });
    // The relay listens, finds nothing, and waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut latency = Latency {
        sink: name,
        handed: Vec::with_capacity(LATENCY_MESSAGES),
        confirmed: Vec::with_capacity(LATENCY_MESSAGES),
    };
    // Message 0 is not kept: it opens the sink's connection and prepares the round's
    // statements, as a relay that has run a while has.
    for n in 0..=LATENCY_MESSAGES {
        tokio::time::sleep(Duration::from_millis(rand::random_range(LATENCY_PAUSE_MS))).await;
        let message = Message::new(destination, payload(n))
            .partition_key(format!("key-{}", n % 100))
            .header("content-type", "application/json")
            .header(SEQUENCE_HEADER, n.to_string());
        let mut transaction = pool.begin().await.expect("begin");
        CorrelationId::new()
            .task_local(outbox.enqueue(&mut transaction, message))
            .await
            .expect("enqueue");
        let committing = Instant::now();
        transaction.commit().await.expect("commit");
        // Three poll intervals: a missed notification shows as about 5 s, a relay that
        // never publishes fails the bench.
        let arrival = tokio::time::timeout(Duration::from_secs(15), arrived.recv())
            .await
            .unwrap_or_else(|_| panic!("message {n} not published within 15 s"))
            .expect("the relay's sink");
        assert_eq!(arrival.sequence, n, "published once each, in commit order");
        if n == 0 {
            continue;
        }
        latency.handed.push(arrival.handed - committing);
        latency.confirmed.push(arrival.confirmed - committing);
    }
    let _ = stop.send(());
    running.await.expect("the relay's task");
    assert!(arrived.try_recv().is_err(), "no message published twice");
    let pending: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {LATENCY_TABLE} WHERE published_at IS NULL"
    ))
    .fetch_one(pool)
    .await
    .expect("count");
    assert_eq!(pending, 0, "every message marked");
    latency
}

/// What an idle relay asked of its database.
struct Idle {
    /// Statements sqlx ran for the relay, by their first words, each with its time
    /// from the relay's start.
    statements: Vec<(Duration, String)>,
    /// The relay's whole life, from its start to its connections' close.
    life: Duration,
    /// The server's count of the database's transactions over that life.
    transactions: i64,
    /// The pool's connections it held while idle, midway between two polls.
    held: u32,
}

/// The idle relay's pool.
const IDLE_POOL: u32 = 4;

/// Counts the `sqlx::query` events (one per statement sqlx runs) of the thread it is
/// the default subscriber of.
struct StatementLog {
    started: Instant,
    log: Arc<Mutex<Vec<(Duration, String)>>>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for StatementLog {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Summary(String);
        impl tracing::field::Visit for Summary {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "summary" {
                    value.clone_into(&mut self.0);
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "summary" && self.0.is_empty() {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut summary = Summary(String::new());
        event.record(&mut summary);
        self.log
            .lock()
            .unwrap()
            .push((self.started.elapsed(), summary.0));
    }
}

/// Runs `Relay::run` (default settings) on an empty table in a database of its own for
/// `IDLE_RUN`, on a thread of its own whose statements are counted; reads the server's
/// transaction count through `pool` (another database's, so the reads count nowhere).
fn idle_statements(runtime: &tokio::runtime::Runtime, pool: &PgPool) -> Option<Idle> {
    use tracing_subscriber::{filter::Targets, layer::SubscriberExt as _, Layer as _};

    let transactions = |name: String| {
        let pool = pool.clone();
        async move {
            let count: i64 = sqlx::query_scalar(
                "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database WHERE datname = $1",
            )
            .bind(name)
            .fetch_one(&pool)
            .await
            .expect("the database's statistics");
            count
        }
    };
    let gone = |name: String| {
        let pool = pool.clone();
        async move {
            // A backend flushes its statistics as it exits.
            loop {
                let open: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = $1")
                        .bind(&name)
                        .fetch_one(&pool)
                        .await
                        .expect("the server's activity");
                if open == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };

    let (ready, ready_rx) = std::sync::mpsc::channel::<Option<String>>();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let started = Instant::now();
        let log = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(
            StatementLog {
                started,
                log: log.clone(),
            }
            .with_filter(Targets::new().with_target("sqlx::query", tracing::Level::TRACE)),
        );
        let counting = tracing::subscriber::set_default(subscriber);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let Some(database) = runtime.block_on(TestDatabase::create()) else {
            let _ = ready.send(None);
            return None;
        };
        let name = database
            .url()
            .rsplit('/')
            .next()
            .expect("a database name")
            .to_owned();
        runtime.block_on(async {
            let pool = database.pool(2).await;
            Outbox::new(pool.clone()).migrate().await.expect("migrate");
            pool.close().await;
        });
        ready.send(Some(name)).expect("the bench waits");
        go_rx.recv().expect("the bench's go");
        let relay_started = Instant::now();
        let held = runtime.block_on(async {
            let pool = database.pool(IDLE_POOL).await;
            let relay = Outbox::new(pool.clone()).relay(NullSink).build();
            // Midway between two polls: the pool's connections the idle relay holds.
            let (_, held) = tokio::join!(relay.run(tokio::time::sleep(IDLE_RUN)), async {
                tokio::time::sleep(IDLE_RUN / 2 + Duration::from_millis(2_500)).await;
                pool.size() - u32::try_from(pool.num_idle()).unwrap_or(0)
            });
            drop(relay);
            pool.close().await;
            held
        });
        let life = relay_started.elapsed();
        let start = relay_started - started;
        let statements = std::mem::take(&mut *log.lock().unwrap())
            .into_iter()
            .filter(|(at, _)| *at >= start)
            .map(|(at, summary)| (at - start, summary))
            .collect();
        drop(runtime);
        drop(counting);
        // Dropped once the server's count is read.
        Some((statements, life, held, database))
    });

    let name = ready_rx.recv().ok().flatten()?;
    runtime.block_on(gone(name.clone()));
    let before = runtime.block_on(transactions(name.clone()));
    go.send(()).expect("the idle relay's thread");
    let (statements, life, held, database) = thread.join().expect("the idle relay's thread")?;
    runtime.block_on(gone(name.clone()));
    let after = runtime.block_on(transactions(name));
    drop(database);
    Some(Idle {
        statements,
        life,
        held,
        transactions: after - before,
    })
}

// ---------------------------------------------------------------------------------
// What the run kept, and the report

/// Every iteration's time per row, and the messages an iteration publishes.
#[derive(Default)]
struct Kept {
    rows: BTreeMap<(String, String), (usize, Vec<Duration>)>,
    /// Transaction times of each of `INTERLEAVED_ROWS`, taken in turn.
    interleaved: Option<Vec<Vec<Duration>>>,
    /// A commit's publication by an idle relay, per sink.
    latencies: Vec<Latency>,
    /// An idle relay's statements.
    idle: Option<Idle>,
}

impl Kept {
    fn row(&mut self, group: &str, row: &str, messages: usize) -> &mut Vec<Duration> {
        &mut self
            .rows
            .entry((group.to_owned(), row.to_owned()))
            .or_insert((messages, Vec::new()))
            .1
    }

    fn median(&self, group: &str, row: &str) -> Option<Duration> {
        let (_, times) = self.rows.get(&(group.to_owned(), row.to_owned()))?;
        median(times)
    }
}

fn median(times: &[Duration]) -> Option<Duration> {
    let mut sorted = times.to_vec();
    sorted.sort();
    sorted.get(sorted.len() / 2).copied()
}

fn rate(messages: usize, time: Duration) -> f64 {
    messages as f64 / time.as_secs_f64()
}

fn report(kept: &Kept, sweep: &[Swept]) {
    println!("\noutbox: relay against the plain loop (medians of every iteration)");
    println!(
        "{:<14} {:<10} {:<16} {:>12} {:>12} {:>8} {:>7}  goal",
        "group", "shape", "row", "plain msg/s", "msg/s", "ratio", "iters"
    );
    for ((group, row), (messages, times)) in &kept.rows {
        let Some((shape, name)) = row.split_once('/') else {
            continue;
        };
        if name == "plain" {
            continue;
        }
        let (Some(relay), Some(plain)) =
            (median(times), kept.median(group, &format!("{shape}/plain")))
        else {
            continue;
        };
        let ratio = plain.as_secs_f64() / relay.as_secs_f64();
        let verdict = if name.starts_with("plain") {
            "(another plain loop)".to_owned()
        } else {
            let goal = goal(group, shape);
            format!(
                ">= {goal}: {}",
                if ratio >= goal { "met" } else { "MISSED" }
            )
        };
        println!(
            "{group:<14} {shape:<10} {name:<16} {:>12.0} {:>12.0} {:>8.3} {:>7}  {verdict}",
            rate(*messages, plain),
            rate(*messages, relay),
            ratio,
            times.len(),
        );
    }

    if !sweep.is_empty() {
        println!(
            "\noutbox: settings sweep ({PAIRS} drains each through Relay::run, each beside a plain loop; \
             medians; the drain's split is the median drain's)"
        );
        println!(
            "{:<6} {:<9} {:<52} {:>9} {:>9} {:>7} {:>9} {:>10} {:>9} {:>9} {:>10}",
            "broker",
            "shape",
            "setting",
            "plain/s",
            "relay/s",
            "ratio",
            "drain ms",
            "publish ms",
            "other ms",
            "in flight",
            "publish µs"
        );
        for swept in sweep {
            let n = swept.shape.messages;
            let mut by_time = swept.trials.clone();
            by_time.sort_by_key(|trial| trial.relay);
            let middle = by_time[by_time.len() / 2];
            let plain: Vec<Duration> = swept.trials.iter().filter_map(|t| t.plain).collect();
            let mut ratios: Vec<f64> = swept
                .trials
                .iter()
                .filter_map(|t| Some(t.plain?.as_secs_f64() / t.relay.as_secs_f64()))
                .collect();
            ratios.sort_by(f64::total_cmp);
            let busy = middle.clock.busy;
            println!(
                "{:<6} {:<9} {:<52} {:>9.0} {:>9.0} {:>7.3} {:>9.1} {:>10.1} {:>9.1} {:>9.1} {:>10.0}",
                swept.broker,
                swept.shape.name,
                swept.setting,
                median(&plain).map_or(f64::NAN, |plain| rate(n, plain)),
                rate(n, middle.relay),
                ratios.get(ratios.len() / 2).copied().unwrap_or(f64::NAN),
                middle.relay.as_secs_f64() * 1e3,
                busy.as_secs_f64() * 1e3,
                middle.relay.saturating_sub(busy).as_secs_f64() * 1e3,
                middle.clock.latency.as_secs_f64() / busy.as_secs_f64().max(f64::MIN_POSITIVE),
                middle.clock.latency.as_secs_f64() * 1e6 / middle.clock.publications.max(1) as f64,
            );
        }
    }

    let enqueue = |row: &str| kept.median("outbox_enqueue", row);
    if let Some(base) = enqueue("commit_only") {
        println!(
            "\noutbox: a request's transaction, criterion rows (median of the samples' means)"
        );
        println!("{:<14} {:>10} {:>10}", "row", "µs", "added µs");
        for row in ["commit_only", "enqueue", "enqueue_keyed"] {
            if let Some(time) = enqueue(row) {
                println!(
                    "{row:<14} {:>10.1} {:>+10.1}",
                    time.as_secs_f64() * 1e6,
                    (time.as_secs_f64() - base.as_secs_f64()) * 1e6
                );
            }
        }
    }
    if let Some(times) = &kept.interleaved {
        let base = median(&times[0]).unwrap_or_default();
        println!(
            "\noutbox: a request's transaction, {INTERLEAVED} of each in turn (median, p90 per transaction)"
        );
        println!(
            "{:<14} {:>10} {:>10} {:>10} {:>8}  goal",
            "row", "p50 µs", "added µs", "p90 µs", "ratio"
        );
        for ((row, _), times) in INTERLEAVED_ROWS.iter().zip(times) {
            let mut sorted = times.clone();
            sorted.sort();
            let p50 = sorted[sorted.len() / 2];
            let p90 = sorted[sorted.len() * 9 / 10];
            let ratio = p50.as_secs_f64() / base.as_secs_f64();
            println!(
                "{row:<14} {:>10.1} {:>+10.1} {:>10.1} {:>7.3}x  {}",
                p50.as_secs_f64() * 1e6,
                (p50.as_secs_f64() - base.as_secs_f64()) * 1e6,
                p90.as_secs_f64() * 1e6,
                ratio,
                if !row.starts_with("enqueue") {
                    String::new()
                } else {
                    format!(
                        "<= {ENQUEUE_GOAL}x: {}",
                        if ratio <= ENQUEUE_GOAL {
                            "met"
                        } else {
                            "MISSED"
                        }
                    )
                }
            );
        }
    }

    if !kept.latencies.is_empty() {
        println!(
            "\noutbox: a commit to an idle relay (Relay::run, default settings), {LATENCY_MESSAGES} \
             messages each committed alone, from just before COMMIT"
        );
        println!(
            "{:<16} {:<22} {:>10} {:>10} {:>10}  goal (p50 < {}, p99 < {})",
            "sink",
            "until",
            "p50",
            "p99",
            "max",
            millis(LATENCY_P50_GOAL),
            millis(LATENCY_P99_GOAL)
        );
        for latency in &kept.latencies {
            for (until, times) in [
                ("handed to the sink", &latency.handed),
                ("confirmed", &latency.confirmed),
            ] {
                let mut sorted = times.clone();
                sorted.sort();
                let (p50, p99) = (percentile(&sorted, 0.50), percentile(&sorted, 0.99));
                let over = sorted.iter().filter(|t| **t >= LATENCY_P99_GOAL).count();
                println!(
                    "{:<16} {until:<22} {:>10} {:>10} {:>10}  {} ({over} at or over {})",
                    latency.sink,
                    millis(p50),
                    millis(p99),
                    millis(sorted[sorted.len() - 1]),
                    if p50 < LATENCY_P50_GOAL && p99 < LATENCY_P99_GOAL {
                        "met"
                    } else {
                        "MISSED"
                    },
                    millis(LATENCY_P99_GOAL),
                );
            }
        }
    }

    if let Some(idle) = &kept.idle {
        println!(
            "\noutbox: an idle relay's statements (Relay::run, default settings, an empty table, \
             a database of its own; sqlx's statements, counted on the client, with a BEGIN \
             for each COMMIT, which sqlx does not log)"
        );
        // Bursts: statements less than a second apart.
        let mut bursts: Vec<Vec<&(Duration, String)>> = Vec::new();
        for statement in &idle.statements {
            match bursts.last_mut() {
                Some(burst) if statement.0 - burst[burst.len() - 1].0 < Duration::from_secs(1) => {
                    burst.push(statement);
                }
                _ => bursts.push(vec![statement]),
            }
        }
        // sqlx logs no `BEGIN`: one per `COMMIT` or `ROLLBACK`.
        let counted = |burst: &[&(Duration, String)]| {
            burst.len()
                + burst
                    .iter()
                    .filter(|(_, s)| s.starts_with("COMMIT") || s.starts_with("ROLLBACK"))
                    .count()
        };
        for (n, burst) in bursts.iter().enumerate() {
            let kinds: Vec<&str> = burst.iter().map(|(_, summary)| summary.as_str()).collect();
            println!(
                "  at {:>6.3} s: {} statements: {}",
                burst[0].0.as_secs_f64(),
                counted(burst),
                if n == 0 || n == 1 {
                    kinds.join(" | ")
                } else {
                    String::new()
                }
            );
        }
        if bursts.len() > 2 {
            let steady = &bursts[1..];
            let statements: usize = steady.iter().map(|burst| counted(burst)).sum();
            let span = steady[steady.len() - 1][0].0 - steady[0][0].0;
            let gap = span / u32::try_from(steady.len() - 1).unwrap_or(1);
            println!(
                "  after the start: {statements} statements in {} polls, one every {:.2} s: {:.1} per minute",
                steady.len(),
                gap.as_secs_f64(),
                statements as f64 / steady.len() as f64 * 60.0 / gap.as_secs_f64()
            );
        }
        let all: Vec<&(Duration, String)> = idle.statements.iter().collect();
        println!(
            "  all: {} statements in {:.1} s (start-up included); the server counted {} \
             transactions on the database over the relay's life (pg_stat_database \
             xact_commit + xact_rollback)",
            counted(&all),
            idle.life.as_secs_f64(),
            idle.transactions
        );
        println!(
            "  while idle, between polls, it held {} of its pool's connections (at most {IDLE_POOL}; \
             size - idle)",
            idle.held
        );
    }
}

/// The nearest-rank percentile of sorted, non-empty `durations`.
fn percentile(durations: &[Duration], quantile: f64) -> Duration {
    let rank = (quantile * durations.len() as f64).ceil() as usize;
    durations[rank.clamp(1, durations.len()) - 1]
}

fn millis(duration: Duration) -> String {
    format!("{:.2} ms", duration.as_secs_f64() * 1000.0)
}
