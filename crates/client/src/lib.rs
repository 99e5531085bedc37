//! Client retries: one idempotency key for every attempt of a request, a new
//! correlation ID and `attempt-id` for each, backoff with full jitter, and the server's
//! `Retry-After` honoured.
//!
//! [`RetryLayer`] wraps any tower HTTP client (`Service<http::Request<B>>`), hyper-util's
//! legacy `Client` for one. It is the calling side of the
//! [idempotency contract](tower_ids_core): the server runs an action once per key,
//! and this layer makes sure every retry of one action carries that one key, that each
//! attempt can still be told apart in the logs, and that it retries only what is safe
//! to repeat.
//!
//! # Example
//!
//! ```
//! use std::{sync::{Arc, atomic::{AtomicU32, Ordering}}, time::Duration};
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_ids::{client::{RetryLayer, RetryOutcome}, correlation::CorrelationId};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // A stand-in for the HTTP client: the server fails once, then succeeds.
//! let calls = Arc::new(AtomicU32::new(0));
//! let counter = calls.clone();
//! let http_client = service_fn(move |request: Request<Full<Bytes>>| {
//!     let n = counter.fetch_add(1, Ordering::SeqCst);
//!     async move {
//!         let h = |name: &str| request.headers()[name].to_str().unwrap().to_owned();
//!         println!("{} attempt {} key {}", h("x-correlation-id"), h("attempt-id"), h("idempotency-key"));
//!         let status = if n == 0 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
//!         let response = Response::builder().status(status).body(String::new()).unwrap();
//!         Ok::<_, std::convert::Infallible>(response)
//!     }
//! });
//!
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new().backoff(Duration::from_millis(10), Duration::from_millis(100)))
//!     .service(http_client);
//!
//! let request = Request::post("http://commands.internal/commands")
//!     .body(Full::new(Bytes::from_static(br#"{"name":"reboot"}"#)))
//!     .unwrap();
//! // Inside a request handler the parent is the server's correlation ID; here, our own.
//! let parent = CorrelationId::parse("order-7").unwrap();
//! let response = parent.scope(client.oneshot(request)).await.unwrap();
//!
//! // Printed: `order-7.1 attempt 1 key 0193…` then `order-7.2 attempt 2 key 0193…`
//! // (the same key).
//! assert_eq!(response.status(), StatusCode::CREATED);
//! let outcome = response.extensions().get::<RetryOutcome>().unwrap();
//! assert_eq!(outcome.attempts(), 2);
//! assert_eq!(outcome.correlation_id(), "order-7.2");
//! assert!(!outcome.replayed());
//! # }
//! ```
//!
//! On hyper-util's client:
//!
//! ```no_run
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_ids_client::RetryLayer;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let hyper_client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let client = ServiceBuilder::new().layer(RetryLayer::new()).service(hyper_client);
//!
//! let request = http::Request::post("http://127.0.0.1:3000/commands")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"name":"reboot"}"#)))?;
//! let response = client.oneshot(request).await?; // RetryError<hyper_util::client::legacy::Error>
//! # let _ = response;
//! # Ok(())
//! # }
//! ```
//!
//! # Headers
//!
//! | Header | Set | Value |
//! |---|---|---|
//! | `Idempotency-Key` | once per logical request, if the method is not safe (POST, PATCH, PUT, DELETE, ...) and the caller set neither it nor `X-Idempotency-Key`; off with [`add_keys(false)`](RetryLayer::add_keys) | a UUIDv7, the same on every attempt; a key of the caller's is never touched |
//! | `x-correlation-id` ([`correlation_header`](RetryLayer::correlation_header)) | every attempt, overwritten | `parent.1`, `parent.2`, ... ([`CorrelationId::next_child`](tower_ids_correlation::CorrelationId::next_child)) |
//! | `attempt-id` | every attempt, overwritten; off with [`attempt_ids(false)`](RetryLayer::attempt_ids) | `1`, `2`, `3`, ... |
//!
//! The parent correlation ID is the request's [`CorrelationId`](tower_ids_correlation::CorrelationId)
//! extension, else a valid correlation header the caller set, else the task's
//! [`CorrelationId::current`](tower_ids_correlation::CorrelationId::current) (inside a
//! handler behind [`CorrelationLayer`](tower_ids_correlation::CorrelationLayer), the incoming
//! request's ID), else a fresh UUIDv7. Each attempt's request also carries its own ID as
//! its `CorrelationId` extension. The parent, the key and the deadline's clock are
//! taken when `call` runs: `id.scope(client.oneshot(request))` uses `id`, while
//! `id.scope(client.call(request))` does not (`call` ran before the scope).
//!
//! From the response the layer reads `Retry-After` and `idempotent-replayed`.
//!
//! # Retry rules
//!
//! 1. **Only what is safe to repeat**: idempotent methods (GET, HEAD, OPTIONS, TRACE,
//!    PUT, DELETE), or any method with an idempotency key, the layer's included. Other
//!    requests are sent once.
//! 2. **What is worth repeating**: errors of the inner client (connect refused, reset,
//!    connection closed before the response), attempts past the
//!    [per-attempt timeout](RetryLayer::attempt_timeout), and the responses
//!    [`default_retry_if`] names: `5xx` (but `501`, `505`), `408`, `429`, and `409` with
//!    `Retry-After` (the idempotency layer's "in flight"). Other `4xx` come back at
//!    once. Change the responses with [`retry_if`](RetryLayer::retry_if).
//! 3. **How long to wait**: before retry `n`, a random time in
//!    `[0, min(cap, base * 2^(n-1))]` (full jitter; defaults 250 ms doubling to 4 s),
//!    or the response's `Retry-After` (seconds or HTTP-date) if longer.
//! 4. **When to stop**: after [`max_attempts`](RetryLayer::max_attempts) (default 5);
//!    when the wait would reach past the [deadline](RetryLayer::deadline) (default
//!    30 s from the call; the layer stops at once rather than sleep into it); when the
//!    deadline passes during an attempt (the attempt is abandoned).
//! 5. **Bodies**: a body is sent again only if it can be copied whole
//!    ([`ReplayableBody`]: `http_body_util::Full`, `Empty`, `String`, a buffered
//!    [`ReplayBody`]). A streaming [`ReplayBody`] is sent once; if a retry is due after
//!    that, the layer answers [`RetryError::BodyNotReplayable`] rather than send it
//!    again or pass the failed attempt off as the answer.
//!
//! # What the caller gets
//!
//! - A response whenever an attempt got one, the last attempt's, with a
//!   [`RetryOutcome`] extension: attempts made, whether the server replayed a stored
//!   response (`idempotent-replayed: true`), and a [`StopReason`] saying whether the
//!   layer gave up on a retryable response (every attempt used, the deadline, not
//!   safe to repeat). A `503` after every attempt is still the `503`, with its body.
//! - A [`RetryError`] when there is no response to return: the inner client's error
//!   ([`Transport`](RetryError::Transport)), a timed-out last attempt
//!   ([`TimedOut`](RetryError::TimedOut)), the deadline
//!   ([`DeadlineExceeded`](RetryError::DeadlineExceeded)), or a streaming body a retry
//!   would need again ([`BodyNotReplayable`](RetryError::BodyNotReplayable)).
//!
//! The timeouts cover each attempt until its response head arrives; reading the body
//! is the caller's, and a body that fails mid-read is not retried.
//!
//! # Layer order
//!
//! Put `RetryLayer` outermost on the client. Layers inside it (tower-http's
//! `TraceLayer`, a per-attempt metric) see every attempt; layers outside see one call.
//! It sets the correlation header itself, so the same client needs no
//! [`OutboundCorrelationLayer`](tower_ids_correlation::OutboundCorrelationLayer) (which
//! never overwrites a header and would leave this one as it is).
//!
//! # Events
//!
//! One event per attempt, `event = "client.attempt"`, with `attempt`, `correlation_id`
//! (this attempt's), `idempotency_key`, `outcome` (the status, or `transport_error`,
//! `timed_out`, `deadline_exceeded`, `not_ready`), `decision`, `delay_ms` (the wait
//! before the next attempt), and on failures `error` (the inner client's error) and
//! `reason`:
//!
//! | `decision` | Level | When |
//! |---|---|---|
//! | `done` | DEBUG | the response is not one to retry (`2xx`, `404`, ...) |
//! | `retry` | INFO | another attempt follows after `delay_ms` |
//! | `give_up` | WARN | a retryable failure and no more attempts; `reason`: `attempts_exhausted`, `deadline_reached`, `not_safe_to_repeat`, `body_not_replayable`, `not_ready` |
//!
//! # Deterministic keys
//!
//! A caller that must send the same key after a restart, without storing it, derives it
//! with [`derive_key`] from the computation, an epoch and the request bytes, and sets
//! it as `Idempotency-Key`; the layer keeps it. Read the trade-offs there first.

mod backoff;
mod body;
mod derive;
mod error;
mod future;
mod layer;
mod outcome;
#[cfg(feature = "reqwest")]
mod reqwest_client;
mod service;

pub use self::{
    body::{BoxedBody, ReplayBody, ReplayableBody},
    derive::{derive_key, DerivedKey, DERIVED_KEY_DOMAIN},
    error::RetryError,
    future::ResponseFuture,
    layer::{
        default_retry_if, RetryLayer, DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_BACKOFF_BASE,
        DEFAULT_BACKOFF_CAP, DEFAULT_DEADLINE, DEFAULT_MAX_ATTEMPTS,
    },
    outcome::{RetryOutcome, StopReason},
    service::Retry,
};
