//! The outbox's throughput and cost, by measurement: its `Relay` draining committed
//! messages beside a plain producer loop publishing the same messages, on RabbitMQ and
//! on Kafka, in the same run; and what `Outbox::enqueue` adds to a request's
//! transaction.
//!
//! Groups `outbox_amqp` and `outbox_kafka` (throughput in messages; `<shape>/<row>`):
//! - Shapes: `keys_100`, 5,000 messages over 100 partition keys (`key-0` ... `key-99`,
//!   round robin), and `keys_1`, 1,000 messages of one key, the relay's worst case
//!   (it publishes a key's messages one at a time, each confirmed before the next).
//!   Payloads are 200-byte JSON documents, with a `content-type` header. Each shape is
//!   enqueued once at the start through `Outbox::enqueue`, each message in a
//!   correlation scope of its own as a request would, into a template table.
//! - `relay`: before each iteration (untimed) the bench's outbox table is emptied and
//!   refilled from the template with the row's destination, all committed; the timing
//!   is `Relay::round` in a loop, as `Relay::run` does with a backlog, until every
//!   message is published and marked. Default settings (batch of 256); `KafkaSink::new`.
//! - `relay_linger_0` (Kafka): the same with `KafkaSink::from_config` and
//!   `linger.ms=0` (librdkafka's default is 5 ms, paid by every record sent alone).
//! - `plain`: the same messages, with the same headers (`content-type`,
//!   `idempotency-key`, `x-correlation-id`, and `x-partition-key` on AMQP) and keys,
//!   published as a careful user would without an outbox: every message sent, then
//!   every acknowledgement awaited. On RabbitMQ, lapin on one channel in confirm mode,
//!   persistent and `mandatory` as `AmqpSink` publishes; on Kafka, an rdkafka
//!   `FutureProducer` configured as `KafkaSink::new` configures its own
//!   (`enable.idempotence=true`, `message.timeout.ms=10000`), every record queued with
//!   `send_result`, then every delivery awaited.
//! - RabbitMQ: the default exchange and one durable queue of the bench's, purged after
//!   each iteration (untimed; the purge's count checks that every message arrived).
//!   Kafka: a Tansu broker of the bench's (`TANSU_BIN`, memory storage, a free loopback
//!   port) and one topic of 3 partitions.
//!
//! Besides the groups, a settings sweep (not criterion) drains the same backlogs
//! through `Relay::run`, one task per relay, stopped once every message is published,
//! with the sink wrapped in one that clocks every publication: the time with at least
//! one publication in flight, the rest (the rounds' SQL and the relay's own work), the
//! mean number in flight and the mean time of one publication. Each setting gets three
//! drains, each beside a plain loop (in turn first), and the ratio is the median of the
//! three pairs', so that the VM's speed moving between rows does not move it. Settings:
//! - `batch_size` 256 and 1,024; on 100 keys, 2 and 4 relays side by side, and 4 relays
//!   of 1,024; on Kafka, each with `linger.ms` 5 (librdkafka's default) and 0;
//! - broker `none`: a sink that takes every message at once, which leaves the relay's
//!   floor (its SQL, its per-message work);
//! - `UNCONFIRMED (bound)`: NOT a safe sink. It publishes as `AmqpSink` or `KafkaSink`
//!   does but returns without waiting for the acknowledgement, which the drain awaits
//!   for every message at its end (inside its time). It bounds what a relay that kept
//!   a key's messages in flight together, instead of one at a time, could reach.
//!
//! Group `outbox_enqueue`: one request's transaction on a pool connection, `BEGIN`, an
//! `INSERT` of a domain row (a UUID and the 200-byte document), then `COMMIT`:
//! - `commit_only`: nothing more;
//! - `enqueue`: `Outbox::enqueue` of a message without a partition key before the
//!   commit (one `INSERT ... RETURNING`);
//! - `enqueue_keyed`: with a partition key among 100 (a `pg_advisory_xact_lock` on the
//!   key first, then the `INSERT`).
//!
//! Then 1,000 transactions of each, in turn, for the medians and the time added.
//!
//! Criterion reports means; the bench also keeps every iteration's time and prints at
//! the end the medians, messages per second, the relay/plain ratio beside the goal
//! (at least 0.5), and the time the enqueue adds. Medians include criterion's warm-up
//! iterations.
//!
//! Servers: PostgreSQL at `TOWER_IDS_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`; a database of the bench's own, dropped
//! at the end), RabbitMQ at `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! Tansu from `TANSU_BIN`. Without PostgreSQL the bench says `SKIPPED` and measures
//! nothing; without RabbitMQ or `TANSU_BIN` it says `SKIPPED` for that broker's rows.
//! Under `CI` a missing server fails it instead.
//!
//! Run: `cargo bench --bench outbox --features outbox,amqp,kafka` (about 5 minutes)
#![allow(missing_docs)]

#[path = "../tests/postgres/database.rs"]
mod database;
#[path = "../tests/support/kafka.rs"]
mod kafka_broker;
#[path = "../tests/support/rabbitmq.rs"]
mod rabbitmq;

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

/// Many keys, the common case; one key, the relay's worst (fewer messages: on Kafka
/// with the default `linger.ms` each costs about 5 ms).
const SHAPES: [Shape; 2] = [
    Shape {
        name: "keys_100",
        messages: 5_000,
        keys: 100,
    },
    Shape {
        name: "keys_1",
        messages: 1_000,
        keys: 1,
    },
];

/// The payload's size, a small JSON document.
const PAYLOAD_BYTES: usize = 200;

/// The table the relays drain, refilled before each iteration.
const OUTBOX_TABLE: &str = "bench_outbox";

/// The table the enqueue rows write to.
const ENQUEUE_TABLE: &str = "bench_enqueue";

/// Connections: a relay's round holds one, the refill another.
const POOL_CONNECTIONS: u32 = 4;

/// The goal the issue sets: the relay at least half the plain loop's rate.
const GOAL: f64 = 0.5;

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

/// NOT a safe sink: publishes as `AmqpSink` does but returns without waiting for the
/// confirm, which [`Finish::finish`] awaits for every message at the end of the drain.
/// The relay then marks messages the broker has not confirmed. It bounds what a relay
/// that kept a key's messages in flight together (and awaited their confirms before
/// marking them) could reach.
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
    (batch, relays): Setting,
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
        let (relay, clock) = sweep_one(outbox, sink, batch, relays, messages).await;
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

/// Drains the outbox of `messages` with `relays` relays of `batch` on `sink`, each run
/// by `Relay::run` in a task of its own until every message is published (a round under
/// way finishes, so its marks are committed); clocked.
async fn sweep_one<S: Sink + Finish>(
    outbox: &Outbox,
    sink: &Arc<S>,
    batch: usize,
    relays: usize,
    messages: usize,
) -> (Duration, Clock) {
    let clock = Arc::new(Mutex::new(Clock::default()));
    let (done, _) = tokio::sync::watch::channel(false);
    let done = Arc::new(done);
    let started = Instant::now();
    let running: Vec<_> = (0..relays)
        .map(|_| {
            let relay = outbox
                .relay(Clocked {
                    inner: sink.clone(),
                    clock: clock.clone(),
                    target: messages as u64,
                    done: done.clone(),
                })
                .batch_size(batch)
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

/// One drain of the sweep: `(batch, relays)`.
type Setting = (usize, usize);

/// The settings tried on a shape: batch sizes, and for many keys several relays.
fn settings(shape: Shape) -> Vec<Setting> {
    if shape.keys > 1 {
        vec![(256, 1), (1024, 1), (256, 2), (256, 4), (1024, 4)]
    } else {
        vec![(256, 1), (1024, 1)]
    }
}

fn describe((batch, relays): Setting) -> String {
    if relays == 1 {
        format!("batch_size {batch}")
    } else {
        format!("batch_size {batch}, {relays} relays")
    }
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
        for setting in [(256, 1), (1024, 1)] {
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
    producer: FutureProducer,
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
        let producer = Self::config(&broker.addr, None)
            .set("enable.idempotence", "true")
            .create()
            .expect("a producer");
        Self {
            bootstrap: broker.addr.clone(),
            topic,
            producer,
        }
    }

    /// What `KafkaSink::new` sets, and `linger.ms` if given.
    fn config(bootstrap: &str, linger_ms: Option<u32>) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", bootstrap)
            .set("message.timeout.ms", "10000");
        if let Some(linger) = linger_ms {
            config.set("linger.ms", linger.to_string());
        }
        config
    }

    fn sink(&self, linger_ms: Option<u32>) -> KafkaSink {
        match linger_ms {
            None => KafkaSink::new(&self.bootstrap).expect("a sink"),
            Some(_) => {
                KafkaSink::from_config(Self::config(&self.bootstrap, linger_ms)).expect("a sink")
            }
        }
    }

    /// Queues every record, then awaits every delivery.
    async fn plain(&self, messages: &[Plain]) {
        let mut deliveries = Vec::with_capacity(messages.len());
        for message in messages {
            let mut headers = OwnedHeaders::new();
            for (name, value) in &message.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_str()),
                });
            }
            let record = FutureRecord::<str, [u8]>::to(&self.topic)
                .key(message.key.as_str())
                .payload(&message.payload)
                .headers(headers);
            let delivery = self
                .producer
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
    let relays = [
        ("relay", Arc::new(outbox.relay(kafka.sink(None)).build())),
        (
            "relay_linger_0",
            Arc::new(outbox.relay(kafka.sink(Some(0))).build()),
        ),
    ];
    let mut group = throughput_group(criterion, "outbox_kafka");
    for (shape, template) in templates {
        let n = shape.messages;
        group.throughput(Throughput::Elements(n as u64));
        let row = format!("{}/plain", shape.name);
        let times = kept.row("outbox_kafka", &row, n);
        group.bench_function(&row, |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let started = Instant::now();
                        kafka.plain(&template.messages).await;
                        let elapsed = started.elapsed();
                        times.push(elapsed);
                        total += elapsed;
                    }
                    total
                })
            })
        });
        for (name, relay) in &relays {
            let row = format!("{}/{name}", shape.name);
            let times = kept.row("outbox_kafka", &row, n);
            group.bench_function(&row, |b| {
                b.iter_custom(|iters| {
                    runtime.block_on(async {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            template.refill(outbox.pool(), &kafka.topic).await;
                            let (elapsed, _) = timed_drain(relay, n).await;
                            times.push(elapsed);
                            total += elapsed;
                        }
                        total
                    })
                })
            });
        }
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
    for linger in [None, Some(0)] {
        let sink = Arc::new(kafka.sink(linger));
        // Connects the producer; not kept.
        let (shape, template) = &templates[0];
        template.refill(outbox.pool(), &kafka.topic).await;
        sweep_one(outbox, &sink, 256, 1, shape.messages).await;
        for (shape, template) in templates {
            for setting in settings(*shape) {
                if linger.is_none() && shape.keys == 1 && setting.0 != 256 {
                    continue; // 6 s a drain, and the batch changes nothing there
                }
                swept.push(Swept {
                    broker: "kafka",
                    shape: *shape,
                    setting: format!(
                        "{}, linger.ms {}",
                        describe(setting),
                        linger.map_or("5".to_owned(), |l| l.to_string())
                    ),
                    trials: trials(kafka, outbox, &sink, setting, template).await,
                });
            }
        }
    }
    for linger in [None, Some(0)] {
        let unconfirmed = Arc::new(KafkaUnconfirmed {
            producer: Kafka::config(&kafka.bootstrap, linger)
                .set("enable.idempotence", "true")
                .create()
                .expect("a producer"),
            pending: Mutex::new(Vec::new()),
        });
        for (shape, template) in templates {
            for setting in [(256, 1), (1024, 1)] {
                swept.push(Swept {
                    broker: "kafka",
                    shape: *shape,
                    setting: format!(
                        "{}, linger.ms {}, UNCONFIRMED (bound)",
                        describe(setting),
                        linger.map_or("5".to_owned(), |l| l.to_string())
                    ),
                    trials: trials(kafka, outbox, &unconfirmed, setting, template).await,
                });
            }
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
}

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

    // The three in turn, one transaction each, so that the VM's speed moving during
    // the run moves all three alike.
    if kept.rows.keys().any(|(group, _)| group == "outbox_enqueue") {
        let (pool, outbox) = (pool.clone(), outbox.clone());
        kept.interleaved = runtime.block_on(async move {
            tokio::spawn(async move {
                let mut times: [Vec<Duration>; 3] = Default::default();
                for n in 0..INTERLEAVED as u64 {
                    for turn in 0..3 {
                        let which = (turn + n as usize) % 3;
                        let enqueue = [Enqueue::None, Enqueue::Unkeyed, Enqueue::Keyed][which];
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
    }
    transaction.commit().await.expect("commit");
}

// ---------------------------------------------------------------------------------
// What the run kept, and the report

/// Every iteration's time per row, and the messages an iteration publishes.
#[derive(Default)]
struct Kept {
    rows: BTreeMap<(String, String), (usize, Vec<Duration>)>,
    /// Transaction times without, with, and with a keyed enqueue, taken in turn.
    interleaved: Option<[Vec<Duration>; 3]>,
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
        "group", "shape", "relay row", "plain msg/s", "relay msg/s", "ratio", "iters"
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
        println!(
            "{group:<14} {shape:<10} {name:<16} {:>12.0} {:>12.0} {:>8.3} {:>7}  {}",
            rate(*messages, plain),
            rate(*messages, relay),
            ratio,
            times.len(),
            if ratio >= GOAL { "met" } else { "missed" }
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
            "{:<14} {:>10} {:>10} {:>10}",
            "row", "p50 µs", "added µs", "p90 µs"
        );
        for (row, times) in ["commit_only", "enqueue", "enqueue_keyed"]
            .iter()
            .zip(times)
        {
            let mut sorted = times.clone();
            sorted.sort();
            let p50 = sorted[sorted.len() / 2];
            let p90 = sorted[sorted.len() * 9 / 10];
            println!(
                "{row:<14} {:>10.1} {:>+10.1} {:>10.1}",
                p50.as_secs_f64() * 1e6,
                (p50.as_secs_f64() - base.as_secs_f64()) * 1e6,
                p90.as_secs_f64() * 1e6
            );
        }
    }
}
