//! Serving an axum app over HTTP/1.1 with a header-read and a body-read timeout and a
//! graceful stop, shared by the demos that listen: no client holds a connection, or a
//! stop, past the timeouts by sending part of a request and then nothing.

use std::{
    future::Future,
    num::NonZeroU64,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{
    body::Body,
    extract::{Request, State},
    http::{header, HeaderValue, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    Router,
};
use http_body_util::BodyExt as _;
use hyper::server::conn::http1;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
    service::TowerToHyperService,
};
use tokio::net::TcpListener;

/// How long the accept loop pauses after an error that is not the connection's own (out
/// of file descriptors, `EMFILE`): long enough for connections closing meanwhile to free
/// some instead of the loop spinning on the error, short enough not to stall the service.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Default `--header-read-timeout-ms`: how long a connection may take to send a
/// request's head (request line and headers), and may stay idle between two requests. A
/// client on a working network sends a few hundred bytes of headers in milliseconds;
/// 10 s leaves room for a slow mobile link and a client's pooled connection, while a
/// client that opens connections and sends nothing holds each for 10 s at most.
pub(crate) const HEADER_READ_TIMEOUT_MS: NonZeroU64 = NonZeroU64::new(10_000).unwrap();

/// Default `--body-timeout-ms`: how long a request body may go without sending a byte
/// (tower-http's `TimeoutBody`, which starts again at every chunk). The examples' bodies
/// are a few hundred bytes, sent in one go; 10 s of silence means a stalled client, and
/// every second it waits it holds a connection (and a stop, which waits for the requests
/// in flight).
pub(crate) const BODY_TIMEOUT_MS: NonZeroU64 = NonZeroU64::new(10_000).unwrap();

/// The `--header-read-timeout-ms` and `--body-timeout-ms` flags of every example server.
#[derive(clap::Args, Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    /// Milliseconds a connection may take to send a request's head, and may stay idle
    /// between requests, before the server closes it.
    #[arg(long, global = true, default_value_t = HEADER_READ_TIMEOUT_MS)]
    pub(crate) header_read_timeout_ms: NonZeroU64,
    /// Milliseconds a request body may go without sending a byte before the request is
    /// answered 408 and its connection closed.
    #[arg(long, global = true, default_value_t = BODY_TIMEOUT_MS)]
    pub(crate) body_timeout_ms: NonZeroU64,
}

impl Timeouts {
    /// The head's timeout: hyper's header-read timeout, also the idle timeout.
    pub(crate) fn header_read(self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms.get())
    }

    /// The body's timeout between two chunks.
    pub(crate) fn body_read(self) -> Duration {
        Duration::from_millis(self.body_timeout_ms.get())
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting, closes
/// the idle connections and waits for the others to finish their request.
///
/// Every request's body is read under `--body-timeout-ms` ([`answer_stalled_bodies`]),
/// so a request that sent its head and part of its body is answered within it, and a
/// stop waits for it no longer.
///
/// HTTP/1.1 only, on hyper's own connection builder with a timer, so that hyper's
/// header-read timeout applies from the first byte a connection could send: to a
/// connection that sends nothing, to one that sends part of a request head, and to one
/// kept alive and idle after a response (hyper starts the timer again whenever the
/// connection goes idle, so this is also the idle timeout). hyper-util's auto builder
/// (axum's `serve`) first reads the bytes that tell HTTP/1 from HTTP/2 with no timeout
/// at all, and hyper's HTTP/2 has no header-read timeout.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    timeouts: Timeouts,
    shutdown: impl Future<Output = ()>,
) {
    let app = app.layer(middleware::from_fn_with_state(
        timeouts.body_read(),
        answer_stalled_bodies,
    ));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(timeouts.header_read());
    let connections = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    accept_failed(error).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let connection =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let connection = connections.watch(connection);
        tokio::spawn(async move {
            // A client that hangs up or times out: the client's doing, not an error.
            if let Err(error) = connection.await {
                tracing::debug!(event = "http.connection_closed", %error, "connection closed");
            }
        });
    }
    drop(listener);
    connections.shutdown().await;
}

/// A failed `accept`. The connection's own failure (reset before it was accepted) costs
/// nothing; any other, such as running out of file descriptors, is logged and the loop
/// pauses [`ACCEPT_ERROR_PAUSE`], as axum's `serve` does, instead of spinning on it.
async fn accept_failed(error: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        error.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::warn!(event = "http.accept_failed", %error, "cannot accept a connection");
    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
}

/// Reads the request's body under `timeout` between two chunks, and answers a body that
/// stopped arriving `408` (problem details, code `request.body_timeout`) with
/// `Connection: close`, whatever the route made of the failed read (the idempotency
/// layer, which reads a protected route's body first, would answer `400
/// idempotency.body_unreadable`; a route's own `408` is left as it is). hyper closes the
/// connection after the answer instead of waiting for the rest of the body. WARN
/// `http.body_timeout`.
async fn answer_stalled_bodies(
    State(timeout): State<Duration>,
    request: Request,
    next: Next,
) -> Response {
    let stalled = Arc::new(AtomicBool::new(false));
    let noted = stalled.clone();
    let request = request.map(|body| {
        Body::new(
            tower_http::timeout::TimeoutBody::new(timeout, body).map_err(move |error| {
                if error.is::<tower_http::timeout::TimeoutError>() {
                    noted.store(true, Ordering::Relaxed);
                }
                error
            }),
        )
    });
    let response = next.run(request).await;
    if !stalled.load(Ordering::Relaxed) || response.status() == StatusCode::REQUEST_TIMEOUT {
        return response;
    }
    let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    tracing::warn!(
        event = "http.body_timeout",
        timeout_ms,
        "the request body stopped arriving; answered 408 and closing the connection"
    );
    let problem = serde_json::json!({
        "type": "urn:tower-ids:example:request.body_timeout",
        "title": "Request body timeout",
        "status": 408,
        "detail": format!("no byte of the request body arrived for {timeout_ms} ms; the request did not run: send it again, whole"),
        "code": "request.body_timeout",
    });
    let mut response = (StatusCode::REQUEST_TIMEOUT, problem.to_string()).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}
