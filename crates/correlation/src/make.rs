use http::Request;
use tracing::{Level, Span};

use super::CorrelationId;

/// Makes the correlation ID of a request that arrived without a usable one.
///
/// Implemented for closures `FnMut(&Request<B>) -> CorrelationId`; the default is
/// [`MakeUuidV7`].
pub trait MakeCorrelationId<B> {
    /// A new ID for `request`.
    fn make_correlation_id(&mut self, request: &Request<B>) -> CorrelationId;
}

impl<B, F> MakeCorrelationId<B> for F
where
    F: FnMut(&Request<B>) -> CorrelationId,
{
    fn make_correlation_id(&mut self, request: &Request<B>) -> CorrelationId {
        self(request)
    }
}

/// Generates UUIDv7 correlation IDs: time-ordered, so a log sorted by ID is sorted by
/// time, with 74 random bits from uuid's fast RNG.
#[derive(Debug, Clone, Copy, Default)]
pub struct MakeUuidV7;

impl<B> MakeCorrelationId<B> for MakeUuidV7 {
    fn make_correlation_id(&mut self, _request: &Request<B>) -> CorrelationId {
        CorrelationId::new()
    }
}

/// Makes the span the inner service runs in, as tower-http's `MakeSpan`.
///
/// Implemented for closures `FnMut(&Request<B>, &CorrelationId) -> Span`. Record the
/// ID in a field named `correlation_id` so log searches work across services.
///
/// ```
/// use http::Request;
/// use tower_ids_correlation::{CorrelationId, CorrelationLayer};
///
/// let layer = CorrelationLayer::new().make_span(|request: &Request<()>, id: &CorrelationId| {
///     tracing::info_span!(
///         "request",
///         correlation_id = id.as_str(),
///         method = %request.method(),
///         path = request.uri().path(),
///     )
/// });
/// # let _ = layer;
/// ```
pub trait MakeSpan<B> {
    /// The span for `request`, whose effective ID is `id`.
    fn make_span(&mut self, request: &Request<B>, id: &CorrelationId) -> Span;
}

impl<B, F> MakeSpan<B> for F
where
    F: FnMut(&Request<B>, &CorrelationId) -> Span,
{
    fn make_span(&mut self, request: &Request<B>, id: &CorrelationId) -> Span {
        self(request, id)
    }
}

/// The field every span of the layer records the correlation ID in.
pub(super) const CORRELATION_ID_FIELD: &str = "correlation_id";

/// The default span: `correlation`, with the field `correlation_id`, at INFO, and the
/// idempotency layer's fields, empty until an idempotency layer inside records them
/// (see `tower_ids::idempotency::field`).
///
/// With the `opentelemetry` feature it also has `trace_id` (the W3C trace ID, recorded
/// by the layer) and `otel.kind = "server"`.
///
/// INFO, unlike tower-http's DEBUG trace span, because the span exists to put the ID on
/// every event inside it: a span a usual `info` filter disabled would drop the ID from
/// exactly the lines that need it. Method, path and timings are tower-http `TraceLayer`'s
/// job; put it inside this layer and its span nests in this one.
#[derive(Debug, Clone, Copy)]
pub struct DefaultMakeSpan {
    level: Level,
}

impl DefaultMakeSpan {
    /// The default span at INFO.
    pub fn new() -> Self {
        Self { level: Level::INFO }
    }

    /// The span at another level.
    pub fn level(mut self, level: Level) -> Self {
        self.level = level;
        self
    }
}

impl Default for DefaultMakeSpan {
    fn default() -> Self {
        Self::new()
    }
}

impl<B> MakeSpan<B> for DefaultMakeSpan {
    fn make_span(&mut self, _request: &Request<B>, id: &CorrelationId) -> Span {
        // No span at all when nothing listens at this level: a disabled span still
        // forwards its enter, exit and close to `log` under tracing's `log` feature.
        if !tracing::level_enabled!(self.level) {
            return Span::none();
        }
        // `trace_id` is recorded once the incoming trace is continued.
        macro_rules! span {
            ($level:expr) => {
                request_span!($level, "correlation", correlation_id = %id,)
            };
        }
        match self.level {
            Level::ERROR => span!(Level::ERROR),
            Level::WARN => span!(Level::WARN),
            Level::INFO => span!(Level::INFO),
            Level::DEBUG => span!(Level::DEBUG),
            Level::TRACE => span!(Level::TRACE),
        }
    }
}

/// Runs the inner service in the span that is already current, recording the
/// correlation ID in its `correlation_id` field: for a span made outside the layer, by
/// tower-http's `TraceLayer` (as [`CorrelationLayer::access_log`] does), so that one
/// span per request carries the ID and the access line is logged inside it.
///
/// The span must declare the field, empty, for the ID to be recorded
/// (`correlation_id = tracing::field::Empty`); with the `opentelemetry` feature, a
/// `trace_id` field as well. A span entered before this layer runs has started, so its
/// maker continues an incoming trace, not this layer.
///
/// ```
/// use http::Request;
/// use tower::ServiceBuilder;
/// use tower_http::trace::TraceLayer;
/// use tower_ids_correlation::{CorrelationLayer, CurrentSpan};
/// # let handler = tower::service_fn(|_: Request<String>| async {
/// #     Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
/// # });
///
/// let service = ServiceBuilder::new()
///     // Outermost: it sees every answer, the correlation layer's refusals included.
///     .layer(TraceLayer::new_for_http().make_span_with(|request: &Request<String>| {
///         tracing::info_span!(
///             "request",
///             method = %request.method(),
///             path = request.uri().path(),
///             correlation_id = tracing::field::Empty,
///         )
///     }))
///     .layer(CorrelationLayer::new().make_span(CurrentSpan))
///     .service(handler);
/// # let _ = service;
/// ```
///
/// [`CorrelationLayer::access_log`] does this for you, with the access line.
#[cfg_attr(
    feature = "access-log",
    doc = "",
    doc = "[`CorrelationLayer::access_log`]: super::CorrelationLayer::access_log"
)]
#[cfg_attr(
    not(feature = "access-log"),
    doc = "",
    doc = "[`CorrelationLayer::access_log`]: super::CorrelationLayer"
)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CurrentSpan;

impl<B> MakeSpan<B> for CurrentSpan {
    fn make_span(&mut self, _request: &Request<B>, id: &CorrelationId) -> Span {
        let span = Span::current();
        span.record(CORRELATION_ID_FIELD, id.as_str());
        span
    }
}
