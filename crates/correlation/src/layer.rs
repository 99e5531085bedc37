use std::sync::Arc;

use http::HeaderName;
use tower_layer::Layer;

use super::{
    Correlation, DefaultMakeSpan, DefaultValidator, MakeUuidV7, DEFAULT_HEADER, DEFAULT_MAX_LEN,
};

/// Applies [`Correlation`] to a service: restores or generates the correlation ID of
/// every request.
///
/// See the [module docs](crate) for what it does and an example.
///
/// # Clone
///
/// The header names and bounds are shared behind an `Arc`; the generator, validator
/// and span maker are cloned into each service.
#[derive(Debug, Clone)]
#[must_use]
pub struct CorrelationLayer<M = MakeUuidV7, V = DefaultValidator, P = DefaultMakeSpan> {
    pub(super) settings: Arc<Settings>,
    pub(super) make_id: M,
    pub(super) validator: V,
    pub(super) make_span: P,
}

#[derive(Debug, Clone)]
pub(super) struct Settings {
    /// Read first, rewritten on the request, echoed on the response.
    pub(super) header: HeaderName,
    /// Read in order when `header` is absent.
    pub(super) fallbacks: Vec<HeaderName>,
    pub(super) max_len: usize,
    pub(super) enforce: bool,
    /// The base of problem types, when not [`CORRELATION_PROBLEM_DOCS`](crate::problem::CORRELATION_PROBLEM_DOCS).
    pub(super) problem_docs: Option<Arc<str>>,
    /// Continue an incoming W3C trace on the span.
    #[cfg(feature = "opentelemetry")]
    pub(super) trace_context: bool,
    /// Take the ID from W3C baggage when no header carries one.
    #[cfg(feature = "opentelemetry")]
    pub(super) baggage: bool,
}

impl CorrelationLayer {
    /// The layer with the defaults: header `x-correlation-id`, IDs of at most
    /// [`DEFAULT_MAX_LEN`] bytes, UUIDv7 for requests without a valid one, an INFO span.
    pub fn new() -> Self {
        Self {
            settings: Arc::new(Settings {
                header: DEFAULT_HEADER,
                fallbacks: Vec::new(),
                max_len: DEFAULT_MAX_LEN,
                enforce: false,
                problem_docs: None,
                #[cfg(feature = "opentelemetry")]
                trace_context: true,
                #[cfg(feature = "opentelemetry")]
                baggage: false,
            }),
            make_id: MakeUuidV7,
            validator: DefaultValidator,
            make_span: DefaultMakeSpan::new(),
        }
    }
}

impl Default for CorrelationLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<M, V, P> CorrelationLayer<M, V, P> {
    /// The header read first, set on the request to the effective ID and echoed on the
    /// response. Default `x-correlation-id`.
    pub fn header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.settings).header = name;
        self
    }

    /// Also accept the ID from `name` when the headers before it are absent; call again
    /// to add more, in order. For example `x-request-id`, to continue the ID that
    /// tower-http's `SetRequestId` or a proxy set.
    pub fn accept(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.settings).fallbacks.push(name);
        self
    }

    /// The longest ID accepted from outside, in bytes; extensions respect it too.
    /// Default [`DEFAULT_MAX_LEN`].
    ///
    /// # Panics
    ///
    /// If `max_len` is below [`MIN_MAX_LEN`](super::MIN_MAX_LEN) (36): a generated
    /// UUIDv7 must fit, or every generated ID would break the bound.
    pub fn max_len(mut self, max_len: usize) -> Self {
        assert!(
            max_len >= super::MIN_MAX_LEN,
            "a correlation id bound of {max_len} bytes cannot hold a UUID (36 bytes)"
        );
        Arc::make_mut(&mut self.settings).max_len = max_len;
        self
    }

    /// The base URL of problem types: a refusal's `type` (and its `Link: <...>;
    /// rel="describedby"` header) is `base` followed by its `code`. Default
    /// [`CORRELATION_PROBLEM_DOCS`](crate::problem::CORRELATION_PROBLEM_DOCS), this crate's
    /// page, which has an anchor per code.
    ///
    /// # Panics
    ///
    /// If `base` is not an absolute URL that can be sent in a header.
    pub fn problem_docs(mut self, base: &str) -> Self {
        Arc::make_mut(&mut self.settings).problem_docs =
            Some(crate::problem::checked_docs_base(base));
        self
    }

    /// Answer `400 Bad Request` (problem+json) to a request whose ID is missing or
    /// invalid, instead of generating one. For internal services whose callers must
    /// always send one.
    pub fn enforce(mut self, enforce: bool) -> Self {
        Arc::make_mut(&mut self.settings).enforce = enforce;
        self
    }

    /// Continue the trace of an incoming W3C `traceparent` (and `tracestate`) on the
    /// request's span, through `tracing-opentelemetry`, and record its trace ID in the
    /// span's `trace_id` field. Default on.
    ///
    /// Turn it off at an edge that does not trust its callers' trace context: their
    /// `traceparent` then starts nothing, and each request begins a trace of its own.
    #[cfg(feature = "opentelemetry")]
    pub fn trace_context(mut self, continue_trace: bool) -> Self {
        Arc::make_mut(&mut self.settings).trace_context = continue_trace;
        self
    }

    /// Take the correlation ID from the `correlation_id` member of W3C `baggage` when
    /// none of the accepted headers is present. Default off.
    ///
    /// The value is validated as a header's is; an invalid one counts as absent (an ID
    /// is generated, or `enforce` refuses the request). The ID is then set on the
    /// request's header, as for an ID read from an accepted header.
    #[cfg(feature = "opentelemetry")]
    pub fn baggage(mut self, read: bool) -> Self {
        Arc::make_mut(&mut self.settings).baggage = read;
        self
    }

    /// Generate IDs with `make_id` instead of UUIDv7.
    pub fn make_id<M2>(self, make_id: M2) -> CorrelationLayer<M2, V, P> {
        CorrelationLayer {
            settings: self.settings,
            make_id,
            validator: self.validator,
            make_span: self.make_span,
        }
    }

    /// Check incoming IDs with `validator` instead of [`DefaultValidator`]. The length
    /// bound and "visible ASCII" still apply first.
    pub fn validator<V2>(self, validator: V2) -> CorrelationLayer<M, V2, P> {
        CorrelationLayer {
            settings: self.settings,
            make_id: self.make_id,
            validator,
            make_span: self.make_span,
        }
    }

    /// Run the inner service in the span `make_span` makes.
    pub fn make_span<P2>(self, make_span: P2) -> CorrelationLayer<M, V, P2> {
        CorrelationLayer {
            settings: self.settings,
            make_id: self.make_id,
            validator: self.validator,
            make_span,
        }
    }
}

impl<S, M: Clone, V: Clone, P: Clone> Layer<S> for CorrelationLayer<M, V, P> {
    type Service = Correlation<S, M, V, P>;

    fn layer(&self, inner: S) -> Self::Service {
        Correlation {
            inner,
            settings: self.settings.clone(),
            make_id: self.make_id.clone(),
            validator: self.validator.clone(),
            make_span: self.make_span.clone(),
        }
    }
}
