//! What the broker drivers ([`amqp`](super::amqp), [`kafka`](super::kafka)) share:
//! their defaults, the headers they write, and the one line a settled delivery gets.

use std::{any::Any, time::Duration};

use futures_util::future::poll_fn;
use serde::de::DeserializeOwned;
use tower_service::Service;

use super::Handled;
use tower_ids_core::{store::Chain, IdempotencyKey};
use tower_ids_correlation::{Carrier, CorrelationId, MessageCorrelation};

/// A handler's error, as the drivers take it: any error tower's services return.
pub(super) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Deliveries a message's handler may fail by default before it is dead-lettered: a
/// passing fault gets a few more tries, a message that always fails stops costing
/// after five.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// How long a delivery refused for a passing reason (the store unavailable, a duplicate
/// in flight) waits before it is handled again, by default.
pub const DEFAULT_RETRY_PAUSE: Duration = Duration::from_millis(500);
/// How long a stop waits for the deliveries in flight by default.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The header that counts a message's failed deliveries, carried by the copy a driver
/// publishes again.
pub const ATTEMPTS_HEADER: &str = "x-tower-ids-attempts";
/// The header a dead letter carries its reason in.
pub const ERROR_HEADER: &str = "x-tower-ids-error";
/// The header a dead letter names its source in, to replay it or find its neighbours:
/// on Kafka `topic:partition:offset`, on RabbitMQ the queue it was consumed from.
pub const SOURCE_HEADER: &str = "x-tower-ids-source";

/// The metric of settled deliveries, by `outcome` (feature `metrics`).
pub const DELIVERIES: &str = "tower_ids_consumer_deliveries_total";

/// What a driver does with a delivery, from what its handler answered: the table on
/// each driver's page, decided here once for both.
pub(super) enum Next {
    /// Done: acknowledge it, or store its offset (`handled`, `replayed`).
    Settle(&'static str),
    /// A passing reason: handed over again after the pause, not counted (`in_flight`,
    /// `requeued`).
    Retry(Duration, &'static str),
    /// The handler failed before its last attempt: published again with this attempt
    /// counted.
    Again(u32),
    /// Dead-lettered, with its code and the reason it carries.
    DeadLetter(&'static str, String),
}

/// Decodes `body` (JSON) and hands it, with its `envelope` (headers, attempts,
/// delivery), to `service`: what to do with the delivery, and the reason for its line.
pub(super) async fn handle<T, R, S>(
    service: &mut S,
    body: &[u8],
    envelope: &Received<()>,
    max_attempts: u32,
    retry_pause: Duration,
) -> (Next, String)
where
    T: DeserializeOwned,
    S: Service<Received<T>, Response = Handled<R>>,
    S::Error: Into<BoxError>,
{
    let Ok(message) = serde_json::from_slice::<T>(body) else {
        let reason = "undecodable: the body is not the handler's message (JSON)";
        return (
            Next::DeadLetter("undecodable", reason.to_owned()),
            "undecodable".to_owned(),
        );
    };
    let attempts = envelope.attempts;
    let received = Received {
        message,
        headers: envelope.headers.clone(),
        attempts,
        delivery: envelope.delivery.clone(),
    };
    let answer = match poll_fn(|cx| service.poll_ready(cx)).await {
        Ok(()) => service.call(received).await,
        Err(error) => Err(error),
    };
    match answer {
        Ok(Handled::Ran(_)) => (Next::Settle("handled"), String::new()),
        Ok(Handled::Replayed { .. }) => (Next::Settle("replayed"), String::new()),
        Ok(Handled::InFlight { retry_after }) => {
            (Next::Retry(retry_after, "in_flight"), String::new())
        }
        Ok(Handled::Refused(refusal)) if refusal.retryable() => (
            Next::Retry(retry_pause, "requeued"),
            refusal.code().to_string(),
        ),
        Ok(Handled::Refused(refusal)) => (
            Next::DeadLetter(refusal.code().as_str(), refusal.to_string()),
            refusal.code().to_string(),
        ),
        Err(error) => {
            // Its whole chain: the cause an operator needs is often a source or two down.
            let error: BoxError = error.into();
            let error = Chain(&*error).to_string();
            let next = if attempts + 1 >= max_attempts {
                Next::DeadLetter("handler_failed", format!("handler_failed: {error}"))
            } else {
                Next::Again(attempts + 1)
            };
            (next, error)
        }
    }
}

/// The delivery's idempotency key for its line, checked as the layer checks it: an
/// invalid one is not logged (the layer refuses it, with its code).
pub(super) fn key_of(carrier: &impl Carrier) -> String {
    IdempotencyKey::from_carrier(carrier)
        .ok()
        .flatten()
        .map(|key| key.as_str().to_owned())
        .unwrap_or_default()
}

/// A settled delivery's one line: its outcome, delivery, failed attempts so far,
/// idempotency key and correlation ID.
pub(super) fn settled_line(
    outcome: &'static str,
    envelope: &Received<()>,
    key: &str,
    reason: &str,
) {
    let correlation_id = tower_ids_correlation::CorrelationId::current();
    tracing::info!(
        target: "tower_ids::idempotency::message",
        event = "message.settled",
        outcome,
        delivery = envelope.delivery,
        attempts = envelope.attempts,
        key,
        correlation_id = correlation_id.as_ref().map(|id| id.as_str()),
        reason,
        "delivery settled"
    );
    #[cfg(feature = "metrics")]
    ::metrics::counter!(DELIVERIES, "outcome" => outcome).increment(1);
}

/// Where a driver reads a delivery's correlation ID from the decoded message (the
/// `correlationId` of a signal's envelope, say), set with a driver's `correlation_from`.
#[derive(Clone, Default)]
pub(super) struct EnvelopeCorrelation(Option<std::sync::Arc<ReadEnvelope>>);

/// Reads the ID from a decoded message, of the type the reader was made for.
type ReadEnvelope = dyn Fn(&dyn Any) -> Option<String> + Send + Sync;

impl std::fmt::Debug for EnvelopeCorrelation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "from the envelope"
        } else {
            "from the headers"
        })
    }
}

impl EnvelopeCorrelation {
    pub(super) fn new<T: 'static>(
        read: impl Fn(&T) -> Option<&str> + Send + Sync + 'static,
    ) -> Self {
        Self(Some(std::sync::Arc::new(move |message: &dyn Any| {
            message
                .downcast_ref::<T>()
                .and_then(&read)
                .map(str::to_owned)
        })))
    }

    /// The delivery's correlation ID: the envelope's if the message decodes and carries
    /// one, else the headers' (or a fresh one), extended per delivery as the
    /// correlation's settings say; every line of the delivery is under it.
    pub(super) fn delivery_id<T: DeserializeOwned + 'static>(
        &self,
        correlation: &MessageCorrelation,
        carrier: &impl Carrier,
        body: &[u8],
    ) -> CorrelationId {
        let from_envelope = self.0.as_ref().and_then(|read| {
            let message = serde_json::from_slice::<T>(body).ok()?;
            read(&message)
        });
        match from_envelope {
            Some(id) => correlation.for_envelope(Some(&id)),
            None => correlation.for_delivery(carrier),
        }
    }
}

/// A message as a driver hands it to the handler: the decoded message, its headers
/// (so the layer reads its key and the correlation ID from them, through [`Carrier`]),
/// its failed attempts so far, and where it came from.
#[derive(Debug)]
pub struct Received<T> {
    pub(super) message: T,
    pub(super) headers: Vec<(String, Vec<u8>)>,
    pub(super) attempts: u32,
    pub(super) delivery: String,
}

impl<T> Received<T> {
    /// The message.
    pub fn message(&self) -> &T {
        &self.message
    }

    /// The message, taken.
    pub fn into_message(self) -> T {
        self.message
    }

    /// A header's text, if it has one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.get(name)
            .and_then(|value| std::str::from_utf8(value).ok())
    }

    /// How many deliveries of this message failed in its handler before this one.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Where this delivery came from, for logs and audit columns: on RabbitMQ the
    /// message's `message_id` (`tag-N`, its delivery tag, without one); on Kafka
    /// `topic:partition:offset`. A redelivery of a RabbitMQ message keeps its ID; a copy
    /// published again for another attempt is at another Kafka offset.
    pub fn delivery(&self) -> &str {
        &self.delivery
    }
}

impl<T> Carrier for Received<T> {
    fn get(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, value)| value.as_slice())
    }

    fn set(&mut self, name: &str, value: &str) {
        self.headers.retain(|(n, _)| n != name);
        self.headers
            .push((name.to_owned(), value.as_bytes().to_vec()));
    }
}
