//! One message's publication: its span and correlation ID, its headers, the send, and
//! what the broker's acknowledgement made of it.

use std::time::Duration;

use tracing::Instrument as _;

use super::{take::Pending, Confirm, Outgoing, Sink, SinkError};
use tower_ids_core::{header::IDEMPOTENCY_KEY, store::Chain};
use tower_ids_correlation::{Carrier, CorrelationId, MessageCorrelation};

/// How one message's publication ended.
pub(super) enum Published<'m> {
    Taken(i64),
    Refused(&'m Pending, SinkError),
    Unavailable(&'m Pending, SinkError),
}

/// A message on its way: in a span that continues its request's trace, under a
/// correlation ID extended from the request's for this publication.
pub(super) struct Publication<'m> {
    message: &'m Pending,
    span: tracing::Span,
    correlation_id: CorrelationId,
}

impl<'m> Publication<'m> {
    pub(super) fn of(message: &'m Pending) -> Self {
        let stored = message
            .correlation_id
            .as_deref()
            .and_then(|id| CorrelationId::parse(id).ok());
        let correlation_id = match &stored {
            Some(id) => id.extend_redelivery(),
            None => CorrelationId::new(),
        };
        let span = tracing::info_span!(
            "outbox.publish",
            correlation_id = %correlation_id,
            message_id = message.id,
            destination = message.destination.as_str(),
            trace_id = tracing::field::Empty,
            otel.kind = "producer",
        );
        #[cfg(feature = "opentelemetry")]
        if let Some(trace) = message.traceparent.as_deref().and_then(|traceparent| {
            tower_ids_correlation::TraceContext::parse(traceparent, message.tracestate.as_deref())
        }) {
            trace.continue_in(&span);
        }
        #[cfg(not(feature = "opentelemetry"))]
        let _ = (&message.traceparent, &message.tracestate);
        Self {
            message,
            span,
            correlation_id,
        }
    }

    /// Hands the message to `sink`, within `timeout`; the sink finds the publication's
    /// ID as `CorrelationId::current()`.
    pub(super) async fn send<S: Sink>(
        &self,
        sink: &S,
        timeout: Duration,
    ) -> Result<Confirm, SinkError> {
        let message = self.message;
        let sending = async move {
            let headers = self.headers();
            let outgoing = Outgoing {
                destination: &message.destination,
                partition_key: message.partition_key.as_deref(),
                headers: &headers.0,
                payload: &message.payload,
            };
            tokio::time::timeout(timeout, sink.publish(&outgoing))
                .await
                .unwrap_or_else(|_| {
                    Err(SinkError::unavailable(format!(
                        "not sent within {timeout:?}"
                    )))
                })
        };
        self.correlation_id
            .clone()
            .task_local(sending)
            .instrument(self.span.clone())
            .await
    }

    /// The message's headers: its own, its idempotency key, the publication's
    /// correlation ID and, with `opentelemetry`, the trace context.
    fn headers(&self) -> HeaderList {
        let message = self.message;
        let mut headers = HeaderList(
            serde_json::from_str::<std::collections::BTreeMap<String, String>>(&message.headers)
                .unwrap_or_default()
                .into_iter()
                .collect(),
        );
        if headers.get(IDEMPOTENCY_KEY.as_str()).is_none() {
            headers.set(IDEMPOTENCY_KEY.as_str(), &message.idempotency_key);
        }
        MessageCorrelation::new().inject(&mut headers, &self.correlation_id);
        #[cfg(feature = "opentelemetry")]
        if let Some(trace) = tower_ids_correlation::TraceContext::current() {
            trace.inject(&mut headers);
        }
        headers
    }

    /// Awaits the broker's acknowledgement, within `timeout`.
    pub(super) async fn confirmed(self, confirm: Confirm, timeout: Duration) -> Published<'m> {
        let span = self.span.clone();
        let acknowledged = tokio::time::timeout(timeout, confirm)
            .instrument(span.clone())
            .await
            .unwrap_or_else(|_| {
                Err(SinkError::unavailable(format!(
                    "no acknowledgement within {timeout:?}"
                )))
            });
        let _entered = span.enter();
        match acknowledged {
            Ok(()) => {
                tracing::debug!(target: "tower_ids::outbox", event = "outbox.published", "message published");
                #[cfg(feature = "metrics")]
                ::metrics::counter!(super::metrics::PUBLISHED, "destination" => self.message.destination.clone())
                    .increment(1);
                Published::Taken(self.message.id)
            }
            Err(error) => self.failed_here(error),
        }
    }

    /// The send failed.
    pub(super) fn failed(self, error: SinkError) -> Published<'m> {
        let span = self.span.clone();
        let _entered = span.enter();
        self.failed_here(error)
    }

    fn failed_here(self, error: SinkError) -> Published<'m> {
        let message = self.message;
        #[cfg(feature = "metrics")]
        ::metrics::counter!(
            super::metrics::FAILURES,
            "destination" => message.destination.clone(),
            "reason" => if error.is_rejected() {
                "rejected"
            } else if error.is_full() {
                "full"
            } else {
                "unavailable"
            },
        )
        .increment(1);
        if error.is_rejected() {
            tracing::warn!(
                target: "tower_ids::outbox",
                event = "outbox.rejected",
                attempt = message.attempts + 1,
                error = %Chain(&error),
                "the broker refused the message; it will be tried again"
            );
            Published::Refused(message, error)
        } else {
            tracing::debug!(target: "tower_ids::outbox", event = "outbox.unavailable", error = %Chain(&error), "the broker is unavailable");
            Published::Unavailable(message, error)
        }
    }
}

/// Headers as the relay builds them, in order.
struct HeaderList(Vec<(String, String)>);

impl Carrier for HeaderList {
    fn get(&self, name: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, value)| value.as_bytes())
    }

    fn set(&mut self, name: &str, value: &str) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some((_, old)) => *old = value.to_owned(),
            None => self.0.push((name.to_owned(), value.to_owned())),
        }
    }
}
