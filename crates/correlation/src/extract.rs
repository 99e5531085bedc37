use std::convert::Infallible;

use axum_core::{
    extract::{FromRequestParts, OptionalFromRequestParts},
    response::{IntoResponse, Response},
};
use http::{request::Parts, StatusCode};

use super::CorrelationId;
use crate::problem::Problem;

/// `CorrelationId` as an axum extractor: the request's effective ID.
///
/// Reads the extension [`CorrelationLayer`](super::CorrelationLayer) set, or the
/// task-local. Without the layer the handler is answered `500` with a problem naming the
/// misconfiguration; extract `Option<CorrelationId>` to handle that case yourself.
impl<S: Send + Sync> FromRequestParts<S> for CorrelationId {
    type Rejection = CorrelationIdRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        find(parts).ok_or(CorrelationIdRejection)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for CorrelationId {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(find(parts))
    }
}

fn find(parts: &Parts) -> Option<CorrelationId> {
    parts
        .extensions
        .get::<CorrelationId>()
        .cloned()
        .or_else(CorrelationId::current)
}

/// Rejection of the [`CorrelationId`] extractor when no correlation layer ran.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct CorrelationIdRejection;

impl IntoResponse for CorrelationIdRejection {
    fn into_response(self) -> Response {
        tracing::error!(
            target: "tower_ids::correlation",
            event = "correlation.layer_missing",
            "CorrelationId extracted but no CorrelationLayer wraps this route"
        );
        let problem = Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "correlation_id.not_installed",
            "Correlation layer missing",
            "the server extracts a correlation id but no CorrelationLayer wraps this route",
        );
        problem.into_response_with(axum_core::body::Body::from)
    }
}
