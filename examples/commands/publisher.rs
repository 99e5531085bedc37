//! In-memory mode's background publisher, and the queue messages it takes. (DB mode's
//! publisher relays the outbox table: [`crate::postgres::publish`].)

use std::time::Duration;

use tokio::{sync::mpsc, time::Instant};
use tower_ids::correlation::CorrelationId;
use uuid::Uuid;

use crate::{memory::Commands, routes::Status};

/// Messages the queue holds before the publisher blocks new commands (backpressure).
pub(crate) const QUEUE_CAPACITY: usize = 1024;

/// A queue message: publish this command. The correlation ID travels with it, as it
/// would in a broker message's headers.
#[derive(Debug)]
pub(crate) struct Publish {
    pub(crate) command_id: Uuid,
    pub(crate) correlation_id: CorrelationId,
    /// When the message was queued, as a broker's message timestamp.
    pub(crate) queued_at: Instant,
}

/// The publisher: takes each queue message and publishes its command.
///
/// Each delivery runs under its own extension of the message's correlation ID, as a
/// consumer of a real broker would: a redelivered message gets a different one, and
/// both lead back to the request. Messages are handled one at a time, in order; each is
/// published `delay` after it was queued, so a burst is not slowed down by the delay.
pub(crate) async fn publish(
    commands: Commands,
    mut deliveries: mpsc::Receiver<Publish>,
    delay: Duration,
) {
    while let Some(message) = deliveries.recv().await {
        let command_id = message.command_id;
        message
            .correlation_id
            .extend_redelivery()
            .scope(async {
                tokio::time::sleep_until(message.queued_at + delay).await;
                let mut store = commands.lock();
                let Some(command) = store.get_mut(command_id) else {
                    tracing::info!(
                        event = "commands.publish_skipped",
                        command_id = %command_id,
                        reason = "evicted",
                        "command dropped from the list before publishing"
                    );
                    return;
                };
                match command.status {
                    Status::Queued => {
                        command.status = Status::Sent;
                        tracing::info!(
                            event = "commands.published",
                            command_id = %command_id,
                            device_id = command.device_id.as_str(),
                            "command published"
                        );
                    }
                    Status::Cancelled => tracing::info!(
                        event = "commands.publish_skipped",
                        command_id = %command_id,
                        reason = "cancelled",
                        "command cancelled before publishing"
                    ),
                    Status::Sent => {}
                }
            })
            .await;
    }
}
