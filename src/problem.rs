//! RFC 9457 problem details: every error a tower-ids layer answers with is built here.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde::Serialize;

use crate::body::ResponseBody;

/// The media type of RFC 9457 problem details.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// One problem a layer reports to the client.
///
/// `type` is a stable URN and `code` a stable short string; clients match on either,
/// never on `title` or `detail`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Problem {
    #[serde(rename = "type")]
    type_uri: &'static str,
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
            type_uri: type_uri(code),
            title,
            status,
            detail: detail.into(),
            code,
        }
    }

    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    pub(crate) fn to_bytes(&self) -> Bytes {
        // Serialising a struct of strings and an integer cannot fail.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    pub(crate) fn into_response<B>(self) -> Response<ResponseBody<B>> {
        let mut response = Response::new(ResponseBody::complete(self.to_bytes()));
        *response.status_mut() = self.status;
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        response
    }
}

/// Maps a problem code to its stable `type` URN.
fn type_uri(code: &'static str) -> &'static str {
    match code {
        "correlation_id.missing" => "urn:tower-ids:problem:correlation-id-missing",
        "correlation_id.invalid" => "urn:tower-ids:problem:correlation-id-invalid",
        "correlation_id.not_installed" => "urn:tower-ids:problem:correlation-layer-missing",
        _ => "about:blank",
    }
}
