//! The problem details of the idempotency layer's answers, on the correlation crate's
//! RFC 9457 builder.

pub(crate) use tower_ids_correlation::problem::{checked_docs_base, Problem};

/// The problem of an idempotency layer's refusal: its status and title are the code's.
pub(crate) fn idempotency(code: crate::idempotency::Code, detail: impl Into<String>) -> Problem {
    Problem::new(code.http_status(), code.as_str(), code.title(), detail)
}

#[cfg(test)]
mod tests {
    use std::{fs, path::Path};

    use http::{Response, StatusCode};

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

    /// Every code of the code book is in the table of the transport that answers it,
    /// with the status (or gRPC code) the book maps it to; and its problem says that
    /// status and links to its row.
    #[test]
    fn every_code_is_in_its_transports_table_with_its_status() {
        use crate::idempotency::Code;
        // Answered only on gRPC calls, or only to message consumers.
        let grpc_only = [Code::StreamingUnsupported, Code::MessageInvalid];
        let message_only = [Code::OutcomeUndecodable];

        let page = source("idempotency/mod.rs");
        let rows = table_rows(&page);
        for code in Code::ALL {
            let response = idempotency(code, "detail").into_response::<()>();
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
            assert!(
                Code::ALL.iter().any(|c| c.as_str() == code.as_str()),
                "{code}"
            );
        }

        let refusals = source("../crates/message/src/service.rs");
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
                    let Some(book) = Code::ALL.into_iter().find(|c| c.as_str() == code) else {
                        continue;
                    };
                    let grpc = format!("{:?}", tonic::Code::from_i32(book.grpc_status()));
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
            use crate::idempotency::adapter::openapi::{answered_with, CLIENT_MISSING, PROBLEMS};
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

    /// Every event the layers log is in the idempotency module docs' list of events.
    #[test]
    fn every_event_is_documented() {
        let docs = source("idempotency/mod.rs");
        let missing: Vec<_> = tower_ids_core::event::ALL
            .iter()
            .filter(|name| !docs.contains(&format!("`{name}`")))
            .collect();
        assert!(
            missing.is_empty(),
            "events the module docs leave out: {missing:?}"
        );
    }
}
