//! The dead-letter topics, checked (or created) when a consumer starts: a missing one
//! would hold its partition's dead letter, retried, until someone creates it.

use std::time::Duration;

use rdkafka::{
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    consumer::{Consumer as _, StreamConsumer},
    metadata::Metadata,
    types::RDKafkaErrorCode,
    ClientConfig,
};

/// How long the start's metadata request and topic creation may take.
const TOPOLOGY_TIMEOUT: Duration = Duration::from_secs(10);

/// The dead-letter topic of `topic`.
pub(super) fn dead_letter_topic(topic: &str) -> String {
    format!("{topic}.dead")
}

/// Says, for each subscribed topic (not a `^` pattern), whether its dead-letter topic
/// exists; with `create`, creates a missing one with the topic's partitions and
/// replicas. Logged, never fatal: a broker that cannot be asked now is the run's to
/// wait out.
pub(super) async fn check_dead_letter_topics(
    consumer: &std::sync::Arc<StreamConsumer>,
    config: &ClientConfig,
    topics: &[String],
    create: bool,
) {
    let asking = consumer.clone();
    let metadata =
        tokio::task::spawn_blocking(move || asking.fetch_metadata(None, TOPOLOGY_TIMEOUT)).await;
    let metadata = match metadata {
        Ok(Ok(metadata)) => metadata,
        Ok(Err(error)) => {
            tracing::warn!(target: "tower_ids::idempotency::message", event = "message.dead_letter_topic_unchecked", error = %error, "could not read the brokers' topics to check the dead-letter topics");
            return;
        }
        Err(_) => return,
    };
    for topic in topics.iter().filter(|topic| !topic.starts_with('^')) {
        let dead = dead_letter_topic(topic);
        if find(&metadata, &dead).is_some() {
            tracing::info!(
                target: "tower_ids::idempotency::message",
                event = "message.dead_letter_topic",
                topic = topic.as_str(),
                dead_letter_topic = dead.as_str(),
                status = "exists",
                "the dead-letter topic exists"
            );
            continue;
        }
        if !create {
            tracing::warn!(
                target: "tower_ids::idempotency::message",
                event = "message.dead_letter_topic_missing",
                topic = topic.as_str(),
                dead_letter_topic = dead.as_str(),
                "the dead-letter topic does not exist: a dead letter waits, retried, until it does (or the broker creates topics on first use); create it, or set create_dead_letter_topics(true)"
            );
            continue;
        }
        let (partitions, replicas) = find(&metadata, topic).map_or((1, 1), |source| {
            let partitions = i32::try_from(source.partitions().len()).unwrap_or(1).max(1);
            let replicas = (source.partitions().first()).map_or(1, |partition| {
                i32::try_from(partition.replicas().len())
                    .unwrap_or(1)
                    .max(1)
            });
            (partitions, replicas)
        });
        match create_topic(config, &dead, partitions, replicas).await {
            Ok(status) => {
                tracing::info!(
                    target: "tower_ids::idempotency::message",
                    event = "message.dead_letter_topic",
                    topic = topic.as_str(),
                    dead_letter_topic = dead.as_str(),
                    status,
                    partitions,
                    replicas,
                    "the dead-letter topic is ready"
                );
            }
            Err(error) => {
                tracing::warn!(target: "tower_ids::idempotency::message", event = "message.dead_letter_topic_missing", topic = topic.as_str(), dead_letter_topic = dead.as_str(), error = %error, "could not create the dead-letter topic: a dead letter waits, retried, until it exists");
            }
        }
    }
}

fn find<'m>(metadata: &'m Metadata, name: &str) -> Option<&'m rdkafka::metadata::MetadataTopic> {
    (metadata.topics().iter()).find(|topic| topic.name() == name && topic.error().is_none())
}

/// Creates `name`: `created`, or `exists` when another consumer created it first.
async fn create_topic(
    config: &ClientConfig,
    name: &str,
    partitions: i32,
    replicas: i32,
) -> Result<&'static str, rdkafka::error::KafkaError> {
    let admin: AdminClient<DefaultClientContext> = config.create()?;
    let new = NewTopic::new(name, partitions, TopicReplication::Fixed(replicas));
    let options = AdminOptions::new().operation_timeout(Some(TOPOLOGY_TIMEOUT));
    let results = admin.create_topics([&new], &options).await?;
    match results.into_iter().next() {
        Some(Ok(_)) | None => Ok("created"),
        Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) => Ok("exists"),
        Some(Err((_, code))) => Err(rdkafka::error::KafkaError::AdminOp(code)),
    }
}
