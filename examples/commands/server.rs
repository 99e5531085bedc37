//! Listening and serving: the listener, hyper's HTTP/1.1 connections with their
//! timeouts, the request-level limits (tower's and tower-http's layers) and the graceful
//! stop. See [Limits](crate#limits).

use std::{
    net::SocketAddr,
    num::{NonZeroU64, NonZeroUsize},
    sync::{Arc, OnceLock},
    time::Duration,
};

use axum::{
    body::{Body, Bytes, HttpBody},
    error_handling::HandleErrorLayer,
    extract::{DefaultBodyLimit, Request, State},
    http::{header, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    BoxError, Router,
};
use http_body_util::BodyExt;
use tokio::net::{TcpListener, TcpSocket};
use tower::{
    limit::GlobalConcurrencyLimitLayer,
    load_shed::{error::Overloaded, LoadShedLayer},
    ServiceBuilder,
};
use tower_http::{
    limit::RequestBodyLimitLayer,
    timeout::{TimeoutError, TimeoutLayer},
};
use tower_ids::PROBLEM_JSON;

use crate::api::ApiError;

/// Default `--request-timeout-ms`: how long a request may take from its head to its answer
/// (tower-http's `TimeoutLayer`). The handlers answer in microseconds (plus
/// `--handler-delay-ms`); 30 s bounds how long one request can hold a concurrency slot,
/// even when its client trickles the body a byte at a time, each just in time for
/// `--body-timeout-ms`.
pub(crate) const REQUEST_TIMEOUT_MS: NonZeroU64 = NonZeroU64::new(30_000).unwrap();

/// Default `--max-body-bytes`: the largest request body (tower-http's
/// `RequestBodyLimitLayer`, and the idempotency layer's own limit). A command is a small
/// JSON object (under 100 bytes in the examples above); 64 KiB leaves room for a large
/// payload, while `MAX_COMMANDS` commands hold at most 64 MiB of payload and
/// `MAX_CONCURRENT_REQUESTS` bodies in flight at most 32 MiB.
pub(crate) const MAX_BODY_BYTES: NonZeroUsize = NonZeroUsize::new(64 * 1024).unwrap();

/// Default `--max-concurrent-requests`: requests handled at once; over it, new requests
/// are shed with `503` at once rather than queued. Far above what the demo needs
/// (`benches/load.sh` opens 256 connections at most), and low enough that
/// `MAX_CONCURRENT_REQUESTS` bodies of `MAX_BODY_BYTES` take 32 MiB, where 3,000
/// unbounded requests of 1 MiB took 2.6 GiB.
pub(crate) const MAX_CONCURRENT_REQUESTS: NonZeroUsize = NonZeroUsize::new(512).unwrap();

/// Connections the kernel completes and queues before the accept loop takes them (the
/// listen backlog; Linux caps it at `net.core.somaxconn`, 4,096 by default). A burst of
/// new connections larger than the queue has its handshakes dropped and retried a second
/// later. std's and tokio's `TcpListener::bind` ask for 128; 4,096 lets a burst of
/// thousands wait their turn instead.
const LISTEN_BACKLOG: u32 = 4096;

/// The bounds on what one request may take (see [Limits](crate#limits)), from the flags.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// The head's and the body's, applied by the server the examples share.
    pub(crate) timeouts: crate::http1::Timeouts,
    pub(crate) request_timeout: Duration,
    pub(crate) max_body_bytes: usize,
    pub(crate) max_concurrent_requests: usize,
}

/// A listener on `addr` with a backlog of [`LISTEN_BACKLOG`].
pub(crate) fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // As tokio's `bind` does: a restarted service can bind while its old connections
    // wait out TIME_WAIT.
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Raises this process's open-files limit (the soft `RLIMIT_NOFILE`) to the hard limit and
/// returns it. Every connection is a file descriptor, and the soft limit is often 1,024:
/// that many idle connections would stop the service from accepting any other.
#[cfg(unix)]
pub(crate) fn raise_open_files_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => Some(limit),
        Err(error) => {
            tracing::warn!(event = "commands.open_files_limit_failed", %error, "cannot raise the open-files limit");
            None
        }
    }
}

#[cfg(not(unix))]
pub(crate) fn raise_open_files_limit() -> Option<u64> {
    None
}

/// `routes` in the request-level limits, outermost first (see [Limits](crate#limits)):
/// tower's and tower-http's own layers. What is ours only turns their refusals into
/// problem details: [`refused`] (the shed error), [`tower_http_refusals`] (their empty or
/// plain-text answers) and [`body_failures`] (a body that failed in them).
///
/// `Router::layer` wraps each route (and the fallback) in its own copy of these layers,
/// so the concurrency limit is tower's `GlobalConcurrencyLimitLayer`, whose copies share
/// one semaphore: a `ConcurrencyLimitLayer` makes a semaphore per copy, which here would
/// be a limit per route.
pub(crate) fn with_request_limits(routes: Router, limits: Limits) -> Router {
    routes.layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(refused))
            .layer(LoadShedLayer::new())
            .layer(GlobalConcurrencyLimitLayer::new(
                limits.max_concurrent_requests,
            ))
            .map_response(move |response| tower_http_refusals(response, limits))
            .layer(RequestBodyLimitLayer::new(limits.max_body_bytes))
            // `RequestBodyLimitLayer` is the limit: axum's own (2 MB, for its extractors)
            // off, or a body between 2 MB and a larger `--max-body-bytes` would be
            // refused by the `Json` extractor (`413 body.unreadable`).
            .layer(DefaultBodyLimit::disable())
            .layer(TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                limits.request_timeout,
            ))
            .map_request(into_axum_body)
            .layer(middleware::from_fn_with_state(limits, body_failures)),
    )
}

/// The request with axum's `Body` around tower-http's, which axum's middleware takes.
fn into_axum_body<B>(request: Request<B>) -> Request
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    request.map(Body::new)
}

/// The answer to a request the load shedder refused (`--max-concurrent-requests`
/// reached), through axum's `HandleErrorLayer`.
async fn refused(error: BoxError) -> ApiError {
    if error.is::<Overloaded>() {
        tracing::debug!(event = "commands.overloaded", "request shed");
        ApiError::Overloaded
    } else {
        // No inner layer fails: every error of theirs is already a response.
        tracing::error!(event = "commands.internal_error", %error, "unexpected error");
        ApiError::Internal
    }
}

/// tower-http's own refusals, as problem details: `TimeoutLayer`'s empty `408`, and
/// `RequestBodyLimitLayer`'s plain-text `413` for a declared `Content-Length` over the
/// limit. Every other answer (problem details already) passes unchanged.
fn tower_http_refusals<B>(response: Response<B>, limits: Limits) -> Response
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| value == PROBLEM_JSON);
    match response.status() {
        _ if problem => response.map(Body::new),
        StatusCode::REQUEST_TIMEOUT => {
            ApiError::RequestTimeout(limits.request_timeout).into_response()
        }
        StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::BodyTooLarge(limits.max_body_bytes).into_response()
        }
        _ => response.map(Body::new),
    }
}

/// How a request body failed in tower-http's layers.
#[derive(Debug, Clone, Copy)]
enum BodyFailure {
    /// The shared server's body-read timeout: no byte for `--body-timeout-ms`.
    Stalled,
    /// `RequestBodyLimitLayer`: more than `--max-body-bytes`, without a `Content-Length`
    /// saying so up front.
    TooLarge,
}

impl BodyFailure {
    /// The failure `error` (or an error it wraps) stands for, if any.
    fn of(error: &(dyn std::error::Error + 'static)) -> Option<Self> {
        std::iter::successors(Some(error), |error| error.source()).find_map(|error| {
            if error.is::<TimeoutError>() {
                Some(Self::Stalled)
            } else if error.is::<http_body_util::LengthLimitError>() {
                Some(Self::TooLarge)
            } else {
                None
            }
        })
    }
}

/// Answers `408` or `413` for a request whose body stalled or grew past the limit,
/// whatever the route made of the failed read: the idempotency layer, which reads the
/// body of the `POST` routes first, would answer `400 idempotency.body_unreadable`.
///
/// The body failures happen in tower-http's layers outside this one; the body is wrapped
/// here so that its failure is noted on the way to whoever reads it.
async fn body_failures(State(limits): State<Limits>, request: Request, next: Next) -> Response {
    let failure = Arc::new(OnceLock::new());
    let noted = failure.clone();
    let request = request.map(|body| {
        Body::new(body.map_err(move |error| {
            if let Some(kind) = BodyFailure::of(&error) {
                let _ = noted.set(kind);
            }
            error
        }))
    });
    let response = next.run(request).await;
    let Some(failure) = failure.get() else {
        return response;
    };
    let (error, reason) = match failure {
        BodyFailure::Stalled => (
            ApiError::BodyTimeout(limits.timeouts.body_read()),
            "timeout",
        ),
        BodyFailure::TooLarge => (ApiError::BodyTooLarge(limits.max_body_bytes), "too_large"),
    };
    tracing::info!(
        event = "commands.body_refused",
        reason,
        status = error.status().as_u16(),
        "request body refused"
    );
    error.into_response()
}

/// Resolves on Ctrl-C, or on SIGTERM on Unix, and says so.
pub(crate) async fn shutdown_signal() {
    let signal = crate::shutdown::signal().await;
    tracing::info!(event = "commands.shutting_down", signal, "shutting down");
}
