//! Tower middleware for the two identifiers every retried request needs.
//!
//! - A **correlation ID** names one attempt: restored from the incoming header or
//!   generated, carried in a tracing span and a task-local, echoed on the response,
//!   propagated on outgoing calls, and extended, replaced, combined or restored as work
//!   splits and merges. See [`correlation`].
//! - An **idempotency key** stays the same across every retry of one user action, so
//!   the server runs the action once and replays its response to every retry. See
//!   [`idempotency`].
//! - On the calling side, a **retry layer** for HTTP clients sends one idempotency key
//!   across every attempt, a new correlation ID and `attempt-id` for each, and backs
//!   off as the server asks. See [`client`].
//!
//! Every error a layer answers with is an RFC 9457 `application/problem+json` body with
//! a stable `code`, and names the attempt (`correlation_id`) and the key
//! (`idempotency_key`) it answers.
//!
//! # Example
//!
//! Both server layers on a tower service, and a retry of one action:
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response, StatusCode};
//! use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
//! use tower_ids::{body::Body, correlation::CorrelationLayer, idempotency::IdempotencyLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Infallible> {
//! let mut service = ServiceBuilder::new()
//!     .layer(CorrelationLayer::new()) // first, so outermost
//!     .layer(IdempotencyLayer::new())
//!     .service(service_fn(|_request: Request<Body<String>>| async {
//!         tracing::info!("creating"); // inside the request's span, with its correlation_id
//!         Ok::<_, Infallible>(
//!             Response::builder()
//!                 .status(StatusCode::CREATED)
//!                 .body(String::from("order 17"))
//!                 .unwrap(),
//!         )
//!     }));
//!
//! // One user action, two attempts: the same key, a correlation ID each.
//! let attempt = |id: &str| {
//!     Request::post("/orders")
//!         .header("idempotency-key", "order-17")
//!         .header("x-correlation-id", id)
//!         .body(String::from(r#"{"item":"tea"}"#))
//!         .unwrap()
//! };
//! let first = service.ready().await?.call(attempt("attempt-1")).await?;
//! let retry = service.ready().await?.call(attempt("attempt-2")).await?;
//!
//! assert_eq!(first.headers()["idempotent-replayed"], "false");
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true"); // the stored answer
//! assert_eq!(retry.headers()["x-correlation-id"], "attempt-2"); // this attempt's ID
//! assert_eq!(retry.headers()["idempotency-key"], "order-17");
//! # Ok(())
//! # }
//! ```
//!
//! With axum, the idempotency layer goes on the routes it protects and the correlation
//! layer on the router, last, so outermost (see [`idempotency`] for this example
//! served).
//!
//! # Layer order
//!
//! Outermost first, on the server:
//!
//! 1. [`CorrelationLayer`] (or [`CorrelationLayer::access_log`] for an access line per
//!    request): every attempt gets its ID and span before anything else runs, so every
//!    line logged below it, every refusal and every replay carries the ID. Only
//!    tower-http's `SetRequestId` goes outside it, when its `x-request-id` should be a
//!    source ([`accept`](CorrelationLayer::accept)).
//! 2. Authentication, when the idempotency layer scopes keys by what it establishes
//!    ([`ClientFromExtension`](idempotency::ClientFromExtension)).
//! 3. [`IdempotencyLayer`] on the routes it protects (`POST`, `PATCH`).
//! 4. The handler; its HTTP client has [`OutboundCorrelationLayer`] or [`RetryLayer`]
//!    (outermost on the client), so the next service continues the story.
//!
//! An idempotency layer with no correlation ID in scope (the order reversed, or no
//! correlation layer) says so once, at WARN (`idempotency.uncorrelated`).
//!
//! # The guide
//!
//! Beside the module docs, the [guide] has a page per topic: the
//! [guarantees](guide::guarantees) under each fault, every setting
//! ([configuration](guide::configuration)), [observability](guide::observability), and
//! [clients and message consumers](guide::clients_and_messages).
//!
//! # The API at a glance
//!
//! What most services use, by where it lives:
//!
//! | Where | What |
//! |---|---|
//! | [`correlation`] | [`CorrelationLayer`] (server), [`OutboundCorrelationLayer`] (HTTP clients), [`CorrelationId`], `MessageCorrelation` and `Carrier` (messages) |
//! | [`idempotency`] | [`IdempotencyLayer`] (HTTP routes), [`MessageIdempotencyLayer`](idempotency::message::MessageIdempotencyLayer) (consumers); the values `IdempotencyKey`, `AttemptId`, `ClientId`; the extractors `KeyFromHeader`, `KeyFromJson`, `ClientFromHeader`, `ClientFromAuthorization`, `ClientFromExtension`, `EpochFromHeader`, `EpochFromExtension`; `InFlight`, `StoreFailure`; replay hooks (`OnReplay`, `JsonReplayMarker`) |
//! | `idempotency::store` | [`MokaStore`](idempotency::MokaStore) (default), `RedisStore`, `PostgresStore` and their builders; `IdempotencyStore` and the record types, to write a store of your own |
//! | `idempotency::message` | the consumer layer's answers (`Handled`, `Refusal`) and keys (`MessageKey`, `ExtractMessageKey`) |
//! | `idempotency::extract` | the traits behind the extractors, for a key, client or epoch read your own way |
//! | `idempotency::header`, `idempotency::metrics` | the header names and metric names |
//! | `outbox` | `Outbox` (enqueue in the request's transaction), `Message`, `Relay`, the `Sink` trait, `AmqpSink`, `KafkaSink` |
//! | [`client`] | [`RetryLayer`], `derive_key`, `RetryOutcome` |
//! | [`body`] | [`Body`](body::Body), the body the server layers hand on |
//!
//! Inside `idempotency`, one engine decides for every transport whether to run, replay
//! or refuse; the HTTP and message layers translate its decision into a response or a
//! [`Handled`](idempotency::message::Handled), and the stores sit below the engine.
//!
//! # Features
//!
//! | Feature | Default | What it adds |
//! |---|---|---|
//! | `correlation` | yes | [`correlation`]: the server and outbound layers, [`CorrelationId`] |
//! | `idempotency` | yes | [`idempotency`]: the HTTP and message layers and the in-memory [`MokaStore`](idempotency::MokaStore) |
//! | `client` | yes | [`client`]: [`RetryLayer`] and `derive_key` (without the idempotency layer or moka) |
//! | `axum` | yes | [`CorrelationId`] as an axum extractor (and, with `postgres`, the handler's `Transaction`) |
//! | `redis` | no | `RedisStore`, one record per key for every replica, on one Redis or on Redis Cluster |
//! | `postgres` | no | `PostgresStore`, durable records, and the handler's writes committed with the record |
//! | `access-log` | no | [`CorrelationLayer::access_log`]: one access line per request inside its span, on tower-http's `TraceLayer` |
//! | `opentelemetry` | no | W3C `traceparent` continued on the request's span and sent on outgoing calls, the `trace_id` in logs, optional W3C `baggage` (`tracing-opentelemetry`) |
//! | `metrics` | no | the idempotency layer's counters, store latency and requests in flight, on the `metrics` facade |
//! | `reqwest` | no | [`OutboundCorrelationLayer`] (and, with `client`, [`RetryLayer`]) as `reqwest-middleware` middleware |
//! | `openapi` | no | `IdempotencyLayer::document`: a protected operation's key header, problems and response headers in an OpenAPI document (utoipa) |
//! | `grpc` | no | `IdempotencyLayer::for_grpc()`: unary tonic calls deduplicated, answered as gRPC statuses with `google.rpc` details |
//! | `amqp` | no | AMQP 0-9-1 (RabbitMQ, lapin) header tables as a [`Carrier`](correlation::Carrier): a message's correlation ID, idempotency key (with `idempotency`) and trace context (with `opentelemetry`) |
//! | `kafka` | no | Kafka record headers (rdkafka) as a [`Carrier`](correlation::Carrier): a record's correlation ID, idempotency key (with `idempotency`) and trace context (with `opentelemetry`) |
//! | `outbox` | no | `outbox`: messages enqueued in the request's PostgreSQL transaction and a relay that publishes them once committed (RabbitMQ with `amqp`, Kafka with `kafka`); implies `postgres` |
//! | `full` | no | all of the above |
//!
//! docs.rs builds the documentation with every feature.
//!
//! # Observability
//!
//! - **Logs**: one span per request carrying `correlation_id`, events with stable
//!   `event` codes and structured fields; the access line with the `access-log`
//!   feature.
//! - **Traces**: with the `opentelemetry` feature the request's span continues the
//!   caller's W3C trace; unsampled traces keep their correlation ID in logs and
//!   headers.
//! - **Metrics**: with the `metrics` feature, see
//!   [the list](idempotency#metrics).
//!
//! The [observability guide](guide::observability) has the recipes, one per pipeline.
#![cfg_attr(docsrs, feature(doc_cfg))]
// Links to items of features that are off point at their type instead.
#![cfg_attr(
    not(feature = "access-log"),
    doc = "",
    doc = "[`CorrelationLayer::access_log`]: CorrelationLayer"
)]

#[cfg(feature = "client")]
#[doc(inline)]
pub use tower_ids_client as client;
#[cfg(feature = "correlation")]
#[doc(inline)]
pub use tower_ids_correlation as correlation;
#[cfg(feature = "correlation")]
#[doc(inline)]
pub use tower_ids_correlation::body;
#[cfg(all(feature = "correlation", feature = "idempotency"))]
pub mod cors;
#[cfg(any(feature = "idempotency", feature = "client"))]
pub mod idempotency;
#[cfg(feature = "outbox")]
#[doc(inline)]
pub use tower_ids_outbox as outbox;
#[cfg(feature = "idempotency")]
mod problem;

#[cfg(all(feature = "correlation", feature = "idempotency"))]
pub mod guide {
    //! The guide, a page per topic, beside the module docs it links into:
    //!
    //! - [`guarantees`]: what holds under which fault, for each store, and the tests
    //!   that break it on purpose.
    //! - [`configuration`]: every setting of the layers and the stores, keys from
    //!   payloads, replay hooks, Redis, PostgreSQL and transactional mode, memory.
    //! - [`observability`]: logs, the access line, OpenTelemetry traces, metrics (with
    //!   a sample `/metrics` and PromQL), reqwest.
    //! - [`clients_and_messages`]: a correlation ID's lifecycle, client retries, and
    //!   message consumers.
    //! - `outbox` (feature `outbox`): messages committed with the request and relayed to
    //!   RabbitMQ or Kafka: what is guaranteed, what is not, several relays.
    //!
    //! The status codes, headers and events are in [the idempotency
    //! module](crate::idempotency#status-codes) and [the correlation
    //! module](crate::correlation); the demos' walkthroughs in their READMEs in the
    //! repository (`examples/commands/README.md`, `examples/control_plane/README.md`);
    //! the figures in `benches/README.md`.

    #[doc = include_str!("../docs/guarantees.md")]
    pub mod guarantees {}

    #[doc = include_str!("../docs/configuration.md")]
    pub mod configuration {}

    #[doc = include_str!("../docs/observability.md")]
    pub mod observability {}

    #[doc = include_str!("../docs/clients_and_messages.md")]
    pub mod clients_and_messages {}

    #[cfg(feature = "outbox")]
    #[doc = include_str!("../docs/outbox.md")]
    pub mod outbox {}
}

#[cfg(feature = "correlation")]
pub use tower_ids_correlation::problem::{
    CORRELATION_PROBLEM_DOCS, IDEMPOTENCY_PROBLEM_DOCS, PROBLEM_JSON,
};

#[cfg(feature = "client")]
pub use client::RetryLayer;
#[cfg(feature = "correlation")]
pub use correlation::{CorrelationId, CorrelationLayer, OutboundCorrelationLayer};
/// [`idempotency::IdempotencyLayer`], at the crate's root beside the correlation and
/// retry layers: the same type under a second name, with the same defaults.
#[cfg(feature = "idempotency")]
pub type IdempotencyLayer<
    St = idempotency::MokaStore,
    C = idempotency::extract::NoClient,
    E = idempotency::extract::NoEpoch,
    T = idempotency::Http,
> = idempotency::IdempotencyLayer<St, C, E, T>;
