//! Payments from a Kafka topic, through the library's driver: a consumer group, each
//! partition's records in order, a record's offset committed only once the inbox has
//! committed (or replayed) it and every record before it.

use std::time::Duration;

use rdkafka::{
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    error::RDKafkaErrorCode,
    producer::{FutureProducer, FutureRecord},
    ClientConfig,
};
use tower_ids::idempotency::{message::kafka::KafkaConsumer, Stopped};

use crate::{shutdown, Inbox, Payment, RETRY_PAUSE};

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
    /// Partitions a consumer handles at once, each in order.
    #[arg(long, global = true, default_value_t = 4)]
    pub(crate) partitions_at_once: usize,
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

/// Consumes the topic in the group until Ctrl-C or SIGTERM, then drains within
/// `drain`; names the messages the drain left unsettled (their offsets stay where they
/// were).
pub(crate) async fn consume(
    args: &KafkaArgs,
    inbox: Inbox,
    drain: Duration,
) -> Result<Stopped, Error> {
    let session = args.session_timeout_ms;
    let mut config = config(args);
    config
        .set("group.id", &args.group)
        .set("auto.offset.reset", "earliest")
        // A group that rebalances in seconds, not the default 45 s.
        .set("session.timeout.ms", session.to_string())
        .set("heartbeat.interval.ms", (session / 6).max(100).to_string());
    let stop = async {
        shutdown::signal().await;
    };
    let stopped = KafkaConsumer::new(config, [&args.topic])?
        .partitions_at_once(args.partitions_at_once)
        .retry_pause(RETRY_PAUSE)
        .drain_timeout(drain)
        .run(inbox, stop)
        .await;
    Ok(stopped)
}
