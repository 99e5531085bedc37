//! The README's Quick start, as it is there: an axum service with both layers on
//! `127.0.0.1:3000`. `cargo run --example quick_start`, then:
//!
//! ```sh
//! curl -si localhost:3000/commands -H 'x-api-key: me' -H 'idempotency-key: k-1' -d '{}'
//! ```

use axum::{routing::post, Router};
use http::HeaderName;
use tower_ids::{
    correlation::{CorrelationId, CorrelationLayer},
    idempotency::{ClientFromHeader, IdempotencyLayer, MokaStore},
};

async fn create(id: CorrelationId) -> String {
    tracing::info!("creating"); // logged inside the span, with correlation_id
    format!("created under {id}\n")
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt().init();

    let store = MokaStore::new(); // clones share one cache: one store for every route
    let idempotent = IdempotencyLayer::with_store(store)
        .client(ClientFromHeader::new(HeaderName::from_static("x-api-key")))
        .require_key(true);

    let app: Router = Router::new()
        // Per route: only the POST is deduplicated.
        .route("/commands", post(create).layer(idempotent))
        // Last, so outermost: everything inside (replays included) runs in its span.
        .layer(CorrelationLayer::new().accept(HeaderName::from_static("x-request-id")));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000")
        .await
        .unwrap();
    axum::serve(listener, app).await.unwrap();
}
