//! Correlation IDs: one per attempt, restored or generated, carried through tracing,
//! responses and outgoing calls.
//!
//! A correlation ID names one unit of work, one attempt, so its whole story can be found
//! in the logs of every service it touched. It is not an idempotency key (that one is
//! stable across retries): a retry is a new attempt and gets a new correlation ID.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_ids_correlation::{CorrelationId, CorrelationLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Infallible> {
//! let service = ServiceBuilder::new()
//!     .layer(CorrelationLayer::new())
//!     .service(service_fn(|request: Request<String>| async move {
//!         // The effective ID, three ways: extension, task-local, rewritten header.
//!         let id = request.extensions().get::<CorrelationId>().unwrap();
//!         assert_eq!(Some(id.clone()), CorrelationId::current());
//!         assert_eq!(request.headers()["x-correlation-id"], id.as_str());
//!         tracing::info!("inside the `correlation` span, with correlation_id");
//!         Ok::<_, Infallible>(Response::new(String::from("done")))
//!     }));
//!
//! let request = Request::builder()
//!     .header("x-correlation-id", "abcd-efgh")
//!     .body(String::new())
//!     .unwrap();
//! let response = service.oneshot(request).await?;
//! assert_eq!(response.headers()["x-correlation-id"], "abcd-efgh");
//! # Ok(())
//! # }
//! ```
//!
//! With axum, and the `axum` feature for the extractor:
//!
//! ```no_run
//! # #[cfg(feature = "axum")]
//! # mod example {
//! use axum::{routing::get, Router};
//! use tower_ids_correlation::{CorrelationId, CorrelationLayer};
//!
//! async fn handler(id: CorrelationId) -> String {
//!     format!("working on {id}")
//! }
//!
//! # pub async fn run() {
//! let app: Router = Router::new()
//!     .route("/", get(handler))
//!     .layer(CorrelationLayer::new().accept(http::HeaderName::from_static("x-request-id")));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await.unwrap();
//! axum::serve(listener, app).await.unwrap();
//! # }
//! # }
//! # fn main() {}
//! ```
//!
//! # What the server layer does
//!
//! [`CorrelationLayer`] works on any `http::Request<B>` service (axum, hyper, tonic):
//!
//! 1. Reads the ID from `x-correlation-id`, then from each header added with
//!    [`accept`](CorrelationLayer::accept), in order; the first header present is used.
//! 2. Validates it before anything logs it: 1 to 128 bytes ([`DEFAULT_MAX_LEN`]) of
//!    letters, digits and `-._:` ([`DefaultValidator`]), a single header value, never a
//!    space, control character or non-ASCII byte, whatever the validator. A
//!    missing ID is generated (UUIDv7, [`MakeUuidV7`]); an invalid one is replaced by a
//!    generated one with a WARN event `correlation.invalid` that carries the new ID and
//!    the reason, never the value. In [`enforce`](CorrelationLayer::enforce) mode both
//!    are answered `400` instead.
//! 3. Makes the effective ID available: a [`CorrelationId`] in the request extensions,
//!    the `x-correlation-id` request header rewritten to it, a span (`correlation`, with
//!    field `correlation_id`, see [`MakeSpan`]) around the inner service, and a
//!    task-local read by [`CorrelationId::current`].
//! 4. Echoes the ID on the response header, unless the handler set that header.
//!
//! # Messages
//!
//! A message consumer has no layer in front of it: [`MessageCorrelation`] reads the ID
//! from a message's headers through a [`Carrier`] (`http::HeaderMap`, and with the
//! `amqp` feature lapin's `FieldTable`) or from its envelope, validates it as the layer
//! does, extends it per delivery ([`CorrelationId::extend_redelivery`]), and writes it
//! into the headers of the messages the handler sends. Run the handler in
//! [`CorrelationId::scope`] to put it in the span and the task-local.
//!
//! # Layer order
//!
//! Put `CorrelationLayer` outermost, or just inside tower-http's `SetRequestId` when you
//! want its `x-request-id` as a source: everything inside it (the idempotency layer, the
//! handler) then logs inside its span. Inside the handler,
//! [`OutboundCorrelationLayer`] on the HTTP client carries the ID to the next service
//! (as `reqwest-middleware` middleware too, with the `reqwest` feature).
//!
//! # Access log
//!
//! tower-http's `TraceLayer` cannot go on either side of this layer as it is: outside,
//! its span is made before the ID is known; inside, it never sees this layer's own
//! refusals. With the `access-log` feature, [`CorrelationLayer::access_log`] puts a
//! `TraceLayer` outside and has this layer record the ID in that layer's span
//! ([`CurrentSpan`]): one span per request, `request{method, path, correlation_id}`,
//! and one INFO line per request when its answer leaves, whoever answered:
//!
//! ```text
//! INFO request{method=POST path=/commands correlation_id=attempt-2}: request answered event="http.access" status=201 latency_ms=0.41
//! ```
//!
//! Without the feature, the same with your own `TraceLayer`: see [`CurrentSpan`].
//!
//! # OpenTelemetry
//!
//! With the `opentelemetry` feature and a `tracing-opentelemetry` layer in the
//! subscriber:
//!
//! - an incoming W3C `traceparent` (and `tracestate`) becomes the parent of the
//!   request's span (a server span; [`trace_context(false)`][trace_context]
//!   at an edge that should not trust it), which has the `correlation_id` attribute;
//! - the span records the trace ID in its `trace_id` field, so plain log lines have
//!   both IDs (without an OpenTelemetry layer, the incoming trace ID is recorded);
//! - [`OutboundCorrelationLayer`] and the client's `RetryLayer` send `traceparent` from
//!   the current span beside the correlation ID;
//! - optionally the ID travels in W3C `baggage` as `correlation_id`
//!   ([`OutboundCorrelationLayer::baggage`]) and is restored from it when no header
//!   carries one ([`CorrelationLayer::baggage`]).
//!
//! A trace the caller did not sample exports nothing, but its requests keep their
//! correlation ID, and their `trace_id`, in logs and headers.
//!
//! # Headers and status codes
//!
//! | Header | Direction | Meaning |
//! |---|---|---|
//! | `x-correlation-id` | request | the caller's ID for this attempt (optional unless `enforce`) |
//! | `x-correlation-id` | response | the effective ID: the caller's, or the generated one |
//! | `traceparent`, `tracestate` | request, outgoing request | W3C trace context, with the `opentelemetry` feature |
//! | `baggage` | request, outgoing request | W3C baggage; its `correlation_id` member, when asked |
//!
//! | Status | When | `code` in the problem body |
//! |---|---|---|
//! | `400` `application/problem+json` | `enforce`, and the ID is missing | <a id="correlation_id.missing"></a>`correlation_id.missing` |
//! | `400` `application/problem+json` | `enforce`, and the ID is invalid | <a id="correlation_id.invalid"></a>`correlation_id.invalid` |
//! | `500` `application/problem+json` | the axum extractor ran without the layer | <a id="correlation_id.not_installed"></a>`correlation_id.not_installed` |
//!
//! A refusal's body names the ID the response header carries, in its `correlation_id`
//! member.
//!
//! # Lifecycle
//!
//! As work splits and merges, the ID follows:
//!
//! - [`next_child`](CorrelationId::next_child): `id.1`, `id.2`, ... for work spawned by
//!   iteration, from a counter that belongs to the parent;
//! - [`extend_random`](CorrelationId::extend_random) (24 bits, 4 characters) and
//!   [`extend_redelivery`](CorrelationId::extend_redelivery) (a coarse clock and 10
//!   random bits, 3 characters) for work that cannot count its siblings;
//! - [`replace`](CorrelationId::replace), [`combine`](CorrelationId::combine) and
//!   [`restore`](CorrelationId::restore), which tie the old and new IDs together with the
//!   INFO pair `Replacing correlation id` / `Replaced correlation id`.
//!
//! An extension that would pass the length bound replaces the ID instead.
//!
//! ```
//! use tower_ids_correlation::CorrelationId;
//!
//! let parent = CorrelationId::parse("abcd-efgh").unwrap();
//! assert_eq!(parent.next_child(), "abcd-efgh.1");
//! assert_eq!(parent.next_child(), "abcd-efgh.2");
//! assert_eq!(parent.extend_random().as_str().len(), "abcd-efgh".len() + 5);
//!
//! // A batch of two messages becomes one unit of work.
//! let a = CorrelationId::parse("msg-a").unwrap();
//! let b = CorrelationId::parse("msg-b").unwrap();
//! let batch = CorrelationId::combine([&a, &b]);
//! # let _ = batch;
//! ```
//!
//! # Events
//!
//! | `event` field | Level | When |
//! |---|---|---|
//! | `correlation.invalid` | WARN | an incoming ID was invalid and replaced |
//! | `correlation.missing` / `correlation.rejected` | WARN | `enforce` refused a request |
//! | `correlation.replacing` / `correlation.replaced` | INFO | replace, combine, restore, or an extension past the bound |
//! | `correlation.restore_rejected` | WARN | [`restore`](CorrelationId::restore) was given an invalid ID |
//! | `http.access` | INFO | with [`access_log`][access_log]: a request was answered (`status`, `latency_ms`) |

#![cfg_attr(docsrs, feature(doc_cfg))]
// Links to items of features that are off point at their type instead.
#![cfg_attr(
    feature = "access-log",
    doc = "",
    doc = "[access_log]: CorrelationLayer::access_log"
)]
#![cfg_attr(
    not(feature = "access-log"),
    doc = "",
    doc = "[access_log]: CorrelationLayer",
    doc = "[`CorrelationLayer::access_log`]: CorrelationLayer"
)]
#![cfg_attr(
    feature = "opentelemetry",
    doc = "",
    doc = "[trace_context]: CorrelationLayer::trace_context"
)]
#![cfg_attr(
    not(feature = "opentelemetry"),
    doc = "",
    doc = "[trace_context]: CorrelationLayer",
    doc = "[`CorrelationLayer::baggage`]: CorrelationLayer",
    doc = "[`OutboundCorrelationLayer::baggage`]: OutboundCorrelationLayer"
)]

/// A request's span: `$name` at `$level` with `$fields`, and, empty, the fields the
/// layers record in it: the idempotency layer's (`tower_ids::idempotency::field`) and,
/// with the `opentelemetry` feature, `trace_id` and `otel.kind = "server"` (which makes
/// it a server span for tracing-opentelemetry).
macro_rules! request_span {
    ($level:expr, $name:literal, $($fields:tt)*) => {{
        #[cfg(not(feature = "opentelemetry"))]
        let span = tracing::span!(
            target: "tower_ids::correlation",
            $level,
            $name,
            $($fields)*
            idempotency_key = tracing::field::Empty,
            idempotency_scope = tracing::field::Empty,
            idempotency_client = tracing::field::Empty,
            idempotency_outcome = tracing::field::Empty,
            idempotency_request_count = tracing::field::Empty,
            idempotency_store_ms = tracing::field::Empty,
        );
        #[cfg(feature = "opentelemetry")]
        let span = tracing::span!(
            target: "tower_ids::correlation",
            $level,
            $name,
            $($fields)*
            idempotency_key = tracing::field::Empty,
            idempotency_scope = tracing::field::Empty,
            idempotency_client = tracing::field::Empty,
            idempotency_outcome = tracing::field::Empty,
            idempotency_request_count = tracing::field::Empty,
            idempotency_store_ms = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            otel.kind = "server",
        );
        span
    }};
}

#[cfg(feature = "access-log")]
mod access_log;
pub mod body;
mod carrier;
mod future;
mod id;
mod layer;
mod make;
#[cfg(feature = "opentelemetry")]
mod otel;
mod outbound;
#[doc(hidden)]
pub mod problem;
#[cfg(feature = "reqwest")]
mod reqwest_client;
mod service;

#[cfg(feature = "axum")]
mod extract;

use http::HeaderName;

#[cfg(feature = "access-log")]
pub use self::access_log::{AccessLine, AccessLog, AccessLogLayer, AccessSpan};
#[cfg(feature = "axum")]
pub use self::extract::CorrelationIdRejection;
#[cfg(feature = "opentelemetry")]
#[doc(hidden)]
pub use self::otel::inject_trace_context;
#[cfg(feature = "opentelemetry")]
pub use self::otel::{TraceContext, BAGGAGE, BAGGAGE_CORRELATION_ID, TRACEPARENT, TRACESTATE};
pub use self::{
    carrier::{Carrier, MessageCorrelation},
    future::ResponseFuture,
    id::{
        CorrelationId, CorrelationIdError, DefaultValidator, ValidateCorrelationId,
        DEFAULT_MAX_LEN, EXTENSION_SEPARATOR, MIN_MAX_LEN, RANDOM_EXTENSION_BITS,
        REDELIVERY_TICK_SECS,
    },
    layer::CorrelationLayer,
    make::{CurrentSpan, DefaultMakeSpan, MakeCorrelationId, MakeSpan, MakeUuidV7},
    outbound::{OutboundCorrelation, OutboundCorrelationLayer},
    service::Correlation,
};

/// `x-correlation-id`: the default header, read, rewritten and echoed.
///
/// The de facto name across services and log pipelines; `x-request-id` (tower-http's)
/// can be accepted as well with [`CorrelationLayer::accept`].
pub const DEFAULT_HEADER: HeaderName = HeaderName::from_static("x-correlation-id");

/// `duration` in milliseconds, to the microsecond: what a log line needs.
#[doc(hidden)]
pub fn log_millis(duration: std::time::Duration) -> f64 {
    // Exact below 2^53 µs (285 years).
    #[allow(clippy::cast_precision_loss)]
    let micros = duration.as_micros() as f64;
    micros / 1000.0
}
