//! The idempotency layer on a plain hyper 1 server, without axum.
//!
//! One route, `POST /orders`, takes a JSON body and answers `201` with
//! `{"order": N, "echo": <body>}`, where `N` counts the handler's executions. The stack
//! is built with `tower::ServiceBuilder`: [`CorrelationLayer`] outermost (every attempt
//! gets its own `x-correlation-id` and span), then
//! [`IdempotencyLayer`]`::new().require_key(true)` (its own in-memory store, keys global:
//! no client scoping), around a `service_fn` handler. hyper-util's
//! `TowerToHyperService` turns the tower service into a hyper one.
//!
//! Without a router, the layer wraps every path: a `POST` anywhere needs a key (a `POST`
//! to an unknown path without one is `400`, not `404`), and every response, `GET`s
//! included, carries `idempotent-replayed: false` unless it is a replay. With axum, put
//! the layer on the method routers it protects instead (see the `commands` example).
//!
//! Types to note: the handler receives `Request<tower_ids::body::Body<Incoming>>` (the
//! idempotency layer reads the body to fingerprint it and hands it on as a
//! `tower_ids::body::Body`), and the layered service answers
//! `Response<tower_ids::body::Body<Full<Bytes>>>`.
//!
//! # Run
//!
//! ```sh
//! cargo run --example hyper_server
//! cargo run --example hyper_server -- --addr 127.0.0.1:0
//! ```
//!
//! Once bound it logs `listening on http://ADDR` with the real address.
//!
//! # Try it
//!
//! ```sh
//! # Runs the handler: 201, idempotent-replayed: false, {"order":1,"echo":{"sku":"tea"}}
//! curl -si localhost:3001/orders -H 'content-type: application/json' \
//!     -H 'idempotency-key: order-1' -d '{"sku":"tea"}'
//!
//! # A retry: the same response, idempotent-replayed: true, still order 1.
//! curl -si localhost:3001/orders -H 'content-type: application/json' \
//!     -H 'idempotency-key: order-1' -d '{"sku":"tea"}'
//!
//! # The same key, another body: 422. No key: 400. Another path: 404.
//! curl -si localhost:3001/orders -H 'idempotency-key: order-1' -d '{"sku":"coffee"}'
//! curl -si localhost:3001/orders -d '{"sku":"tea"}'
//! curl -si localhost:3001/nothing
//! ```

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use bytes::Bytes;
use clap::Parser;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto::Builder,
    service::TowerToHyperService,
};
use tokio::net::TcpListener;
use tower::{service_fn, ServiceBuilder};
use tower_ids::{body::Body, correlation::CorrelationLayer, idempotency::IdempotencyLayer};
use tracing_subscriber::{filter::LevelFilter, EnvFilter};

/// tower-ids' idempotency layer on a plain hyper server.
#[derive(Debug, Parser)]
struct Args {
    /// Address to listen on; port 0 picks a free port (the log says which).
    #[arg(long, default_value = "127.0.0.1:3001")]
    addr: SocketAddr,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::builder()
                .with_default_directive(LevelFilter::INFO.into())
                .from_env_lossy(),
        )
        .init();

    let orders = Arc::new(AtomicU64::new(0));
    let service = ServiceBuilder::new()
        .layer(CorrelationLayer::new())
        .layer(IdempotencyLayer::new().require_key(true))
        .service(service_fn(move |request| handle(orders.clone(), request)));

    let listener = TcpListener::bind(args.addr).await?;
    let addr = listener.local_addr()?;
    tracing::info!(event = "orders.listening", %addr, "listening on http://{addr}");

    loop {
        let (stream, _peer) = listener.accept().await?;
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            if let Err(error) = Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(event = "orders.connection_error", %error, "connection closed");
            }
        });
    }
}

/// `POST /orders`: counts an execution and echoes the JSON body. Anything else: 404.
async fn handle(
    orders: Arc<AtomicU64>,
    request: Request<Body<Incoming>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if request.method() != Method::POST || request.uri().path() != "/orders" {
        return Ok(reply(StatusCode::NOT_FOUND, Bytes::new()));
    }
    let body = match request.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return Ok(reply(StatusCode::BAD_REQUEST, Bytes::new())),
    };
    let Ok(echo) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return Ok(reply(StatusCode::BAD_REQUEST, Bytes::new()));
    };
    let order = orders.fetch_add(1, Ordering::Relaxed) + 1;
    tracing::info!(event = "orders.created", order, "order created");
    let json = serde_json::json!({ "order": order, "echo": echo });
    Ok(reply(StatusCode::CREATED, Bytes::from(json.to_string())))
}

fn reply(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    if status == StatusCode::CREATED {
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
    }
    response
}
