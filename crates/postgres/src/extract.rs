//! The PostgreSQL store's [`Transaction`] as an axum extractor, for the handlers of an
//! HTTP route: the layer offers it in the request's extensions.

use axum_core::{
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use http::request::Parts;

use tower_ids_core::{event, Code};
use tower_ids_correlation::problem::Problem;

use crate::Transaction;

/// The request's [`Transaction`] as an axum extractor. On a route without an
/// idempotency layer over a `PostgresStore` in transactional mode, or on a request the
/// layer did not run (a replay never reaches the handler), the handler is answered
/// `500`.
impl<S: Send + Sync> FromRequestParts<S> for Transaction {
    type Rejection = TransactionRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Transaction>()
            .cloned()
            .ok_or(TransactionRejection)
    }
}

/// Rejection of the [`Transaction`] extractor when no idempotency layer over a
/// `PostgresStore` in transactional mode offered one.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct TransactionRejection;

impl IntoResponse for TransactionRejection {
    fn into_response(self) -> Response {
        tracing::error!(
            target: "tower_ids::idempotency::store",
            event = event::TRANSACTION_MISSING,
            "Transaction extracted but no idempotency layer over a PostgresStore in transactional mode offered one"
        );
        Problem::new(
            Code::TransactionMissing.http_status(),
            Code::TransactionMissing.as_str(),
            Code::TransactionMissing.title(),
            "this route takes the request's transaction, but no idempotency layer over a PostgresStore in transactional mode runs it",
        )
        .into_response_with(axum_core::body::Body::from)
    }
}
