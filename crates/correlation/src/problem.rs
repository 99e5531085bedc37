//! RFC 9457 problem details: every error a tower-ids layer answers with is built here.
//! Public for the tower-ids crates' own layers; not a part of the API to build on.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde::Serialize;

use crate::{body::Body, CorrelationId};

/// The media type of RFC 9457 problem details.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Where the `type` of an idempotency problem points by default: its row in the status
/// table of the `tower_ids::idempotency` module's documentation. The type
/// is this followed by the problem's `code`; set another base with
/// `IdempotencyLayer::problem_docs`.
pub const IDEMPOTENCY_PROBLEM_DOCS: &str =
    "https://docs.rs/tower-ids/latest/tower_ids/idempotency/index.html#";

/// Where the `type` of a correlation problem points by default: its row in the
/// [`correlation`](crate) module's documentation. Set another base with
/// `CorrelationLayer::problem_docs`.
pub const CORRELATION_PROBLEM_DOCS: &str =
    "https://docs.rs/tower-ids/latest/tower_ids/correlation/index.html#";

/// Checks a base URL for problem types: an absolute URI that can sit in a `Link`
/// header. Panics otherwise, as a misconfiguration found at start-up.
pub fn checked_docs_base(base: &str) -> std::sync::Arc<str> {
    let valid = base
        .parse::<http::Uri>()
        .is_ok_and(|uri| uri.scheme().is_some())
        && HeaderValue::from_str(base).is_ok()
        && !base.contains(['<', '>']);
    assert!(
        valid,
        "problem_docs: {base:?} is not an absolute URL that can be sent in a header"
    );
    std::sync::Arc::from(base)
}

/// One problem a layer reports to the client.
///
/// `type` is a URL that opens the problem's documentation: a base URL (by default
/// [`IDEMPOTENCY_PROBLEM_DOCS`] or [`CORRELATION_PROBLEM_DOCS`], whose pages have an
/// anchor per code) followed by `code`, and the response links to it with
/// `Link: <type>; rel="describedby"`. `code` is a stable short string; clients match on
/// it, never on `type` (which moves with the base), `title` or `detail`.
///
/// Two extension members (RFC 9457, section 3.2) name the request, so a client that
/// logs only bodies can quote both IDs: `correlation_id`, the effective ID of this
/// attempt (the one in the `x-correlation-id` response header), and `idempotency_key`,
/// the key the request sent, when it sent a valid one. A member without a value is
/// left out.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'static str,
    #[serde(serialize_with = "serialize_status")]
    status: StatusCode,
    detail: String,
    code: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    correlation_id: Option<CorrelationId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    idempotency_key: Option<String>,
}

fn serialize_status<S: serde::Serializer>(status: &StatusCode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u16(status.as_u16())
}

impl Problem {
    /// A problem with `status`, `code`, `title` and `detail`, its `type` in the docs of
    /// the layer whose code it is.
    pub fn new(
        status: StatusCode,
        code: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        let base = if code.starts_with("correlation_id.") {
            CORRELATION_PROBLEM_DOCS
        } else {
            IDEMPOTENCY_PROBLEM_DOCS
        };
        Self {
            type_uri: format!("{base}{code}"),
            title,
            status,
            detail: detail.into(),
            code,
            correlation_id: None,
            idempotency_key: None,
        }
    }

    /// Points `type` at `base` followed by the code, when the layer was given a base
    /// ([`checked_docs_base`]).
    pub fn docs(mut self, base: Option<&str>) -> Self {
        if let Some(base) = base {
            self.type_uri = format!("{base}{}", self.code);
        }
        self
    }

    /// Names the attempt with `id`, for a layer that answers before the ID is current
    /// (the correlation layer's own refusals). Otherwise the current ID is used.
    pub fn correlation_id(mut self, id: &CorrelationId) -> Self {
        self.correlation_id = Some(id.clone());
        self
    }

    /// Names the idempotency key the request sent, if it sent a valid one.
    pub fn idempotency_key(mut self, key: Option<&str>) -> Self {
        self.idempotency_key = key.map(str::to_owned);
        self
    }

    /// The problem as JSON.
    pub fn to_bytes(&self) -> Bytes {
        // Serialising a struct of strings and an integer cannot fail.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// The response, its body complete.
    pub fn into_response<B>(self) -> Response<Body<B>> {
        self.into_response_with(Body::complete)
    }

    /// The response, its body made by `body` from the JSON bytes.
    ///
    /// A correlation ID not set yet is the task's current one.
    pub fn into_response_with<T>(mut self, body: impl FnOnce(Bytes) -> T) -> Response<T> {
        if self.correlation_id.is_none() {
            self.correlation_id = CorrelationId::current();
        }
        let mut response = Response::new(body(self.to_bytes()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        // The base was checked to fit a header, and a code is letters, `.` and `_`.
        if let Ok(link) =
            HeaderValue::from_str(&format!("<{}>; rel=\"describedby\"", self.type_uri))
        {
            headers.insert(header::LINK, link);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use std::{fs, path::Path};

    use super::*;

    fn source(file: &str) -> String {
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(file)).unwrap()
    }

    /// Every row of a status table in `text`'s module docs, as (status, code).
    fn table_rows(text: &str) -> Vec<(u16, String)> {
        text.lines()
            .filter_map(|line| {
                let row = line.trim_start().strip_prefix("//! | `")?;
                let (status, rest) = row.split_once('`')?;
                let status = status.parse().ok()?;
                let code = rest.split("</a>`").nth(1)?.split('`').next()?;
                Some((status, code.to_owned()))
            })
            .collect()
    }

    fn status_of(response: &Response<crate::body::Body<()>>) -> (StatusCode, serde_json::Value) {
        let body = response.body().complete_bytes().expect("a complete body");
        (response.status(), serde_json::from_slice(&body).unwrap())
    }

    /// The correlation layer's rows: each answers the status its row gives, and its
    /// `type` opens its row.
    #[test]
    fn every_correlation_problem_says_the_status_of_its_row() {
        let page = source("lib.rs");
        let rows = table_rows(&page);
        assert!(rows.len() >= 2, "the table was read: {rows:?}");
        for (status, code) in &rows {
            assert!(page.contains(&format!("<a id=\"{code}\"></a>")), "{code}");
            let code: &'static str = Box::leak(code.clone().into_boxed_str());
            let status = StatusCode::from_u16(*status).unwrap();
            let response = Problem::new(status, code, "title", "detail").into_response::<()>();
            let (answered, body) = status_of(&response);
            assert_eq!(
                (answered, &body["status"]),
                (status, &status.as_u16().into())
            );
            assert_eq!(body["code"], code);
            assert_eq!(
                body["type"],
                format!("{CORRELATION_PROBLEM_DOCS}{code}"),
                "{code}"
            );
        }
    }
}
