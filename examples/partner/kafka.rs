//! The dispatch feed on Kafka (`--kafka-brokers`): the planner publishes each event of
//! the feed, keyed by `warehouse_frn` so that one warehouse's events stay on one
//! partition, in feed order (on PostgreSQL through the library's outbox and relay, in
//! memory from a channel); the executor consumes them through a
//! `MessageIdempotencyLayer` keyed by (`planner_id`, `correlation_id`), and commits a
//! record's offset only once it stored the event. On a stop it polls no more records:
//! the one in hand is handled (or, if it is still waiting on another's claim, left
//! uncommitted for the group) and the consumer returns.

use std::{sync::Arc, time::Duration};
use tower_ids::idempotency::Policy;

use rdkafka::{
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    consumer::{CommitMode, Consumer, StreamConsumer},
    message::OwnedHeaders,
    producer::{FutureProducer, FutureRecord},
    ClientConfig, Message,
};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::{
    sync::mpsc::{self, UnboundedSender},
    task::JoinHandle,
};
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
use tower_ids::{
    correlation::{CorrelationId, MessageCorrelation},
    idempotency::{
        extract::KeyRejection,
        message::{Handled, MessageIdempotencyLayer, MessageKey},
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

/// One record as the layer sees it: its headers and its JSON payload.
struct Delivery {
    headers: OwnedHeaders,
    payload: Value,
}

/// (planner, correlation ID) from the record: the key from its `idempotency-key`
/// header, scoped by the payload's `planner_id`; the payload is the fingerprint.
fn delivery_key(delivery: &Delivery) -> Result<Option<MessageKey>, KeyRejection> {
    let Some(key) = IdempotencyKey::from_carrier(&delivery.headers)? else {
        return Ok(None);
    };
    let planner = delivery.payload["planner_id"].as_str().unwrap_or_default();
    Ok(Some(
        MessageKey::new(key)
            .scope(planner)
            .fingerprint(delivery.payload.to_string()),
    ))
}

/// Starts the consumer; returns its task, which ends once a stop is asked for, and the
/// [`Drain`] of its idempotency layer.
pub(crate) fn spawn_consumer(
    db: ExecutorDb,
    brokers: &str,
    options: &Options,
    common: &Common,
    stopping: Stopping,
) -> Result<(JoinHandle<()>, Drain), Box<dyn std::error::Error + Send + Sync>> {
    let consumer: StreamConsumer = config(brokers)
        .set("group.id", &options.kafka_group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        // A group forms in seconds, not the default 45 s session.
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000")
        .create()?;
    consumer.subscribe(&[&options.kafka_topic])?;
    let retention = options.webhook_retention;
    let executor_id = options.executor_id.clone();
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
    consumer: StreamConsumer,
    db: ExecutorDb,
    store: St,
    retention: Duration,
    executor_id: String,
    stopping: Stopping,
) -> (JoinHandle<()>, Drain) {
    // A database failure is an error, not an outcome: the layer releases the key and the
    // record is handled again, never committed unstored.
    let handler = service_fn(move |delivery: Delivery| {
        let db = db.clone();
        async move {
            let stored = match received("kafka", &delivery.payload) {
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
        .policy(Policy::new().ttl(retention));
    let drain = layer.drain();
    let service = ServiceBuilder::new().layer(layer).service(handler);
    let consumer = tokio::spawn(consume(consumer, service, executor_id, stopping));
    (consumer, drain)
}

async fn consume<S>(
    consumer: StreamConsumer,
    mut service: S,
    executor_id: String,
    mut stopping: Stopping,
) where
    S: Service<Delivery, Response = Handled<Value>>,
    S::Error: std::fmt::Display,
{
    let correlation = MessageCorrelation::new();
    loop {
        let received = tokio::select! {
            received = consumer.recv() => received,
            _ = stopping.wait_for(|stop| *stop) => break,
        };
        let message = match received {
            Ok(message) => message,
            Err(error) => {
                tracing::warn!(event = "partner.consume_failed", error = %error, "consume failed");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let headers = message
            .headers()
            .map(|headers| headers.detach())
            .unwrap_or_default();
        let payload = message
            .payload()
            .and_then(|bytes| serde_json::from_slice(bytes).ok())
            .unwrap_or(Value::Null);
        // The topic carries every partner's feed: this executor handles its own.
        if payload["executor_id"].as_str() != Some(executor_id.as_str()) {
            commit(&consumer, &message);
            continue;
        }
        let id = correlation.for_delivery(&headers);
        // For the replay's line; the layer reads and checks the key itself.
        let key = IdempotencyKey::from_carrier(&headers)
            .ok()
            .flatten()
            .map(|key| key.as_str().to_owned());
        // A record is committed once it is handled or can never be: a claim held
        // elsewhere, or a store that cannot answer, is waited out here, as Kafka
        // redelivers nothing that was read.
        let commit = loop {
            // Stopping (the record not started, or waiting on another's claim or on
            // the store): left uncommitted, for the group to deliver again.
            if *stopping.borrow() {
                break false;
            }
            let delivery = Delivery {
                headers: headers.clone(),
                payload: payload.clone(),
            };
            let handled = correlation
                .scope(id.clone(), &headers, async {
                    let handled = service.ready().await?.call(delivery).await;
                    // A first handling has its line from the handler, in the record's
                    // spans; a replay has this one, in its delivery's span, with the key.
                    if let Ok(Handled::Replayed { replay, .. }) = &handled {
                        tracing::info!(
                            event = "partner.kafka_duplicate",
                            idempotency_key = key.as_deref(),
                            idempotency_outcome = "replayed",
                            idempotency_request_count = replay.request_count(),
                            original_correlation_id =
                                replay.original_attempt().map(|attempt| attempt.as_str()),
                            "duplicate record: stored outcome replayed, not handled again"
                        );
                    }
                    handled
                })
                .await;
            match handled {
                Ok(Handled::Ran(_) | Handled::Replayed { .. }) => break true,
                Ok(Handled::InFlight { retry_after }) => tokio::time::sleep(retry_after).await,
                Ok(Handled::Refused(refusal)) if refusal.retryable() => {
                    tracing::warn!(
                        event = "partner.kafka_retrying",
                        code = refusal.code(),
                        "record not handled yet; retrying"
                    );
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Ok(Handled::Refused(refusal)) => {
                    tracing::warn!(
                        event = "partner.kafka_refused",
                        code = refusal.code(),
                        "record refused for good"
                    );
                    break true;
                }
                Ok(_) => break true,
                Err(error) => {
                    tracing::warn!(event = "partner.kafka_retrying", error = %error, "record not stored; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        };
        if commit {
            self::commit(&consumer, &message);
        }
    }
    tracing::info!(
        event = "partner.kafka_stopped",
        "the consumer polls no more records"
    );
}

/// Commits past `message` without waiting for the broker: a later commit covers an
/// earlier one that failed.
fn commit(consumer: &StreamConsumer, message: &rdkafka::message::BorrowedMessage<'_>) {
    if let Err(error) = consumer.commit_message(message, CommitMode::Async) {
        tracing::warn!(event = "partner.commit_failed", error = %error, "offset commit failed");
    }
}
