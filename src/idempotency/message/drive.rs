//! What the broker drivers ([`amqp`](super::amqp), [`kafka`](super::kafka)) share:
//! their defaults, the headers they write, what a stop reports, and the one line a
//! settled delivery gets.

use std::time::Duration;

use crate::correlation::Carrier;

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

/// The metric of settled deliveries, by `outcome` (feature `metrics`).
pub const DELIVERIES: &str = "tower_ids_consumer_deliveries_total";

/// What a stop left: the deliveries still in flight at the drain's deadline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stopped {
    /// Deliveries left unsettled: they come back (RabbitMQ requeues them; Kafka's
    /// offsets were not committed past them).
    pub left: usize,
}

/// A settled delivery's one line: its outcome, idempotency key and correlation ID.
pub(super) fn settled_line(outcome: &'static str, key: &str, reason: &str) {
    let correlation_id = crate::correlation::CorrelationId::current()
        .map(|id| id.as_str().to_owned())
        .unwrap_or_default();
    tracing::info!(
        event = "message.settled",
        outcome,
        key,
        correlation_id,
        reason,
        "delivery settled"
    );
    #[cfg(feature = "metrics")]
    ::metrics::counter!(DELIVERIES, "outcome" => outcome).increment(1);
}

/// A message as a driver hands it to the handler: the decoded message, its headers
/// (so the layer reads its key and the correlation ID from them, through [`Carrier`]),
/// and its failed attempts so far.
#[derive(Debug)]
pub struct Received<T> {
    pub(super) message: T,
    pub(super) headers: Vec<(String, Vec<u8>)>,
    pub(super) attempts: u32,
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
