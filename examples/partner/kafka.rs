//! The dispatch feed on Kafka (`--kafka-brokers`): the planner publishes each event of
//! the feed, keyed by `warehouse_frn` so that one warehouse's events stay on one
//! partition, in feed order (on PostgreSQL through the library's outbox and relay, in
//! memory from a channel); the executor consumes them through the library's driver,
//! `KafkaConsumer`, and a `MessageIdempotencyLayer` keyed by (`planner_id`,
//! `correlation_id`): a record's offset is committed only once it is settled. On a stop
//! it polls no more records: the ones in hand are settled (or, if still waiting on
//! another's claim, left uncommitted for the group) and the consumer returns.

use std::{sync::Arc, time::Duration};
use tower_ids::idempotency::Policy;

use rdkafka::{
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    message::OwnedHeaders,
    producer::{FutureProducer, FutureRecord},
    ClientConfig,
};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::{
    sync::mpsc::{self, UnboundedSender},
    task::JoinHandle,
};
use tower::{service_fn, Service, ServiceBuilder, ServiceExt as _};
use tower_ids::{
    correlation::{CorrelationId, MessageCorrelation},
    idempotency::{
        extract::KeyRejection,
        message::{kafka::KafkaConsumer, Handled, MessageIdempotencyLayer, MessageKey, Received},
        store::PostgresStore,
        Drain, IdempotencyKey, IdempotencyStore, MokaStore,
    },
    outbox::{kafka::KafkaSink, Outbox},
};

use crate::{
    db::{ExecutorDb, FeedRecord, KafkaOutbox},
    executor::{received, Options},
    stop_asked, Common, Stopping,
};

/// Partitions of the topic the planner creates when it is missing.
const PARTITIONS: i32 = 3;

fn config(brokers: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    config
}

/// Creates the topic if it is missing (a failure is logged: the broker may create
/// topics itself).
async fn create_topic(admin: AdminClient<DefaultClientContext>, topic: &str) {
    let new = NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1));
    if let Err(error) = admin.create_topics([&new], &AdminOptions::new()).await {
        tracing::warn!(event = "partner.topic_failed", error = %error, "could not create the topic");
    }
}

/// On PostgreSQL: creates the outbox table, then (in a task) the topic, then runs the
/// library's relay until a stop is asked for. `PlannerDb::book` enqueues each event's
/// record in the request's transaction; the relay publishes committed records, each
/// warehouse's in commit order, and marks them published. A crash before the mark
/// publishes them again, with the same `idempotency-key`: the consumer's idempotency
/// absorbs that.
pub(crate) async fn spawn_relay(
    pool: PgPool,
    brokers: &str,
    topic: &str,
    stopping: Stopping,
) -> Result<(KafkaOutbox, JoinHandle<()>), Box<dyn std::error::Error + Send + Sync>> {
    let admin = config(brokers).create()?;
    let outbox = Outbox::new(pool);
    outbox.migrate().await?;
    let relay = outbox.relay(KafkaSink::new(brokers)?).build();
    let topic: Arc<str> = topic.into();
    let task = {
        let topic = topic.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = create_topic(admin, &topic) => {}
                () = stop_asked(stopping.clone()) => return,
            }
            relay.run(stop_asked(stopping)).await;
        })
    };
    Ok((KafkaOutbox { outbox, topic }, task))
}

/// In memory: creates the topic, then produces each record `PlannerDb::book` sends,
/// in the order sent, each delivered (retried until it is) before the next. Records
/// not yet delivered when the process stops are lost, as the rest of memory mode is.
pub(crate) fn spawn_producer(
    brokers: &str,
    topic: &str,
) -> Result<UnboundedSender<FeedRecord>, Box<dyn std::error::Error + Send + Sync>> {
    let admin = config(brokers).create()?;
    let producer: FutureProducer = config(brokers)
        .set("enable.idempotence", "true")
        .set("message.timeout.ms", "10000")
        .create()?;
    let (send, mut records) = mpsc::unbounded_channel::<FeedRecord>();
    let topic = topic.to_owned();
    tokio::spawn(async move {
        create_topic(admin, &topic).await;
        while let Some(record) = records.recv().await {
            // The event's key, and this publication's own correlation ID.
            let mut headers = OwnedHeaders::new();
            record.idempotency_key.inject(&mut headers);
            MessageCorrelation::new().inject(&mut headers, &CorrelationId::new());
            loop {
                let sent = FutureRecord::to(&topic)
                    .key(&record.key)
                    .payload(&record.payload)
                    .headers(headers.clone());
                match producer.send(sent, Duration::from_secs(10)).await {
                    Ok(_) => break,
                    Err((error, _)) => {
                        tracing::warn!(event = "partner.publish_failed", error = %error, "publishing failed; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
            tracing::info!(event = "partner.published", warehouse_frn = %record.key, "published");
        }
    });
    Ok(send)
}

/// (planner, correlation ID) from the record: the key from its `idempotency-key`
/// header, scoped by the payload's `planner_id`; the payload is the fingerprint.
fn delivery_key(record: &Received<Value>) -> Result<Option<MessageKey>, KeyRejection> {
    let Some(key) = IdempotencyKey::from_carrier(record)? else {
        return Ok(None);
    };
    let payload = record.message();
    let planner = payload["planner_id"].as_str().unwrap_or_default();
    Ok(Some(
        MessageKey::new(key)
            .scope(planner)
            .fingerprint(payload.to_string()),
    ))
}

/// Starts the consumer (the library's driver); returns its task, which ends once a
/// stop is asked for and the records in hand are settled, and the [`Drain`] of its
/// idempotency layer.
pub(crate) fn spawn_consumer(
    db: ExecutorDb,
    brokers: &str,
    options: &Options,
    common: &Common,
    stopping: Stopping,
) -> Result<(JoinHandle<()>, Drain), Box<dyn std::error::Error + Send + Sync>> {
    let mut config = config(brokers);
    config
        .set("group.id", &options.kafka_group)
        .set("auto.offset.reset", "earliest")
        // A group forms in seconds, not the default 45 s session.
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000");
    let consumer = KafkaConsumer::new(config, [&options.kafka_topic])?
        .retry_pause(Duration::from_secs(1))
        .drain_timeout(common.drain.timeout());
    let retention = options.webhook_retention;
    let executor_id: Arc<str> = options.executor_id.as_str().into();
    let started = match (&db, &common.database_url) {
        (ExecutorDb::Postgres(pool), Some(_)) => {
            let store = PostgresStore::builder(pool.clone()).build()?;
            start(consumer, db, store, retention, executor_id, stopping)
        }
        _ => start(
            consumer,
            db,
            MokaStore::new(),
            retention,
            executor_id,
            stopping,
        ),
    };
    Ok(started)
}

fn start<St: IdempotencyStore>(
    consumer: KafkaConsumer,
    db: ExecutorDb,
    store: St,
    retention: Duration,
    executor_id: Arc<str>,
    stopping: Stopping,
) -> (JoinHandle<()>, Drain) {
    // A database failure is an error, not an outcome: the layer releases the key, and
    // the driver hands the record over again (its attempt counted).
    let handler = service_fn(move |record: Received<Value>| {
        let db = db.clone();
        async move {
            let stored = match received("kafka", record.message()) {
                Ok(event) => Some(
                    db.store(&[event])
                        .await
                        .map_err(|problem| format!("{problem:?}"))?
                        == 1,
                ),
                Err(_) => None,
            };
            tracing::info!(
                event = "partner.kafka_handled",
                correlation_id = CorrelationId::current().as_ref().map(CorrelationId::as_str),
                ?stored,
                "dispatch record handled"
            );
            Ok::<_, String>(json!({ "stored": stored }))
        }
    });
    // A record refused for its payload (`"stored": null`) is not stored, as the
    // webhook's `400` is not: a corrected record under the same key is handled.
    let layer = MessageIdempotencyLayer::with_store(store)
        .key(delivery_key)
        .require_key(true)
        .store_if(|outcome: &Value| !outcome["stored"].is_null())
        .policy(Policy::new().ttl(retention))
        .expect("the default lease suits every store");
    let drain = layer.drain();
    let service = ServiceBuilder::new().layer(layer).service(handler);
    let executor = service_fn(move |record: Received<Value>| {
        own_record(service.clone(), record, executor_id.clone())
    });
    let task = tokio::spawn(async move {
        let stopped = consumer.run(executor, stop_asked(stopping)).await;
        tracing::info!(
            event = "partner.kafka_stopped",
            left = ?stopped.left,
            "the consumer polls no more records"
        );
    });
    (task, drain)
}

/// The topic carries every partner's feed: this executor hands its own records to the
/// layer, and settles the others untouched. A replay gets its own line, in its
/// delivery's span, with the key.
async fn own_record<S>(
    mut service: S,
    record: Received<Value>,
    executor_id: Arc<str>,
) -> Result<Handled<Value>, S::Error>
where
    S: Service<Received<Value>, Response = Handled<Value>>,
{
    if record.message()["executor_id"].as_str() != Some(&*executor_id) {
        return Ok(Handled::Ran(json!({ "stored": null })));
    }
    // For the replay's line; the layer reads and checks the key itself.
    let key = IdempotencyKey::from_carrier(&record)
        .ok()
        .flatten()
        .map(|key| key.as_str().to_owned());
    let handled = service.ready().await?.call(record).await?;
    if let Handled::Replayed { replay, .. } = &handled {
        tracing::info!(
            event = "partner.kafka_duplicate",
            idempotency_key = key.as_deref(),
            idempotency_outcome = "replayed",
            idempotency_request_count = replay.request_count(),
            original_correlation_id = replay.original_attempt().map(|attempt| attempt.as_str()),
            "duplicate record: stored outcome replayed, not handled again"
        );
    }
    Ok(handled)
}
