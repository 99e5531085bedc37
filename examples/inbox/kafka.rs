//! Payments from a Kafka topic: a consumer group, no auto-commit, one record at a time;
//! a record's offset is committed only once the inbox has committed (or replayed) it.

use std::time::Duration;

use rdkafka::{
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    consumer::{CommitMode, Consumer as _, StreamConsumer},
    error::{KafkaError, RDKafkaErrorCode},
    producer::{FutureProducer, FutureRecord},
    ClientConfig, Message as _,
};
use tracing::Instrument as _;

use crate::{acknowledge, handle, shutdown, Consumer, Delivered, Next, Payment};

#[derive(clap::Args, Debug)]
pub(crate) struct KafkaArgs {
    /// The Kafka bootstrap servers (`--broker kafka`).
    #[arg(long, global = true, default_value = "127.0.0.1:9092")]
    kafka_brokers: String,
    /// The topic the payments are published to and consumed from.
    #[arg(long, global = true, default_value = "inbox.payments")]
    topic: String,
    /// The consumer group.
    #[arg(long, global = true, default_value = "inbox")]
    group: String,
    /// Partitions of the topic, when `publish` creates it.
    #[arg(long, global = true, default_value_t = 4)]
    partitions: i32,
    /// How long the group waits for a consumer that stopped answering (a killed one)
    /// before it hands its partitions to the others; heartbeats go every sixth of it.
    #[arg(long, global = true, default_value_t = 6_000)]
    session_timeout_ms: u64,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

fn config(args: &KafkaArgs) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &args.kafka_brokers);
    config
}

/// Creates the topic if it is missing, then publishes each payment keyed by its
/// account (an account's payments stay on one partition, in order), each delivery
/// awaited.
pub(crate) async fn publish(args: &KafkaArgs, payments: &[&Payment]) -> Result<(), Error> {
    let admin: AdminClient<_> = config(args).create()?;
    let topic = NewTopic::new(&args.topic, args.partitions, TopicReplication::Fixed(1));
    for created in admin.create_topics([&topic], &AdminOptions::new()).await? {
        match created {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(format!("creating {topic}: {code}").into()),
        }
    }
    let producer: FutureProducer = config(args)
        .set("enable.idempotence", "true")
        .set("message.timeout.ms", "10000")
        .create()?;
    for payment in payments {
        let body = serde_json::to_vec(payment)?;
        let record = FutureRecord::to(&args.topic)
            .key(&payment.account)
            .payload(&body);
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(error, _)| error)?;
    }
    Ok(())
}

/// Consumes the topic in the group until Ctrl-C or SIGTERM, one record at a time. A
/// record is retried in place until the inbox has an answer (Kafka has no requeue),
/// then its offset is committed. On a stop, the record in hand is handled and
/// committed, or left uncommitted for the group if it is still waiting.
pub(crate) async fn consume(args: &KafkaArgs, consumer: Consumer) -> Result<(), Error> {
    let session = args.session_timeout_ms;
    let kafka: StreamConsumer = config(args)
        .set("group.id", &args.group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        // A group that rebalances in seconds, not the default 45 s.
        .set("session.timeout.ms", session.to_string())
        .set("heartbeat.interval.ms", (session / 6).max(100).to_string())
        .create()?;
    kafka.subscribe(&[&args.topic])?;
    tracing::info!(event = "inbox.ready", broker = "kafka", topic = %args.topic, group = %args.group, "consuming");

    let Consumer {
        mut inbox,
        drain,
        ack_delay,
        drain_timeout,
    } = consumer;
    let stop = shutdown::signal();
    tokio::pin!(stop);
    let mut stopping = None;
    while stopping.is_none() {
        let received = tokio::select! {
            received = kafka.recv() => received,
            signal = &mut stop => {
                stopping = Some(signal);
                break;
            }
        };
        let message = match received {
            Ok(message) => message,
            Err(error) => {
                tracing::warn!(event = "inbox.consume_failed", error = %error, "consume failed");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let id = format!("{}:{}", message.partition(), message.offset());
        let span = tracing::info_span!("delivery", delivery = %id);
        let payment = message
            .payload()
            .and_then(|body| serde_json::from_slice::<Payment>(body).ok());
        let Some(payment) = payment else {
            tracing::warn!(parent: &span, event = "inbox.rejected", delivery = %id, reason = "not_a_payment", "not a payment; skipped");
            acknowledge(Duration::ZERO, &id, commit(&kafka, &message))
                .instrument(span)
                .await;
            continue;
        };
        tracing::info!(parent: &span, event = "inbox.received", delivery = %id, key = %payment.idempotency_key, "payment received");
        let handled = async {
            loop {
                let delivered = Delivered {
                    payment: payment.clone(),
                    delivery: id.clone(),
                };
                match handle(&mut inbox, delivered).await {
                    Next::Ack | Next::Reject => return true,
                    Next::Retry(after) => tokio::select! {
                        () = tokio::time::sleep(after) => {}
                        signal = &mut stop => {
                            stopping = Some(signal);
                            return false;
                        }
                    },
                }
            }
        }
        .instrument(span.clone())
        .await;
        if handled {
            acknowledge(ack_delay, &id, commit(&kafka, &message))
                .instrument(span)
                .await;
        }
    }
    tracing::info!(
        event = "inbox.stopping",
        signal = stopping,
        "stopping: no new records"
    );
    shutdown::drain(&[drain], drain_timeout).await;
    // Dropping the consumer leaves the group: the others take its partitions at once.
    drop(kafka);
    tracing::info!(event = "inbox.stopped", "stopped");
    Ok(())
}

/// Commits the group's offset past `message`, and waits for the broker to take it.
async fn commit(
    kafka: &StreamConsumer,
    message: &rdkafka::message::BorrowedMessage<'_>,
) -> Result<(), KafkaError> {
    tokio::task::block_in_place(|| kafka.commit_message(message, CommitMode::Sync))
}
