//! In-memory mode's background publisher, and the queue messages it takes. (DB mode's
//! publisher is the library's outbox relay: [`crate::relay`].)

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

/// A queue message: publish this command. Its origin travels with it, as it would in
/// a broker message's headers.
#[derive(Debug)]
pub(crate) struct Publish {
    pub(crate) command_id: Uuid,
    pub(crate) origin: Origin,
    /// When the message was queued, as a broker's message timestamp.
    pub(crate) queued_at: Instant,
}

/// What travels from the request that created a command to the publishing of its
/// event (a queue message in memory, an outbox row in DB mode): the request's
/// correlation ID, its idempotency key and, with `--features opentelemetry`, its W3C
/// trace context, so the publisher's lines carry the request's `trace_id` and the AMQP
/// message its `traceparent`.
#[derive(Debug, Clone)]
pub(crate) struct Origin {
    pub(crate) correlation_id: CorrelationId,
    /// The key of the request that created the command.
    pub(crate) idempotency_key: Option<IdempotencyKey>,
    /// W3C `traceparent` and `tracestate` of the request's span.
    pub(crate) traceparent: Option<String>,
    pub(crate) tracestate: Option<String>,
}

impl Origin {
    /// The origin of the request being handled: its trace context is the current
    /// span's.
    pub(crate) fn current(
        correlation_id: CorrelationId,
        idempotency_key: Option<IdempotencyKey>,
    ) -> Self {
        #[cfg(feature = "opentelemetry")]
        let trace = tower_ids::correlation::TraceContext::current();
        #[cfg(feature = "opentelemetry")]
        let (traceparent, tracestate) = match trace {
            Some(trace) => (
                Some(trace.traceparent().to_owned()),
                trace.tracestate().map(str::to_owned),
            ),
            None => (None, None),
        };
        #[cfg(not(feature = "opentelemetry"))]
        let (traceparent, tracestate) = (None, None);
        Self {
            correlation_id,
            idempotency_key,
            traceparent,
            tracestate,
        }
    }

    /// Runs `publishing` under this delivery's extension of the request's correlation
    /// ID, in a `publish` span that continues the request's trace (a child of the
    /// request's span: the event is the request's doing, as OpenTelemetry's messaging
    /// conventions make a producer span a child of the context that created the
    /// message), so its lines carry the request's `trace_id`.
    pub(crate) async fn publishing<F: std::future::Future>(&self, publishing: F) -> F::Output {
        use tracing::Instrument as _;
        let delivery = self.correlation_id.extend_redelivery();
        #[cfg(feature = "opentelemetry")]
        let span = {
            let span = tracing::info_span!(
                "publish",
                correlation_id = %delivery,
                trace_id = tracing::field::Empty,
                otel.kind = "producer",
            );
            let stored = self.traceparent.as_deref().and_then(|traceparent| {
                tower_ids::correlation::TraceContext::parse(traceparent, self.tracestate.as_deref())
            });
            if let Some(trace) = stored {
                trace.continue_in(&span);
            }
            span
        };
        #[cfg(not(feature = "opentelemetry"))]
        let span = tracing::info_span!("publish", correlation_id = %delivery);
        delivery.task_local(publishing).instrument(span).await
    }
}

/// The publisher: takes each queue message and publishes its command, by log and, with
/// `--amqp-url`, to the `broker`.
///
/// Each delivery runs under its own extension of the message's correlation ID, as a
/// consumer of a real broker would: a redelivered message gets a different one, and
/// both lead back to the request; and in the request's trace ([`Origin::publishing`]). Messages are handled one at a time, in order; each is
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
        let origin = &message.origin;
        origin
            .publishing(async {
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
                            .publish(&event, origin.idempotency_key.as_ref())
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
