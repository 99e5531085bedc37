//! RFC 9457 problem details: every error a tower-ids layer answers with is built here.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde::Serialize;

use crate::body::Body;

/// The media type of RFC 9457 problem details.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// One problem a layer reports to the client.
///
/// `type` is a stable URN made from `code` (`idempotency.in_flight` is
/// `urn:tower-ids:problem:idempotency-in-flight`) and `code` a stable short string;
/// clients match on either, never on `title` or `detail`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Problem {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'static str,
    #[serde(serialize_with = "serialize_status")]
    status: StatusCode,
    detail: String,
    code: &'static str,
}

fn serialize_status<S: serde::Serializer>(status: &StatusCode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u16(status.as_u16())
}

impl Problem {
    pub(crate) fn new(
        status: StatusCode,
        code: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            type_uri: format!("urn:tower-ids:problem:{}", code.replace(['.', '_'], "-")),
            title,
            status,
            detail: detail.into(),
            code,
        }
    }

    pub(crate) fn to_bytes(&self) -> Bytes {
        // Serialising a struct of strings and an integer cannot fail.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    pub(crate) fn into_response<B>(self) -> Response<Body<B>> {
        self.into_response_with(Body::complete)
    }

    /// The response, its body made by `body` from the JSON bytes.
    pub(crate) fn into_response_with<T>(self, body: impl FnOnce(Bytes) -> T) -> Response<T> {
        let mut response = Response::new(body(self.to_bytes()));
        *response.status_mut() = self.status;
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        response
    }
}
