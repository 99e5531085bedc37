//! RFC 9457 problem details: every error a tower-ids layer answers with is built here.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde::Serialize;

use crate::{body::Body, correlation::CorrelationId};

/// The media type of RFC 9457 problem details.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Where the `type` of an idempotency problem points by default: its row in the status
/// table of the [`idempotency`](crate::idempotency) module's documentation. The type
/// is this followed by the problem's `code`; set another base with
/// `IdempotencyLayer::problem_docs`.
pub const IDEMPOTENCY_PROBLEM_DOCS: &str =
    "https://docs.rs/tower-ids/latest/tower_ids/idempotency/index.html#";

/// Where the `type` of a correlation problem points by default: its row in the
/// [`correlation`](crate::correlation) module's documentation. Set another base with
/// `CorrelationLayer::problem_docs`.
pub const CORRELATION_PROBLEM_DOCS: &str =
    "https://docs.rs/tower-ids/latest/tower_ids/correlation/index.html#";

/// Checks a base URL for problem types: an absolute URI that can sit in a `Link`
/// header. Panics otherwise, as a misconfiguration found at start-up.
pub(crate) fn checked_docs_base(base: &str) -> std::sync::Arc<str> {
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
pub(crate) struct Problem {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'static str,
    #[serde(serialize_with = "serialize_status")]
    status: StatusCode,
    detail: String,
    code: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    correlation_id: Option<CorrelationId>,
    #[cfg(feature = "idempotency")]
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_key"
    )]
    idempotency_key: Option<crate::idempotency::IdempotencyKey>,
}

fn serialize_status<S: serde::Serializer>(status: &StatusCode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u16(status.as_u16())
}

#[cfg(feature = "idempotency")]
fn serialize_key<S: serde::Serializer>(
    key: &Option<crate::idempotency::IdempotencyKey>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match key {
        Some(key) => s.serialize_str(key.as_str()),
        None => s.serialize_none(),
    }
}

impl Problem {
    pub(crate) fn new(
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
            #[cfg(feature = "idempotency")]
            idempotency_key: None,
        }
    }

    /// The problem of an idempotency layer's refusal: its status and title are the
    /// code's.
    #[cfg(feature = "idempotency")]
    pub(crate) fn idempotency(code: crate::idempotency::Code, detail: impl Into<String>) -> Self {
        Self::new(code.http_status(), code.as_str(), code.title(), detail)
    }

    /// Points `type` at `base` followed by the code, when the layer was given a base
    /// ([`checked_docs_base`]).
    pub(crate) fn docs(mut self, base: Option<&str>) -> Self {
        if let Some(base) = base {
            self.type_uri = format!("{base}{}", self.code);
        }
        self
    }

    /// Names the attempt with `id`, for a layer that answers before the ID is current
    /// (the correlation layer's own refusals). Otherwise the current ID is used.
    pub(crate) fn correlation_id(mut self, id: &CorrelationId) -> Self {
        self.correlation_id = Some(id.clone());
        self
    }

    /// Names the idempotency key the request sent, if it sent a valid one.
    #[cfg(feature = "idempotency")]
    pub(crate) fn idempotency_key(
        mut self,
        key: Option<&crate::idempotency::IdempotencyKey>,
    ) -> Self {
        self.idempotency_key = key.cloned();
        self
    }

    pub(crate) fn to_bytes(&self) -> Bytes {
        // Serialising a struct of strings and an integer cannot fail.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    pub(crate) fn into_response<B>(self) -> Response<Body<B>> {
        self.into_response_with(Body::complete)
    }

    /// The response, its body made by `body` from the JSON bytes.
    ///
    /// A correlation ID not set yet is the task's current one.
    pub(crate) fn into_response_with<T>(mut self, body: impl FnOnce(Bytes) -> T) -> Response<T> {
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
        let page = source("correlation/mod.rs");
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

    /// Every code of the code book is in the table of the transport that answers it,
    /// with the status (or gRPC code) the book maps it to; and its problem says that
    /// status and links to its row.
    #[test]
    #[cfg(feature = "idempotency")]
    fn every_code_is_in_its_transports_table_with_its_status() {
        use crate::idempotency::Code;
        // Answered only on gRPC calls, or only to message consumers.
        let grpc_only = [Code::StreamingUnsupported, Code::MessageInvalid];
        let message_only = [Code::OutcomeUndecodable];

        let page = source("idempotency/mod.rs");
        let rows = table_rows(&page);
        for code in Code::ALL {
            let response = Problem::idempotency(code, "detail").into_response::<()>();
            let (status, body) = status_of(&response);
            assert_eq!(status, code.http_status(), "{code}");
            assert_eq!(body["status"], status.as_u16(), "{code}");
            assert_eq!(body["code"], code.as_str());
            assert_eq!(body["title"], code.title());
            if grpc_only.contains(&code) || message_only.contains(&code) {
                continue;
            }
            let row = rows.iter().find(|(_, c)| c == code.as_str());
            assert_eq!(
                row.map(|(s, _)| *s),
                Some(status.as_u16()),
                "{code}: its row in the status table"
            );
            assert!(
                page.contains(&format!("<a id=\"{code}\"></a>")),
                "{code} has no anchor for its problem type"
            );
        }
        // No row names a code the book does not have.
        for (_, code) in &rows {
            assert!(Code::ALL.iter().any(|c| c == code.as_str()), "{code}");
        }

        let refusals = source("idempotency/message/service.rs");
        for code in message_only {
            assert!(refusals.contains(&format!("/// | `{code}` |")), "{code}");
        }

        #[cfg(feature = "grpc")]
        {
            // `| case | `STATUS` | `code`, `code` | retry |`
            let page = source("idempotency/grpc/mod.rs");
            let mut listed = Vec::new();
            for line in page.lines() {
                let cells: Vec<&str> = line.split(" | ").collect();
                let (Some(status), Some(codes)) = (cells.get(2), cells.get(3)) else {
                    continue;
                };
                for code in codes.split(", ").filter_map(|c| c.strip_prefix('`')) {
                    let code = code.trim_end_matches('`');
                    let Some(book) = Code::ALL.into_iter().find(|c| *c == code) else {
                        continue;
                    };
                    let grpc = format!("{:?}", book.grpc());
                    let mut screaming = String::new();
                    for (i, ch) in grpc.char_indices() {
                        if ch.is_uppercase() && i > 0 {
                            screaming.push('_');
                        }
                        screaming.push(ch.to_ascii_uppercase());
                    }
                    assert_eq!(status.trim_matches('`'), screaming, "{code}");
                    listed.push(book);
                }
            }
            let missing: Vec<_> = Code::ALL
                .into_iter()
                .filter(|code| !message_only.contains(code))
                .filter(|code| {
                    !matches!(
                        code,
                        Code::BodyNotJson
                            | Code::EpochInvalid
                            | Code::EpochMismatch
                            | Code::TransactionMissing
                    )
                })
                .filter(|code| !listed.contains(code))
                .collect();
            assert!(
                missing.is_empty(),
                "codes the gRPC table lacks: {missing:?}"
            );
        }

        // The OpenAPI description lists every code the layer answers a route with.
        #[cfg(feature = "openapi")]
        {
            use crate::idempotency::http::openapi::{answered_with, CLIENT_MISSING, PROBLEMS};
            for (status, code) in &rows {
                if code == Code::TransactionMissing.as_str() {
                    continue;
                }
                assert!(
                    PROBLEMS
                        .iter()
                        .chain([&CLIENT_MISSING])
                        .any(|(s, _)| s == status),
                    "{status} is not described"
                );
                assert!(answered_with(*status).contains(&code.as_str()), "{code}");
            }
        }
    }
}
