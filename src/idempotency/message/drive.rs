//! What the broker drivers ([`amqp`](super::amqp), [`kafka`](super::kafka)) share:
//! their defaults, the headers they write, what a stop reports, and the one line a
//! settled delivery gets.

use std::time::Duration;

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
