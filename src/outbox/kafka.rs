//! [`KafkaSink`]: the outbox's messages as Kafka records (rdkafka), from an idempotent
//! producer.

use std::{
    sync::{Arc, RwLock},
    time::Duration,
};

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
/// (a timeout, brokers down) is [unavailable](SinkError::unavailable).
///
/// After a record timed out (`message.timeout.ms`, 5 s unless set, below the relay's
/// publish timeout) or a fatal error, librdkafka's idempotent producer may keep failing every
/// record of its partition at once, even when the broker is back: the sink then
/// builds a new producer (a new producer ID) from the same configuration for the next
/// publication. Order per key is the relay's to keep (one record of a key at a time),
/// so it does not depend on the producer's session.
pub struct KafkaSink {
    config: ClientConfig,
    /// The producer, and how many were built before it.
    producer: RwLock<(u64, Arc<FutureProducer>)>,
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
        config.set("bootstrap.servers", bootstrap_servers);
        Self::from_config(config)
    }

    /// A sink with a producer built from `config`, made idempotent
    /// (`enable.idempotence=true` is set whatever `config` says), with `linger.ms=0`
    /// unless `config` sets it: the relay sends one record of a key at a time and waits
    /// for its acknowledgement, so librdkafka's default linger (5 ms) would be paid by
    /// every record of a key (measured: 15 to 23 times the single-key rate without it,
    /// `benches/README.md`).
    pub fn from_config(mut config: ClientConfig) -> Result<Self, KafkaError> {
        config.set("enable.idempotence", "true");
        if config.get("linger.ms").is_none() {
            config.set("linger.ms", "0");
        }
        // Below the relay's publish timeout (10 s by default), so a record the broker
        // does not take fails here, where the producer is replaced, rather than in
        // the relay's timer.
        if config.get("message.timeout.ms").is_none() {
            config.set("message.timeout.ms", "5000");
        }
        let producer = Arc::new(config.create()?);
        Ok(Self {
            config,
            producer: RwLock::new((0, producer)),
        })
    }

    /// The producer now, to flush it at shutdown.
    pub fn producer(&self) -> Arc<FutureProducer> {
        self.current().1
    }

    fn current(&self) -> (u64, Arc<FutureProducer>) {
        let guard = self.producer.read().unwrap_or_else(|e| e.into_inner());
        (guard.0, guard.1.clone())
    }

    /// Replaces producer `generation` with a new one, unless another publication did.
    fn replace(&self, generation: u64) {
        let mut guard = self.producer.write().unwrap_or_else(|e| e.into_inner());
        if guard.0 != generation {
            return;
        }
        match self.config.create::<FutureProducer>() {
            Ok(producer) => *guard = (generation + 1, Arc::new(producer)),
            Err(error) => {
                tracing::debug!(event = "outbox.producer_failed", error = %error, "could not build a new Kafka producer");
            }
        }
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
        let (generation, producer) = self.current();
        let sent = producer
            .send(record, Timeout::After(Duration::from_secs(1)))
            .await;
        sent.map(|_| ()).map_err(|(error, _)| {
            if matches!(
                error.rdkafka_error_code(),
                Some(RDKafkaErrorCode::MessageTimedOut | RDKafkaErrorCode::Fatal)
            ) {
                self.replace(generation);
            }
            classify(error)
        })
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
