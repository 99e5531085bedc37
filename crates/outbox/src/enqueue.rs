//! A message, and how it goes into the request's transaction.

use std::collections::BTreeMap;

use sqlx::PgConnection;

use super::{partition_lock, Outbox, OutboxError, ENQUEUE_LOCK_CLASS};
use tower_ids_core::IdempotencyKey;
use tower_ids_correlation::CorrelationId;

/// A message to publish once the transaction that enqueues it commits.
///
/// ```
/// use tower_ids_outbox::Message;
///
/// let message = Message::new("order.created", r#"{"order":17}"#)
///     .partition_key("customer-4")
///     .header("content-type", "application/json");
/// assert_eq!(message.destination(), "order.created");
/// ```
#[derive(Debug, Clone)]
pub struct Message {
    destination: String,
    partition_key: Option<String>,
    headers: BTreeMap<String, String>,
    payload: Vec<u8>,
    idempotency_key: Option<IdempotencyKey>,
}

impl Message {
    /// A message for `destination` (what it means is the sink's: a routing key on
    /// [`AmqpSink`](super::amqp::AmqpSink)'s exchange, a topic for
    /// [`KafkaSink`](super::kafka::KafkaSink)) with `payload` as its body.
    pub fn new(destination: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            destination: destination.into(),
            partition_key: None,
            headers: BTreeMap::new(),
            payload: payload.into(),
            idempotency_key: None,
        }
    }

    /// Messages with the same partition key are published in the order their
    /// transactions committed, by one relay at a time, whatever the number of relays; a
    /// Kafka record's key. Without one, a message is published in no particular order.
    ///
    /// The price: transactions that enqueue with the same partition key commit one after
    /// the other (the enqueue takes a lock on the key, held to the commit). Use the
    /// entity whose events must stay in order (an account, a device), not a constant.
    #[must_use]
    pub fn partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Adds a header (a later one with the same name replaces it). The relay adds
    /// `idempotency-key`, `x-correlation-id`, and `traceparent`/`tracestate`, unless
    /// set here.
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The message's own idempotency key, sent as its `idempotency-key` header: by
    /// default a new UUIDv7 per message, so a publication repeated after a relay crash
    /// carries the same key and a consumer with an inbox absorbs it. Set your own for
    /// a message that stands for one business event whichever request enqueues it.
    #[must_use]
    pub fn idempotency_key(mut self, key: IdempotencyKey) -> Self {
        self.idempotency_key = Some(key);
        self
    }

    /// Where the message goes.
    pub fn destination(&self) -> &str {
        &self.destination
    }
}

/// The ID of an enqueued message: its row in the outbox table, in commit order per
/// partition key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageId(pub i64);

impl Outbox {
    /// Enqueues `message` on `connection`, in the transaction it is in: the message is
    /// published once that transaction commits, and never if it rolls back. Records the
    /// current correlation ID and, with `opentelemetry`, the current span's trace
    /// context.
    ///
    /// `connection` is what the handler already holds for its own writes: the guard of
    /// the request's [`Transaction`](tower_ids_postgres::Transaction)
    /// (`&mut guard`), or a sqlx transaction of your own (`&mut tx`). (On a connection
    /// in autocommit the message is committed at once.)
    ///
    /// With a partition key, waits for other open transactions that enqueued with the
    /// same key to end (see [`Message::partition_key`]).
    pub async fn enqueue(
        &self,
        connection: &mut PgConnection,
        message: Message,
    ) -> Result<MessageId, OutboxError> {
        let Message {
            destination,
            partition_key,
            headers,
            payload,
            idempotency_key,
        } = message;
        let idempotency_key = match idempotency_key {
            Some(key) => key,
            None => IdempotencyKey::new(&uuid::Uuid::now_v7().to_string())
                .expect("a UUID is a valid key"),
        };
        let (traceparent, tracestate) = trace_context();
        let headers = serde_json::to_string(&headers).expect("a map of strings serialises");
        let sql = &self.shared.sql;
        let lock = partition_key.as_deref().map(partition_lock);
        let statement = if lock.is_some() {
            &sql.enqueue_keyed
        } else {
            &sql.enqueue
        };
        let mut query = sqlx::query_scalar::<_, i64>(statement)
            .bind(destination)
            .bind(partition_key)
            .bind(idempotency_key.as_str())
            .bind(headers)
            .bind(payload)
            .bind(CorrelationId::current().map(|id| id.as_str().to_owned()))
            .bind(traceparent)
            .bind(tracestate);
        if let Some(lock) = lock {
            query = query.bind(ENQUEUE_LOCK_CLASS).bind(lock);
        }
        let id = query
            .fetch_one(&mut *connection)
            .await
            .map_err(|e| OutboxError::database("could not enqueue the message", e))?;
        Ok(MessageId(id))
    }
}

/// The current span's W3C `traceparent` and `tracestate`.
fn trace_context() -> (Option<String>, Option<String>) {
    #[cfg(feature = "opentelemetry")]
    if let Some(trace) = tower_ids_correlation::TraceContext::current() {
        return (
            Some(trace.traceparent().to_owned()),
            trace.tracestate().map(str::to_owned),
        );
    }
    (None, None)
}
