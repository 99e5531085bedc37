//! Serving an axum app over HTTP/1.1 with a header-read timeout and a graceful stop,
//! shared by the demos that listen.

use std::{future::Future, time::Duration};

use axum::Router;
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

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting, closes
/// the idle connections and waits for the others to finish their request.
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
    header_read_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
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
