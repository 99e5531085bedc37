//! [`KafkaSink`]: the outbox's messages as Kafka records (rdkafka), from an idempotent
//! producer.

use std::time::Duration;

use rdkafka::{
    config::ClientConfig,
    error::{KafkaError, RDKafkaErrorCode},
    message::{Header, OwnedHeaders},
    producer::{FutureProducer, FutureRecord},
    util::Timeout,
};

use super::{Outgoing, Sink, SinkError};

/// Publishes each message as a record of the topic its destination names, keyed by its
/// partition key (so one key's records stay on one partition, in order), with its
/// headers as record headers, and waits for the broker's acknowledgement.
///
/// The producer is idempotent (`enable.idempotence=true`, so `acks=all`): the records
/// of one partition are written once each, in the order sent, through the producer's
/// own retries. A record the broker refuses for itself (too large, an unknown or
/// invalid topic, not authorised) is [rejected](SinkError::rejected); anything else
/// (a timeout, brokers down) is [unavailable](SinkError::unavailable), and the
/// producer reconnects on its own.
pub struct KafkaSink {
    producer: FutureProducer,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink").finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// A sink to the brokers at `bootstrap_servers` (`host:port,...`).
    pub fn new(bootstrap_servers: &str) -> Result<Self, KafkaError> {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", bootstrap_servers)
            .set("message.timeout.ms", "10000");
        Self::from_config(config)
    }

    /// A sink with a producer built from `config`, made idempotent
    /// (`enable.idempotence=true` is set whatever `config` says).
    pub fn from_config(mut config: ClientConfig) -> Result<Self, KafkaError> {
        config.set("enable.idempotence", "true");
        Ok(Self {
            producer: config.create()?,
        })
    }

    /// The producer, to flush it at shutdown.
    pub fn producer(&self) -> &FutureProducer {
        &self.producer
    }
}

impl Sink for KafkaSink {
    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), SinkError> {
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
        self.producer
            .send(record, Timeout::After(Duration::from_secs(1)))
            .await
            .map(|_| ())
            .map_err(|(error, _)| classify(error))
    }
}

/// Refusals of the record itself, against failures to reach the brokers.
fn classify(error: KafkaError) -> SinkError {
    use RDKafkaErrorCode as Code;
    let about_the_record = matches!(
        error.rdkafka_error_code(),
        Some(
            Code::MessageSizeTooLarge
                | Code::InvalidMessageSize
                | Code::InvalidMessage
                | Code::InvalidRecord
                | Code::MessageBatchTooLarge
                | Code::UnknownTopicOrPartition
                | Code::UnknownTopic
                | Code::UnknownPartition
                | Code::InvalidTopic
                | Code::TopicAuthorizationFailed
        )
    );
    if about_the_record {
        SinkError::rejected(error)
    } else {
        SinkError::unavailable(error)
    }
}
