//! One access line per request, inside the correlation span (feature `access-log`).
//!
//! tower-http's `TraceLayer` outside the correlation layer sees every answer, the
//! correlation layer's own refusals included, but its span, made before the ID is
//! known, carries no correlation ID; inside, its span carries the ID but it never sees
//! a refusal. [`AccessLogLayer`] puts a `TraceLayer` outside and has the correlation
//! layer record the ID in that layer's span ([`CurrentSpan`]): one span per request,
//! made first, closed last, with the ID, and one line when the answer leaves.

use std::time::Duration;

use http::{Request, Response};
use tower_http::{
    classify::{ServerErrorsAsFailures, SharedClassifier},
    trace::{OnResponse, Trace, TraceLayer},
};
use tower_layer::Layer;
use tracing::Span;

use super::{
    log_millis as millis, Correlation, CorrelationLayer, CurrentSpan, DefaultValidator, MakeUuidV7,
};

/// The service [`AccessLogLayer`] makes: tower-http's `Trace` around the correlation
/// layer, around `S`.
pub type AccessLog<S, M = MakeUuidV7, V = DefaultValidator> = Trace<
    Correlation<S, M, V, CurrentSpan>,
    SharedClassifier<ServerErrorsAsFailures>,
    AccessSpan,
    (),
    AccessLine,
    (),
    (),
    (),
>;

/// The correlation layer with an access line per request: made by
/// [`CorrelationLayer::access_log`].
///
/// Every request, whatever answers it (the handler, the idempotency layer's refusals
/// and replays, the correlation layer's own `400` in `enforce` mode), logs exactly one
/// INFO event, `event = "http.access"`, with `status` and `latency_ms`, inside the span
/// `request{method, path, correlation_id}` (plus `trace_id` with the `opentelemetry`
/// feature, and what an idempotency layer inside recorded: see [`AccessSpan`]). It is
/// the request's canonical line: with the idempotency layer's steps at DEBUG, a request
/// that goes well writes only this line at INFO. Every other event of the request is logged inside that span too, so it
/// carries the correlation ID as the plain layer's span does.
///
/// A request whose inner service fails with an error instead of a response (never, on
/// axum) logs no access line, nor does one whose client went away before the answer;
/// if such a request had claimed an idempotency key, its work runs on and the
/// idempotency layer logs its line, INFO `idempotency.detached`, in this span when the
/// work settles.
///
/// # Clone
///
/// As [`CorrelationLayer`]: settings behind an `Arc`, the rest cloned.
#[derive(Debug, Clone)]
#[must_use]
pub struct AccessLogLayer<M = MakeUuidV7, V = DefaultValidator> {
    correlation: CorrelationLayer<M, V, CurrentSpan>,
    span: AccessSpan,
}

impl<M, V, P> CorrelationLayer<M, V, P> {
    /// This layer with tower-http's `TraceLayer` outside it, logging one access line
    /// per request inside the request's span; see [`AccessLogLayer`].
    ///
    /// The span is [`AccessSpan`], in place of the one [`make_span`](Self::make_span)
    /// would make.
    ///
    /// ```
    /// use axum::{routing::get, Router};
    /// use tower_ids_correlation::CorrelationLayer;
    ///
    /// let app: Router = Router::new()
    ///     .route("/", get(|| async { "ok" }))
    ///     // Outermost, as the plain layer: every answer gets its line.
    ///     .layer(CorrelationLayer::new().access_log());
    /// # let _ = app;
    /// ```
    pub fn access_log(self) -> AccessLogLayer<M, V> {
        #[cfg_attr(not(feature = "opentelemetry"), allow(unused_mut))]
        let mut correlation = self.make_span(CurrentSpan);
        let span = AccessSpan {
            #[cfg(feature = "opentelemetry")]
            trace_context: correlation.settings.trace_context,
        };
        // The span is entered before the correlation layer runs, so `AccessSpan`
        // continues the incoming trace, not the correlation layer.
        #[cfg(feature = "opentelemetry")]
        {
            std::sync::Arc::make_mut(&mut correlation.settings).trace_context = false;
        }
        AccessLogLayer { correlation, span }
    }
}

impl<S, M: Clone, V: Clone> Layer<S> for AccessLogLayer<M, V> {
    type Service = AccessLog<S, M, V>;

    fn layer(&self, inner: S) -> Self::Service {
        TraceLayer::new_for_http()
            .make_span_with(self.span.clone())
            .on_request(())
            .on_response(AccessLine)
            .on_body_chunk(())
            .on_eos(())
            .on_failure(())
            .layer(self.correlation.layer(inner))
    }
}

/// The request's span for [`AccessLogLayer`]: `request`, at INFO, with `method`, `path`
/// (never the query, which may hold secrets), and empty fields the layers inside record:
/// `correlation_id`, and the idempotency layer's `idempotency_*` fields (its key,
/// scope, client, outcome, request count and store time; see
/// `tower_ids::idempotency::field`), so that the access line, logged in this span,
/// says what the layers did.
///
/// With the `opentelemetry` feature it also has `trace_id` and `otel.kind = "server"`,
/// and continues the trace of an incoming W3C `traceparent`.
#[derive(Debug, Clone)]
pub struct AccessSpan {
    #[cfg(feature = "opentelemetry")]
    trace_context: bool,
}

impl<B> tower_http::trace::MakeSpan<B> for AccessSpan {
    fn make_span(&mut self, request: &Request<B>) -> Span {
        let span = request_span!(
            tracing::Level::INFO,
            "request",
            method = %request.method(),
            path = request.uri().path(),
            correlation_id = tracing::field::Empty,
        );
        #[cfg(feature = "opentelemetry")]
        if self.trace_context {
            super::otel::continue_trace(&span, request.headers());
        }
        span
    }
}

/// The access line: `event = "http.access"`, `status` and `latency_ms` (to the
/// response head, to the microsecond), at INFO, inside the request's span.
#[derive(Debug, Clone, Copy, Default)]
pub struct AccessLine;

impl<B> OnResponse<B> for AccessLine {
    fn on_response(self, response: &Response<B>, latency: Duration, _span: &Span) {
        tracing::info!(
            target: "tower_ids::correlation",
            event = "http.access",
            status = response.status().as_u16(),
            latency_ms = millis(latency),
            "request answered"
        );
    }
}
