//! In-memory mode's background publisher, and the queue messages it takes. (DB mode's
//! publisher relays the outbox table: [`crate::postgres::publish`].)

use std::{sync::Arc, time::Duration};

use tokio::{sync::mpsc, time::Instant};
use tower_ids::{correlation::CorrelationId, idempotency::IdempotencyKey};
use uuid::Uuid;

use crate::{
    broker::{Broker, Event},
    memory::Commands,
    routes::{Command, Status},
};

/// Messages the queue holds before the publisher blocks new commands (backpressure).
pub(crate) const QUEUE_CAPACITY: usize = 1024;

/// A queue message: publish this command. The correlation ID and the idempotency key
/// travel with it, as they would in a broker message's headers.
#[derive(Debug)]
pub(crate) struct Publish {
    pub(crate) command_id: Uuid,
    pub(crate) correlation_id: CorrelationId,
    /// The key of the request that created the command.
    pub(crate) idempotency_key: Option<IdempotencyKey>,
    /// When the message was queued, as a broker's message timestamp.
    pub(crate) queued_at: Instant,
}

/// The publisher: takes each queue message and publishes its command, by log and, with
/// `--amqp-url`, to the `broker`.
///
/// Each delivery runs under its own extension of the message's correlation ID, as a
/// consumer of a real broker would: a redelivered message gets a different one, and
/// both lead back to the request. Messages are handled one at a time, in order; each is
/// published `delay` after it was queued, so a burst is not slowed down by the delay.
///
/// The command turns `sent` before it goes to the broker, so a cancel arriving while
/// the broker confirms is refused rather than lost. Memory holds nothing to retry from:
/// a publish the broker fails is logged (WARN `commands.amqp_publish_failed`) and the
/// command stays `sent`, published by log only.
pub(crate) async fn publish(
    commands: Commands,
    mut deliveries: mpsc::Receiver<Publish>,
    delay: Duration,
    broker: Option<Arc<Broker>>,
) {
    while let Some(message) = deliveries.recv().await {
        let command_id = message.command_id;
        message
            .correlation_id
            .extend_redelivery()
            .scope(async {
                tokio::time::sleep_until(message.queued_at + delay).await;
                let Some(command) = take_queued(&commands, command_id) else {
                    return;
                };
                let to_broker = match &broker {
                    Some(broker) => {
                        let id = command.id.to_string();
                        let event = Event {
                            event: "command.created",
                            command_id: &id,
                            device_id: &command.device_id,
                            name: &command.name,
                            payload: &command.payload,
                        };
                        match broker
                            .publish(&event, message.idempotency_key.as_ref())
                            .await
                        {
                            Ok(()) => true,
                            Err(error) => {
                                tracing::warn!(
                                    event = "commands.amqp_publish_failed",
                                    command_id = %command_id,
                                    error = %error,
                                    "could not publish the event to the AMQP broker; published by log only"
                                );
                                false
                            }
                        }
                    }
                    None => false,
                };
                tracing::info!(
                    event = "commands.published",
                    command_id = %command_id,
                    device_id = command.device_id.as_str(),
                    amqp = to_broker,
                    "command published"
                );
            })
            .await;
    }
}

/// Marks command `command_id` `sent` if it is still `queued`, and returns it; logs why
/// not otherwise.
fn take_queued(commands: &Commands, command_id: Uuid) -> Option<Command> {
    let mut store = commands.lock();
    let Some(command) = store.get_mut(command_id) else {
        tracing::info!(
            event = "commands.publish_skipped",
            command_id = %command_id,
            reason = "evicted",
            "command dropped from the list before publishing"
        );
        return None;
    };
    match command.status {
        Status::Queued => {
            command.status = Status::Sent;
            Some(command.clone())
        }
        Status::Cancelled => {
            tracing::info!(
                event = "commands.publish_skipped",
                command_id = %command_id,
                reason = "cancelled",
                "command cancelled before publishing"
            );
            None
        }
        Status::Sent => None,
    }
}
