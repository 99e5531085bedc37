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
    use std::{collections::BTreeSet, fs, path::Path};

    /// Every `code` a layer can answer with, read from the source: a string literal
    /// `"idempotency.x"` or `"correlation_id.x"` outside comments and event fields.
    fn codes_in(dir: &Path, skip: &[&str], codes: &mut BTreeSet<String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if skip.iter().any(|s| path.ends_with(s)) {
                continue;
            }
            if path.is_dir() {
                codes_in(&path, skip, codes);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            for line in fs::read_to_string(&path).unwrap().lines() {
                let line = line.trim_start();
                if line.starts_with("//") || line.contains("event") {
                    continue;
                }
                for literal in line.split('"').skip(1).step_by(2) {
                    let is_code = ["idempotency.", "correlation_id."].iter().any(|p| {
                        literal.strip_prefix(p).is_some_and(|rest| {
                            !rest.is_empty()
                                && rest.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                        })
                    });
                    if is_code {
                        codes.insert(literal.to_owned());
                    }
                }
            }
        }
    }

    /// The rows of the markdown tables in `file`'s doc comments that name `code`.
    fn documented(file: &Path, code: &str) -> bool {
        fs::read_to_string(file).unwrap().lines().any(|line| {
            let line = line.trim_start();
            (line.starts_with("//! |") || line.starts_with("/// |"))
                && line.contains(&format!("`{code}`"))
        })
    }

    #[test]
    fn every_problem_code_is_in_a_status_table() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut http = BTreeSet::new();
        // The message layer answers with `Refusal`s, documented on `Refusal::code`; the
        // gRPC layer with statuses, in its own table (checked below).
        codes_in(&src, &["message", "grpc", "tests"], &mut http);
        assert!(http.len() > 20, "the scan found the codes: {http:?}");
        let tables = [
            src.join("idempotency/mod.rs"),
            src.join("correlation/mod.rs"),
        ];
        let missing: Vec<_> = http
            .iter()
            .filter(|code| !tables.iter().any(|file| documented(file, code)))
            .collect();
        assert!(
            missing.is_empty(),
            "codes no status table lists: {missing:?}"
        );
        #[cfg(feature = "grpc")]
        {
            let mut grpc = BTreeSet::new();
            codes_in(&src.join("idempotency/grpc"), &["tests"], &mut grpc);
            assert!(grpc.len() > 10, "the scan found the codes: {grpc:?}");
            let table = src.join("idempotency/grpc/mod.rs");
            let missing: Vec<_> = grpc.iter().filter(|c| !documented(&table, c)).collect();
            assert!(
                missing.is_empty(),
                "gRPC codes its table lacks: {missing:?}"
            );
        }

        // Every problem's `type` opens its row: the page of its module has an anchor
        // named by the code.
        let unanchored: Vec<_> = http
            .iter()
            .filter(|code| {
                let page = if code.starts_with("correlation_id.") {
                    "correlation/mod.rs"
                } else {
                    "idempotency/mod.rs"
                };
                !fs::read_to_string(src.join(page))
                    .unwrap()
                    .contains(&format!("<a id=\"{code}\"></a>"))
            })
            .collect();
        assert!(
            unanchored.is_empty(),
            "codes without an anchor on their page: {unanchored:?}"
        );

        // The OpenAPI description lists every code the layer answers a route with (the
        // `Transaction` extractor's is the handler's misconfiguration, not the layer's).
        #[cfg(feature = "openapi")]
        {
            use crate::idempotency::http::openapi::{CLIENT_MISSING, PROBLEMS};
            let documented: BTreeSet<&str> = PROBLEMS
                .iter()
                .chain([&CLIENT_MISSING])
                .flat_map(|(_, _, codes)| codes.iter().copied())
                .collect();
            let missing: Vec<_> = http
                .iter()
                .filter(|code| code.starts_with("idempotency."))
                .filter(|code| *code != "idempotency.transaction_missing")
                .filter(|code| !documented.contains(code.as_str()))
                .collect();
            assert!(
                missing.is_empty(),
                "codes the OpenAPI description leaves out: {missing:?}"
            );
        }

        let mut refusals = BTreeSet::new();
        codes_in(&src.join("idempotency/message"), &[], &mut refusals);
        let table = src.join("idempotency/message/service.rs");
        let missing: Vec<_> = refusals
            .iter()
            .filter(|code| !documented(&table, code))
            .collect();
        assert!(
            missing.is_empty(),
            "refusal codes Refusal::code does not list: {missing:?}"
        );
    }

    /// Every row of a status table, as (status, code).
    #[cfg(feature = "idempotency")]
    fn table_rows(file: &Path) -> Vec<(u16, String)> {
        fs::read_to_string(file)
            .unwrap()
            .lines()
            .filter_map(|line| {
                let row = line.trim_start().strip_prefix("//! | `")?;
                let (status, rest) = row.split_once('`')?;
                let status = status.parse().ok()?;
                let code = rest.split("</a>`").nth(1)?.split('`').next()?;
                Some((status, code.to_owned()))
            })
            .collect()
    }

    /// A problem's `status` member is the response's status, for every code of the
    /// status tables; and where the source builds a problem with a literal status, it
    /// is the one its row gives.
    #[test]
    #[cfg(feature = "idempotency")]
    fn every_problem_says_the_status_it_is_answered_with() {
        use super::*;
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut rows = table_rows(&src.join("idempotency/mod.rs"));
        rows.extend(table_rows(&src.join("correlation/mod.rs")));
        assert!(rows.len() > 20, "the tables were read: {rows:?}");
        for (status, code) in &rows {
            let code: &'static str = Box::leak(code.clone().into_boxed_str());
            let status = StatusCode::from_u16(*status).unwrap();
            let response = Problem::new(status, code, "title", "detail").into_response::<()>();
            let body: serde_json::Value =
                serde_json::from_slice(&futures_body(response.body())).unwrap();
            assert_eq!(response.status(), status, "{code}");
            assert_eq!(body["status"], status.as_u16(), "{code}");
            assert_eq!(body["code"], code);
        }
        // `Problem::new(StatusCode::X, "code", ...)` in the source agrees with the table.
        let names = [
            ("BAD_REQUEST", 400),
            ("UNAUTHORIZED", 401),
            ("CONFLICT", 409),
            ("GONE", 410),
            ("PAYLOAD_TOO_LARGE", 413),
            ("UNPROCESSABLE_ENTITY", 422),
            ("INTERNAL_SERVER_ERROR", 500),
            ("SERVICE_UNAVAILABLE", 503),
        ];
        let mut checked = 0;
        let mut stack = vec![src.clone()];
        while let Some(dir) = stack.pop() {
            for entry in fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                if path.ends_with("problem.rs") {
                    continue;
                }
                let text = fs::read_to_string(&path).unwrap_or_default();
                for built in text.split("Problem::new(").skip(1) {
                    let mut words = built.split(',').map(str::trim);
                    let (Some(status), Some(code)) = (words.next(), words.next()) else {
                        continue;
                    };
                    let (Some(name), Some(code)) = (
                        status.strip_prefix("StatusCode::"),
                        code.strip_prefix('"').and_then(|c| c.strip_suffix('"')),
                    ) else {
                        continue;
                    };
                    let Some((_, number)) = names.iter().find(|(n, _)| *n == name) else {
                        panic!(
                            "{}: a status this test does not know: {name}",
                            path.display()
                        );
                    };
                    let row = rows.iter().find(|(_, c)| c == code);
                    assert_eq!(
                        row.map(|(s, _)| s),
                        Some(number),
                        "{}: {code} answers {name}, its row says {row:?}",
                        path.display()
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked >= 10, "the source was read: {checked}");
    }

    #[cfg(feature = "idempotency")]
    fn futures_body(body: &crate::body::Body<()>) -> Vec<u8> {
        body.complete_bytes().expect("a complete body").to_vec()
    }
}
