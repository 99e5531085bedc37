//! The PostgreSQL store's [`Transaction`] as an axum extractor, for the handlers of an
//! HTTP route: the layer offers it in the request's extensions.

use axum_core::{
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use http::{request::Parts, StatusCode};

use crate::idempotency::store::Transaction;
use crate::problem::Problem;

/// The request's [`Transaction`] as an axum extractor. On a route without an
/// idempotency layer over a `PostgresStore` in transactional mode, or on a request the
/// layer did not run (a replay never reaches the handler), the handler is answered
/// `500`.
impl<S: Send + Sync> FromRequestParts<S> for Transaction {
    type Rejection = TransactionMissing;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Transaction>()
            .cloned()
            .ok_or(TransactionMissing)
    }
}

/// Rejection of the [`Transaction`] extractor when no idempotency layer over a
/// `PostgresStore` in transactional mode offered one.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct TransactionMissing;

impl IntoResponse for TransactionMissing {
    fn into_response(self) -> Response {
        tracing::error!(
            event = "idempotency.transaction_missing",
            "Transaction extracted but no idempotency layer over a PostgresStore in transactional mode offered one"
        );
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "idempotency.transaction_missing",
            "Server misconfigured",
            "this route takes the request's transaction, but no idempotency layer over a PostgresStore in transactional mode runs it",
        )
        .into_response_with(axum_core::body::Body::from)
    }
}
