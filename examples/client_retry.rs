//! The client retry layer against a real server running the idempotency layer.
//!
//! A local server (127.0.0.1, a free port) protects `POST /commands` with
//! [`IdempotencyLayer`]; the handler counts its executions. The server fails the first
//! two attempts: the handler answers the first with `500`, and in front of it a
//! "flaky network" middleware drops the connection of the second before it reaches the
//! handler (it tells the connection's task to hang up, so the client sees the socket
//! close mid-request: a transport error). The client is hyper-util's legacy `Client`
//! behind [`RetryLayer`] with its defaults.
//!
//! 1. The first call has no key: the layer adds one and makes three attempts, each with
//!    its own correlation ID (`checkout-42.1`, `.2`, `.3`) and `attempt-id`, all with
//!    that one key. The server does not store a `500` (the key is released), so the
//!    third attempt runs the handler, which succeeds.
//! 2. The second call sends the same key again, as a client would after a restart: the
//!    server replays the stored `201` and the handler does not run.
//!
//! The handler ran twice and succeeded exactly once.
//!
//! ```sh
//! cargo run --example client_retry
//! ```

use std::sync::{
    atomic::{AtomicU32, Ordering},
    Arc,
};

use axum::{
    extract::{Request, State},
    http::HeaderMap,
    middleware::{self, Next},
    response::Response,
    routing::post,
    Router,
};
use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::{
    client::legacy::Client,
    rt::{TokioExecutor, TokioIo},
    server::conn::auto::Builder,
    service::TowerToHyperService,
};
use tokio::{net::TcpListener, sync::Notify};
use tower::{ServiceBuilder, ServiceExt};
use tower_ids::{
    client::{RetryLayer, RetryOutcome},
    correlation::{CorrelationId, CorrelationLayer},
    idempotency::IdempotencyLayer,
};

#[derive(Clone, Default)]
struct Counts {
    requests: Arc<AtomicU32>,
    executions: Arc<AtomicU32>,
    successes: Arc<AtomicU32>,
}

/// Closes the request's connection when notified.
#[derive(Clone)]
struct HangUp(Arc<Notify>);

fn attempt_id(headers: &HeaderMap) -> &str {
    headers
        .get("attempt-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
}

/// The handler: `500` on its first execution, `201` after.
async fn create(
    State(counts): State<Counts>,
    id: CorrelationId,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let execution = counts.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let status = if execution == 1 {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        counts.successes.fetch_add(1, Ordering::SeqCst);
        StatusCode::CREATED
    };
    println!(
        "  server: handler execution {execution} ({id}, attempt-id {}): {status}",
        attempt_id(&headers)
    );
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(format!(
            r#"{{"execution":{execution},"command":{}}}"#,
            String::from_utf8_lossy(&body)
        )))
        .unwrap()
}

/// Drops the connection of the second request before it reaches the handler.
async fn flaky_network(State(counts): State<Counts>, request: Request, next: Next) -> Response {
    if counts.requests.fetch_add(1, Ordering::SeqCst) + 1 == 2 {
        let id = request.extensions().get::<CorrelationId>().unwrap();
        println!(
            "  server: request 2 ({id}, attempt-id {}): connection dropped before the handler",
            attempt_id(request.headers())
        );
        request.extensions().get::<HangUp>().unwrap().0.notify_one();
        std::future::pending::<()>().await;
    }
    next.run(request).await
}

/// Serves `app`, one task per connection, each with a [`HangUp`] switch.
async fn serve(listener: TcpListener, app: Router) {
    while let Ok((stream, _)) = listener.accept().await {
        let app = app.clone();
        tokio::spawn(async move {
            let hang_up = HangUp(Arc::new(Notify::new()));
            let switch = hang_up.clone();
            let service = ServiceBuilder::new()
                .map_request(move |mut request: http::Request<Incoming>| {
                    request.extensions_mut().insert(switch.clone());
                    request
                })
                .service(app);
            let builder = Builder::new(TokioExecutor::new());
            let connection =
                builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
            tokio::select! {
                _ = connection => {}
                // Dropping the connection closes the socket, mid-request.
                () = hang_up.0.notified() => {}
            }
        });
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // The client's `client.attempt` events, one line each.
    tracing_subscriber::fmt()
        .with_env_filter("tower_ids::client=debug")
        .without_time()
        .with_target(false)
        .with_ansi(false)
        .init();

    let counts = Counts::default();
    let app = Router::new()
        .route(
            "/commands",
            post(create)
                .layer(IdempotencyLayer::new())
                .layer(middleware::from_fn_with_state(
                    counts.clone(),
                    flaky_network,
                )),
        )
        .with_state(counts.clone())
        .layer(CorrelationLayer::new());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/commands", listener.local_addr()?);
    tokio::spawn(serve(listener, app));

    let hyper_client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(hyper_client);
    let body = Bytes::from_static(br#"{"device":"d-1","name":"reboot"}"#);

    println!(
        "call 1: POST /commands without an idempotency key, parent correlation ID checkout-42"
    );
    let request = http::Request::post(&url)
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))?;
    // `scope` around the call: the layer reads the parent ID when the call is made.
    let response = CorrelationId::parse("checkout-42")?
        .scope(client.clone().oneshot(request))
        .await?;
    let key = report(response).await?;

    println!("call 2: the same request with the same key, parent correlation ID checkout-43");
    let request = http::Request::post(&url)
        .header("content-type", "application/json")
        .header("idempotency-key", &key)
        .body(Full::new(body))?;
    let response = CorrelationId::parse("checkout-43")?
        .scope(client.oneshot(request))
        .await?;
    report(response).await?;

    println!(
        "handler executions: {}, successful: {}",
        counts.executions.load(Ordering::SeqCst),
        counts.successes.load(Ordering::SeqCst)
    );
    Ok(())
}

/// Prints the outcome of a call; returns its idempotency key.
async fn report(
    response: http::Response<Incoming>,
) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    let outcome = response
        .extensions()
        .get::<RetryOutcome>()
        .expect("the retry layer adds its outcome")
        .clone();
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    let key = outcome
        .idempotency_key()
        .map(|k| k.as_str().to_owned())
        .unwrap_or_default();
    println!(
        "  outcome: {status} after {} attempt(s), key {key}, last correlation ID {}, replayed: {}, body {}",
        outcome.attempts(),
        outcome.correlation_id(),
        outcome.replayed(),
        String::from_utf8_lossy(&body)
    );
    Ok(key)
}
