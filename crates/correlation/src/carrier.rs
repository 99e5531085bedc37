//! Correlation IDs on messages: read from a message's headers, extended per delivery,
//! and written into the headers of the messages a handler sends.

use std::{borrow::Cow, future::Future};

use http::{HeaderMap, HeaderName, HeaderValue};
use tokio::task::futures::TaskLocalFuture;
use tracing::{instrument::Instrumented, Instrument as _};

use super::{CorrelationId, CorrelationIdError, DefaultValidator, DEFAULT_MAX_LEN};

/// The headers of a message, as far as the correlation (and idempotency) headers go:
/// `http::HeaderMap`, with the `kafka` feature rdkafka's `OwnedHeaders`, and with the `amqp` feature lapin's `FieldTable` (an AMQP
/// message's header table). `Option<C>` reads as empty when `None` and makes the table
/// on the first write, as lapin's `BasicProperties::headers` is.
///
/// Implement it for your broker's header type (a Kafka record's headers, an SQS
/// message's attributes) to use [`MessageCorrelation`] with it.
pub trait Carrier {
    /// The bytes of header `name`, if present (the first, if repeated).
    fn get(&self, name: &str) -> Option<&[u8]>;

    /// Whether header `name` is present more than once (a carrier that cannot repeat
    /// a name never is).
    fn is_repeated(&self, _name: &str) -> bool {
        false
    }

    /// Sets header `name` to `value`, replacing what was there. Both are valid header
    /// text: `name` a lowercase token, `value` visible ASCII.
    fn set(&mut self, name: &str, value: &str);
}

impl Carrier for HeaderMap {
    fn get(&self, name: &str) -> Option<&[u8]> {
        HeaderMap::get(self, name).map(HeaderValue::as_bytes)
    }

    fn is_repeated(&self, name: &str) -> bool {
        self.get_all(name).iter().nth(1).is_some()
    }

    fn set(&mut self, name: &str, value: &str) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            self.insert(name, value);
        }
    }
}

impl<C: Carrier + Default> Carrier for Option<C> {
    fn get(&self, name: &str) -> Option<&[u8]> {
        self.as_ref()?.get(name)
    }

    fn is_repeated(&self, name: &str) -> bool {
        self.as_ref()
            .is_some_and(|carrier| carrier.is_repeated(name))
    }

    fn set(&mut self, name: &str, value: &str) {
        self.get_or_insert_with(C::default).set(name, value);
    }
}

impl<C: Carrier + ?Sized> Carrier for &mut C {
    fn get(&self, name: &str) -> Option<&[u8]> {
        (**self).get(name)
    }

    fn is_repeated(&self, name: &str) -> bool {
        (**self).is_repeated(name)
    }

    fn set(&mut self, name: &str, value: &str) {
        (**self).set(name, value);
    }
}

/// Kafka record headers (rdkafka's `OwnedHeaders`, feature `kafka`). A header is read
/// when its value is present; one sent twice [`is_repeated`](Carrier::is_repeated), so
/// [`MessageCorrelation::read`] refuses it as the HTTP layer refuses a repeated header.
/// [`set`](Carrier::set) replaces every header of that name. Read a consumed record's
/// headers with `message.headers().map(Headers::detach)`. Kafka header keys are
/// case-sensitive: a producer that writes `X-Correlation-Id` is not read by the default
/// `x-correlation-id` (set [`MessageCorrelation::header`] to its spelling).
#[cfg(feature = "kafka")]
impl Carrier for rdkafka::message::OwnedHeaders {
    fn get(&self, name: &str) -> Option<&[u8]> {
        use rdkafka::message::Headers as _;
        self.iter()
            .find(|header| header.key == name)
            .and_then(|header| header.value)
    }

    fn is_repeated(&self, name: &str) -> bool {
        use rdkafka::message::Headers as _;
        self.iter()
            .filter(|header| header.key == name)
            .nth(1)
            .is_some()
    }

    fn set(&mut self, name: &str, value: &str) {
        use rdkafka::message::{Header, Headers as _};
        let mut rebuilt = rdkafka::message::OwnedHeaders::new_with_capacity(self.count() + 1);
        for header in self.iter().filter(|header| header.key != name) {
            rebuilt = rebuilt.insert(header);
        }
        *self = rebuilt.insert(Header {
            key: name,
            value: Some(value),
        });
    }
}

/// A header table entry holding text: a long string (what publishers send) or a short
/// one. Other AMQP types (numbers, tables) are not an ID.
#[cfg(feature = "amqp")]
impl Carrier for lapin::types::FieldTable {
    fn get(&self, name: &str) -> Option<&[u8]> {
        use lapin::types::AMQPValue;
        match self.inner().get(name)? {
            AMQPValue::LongString(text) => Some(text.as_bytes()),
            AMQPValue::ShortString(text) => Some(text.as_str().as_bytes()),
            AMQPValue::ByteArray(bytes) => Some(bytes.as_slice()),
            _ => None,
        }
    }

    fn set(&mut self, name: &str, value: &str) {
        use lapin::types::{AMQPValue, LongString, ShortString};
        let Ok(name) = ShortString::try_new(name) else {
            return;
        };
        self.insert(name, AMQPValue::LongString(LongString::from(value)));
    }
}

/// Correlation for message consumers and publishers: the ID of a delivery, restored
/// from the message's headers (or its envelope) and extended for this delivery, and the
/// ID written into the headers of the messages it sends.
///
/// ```
/// use http::HeaderMap;
/// use tower_ids_correlation::{Carrier, CorrelationId, MessageCorrelation};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let correlation = MessageCorrelation::new();
///
/// // A delivery whose publisher sent `attempt-001` (with lapin: the delivery's
/// // `properties.headers()`, an `Option<FieldTable>`).
/// let mut incoming = HeaderMap::new();
/// incoming.set("x-correlation-id", "attempt-001");
/// let id = correlation.for_delivery(&incoming); // attempt-001.Aq9: this delivery's
/// assert!(id.as_str().starts_with("attempt-001."));
///
/// id.clone().scope(async {
///     // Inside the `correlation` span and task-local: every log line carries the ID.
///     let mut outgoing = HeaderMap::new();
///     correlation.inject_current(&mut outgoing);
///     assert_eq!(outgoing["x-correlation-id"], CorrelationId::current().unwrap().as_str());
/// })
/// .await;
/// # }
/// ```
///
/// A consumer that runs each delivery in [`scope`](Self::scope) rather than
/// [`CorrelationId::scope`] also continues the message's trace (feature
/// `opentelemetry`).
///
/// A missing ID is generated (UUIDv7); an invalid one (empty, too long, a character
/// other than letters, digits and `-._:`, or a repeated header) is replaced by a
/// generated one with the WARN event `correlation.invalid`, carrying the new ID and the
/// reason and never the value, as [`CorrelationLayer`](super::CorrelationLayer) does.
#[derive(Debug, Clone)]
#[must_use]
pub struct MessageCorrelation {
    header: Cow<'static, str>,
    max_len: usize,
    extend_per_delivery: bool,
}

impl Default for MessageCorrelation {
    fn default() -> Self {
        Self::new()
    }
}

impl MessageCorrelation {
    /// Reads and writes `x-correlation-id` ([`DEFAULT_HEADER`](super::DEFAULT_HEADER)),
    /// IDs up to [`DEFAULT_MAX_LEN`] bytes, each delivery extended
    /// ([`CorrelationId::extend_redelivery`]).
    pub fn new() -> Self {
        Self {
            header: Cow::Borrowed("x-correlation-id"),
            max_len: DEFAULT_MAX_LEN,
            extend_per_delivery: true,
        }
    }

    /// The header the ID is read from and written to. Default `x-correlation-id`.
    pub fn header(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.header = name.into();
        self
    }

    /// The longest ID accepted from a message, in bytes. Default [`DEFAULT_MAX_LEN`].
    ///
    /// # Panics
    ///
    /// Below [`MIN_MAX_LEN`](super::MIN_MAX_LEN): a generated ID must fit.
    pub fn max_len(mut self, max_len: usize) -> Self {
        assert!(
            max_len >= super::MIN_MAX_LEN,
            "a correlation id bound of {max_len} bytes cannot hold a UUID"
        );
        self.max_len = max_len;
        self
    }

    /// Extend each delivery's ID with [`CorrelationId::extend_redelivery`]'s suffix
    /// (`attempt-001.Aq9`), so the first delivery of a message and its redeliveries are
    /// told apart in the logs while a search for the publisher's ID finds them all.
    /// Default on.
    pub fn extend_per_delivery(mut self, extend: bool) -> Self {
        self.extend_per_delivery = extend;
        self
    }

    /// The ID the message carries in its header, validated: `Ok(None)` when it has
    /// none.
    pub fn read(
        &self,
        carrier: &impl Carrier,
    ) -> Result<Option<CorrelationId>, CorrelationIdError> {
        if carrier.is_repeated(&self.header) {
            return Err(CorrelationIdError::multiple_values());
        }
        let Some(raw) = carrier.get(&self.header) else {
            return Ok(None);
        };
        self.parse(raw).map(Some)
    }

    fn parse(&self, raw: &[u8]) -> Result<CorrelationId, CorrelationIdError> {
        let value =
            HeaderValue::from_bytes(raw).map_err(|_| CorrelationIdError::not_visible_ascii())?;
        CorrelationId::from_header_value(&value, self.max_len, &DefaultValidator)
    }

    /// The ID of this delivery of the message whose headers are `carrier`: the
    /// publisher's ID (or a generated one), extended for this delivery unless
    /// [`extend_per_delivery`](Self::extend_per_delivery) is off. Run the handler in
    /// [`CorrelationId::scope`] to put it in the span and the task-local.
    pub fn for_delivery(&self, carrier: &impl Carrier) -> CorrelationId {
        self.delivered(self.read(carrier))
    }

    /// As [`for_delivery`](Self::for_delivery), from a field of the message's envelope
    /// (a JSON `correlationId`, say) rather than a header; `None` when it has none.
    pub fn for_envelope(&self, value: Option<&str>) -> CorrelationId {
        self.delivered(value.map(|value| self.parse(value.as_bytes())).transpose())
    }

    fn delivered(&self, read: Result<Option<CorrelationId>, CorrelationIdError>) -> CorrelationId {
        let id = match read {
            Ok(Some(id)) => id,
            Ok(None) => CorrelationId::new_with_max_len(self.max_len),
            Err(error) => {
                let id = CorrelationId::new_with_max_len(self.max_len);
                tracing::warn!(
                    target: "tower_ids::correlation",
                    event = "correlation.invalid",
                    correlation_id = id.as_str(),
                    header = &*self.header,
                    reason = error.reason(),
                    detail = %error,
                    "invalid correlation id on a message replaced by a fresh one"
                );
                id
            }
        };
        if self.extend_per_delivery {
            id.extend_redelivery()
        } else {
            id
        }
    }

    /// Writes `id` into the headers of an outgoing message, unless they already carry
    /// one (as [`OutboundCorrelationLayer`](super::OutboundCorrelationLayer) never
    /// overwrites a header).
    pub fn inject(&self, carrier: &mut impl Carrier, id: &CorrelationId) {
        if carrier.get(&self.header).is_none() {
            carrier.set(&self.header, id.as_str());
        }
    }

    /// Writes the current task's ID ([`CorrelationId::current`]) into `carrier`, as
    /// [`inject`](Self::inject); nothing when there is none. With the `opentelemetry`
    /// feature, also the current span's W3C trace context (`traceparent`, and
    /// `tracestate` if any; see [`TraceContext`](super::TraceContext)), unless the
    /// carrier has one, so the consumer's [`scope`](Self::scope) continues the trace.
    pub fn inject_current(&self, carrier: &mut impl Carrier) {
        if let Some(id) = CorrelationId::current() {
            self.inject(carrier, &id);
        }
        #[cfg(feature = "opentelemetry")]
        if let Some(trace) = super::TraceContext::current() {
            trace.inject(carrier);
        }
    }

    /// Runs `future`, the handling of one delivery, under `id` (from
    /// [`for_delivery`](Self::for_delivery) or [`for_envelope`](Self::for_envelope)):
    /// in the task-local and in a `correlation` span, as [`CorrelationId::scope`] does.
    ///
    /// With the `opentelemetry` feature the span continues the trace of the message's
    /// `traceparent` (the publisher's, written by [`inject_current`](Self::inject_current)),
    /// records it in its `trace_id` field, and is a consumer span (`otel.kind =
    /// "consumer"`): the publisher's trace goes on into the consumer's lines and spans.
    /// The message's context is the span's parent, not a link: one message is handled
    /// per span, the case where OpenTelemetry's messaging conventions let the consumer
    /// continue the creation context, so the whole user action reads as one trace.
    pub fn scope<F: Future>(
        &self,
        id: CorrelationId,
        carrier: &impl Carrier,
        future: F,
    ) -> Instrumented<TaskLocalFuture<CorrelationId, F>> {
        #[cfg(not(feature = "opentelemetry"))]
        let span = {
            let _ = carrier;
            tracing::info_span!(target: "tower_ids::correlation", "correlation", correlation_id = %id)
        };
        #[cfg(feature = "opentelemetry")]
        let span = {
            let span = tracing::info_span!(
                target: "tower_ids::correlation",
                "correlation",
                correlation_id = %id,
                trace_id = tracing::field::Empty,
                otel.kind = "consumer",
            );
            match super::TraceContext::extract(carrier) {
                Some(trace) => trace.continue_in(&span),
                None => super::otel::continue_trace(&span, &http::HeaderMap::new()),
            }
            span
        };
        id.task_local(future).instrument(span)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_restored_extended_and_never_overwritten() {
        let correlation = MessageCorrelation::new();
        let mut headers = HeaderMap::new();
        headers.set("x-correlation-id", "attempt-001");
        let first = correlation.for_delivery(&headers);
        let again = correlation.for_delivery(&headers);
        assert!(first.as_str().starts_with("attempt-001."), "{first}");
        assert_eq!(first.as_str().len(), "attempt-001".len() + 4);
        // Two deliveries of one message in one tick differ unless 10 random bits agree.
        let _ = again;

        let mut outgoing = HeaderMap::new();
        outgoing.set("x-correlation-id", "mine");
        correlation.inject(&mut outgoing, &first);
        assert_eq!(outgoing["x-correlation-id"], "mine");

        let unextended = MessageCorrelation::new().extend_per_delivery(false);
        assert_eq!(unextended.for_delivery(&headers), "attempt-001");
    }

    #[test]
    fn a_bad_or_missing_id_is_replaced() {
        let correlation = MessageCorrelation::new().extend_per_delivery(false);
        let mut repeated = HeaderMap::new();
        repeated.append("x-correlation-id", HeaderValue::from_static("a"));
        repeated.append("x-correlation-id", HeaderValue::from_static("b"));
        assert_eq!(
            correlation.read(&repeated).unwrap_err().reason(),
            "multiple_values"
        );
        let generated = correlation.for_delivery(&repeated);
        assert_eq!(generated.as_str().len(), 36);
        let none: Option<HeaderMap> = None;
        assert_eq!(correlation.for_delivery(&none).as_str().len(), 36);
        assert_eq!(
            correlation.for_envelope(Some("has space")).as_str().len(),
            36
        );
        assert_eq!(correlation.for_envelope(Some("env-1")), "env-1");
    }

    #[test]
    fn an_absent_table_is_made_on_the_first_write() {
        let mut table: Option<HeaderMap> = None;
        MessageCorrelation::new().inject(&mut table, &CorrelationId::parse("c-1").unwrap());
        assert_eq!(table.unwrap()["x-correlation-id"], "c-1");
    }

    #[cfg(feature = "amqp")]
    #[test]
    fn an_amqp_header_table_carries_the_id() {
        use lapin::types::{AMQPValue, FieldTable, ShortString};

        let mut table = FieldTable::default();
        let correlation = MessageCorrelation::new().extend_per_delivery(false);
        correlation.inject(&mut table, &CorrelationId::parse("amqp-1").unwrap());
        assert_eq!(correlation.for_delivery(&table), "amqp-1");
        let mut short = FieldTable::default();
        short.insert(
            ShortString::from("x-correlation-id"),
            AMQPValue::ShortString(ShortString::from("short-1")),
        );
        assert_eq!(correlation.for_delivery(&short), "short-1");
        let mut number = FieldTable::default();
        number.insert(ShortString::from("x-correlation-id"), AMQPValue::LongInt(7));
        assert_eq!(correlation.read(&number).unwrap(), None);
    }
}
