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
    if span.is_disabled() {
        return;
    }
    let mut incoming = None;
    if headers.contains_key(TRACEPARENT) {
        let parent =
            TraceContextPropagator::new().extract_with_context(&Context::new(), &Extract(headers));
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
pub(crate) fn inject_trace_context(headers: &mut HeaderMap) {
    if headers.contains_key(TRACEPARENT) {
        return;
    }
    let context = Span::current().context();
    if context.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&context, &mut Inject(headers));
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
