//! W3C trace context and baggage for the correlation layers (feature `opentelemetry`).
//!
//! - Server: an incoming `traceparent` (and `tracestate`) becomes the parent of the
//!   correlation span through `tracing-opentelemetry`, and the span records the trace
//!   ID in its `trace_id` field; with [`baggage`](super::CorrelationLayer::baggage), a
//!   request without a correlation header takes its ID from the `correlation_id` member
//!   of W3C `baggage`.
//! - Client: the outgoing request gets `traceparent` (and `tracestate`) from the
//!   current span's OpenTelemetry context, and with
//!   [`baggage`](super::OutboundCorrelationLayer::baggage) the correlation ID in
//!   `baggage`.
//!
//! The propagation is W3C's whatever global propagator is installed: these headers are
//! what the layers promise, with or without an OpenTelemetry pipeline behind them.

use std::borrow::Cow;

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::{
    baggage::BaggageExt as _,
    propagation::{Extractor, Injector, TextMapPropagator as _},
    trace::{TraceContextExt as _, TraceId},
    Context,
};
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use super::CorrelationId;

/// `traceparent`: the W3C trace context header, read on requests the server layer
/// receives and set on requests the outbound layers send.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// `tracestate`: the vendor part of the W3C trace context, travelling with
/// `traceparent`.
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// `baggage`: the W3C baggage header.
pub const BAGGAGE: HeaderName = HeaderName::from_static("baggage");

/// The baggage member that carries the correlation ID: `baggage: correlation_id=<id>`.
pub const BAGGAGE_CORRELATION_ID: &str = "correlation_id";

struct Extract<'a>(&'a HeaderMap);

impl Extractor for Extract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct Inject<'a>(&'a mut HeaderMap);

impl Injector for Inject<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// Continues the trace of an incoming `traceparent` on `span` (if the span has not
/// started yet), and records the trace ID in the span's `trace_id` field: the
/// OpenTelemetry span's (continued, or a new trace), else the incoming one, so logs
/// have it even without an OpenTelemetry pipeline.
pub(super) fn continue_trace(span: &Span, headers: &HeaderMap) {
    continue_from(span, headers.contains_key(TRACEPARENT), &Extract(headers));
}

/// [`continue_trace`] from any extractor; `has_parent` when it holds a `traceparent`.
fn continue_from(span: &Span, has_parent: bool, extractor: &dyn Extractor) {
    if span.is_disabled() {
        return;
    }
    let mut incoming = None;
    if has_parent {
        let parent = TraceContextPropagator::new().extract_with_context(&Context::new(), extractor);
        let remote = parent.span().span_context().trace_id();
        if remote != TraceId::INVALID {
            incoming = Some(remote);
            // Fails only when there is no OpenTelemetry layer, or the span has started
            // (it was entered before this layer ran): the span's maker continued it then.
            let _ = span.set_parent(parent);
        }
    }
    let own = span.context().span().span_context().trace_id();
    let trace_id = if own == TraceId::INVALID {
        incoming
    } else {
        Some(own)
    };
    if let Some(trace_id) = trace_id {
        span.record("trace_id", tracing::field::display(trace_id));
    }
}

/// Sets the `correlation_id` attribute on the OpenTelemetry span of a span that has no
/// such field (a custom [`MakeSpan`](super::MakeSpan)'s); a field becomes an attribute
/// by itself.
pub(super) fn set_correlation_attribute(span: &Span, id: &CorrelationId) {
    if !span.is_disabled() && span.field(super::make::CORRELATION_ID_FIELD).is_none() {
        span.set_attribute(super::make::CORRELATION_ID_FIELD, id.to_string());
    }
}

/// The trace context of the current span, on `headers`, unless they carry a
/// `traceparent` already. Nothing without a valid OpenTelemetry context.
pub fn inject_trace_context(headers: &mut HeaderMap) {
    if headers.contains_key(TRACEPARENT) {
        return;
    }
    let context = Span::current().context();
    if context.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&context, &mut Inject(headers));
    }
}

/// A W3C trace context (`traceparent`, and `tracestate` when there is one) taken out of
/// a span, to travel where a span cannot: a message's headers, an outbox row, an
/// in-process queue (feature `opentelemetry`).
///
/// Work done later on behalf of a request (publishing its event from an outbox, a
/// consumer handling that event) continues the request's trace from it, so that every
/// line it logs carries the request's `trace_id` and the spans form one trace.
///
/// ```
/// use tower_ids_correlation::TraceContext;
///
/// // Stored with the work (here, two text columns of an outbox row) ...
/// let stored = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None)
///     .expect("a valid traceparent");
/// assert_eq!(stored.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
///
/// // ... continued by the span that does the work, before it is entered.
/// let span = tracing::info_span!("publish", trace_id = tracing::field::Empty, otel.kind = "producer");
/// stored.continue_in(&span);
///
/// // Unparseable values are refused, never carried on.
/// assert!(TraceContext::parse("00-not-a-trace", None).is_none());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

impl TraceContext {
    /// The current span's trace context; `None` when it has no valid OpenTelemetry
    /// context (no `tracing-opentelemetry` layer, or the span is disabled).
    pub fn current() -> Option<Self> {
        Self::of(&Span::current())
    }

    /// `span`'s trace context; `None` as for [`current`](Self::current).
    pub fn of(span: &Span) -> Option<Self> {
        let context = span.context();
        if !context.span().span_context().is_valid() {
            return None;
        }
        let mut fields = Fields::default();
        TraceContextPropagator::new().inject_context(&context, &mut fields);
        Self::from_fields(fields)
    }

    /// A trace context from its two W3C values, as stored; `None` unless `traceparent`
    /// is a valid W3C `traceparent` (an invalid `tracestate` is dropped).
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let mut fields = Fields::default();
        fields.0.push(("traceparent", traceparent.to_owned()));
        if let Some(tracestate) = tracestate {
            fields.0.push(("tracestate", tracestate.to_owned()));
        }
        // Parsed as the propagator parses it, and written back as it writes it.
        let context = TraceContextPropagator::new().extract_with_context(&Context::new(), &fields);
        if !context.span().span_context().is_valid() {
            return None;
        }
        let mut canonical = Fields::default();
        TraceContextPropagator::new().inject_context(&context, &mut canonical);
        Self::from_fields(canonical)
    }

    /// The trace context a message carries in its headers (`traceparent` and
    /// `tracestate`); `None` when it has none, or an invalid one.
    pub fn extract(carrier: &impl super::Carrier) -> Option<Self> {
        let text = |name| {
            carrier
                .get(name)
                .and_then(|value| std::str::from_utf8(value).ok())
        };
        Self::parse(text("traceparent")?, text("tracestate"))
    }

    /// Writes `traceparent` (and `tracestate`) into an outgoing message's headers,
    /// unless they carry a `traceparent` already.
    pub fn inject(&self, carrier: &mut impl super::Carrier) {
        if carrier.get("traceparent").is_some() {
            return;
        }
        carrier.set("traceparent", &self.traceparent);
        if let Some(tracestate) = &self.tracestate {
            carrier.set("tracestate", tracestate);
        }
    }

    /// Makes `span` continue this trace, as the server layer does for an incoming
    /// `traceparent`: its parent (the span must not have been entered yet), and its
    /// `trace_id` field if it declares one.
    pub fn continue_in(&self, span: &Span) {
        let mut fields = Fields::default();
        fields.0.push(("traceparent", self.traceparent.clone()));
        if let Some(tracestate) = &self.tracestate {
            fields.0.push(("tracestate", tracestate.clone()));
        }
        continue_from(span, true, &fields);
    }

    /// The W3C `traceparent` value.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The W3C `tracestate` value, if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The trace ID, 32 lowercase hex digits.
    pub fn trace_id(&self) -> &str {
        // `00-<trace id>-<parent id>-<flags>`, checked by `parse` or written by the
        // propagator.
        &self.traceparent[3..35]
    }

    fn from_fields(fields: Fields) -> Option<Self> {
        let mut traceparent = None;
        let mut tracestate = None;
        for (name, value) in fields.0 {
            match name {
                "traceparent" => traceparent = Some(value),
                "tracestate" if !value.is_empty() => tracestate = Some(value),
                _ => {}
            }
        }
        Some(Self {
            traceparent: traceparent?,
            tracestate,
        })
    }
}

/// The two W3C fields, for the propagator to read and write.
#[derive(Default)]
struct Fields(Vec<(&'static str, String)>);

impl Extractor for Fields {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| *name == key)
            .map(|(_, value)| value.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| *name).collect()
    }
}

impl Injector for Fields {
    fn set(&mut self, key: &str, value: String) {
        let name = match key {
            "traceparent" => "traceparent",
            "tracestate" => "tracestate",
            _ => return,
        };
        self.0.push((name, value));
    }
}

/// The `correlation_id` member of the request's W3C baggage, percent-decoded.
pub(super) fn from_baggage(headers: &HeaderMap) -> Option<String> {
    if !headers.contains_key(BAGGAGE) {
        return None;
    }
    let context = BaggagePropagator::new().extract_with_context(&Context::new(), &Extract(headers));
    let value = context.baggage().get(BAGGAGE_CORRELATION_ID)?;
    Some(value.as_str().to_owned())
}

/// Adds `correlation_id=<id>` to the outgoing `baggage`, keeping its other members,
/// unless it names a correlation ID already.
pub(crate) fn add_to_baggage(headers: &mut HeaderMap, id: &CorrelationId) {
    let member = format!("{BAGGAGE_CORRELATION_ID}={}", encode(id.as_str()));
    let value = match headers.get(BAGGAGE).map(HeaderValue::to_str) {
        None => member,
        Some(Ok(existing)) if has_member(existing) => return,
        Some(Ok(existing)) if existing.trim().is_empty() => member,
        Some(Ok(existing)) => format!("{existing},{member}"),
        // Not text: not ours to repair.
        Some(Err(_)) => return,
    };
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert(BAGGAGE, value);
    }
}

fn has_member(baggage: &str) -> bool {
    baggage.split(',').any(|member| {
        member
            .split(['=', ';'])
            .next()
            .is_some_and(|key| key.trim() == BAGGAGE_CORRELATION_ID)
    })
}

/// Percent-encodes what a W3C baggage value may not hold as it is (a custom validator
/// may allow `,`, `;`, `"`, `\` or `%`); the default alphabet passes unchanged.
fn encode(value: &str) -> Cow<'_, str> {
    let plain = |b: u8| b.is_ascii_graphic() && !matches!(b, b',' | b';' | b'"' | b'\\' | b'%');
    if value.bytes().all(plain) {
        return Cow::Borrowed(value);
    }
    let mut encoded = String::with_capacity(value.len() + 8);
    for b in value.bytes() {
        if plain(b) {
            encoded.push(char::from(b));
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    Cow::Owned(encoded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baggage_keeps_other_members_and_an_existing_id() {
        let id = CorrelationId::parse("abc-1").unwrap();
        let mut headers = HeaderMap::new();
        add_to_baggage(&mut headers, &id);
        assert_eq!(headers[BAGGAGE], "correlation_id=abc-1");

        let mut headers = HeaderMap::new();
        headers.insert(BAGGAGE, HeaderValue::from_static("tenant=7;p=1"));
        add_to_baggage(&mut headers, &id);
        assert_eq!(headers[BAGGAGE], "tenant=7;p=1,correlation_id=abc-1");

        let mut headers = HeaderMap::new();
        headers.insert(BAGGAGE, HeaderValue::from_static("correlation_id=other"));
        add_to_baggage(&mut headers, &id);
        assert_eq!(headers[BAGGAGE], "correlation_id=other");
    }

    #[test]
    fn baggage_is_read_and_decoded() {
        let mut headers = HeaderMap::new();
        headers.insert(
            BAGGAGE,
            HeaderValue::from_static("tenant=7, correlation_id=a%2Cb ;prop"),
        );
        assert_eq!(from_baggage(&headers).as_deref(), Some("a,b"));
        assert_eq!(encode("a,b"), "a%2Cb");
        assert_eq!(encode("abc-1.2:x_y"), "abc-1.2:x_y");
    }
}
