//! The headers a browser must be allowed to send and to read, for
//! [`tower_http::cors`](https://docs.rs/tower-http/latest/tower_http/cors/).
//!
//! A page on another origin reaches a protected route through CORS, and the browser
//! enforces two rules the layers cannot see:
//!
//! - **Sending.** `Idempotency-Key`, `x-correlation-id` and `attempt-id` are not
//!   CORS-safelisted request headers, so the browser asks first (a preflight
//!   `OPTIONS`), and refuses to send the request unless the answer allows them:
//!   [`ALLOW_HEADERS`].
//! - **Reading.** Script sees only the safelisted response headers (`Content-Type`,
//!   `Content-Length` and a few more) unless the response exposes the others, so a web
//!   client cannot tell a replay from a first run, nor quote the correlation ID, nor
//!   honour `Retry-After`: [`EXPOSE_HEADERS`].
//!
//! Put the `CorsLayer` outside the correlation layer, so it answers preflights before
//! any other layer runs, and add the headers your own routes need (`Content-Type`
//! for JSON, an API-key header):
//!
//! ```
//! use axum::{routing::post, Router};
//! use http::{header, HeaderName, HeaderValue, Method};
//! use tower_http::cors::CorsLayer;
//! use tower_ids::{cors, CorrelationLayer, IdempotencyLayer};
//!
//! let cors = CorsLayer::new()
//!     .allow_origin(HeaderValue::from_static("https://app.example.com"))
//!     .allow_methods([Method::GET, Method::POST])
//!     .allow_headers(
//!         cors::ALLOW_HEADERS
//!             .into_iter()
//!             .chain([header::CONTENT_TYPE, HeaderName::from_static("x-api-key")])
//!             .collect::<Vec<_>>(),
//!     )
//!     .expose_headers(cors::EXPOSE_HEADERS);
//!
//! let app: Router = Router::new()
//!     .route("/orders", post(|| async { "created" }).layer(IdempotencyLayer::new()))
//!     .layer(CorrelationLayer::new())
//!     .layer(cors); // last, so outermost
//! ```
//!
//! A layer configured with other header names (`CorrelationLayer::header`,
//! `IdempotencyLayer::key_headers`) needs those names in the lists instead.

use http::{header, HeaderName};

use crate::{
    correlation::DEFAULT_HEADER,
    idempotency::header::{
        ATTEMPT_ID, IDEMPOTENCY_EXPIRES, IDEMPOTENCY_FIRST_SEEN, IDEMPOTENCY_KEY,
        IDEMPOTENCY_REQUEST_COUNT, IDEMPOTENT_REPLAYED, ORIGINAL_ATTEMPT_ID,
    },
};

/// The request headers the layers read, for `CorsLayer::allow_headers`:
/// `Idempotency-Key`, `x-correlation-id` and `attempt-id`.
pub const ALLOW_HEADERS: [HeaderName; 3] = [IDEMPOTENCY_KEY, DEFAULT_HEADER, ATTEMPT_ID];

/// The response headers the layers write that a script needs, for
/// `CorsLayer::expose_headers`: `idempotent-replayed`, `Idempotency-Key`,
/// `x-correlation-id`, `attempt-id`, `original-attempt-id`, `idempotency-first-seen`,
/// `idempotency-request-count`, `idempotency-expires`, `Retry-After` (on `409` and
/// `503`) and `Link` (a problem's documentation).
pub const EXPOSE_HEADERS: [HeaderName; 10] = [
    IDEMPOTENT_REPLAYED,
    IDEMPOTENCY_KEY,
    DEFAULT_HEADER,
    ATTEMPT_ID,
    ORIGINAL_ATTEMPT_ID,
    IDEMPOTENCY_FIRST_SEEN,
    IDEMPOTENCY_REQUEST_COUNT,
    IDEMPOTENCY_EXPIRES,
    header::RETRY_AFTER,
    header::LINK,
];
