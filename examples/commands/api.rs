//! Every refusal, as RFC 9457 problem details with a stable `code`.

use std::time::Duration;

use axum::{
    extract::rejection::JsonRejection,
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Json,
};
use serde::Serialize;
use tower_ids::PROBLEM_JSON;
use uuid::Uuid;

use crate::routes::MAX_PAYLOAD_DEPTH;

/// `Retry-After` on a request shed over `--max-concurrent-requests`, in seconds: the
/// requests holding the slots take milliseconds, so a second later is likely to succeed.
/// Also on `503 commands.database_unavailable`: a database that failed a call for a
/// moment (a restart, a failover) is back within seconds, and the pool reconnects.
const OVERLOADED_RETRY_AFTER_SECS: u64 = 1;

/// Everything a handler or a limit can refuse with, answered as RFC 9457 problem
/// details.
#[derive(Debug)]
pub(crate) enum ApiError {
    /// The create body was not a JSON command.
    BadRequest(JsonRejection),
    NotFound,
    AlreadySent,
    PublisherStopped,
    UnknownRoute,
    MethodNotAllowed,
    /// The request was not answered within `--request-timeout-ms`.
    RequestTimeout(Duration),
    /// The request body sent nothing for `--body-timeout-ms`.
    BodyTimeout(Duration),
    /// The request body is over `--max-body-bytes`.
    BodyTooLarge(usize),
    /// Shed: `--max-concurrent-requests` were being handled.
    Overloaded,
    /// A `device_id` or `name` with U+0000, which PostgreSQL text cannot hold: refused in
    /// every mode, so that the answer does not depend on the store.
    NulInText,
    /// The `payload` nests arrays and objects deeper than
    /// [`MAX_PAYLOAD_DEPTH`](crate::routes::MAX_PAYLOAD_DEPTH).
    PayloadTooDeep,
    /// `--fail-after-write-percent`: a `POST` handler failed on purpose after its writes.
    FailedAfterWrite,
    /// DB mode: the database failed or did not answer in time; nothing was written.
    DatabaseUnavailable,
    Internal,
}

impl ApiError {
    pub(crate) fn bad_request(rejection: JsonRejection) -> Self {
        Self::BadRequest(rejection).create_refused()
    }

    /// This refusal of a create request's body, logged.
    pub(crate) fn create_refused(self) -> Self {
        // The status and the code only: a rejection's text can quote the body.
        tracing::warn!(
            event = "commands.bad_request",
            status = self.status().as_u16(),
            code = self.code(),
            "create request refused"
        );
        self
    }

    /// A database call that failed, logged (the error only: sqlx's messages carry no
    /// bound values).
    pub(crate) fn database(error: &(dyn std::error::Error + 'static), doing: &'static str) -> Self {
        tracing::warn!(
            event = "commands.database_failed",
            doing,
            error = %error,
            "database call failed; answering 503"
        );
        Self::DatabaseUnavailable
    }

    pub(crate) fn not_found(id: Uuid) -> Self {
        tracing::info!(event = "commands.not_found", command_id = %id, "unknown command");
        Self::NotFound
    }

    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(rejection) => rejection.status(),
            Self::NotFound | Self::UnknownRoute => StatusCode::NOT_FOUND,
            Self::AlreadySent => StatusCode::CONFLICT,
            Self::PublisherStopped | Self::Overloaded | Self::DatabaseUnavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::NulInText | Self::PayloadTooDeep => StatusCode::UNPROCESSABLE_ENTITY,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::RequestTimeout(_) | Self::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Internal | Self::FailedAfterWrite => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A stable code a client can match on.
    fn code(&self) -> &'static str {
        match self {
            Self::BadRequest(JsonRejection::JsonSyntaxError(_)) => "body.invalid_json",
            Self::BadRequest(JsonRejection::JsonDataError(_)) | Self::NulInText => {
                "body.invalid_fields"
            }
            Self::BadRequest(JsonRejection::MissingJsonContentType(_)) => "body.not_json",
            Self::PayloadTooDeep => "body.too_deep",
            Self::BadRequest(_) => "body.unreadable",
            Self::NotFound => "commands.not_found",
            Self::AlreadySent => "commands.already_sent",
            Self::PublisherStopped => "commands.publisher_stopped",
            Self::UnknownRoute => "route.not_found",
            Self::MethodNotAllowed => "route.method_not_allowed",
            Self::RequestTimeout(_) => "request.timeout",
            Self::BodyTimeout(_) => "request.body_timeout",
            Self::BodyTooLarge(_) => "request.body_too_large",
            Self::Overloaded => "server.overloaded",
            Self::DatabaseUnavailable => "commands.database_unavailable",
            Self::FailedAfterWrite => "commands.failed_after_write",
            Self::Internal => "server.internal_error",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Self::BadRequest(_) | Self::NulInText | Self::PayloadTooDeep => {
                "Invalid command request"
            }
            Self::NotFound => "Command not found",
            Self::AlreadySent => "Command already sent",
            Self::PublisherStopped => "Service shutting down",
            Self::UnknownRoute => "Not found",
            Self::MethodNotAllowed => "Method not allowed",
            Self::RequestTimeout(_) => "Request timeout",
            Self::BodyTimeout(_) => "Request body timeout",
            Self::BodyTooLarge(_) => "Request body too large",
            Self::Overloaded => "Service overloaded",
            Self::DatabaseUnavailable => "Database unavailable",
            Self::FailedAfterWrite => "Failed after writing, on purpose",
            Self::Internal => "Internal error",
        }
    }

    fn detail(&self) -> String {
        match self {
            Self::BadRequest(rejection) => rejection.body_text(),
            Self::NotFound => "no command has this id".to_owned(),
            Self::AlreadySent => {
                "the command was sent to the device and can no longer be cancelled".to_owned()
            }
            Self::PublisherStopped => "the command publisher has stopped; retry later".to_owned(),
            Self::UnknownRoute => "no route matches this path".to_owned(),
            Self::MethodNotAllowed => {
                "this path does not take this method; the Allow header lists those it takes"
                    .to_owned()
            }
            Self::RequestTimeout(limit) => format!(
                "the request was not answered within {} ms; a create or cancel may still \
                 complete: retry it with the same idempotency key",
                limit.as_millis()
            ),
            Self::BodyTimeout(limit) => format!(
                "the request body sent nothing for {} ms",
                limit.as_millis()
            ),
            Self::BodyTooLarge(limit) => {
                format!("a request body may be at most {limit} bytes")
            }
            Self::Overloaded => format!(
                "the service is handling as many requests as it takes at once; retry in {OVERLOADED_RETRY_AFTER_SECS} s"
            ),
            Self::NulInText => {
                "device_id and name may not contain U+0000 (NUL)".to_owned()
            }
            Self::PayloadTooDeep => format!(
                "payload may nest arrays and objects at most {MAX_PAYLOAD_DEPTH} deep"
            ),
            Self::FailedAfterWrite => "the handler failed after its writes, as \
                 --fail-after-write-percent asks: in memory or with Redis the writes stand and \
                 this answer is replayed to a retry with the same idempotency key; in DB mode \
                 they were rolled back with the request's transaction, and a retry runs again"
                .to_owned(),
            Self::DatabaseUnavailable => format!(
                "the database failed or did not answer in time; nothing was written: retry in \
                 {OVERLOADED_RETRY_AFTER_SECS} s (a create or cancel with the same idempotency key)"
            ),
            Self::Internal => "the service failed to answer".to_owned(),
        }
    }
}

/// RFC 9457 problem details.
#[derive(Serialize)]
struct Problem {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'static str,
    status: u16,
    detail: String,
    code: &'static str,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let problem = Problem {
            type_uri: format!("urn:tower-ids:example:commands:{}", self.code()),
            title: self.title(),
            status: status.as_u16(),
            detail: self.detail(),
            code: self.code(),
        };
        let mut response = (status, Json(problem)).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        match self {
            Self::Overloaded | Self::DatabaseUnavailable => {
                headers.insert(
                    header::RETRY_AFTER,
                    HeaderValue::from(OVERLOADED_RETRY_AFTER_SECS),
                );
            }
            // The rest of the body may still be on its way: hyper closes the connection
            // after this answer instead of reading on for the next request.
            Self::RequestTimeout(_) | Self::BodyTimeout(_) | Self::BodyTooLarge(_) => {
                headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        response
    }
}
