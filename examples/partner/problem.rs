//! The example's own refusals, in the shape the crate's layers answer theirs: RFC 9457
//! problem details with a stable `code`, and a WARN event.

use axum::{
    http::{header, StatusCode},
    response::{IntoResponse, Response},
};
use serde_json::json;

/// A refusal: status, stable code, and the example's own words (never the request's).
#[derive(Debug)]
pub(crate) struct Problem {
    status: StatusCode,
    code: &'static str,
    detail: String,
}

impl Problem {
    pub(crate) fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            code,
            detail: detail.into(),
        }
    }

    pub(crate) fn bad_request(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, detail)
    }

    /// A database failure: logged with its error, answered `503` without it.
    pub(crate) fn database(error: &dyn std::error::Error, doing: &str) -> Self {
        tracing::error!(event = "partner.database_failed", error = %error, doing, "database failed");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "partner.database_unavailable",
            format!("the database failed while {doing}; retry with the same correlation_id"),
        )
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        tracing::warn!(
            event = "partner.refused",
            code = self.code,
            status = self.status.as_u16(),
            detail = %self.detail,
            "request refused"
        );
        let body = json!({
            "type": format!("https://example.com/problems/{}", self.code),
            "title": self.status.canonical_reason().unwrap_or("Error"),
            "status": self.status.as_u16(),
            "detail": self.detail,
            "code": self.code,
        });
        (
            self.status,
            [(header::CONTENT_TYPE, "application/problem+json")],
            body.to_string(),
        )
            .into_response()
    }
}
