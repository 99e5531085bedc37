//! [`KafkaSink`]: the outbox's messages as Kafka records (rdkafka), from an idempotent
//! producer.

use std::sync::{Arc, RwLock};

use rdkafka::{
    config::ClientConfig,
    error::{KafkaError, RDKafkaErrorCode},
    message::{Header, OwnedHeaders},
    producer::{FutureProducer, FutureRecord},
};

use super::{Confirm, Outgoing, Sink, SinkError};
use tower_ids_core::store::Chain;

/// Publishes each message as a record of the topic its destination names, keyed by its
/// partition key (so one key's records stay on one partition, in order), with its
/// headers as record headers; its [`Confirm`] is the broker's acknowledgement.
///
/// The producer is idempotent (`enable.idempotence=true`, so `acks=all`) and gapless
/// (`enable.gapless.guarantee=true`): the records of one partition are written once
/// each, in the order sent, through the producer's own retries, and a failure that
/// could leave a gap stops the producer instead. So a key's records are in flight
/// together. A record the broker refuses for itself (too large, an unknown or invalid
/// topic, not authorised) is [rejected](SinkError::rejected); anything else (a timeout,
/// brokers down, the producer's queue full) is [unavailable](SinkError::unavailable).
///
/// After a record timed out (`message.timeout.ms`, 5 s unless set, below the relay's
/// publish timeout) or a fatal error, librdkafka's idempotent producer may keep failing
/// every record of its partition at once, even when the broker is back: the sink then
/// builds a new producer (a new producer ID) from the same configuration for the next
/// publication. The relay sends a key's records again from the first unacknowledged
/// one, so order per key does not depend on the producer's session.
pub struct KafkaSink {
    producers: Arc<Producers>,
}

struct Producers {
    config: ClientConfig,
    /// The producer, and how many were built before it.
    current: RwLock<(u64, Arc<FutureProducer>)>,
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

    /// A sink with a producer built from `config`, made idempotent and gapless
    /// (`enable.idempotence=true`, `enable.gapless.guarantee=true`, whatever `config`
    /// says), with `linger.ms=0` unless `config` sets it: a round's last records of a
    /// key would otherwise wait out librdkafka's default linger (5 ms) before they are
    /// sent (`benches/README.md`).
    pub fn from_config(mut config: ClientConfig) -> Result<Self, KafkaError> {
        config.set("enable.idempotence", "true");
        config.set("enable.gapless.guarantee", "true");
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
            producers: Arc::new(Producers {
                config,
                current: RwLock::new((0, producer)),
            }),
        })
    }

    /// The producer now, to flush it at shutdown.
    pub fn producer(&self) -> Arc<FutureProducer> {
        self.producers.current().1
    }
}

impl Producers {
    fn current(&self) -> (u64, Arc<FutureProducer>) {
        let guard = self.current.read().unwrap_or_else(|e| e.into_inner());
        (guard.0, guard.1.clone())
    }

    /// Replaces producer `generation` with a new one, unless another publication did.
    fn replace(&self, generation: u64) {
        let mut guard = self.current.write().unwrap_or_else(|e| e.into_inner());
        if guard.0 != generation {
            return;
        }
        match self.config.create::<FutureProducer>() {
            Ok(producer) => *guard = (generation + 1, Arc::new(producer)),
            Err(error) => {
                tracing::debug!(target: "tower_ids::outbox", event = "outbox.producer_failed", error = %Chain(&error), "could not build a new Kafka producer");
            }
        }
    }
}

impl Sink for KafkaSink {
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
        let (generation, producer) = self.producers.current();
        let producers = self.producers.clone();
        let failed = move |error: KafkaError| {
            if matches!(
                error.rdkafka_error_code(),
                Some(RDKafkaErrorCode::MessageTimedOut | RDKafkaErrorCode::Fatal)
            ) {
                producers.replace(generation);
            }
            classify(error)
        };
        match producer.send_result(record) {
            Ok(delivery) => Ok(Confirm::later(async move {
                match delivery.await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err((error, _))) => Err(failed(error)),
                    Err(_) => Err(SinkError::unavailable(
                        "the producer dropped the record before its acknowledgement",
                    )),
                }
            })),
            Err((error, _)) => Err(failed(error)),
        }
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
