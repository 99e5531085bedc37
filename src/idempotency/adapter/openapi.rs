//! OpenAPI for a protected operation, with [utoipa](https://docs.rs/utoipa) (feature
//! `openapi`): [`IdempotencyLayer::document`] adds to an operation what a generated
//! client must know of the layer in front of it.
//!
//! utoipa rather than aide: it is what most axum services use to write their
//! document, and its builder API takes an existing `Operation` as it is, whether it
//! came from `#[utoipa::path]` or was built by hand.

use utoipa::openapi::{
    header::HeaderBuilder,
    path::{Operation, ParameterBuilder, ParameterIn},
    schema::{ObjectBuilder, Type},
    ContentBuilder, RefOr, Required, Response, ResponseBuilder,
};

use crate::idempotency::IdempotencyLayer;
use crate::idempotency::{
    header::{
        ATTEMPT_ID, IDEMPOTENCY_EXPIRES, IDEMPOTENCY_FIRST_SEEN, IDEMPOTENCY_KEY,
        IDEMPOTENCY_REQUEST_COUNT, IDEMPOTENT_REPLAYED, ORIGINAL_ATTEMPT_ID,
    },
    Code, IdempotencyKey,
};
use crate::{IDEMPOTENCY_PROBLEM_DOCS, PROBLEM_JSON};

/// The problems the layer answers with, by status, described; the codes of each are
/// [`answered_with`]'s.
pub(crate) const PROBLEMS: &[(u16, &str)] = &[
    (400, "The idempotency headers or the body could not be used"),
    (
        409,
        "A request with this key is running, or the one waited on failed; retry after Retry-After",
    ),
    (410, "The request ran, but its response was too large to keep"),
    (413, "The request body is over the limit"),
    (422, "The key was used with another request"),
    (500, "The handler's response failed while being read"),
    (
        503,
        "The layer is full, its store is unavailable or its pool exhausted (nothing ran), or the handler's \
         transaction did not commit or its outcome is unknown; retry after Retry-After",
    ),
];

/// `401`, only where the layer requires a client.
pub(crate) const CLIENT_MISSING: (u16, &str) = (401, "A key but no client to scope it");

/// The codes the HTTP layer answers a route with `status`: the gRPC layer's and the
/// message layer's own are not, and neither is the `Transaction` extractor's (the
/// handler's misconfiguration, not the layer's).
pub(crate) fn answered_with(status: u16) -> Vec<&'static str> {
    Code::ALL
        .into_iter()
        .filter(|code| code.http_status().as_u16() == status)
        .filter(|code| {
            !matches!(
                code,
                Code::TransactionMissing
                    | Code::StreamingUnsupported
                    | Code::MessageInvalid
                    | Code::OutcomeUndecodable
            )
        })
        .map(Code::as_str)
        .collect()
}

impl<St, C, E> IdempotencyLayer<St, C, E> {
    /// Documents `operation` as one this layer protects, for generated clients: the
    /// `Idempotency-Key` header parameter (its format, and whether this layer requires
    /// it) and `attempt-id`; every problem the layer can answer, as
    /// `application/problem+json` with its `code` values (a status the operation
    /// already documents keeps its own description and gains the problem content);
    /// and the headers the layer adds to every response (`idempotent-replayed` and
    /// the rest), with `Retry-After` on `409` and `503`.
    ///
    /// ```
    /// use utoipa::openapi::{path::OperationBuilder, ResponseBuilder};
    /// use tower_ids::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new().require_key(true);
    /// let mut create = OperationBuilder::new()
    ///     .response("201", ResponseBuilder::new().description("Created"))
    ///     .build();
    /// layer.document(&mut create);
    /// assert!(create.responses.responses.contains_key("409"));
    /// ```
    ///
    /// As a service writes it: describe the handler with `#[utoipa::path]` (its own
    /// answers, a `422` for a body axum's `Json` refuses included), collect the document
    /// with `#[derive(OpenApi)]`, then let the layer that protects the route document the
    /// operation. The order: `document` the operation with the layer *before* `.layer(..)`
    /// consumes it (or document with a clone). A status the handler already documents
    /// keeps its description and gains the layer's problem content beside the handler's:
    /// a client reads the `code` member to tell the layer's `422
    /// idempotency.fingerprint_mismatch` from the handler's own `422`. Every response also
    /// gets the layer's headers, `x-correlation-id` among them.
    ///
    /// ```
    /// use axum::{routing::post, Json, Router};
    /// use tower_ids::{correlation::CorrelationLayer, IdempotencyLayer};
    /// use utoipa::OpenApi;
    ///
    /// #[derive(serde::Deserialize, utoipa::ToSchema)]
    /// struct NewOrder { sku: String }
    ///
    /// #[utoipa::path(post, path = "/orders", request_body = NewOrder, responses(
    ///     (status = 201, description = "Created"),
    ///     (status = 422, description = "The body is not a valid order (axum's Json rejection)"),
    /// ))]
    /// async fn create_order(Json(order): Json<NewOrder>) -> String { order.sku }
    ///
    /// #[derive(OpenApi)]
    /// #[openapi(paths(create_order))]
    /// struct Api;
    ///
    /// let idempotency = IdempotencyLayer::new().require_key(true);
    /// let mut api = Api::openapi();
    /// let path = api.paths.paths.get_mut("/orders").expect("documented");
    /// idempotency.document(path.post.as_mut().expect("a POST"));
    /// let app: Router = Router::new()
    ///     .route("/orders", post(create_order).layer(idempotency))
    ///     .layer(CorrelationLayer::new());
    ///
    /// let post = api.paths.paths["/orders"].post.as_ref().unwrap();
    /// let unprocessable = match &post.responses.responses["422"] {
    ///     utoipa::openapi::RefOr::T(response) => response,
    ///     _ => unreachable!(),
    /// };
    /// assert_eq!(unprocessable.description, "The body is not a valid order (axum's Json rejection)");
    /// assert!(unprocessable.content.contains_key("application/problem+json"));
    /// assert!(unprocessable.headers.contains_key("x-correlation-id"));
    /// # let _ = app;
    /// ```
    pub fn document(&self, operation: &mut Operation) {
        let parameters = operation.parameters.get_or_insert_with(Vec::new);
        parameters.push(key_parameter(self.settings.require_key));
        parameters.push(
            ParameterBuilder::new()
                .name(ATTEMPT_ID.as_str())
                .parameter_in(ParameterIn::Header)
                .required(Required::False)
                .description(Some(
                    "The client's name for this attempt: echoed, and named in the logs; \
                     never part of deduplication.",
                ))
                .schema(Some(string(Some(128))))
                .build(),
        );
        for response in operation.responses.responses.values_mut() {
            if let RefOr::T(response) = response {
                add_layer_headers(response);
            }
        }
        let client_missing = self.settings.require_client.then_some(&CLIENT_MISSING);
        for (status, description) in PROBLEMS.iter().chain(client_missing) {
            let entry = operation
                .responses
                .responses
                .entry(status.to_string())
                .or_insert_with(|| ResponseBuilder::new().description(*description).into());
            if let RefOr::T(response) = entry {
                response.content.insert(
                    PROBLEM_JSON.to_owned(),
                    problem_content(&answered_with(*status)),
                );
                add_layer_headers(response);
                if matches!(status, 409 | 503) {
                    response.headers.insert(
                        "Retry-After".to_owned(),
                        HeaderBuilder::new()
                            .schema(ObjectBuilder::new().schema_type(Type::Integer))
                            .description(Some("Seconds to wait before retrying."))
                            .build(),
                    );
                }
            }
        }
    }
}

fn key_parameter(required: bool) -> utoipa::openapi::path::Parameter {
    ParameterBuilder::new()
        .name("Idempotency-Key")
        .parameter_in(ParameterIn::Header)
        .required(if required {
            Required::True
        } else {
            Required::False
        })
        .description(Some(format!(
            "One key per user action, the same on every retry of it \
             (draft-ietf-httpapi-idempotency-key-header): an RFC 8941 String such as \
             \"0193c4a2-7b1e-7cc0-9a51-3f2d6c1e8b47\" (parameters ignored), or the same \
             text as a bare token; 1 to {} visible ASCII characters. Sent once: a header \
             on two lines is refused. A retry with the same key gets the first \
             response, replayed, with `{}: true`.",
            IdempotencyKey::MAX_LEN,
            IDEMPOTENT_REPLAYED
        )))
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .min_length(Some(1))
                .max_length(Some(IdempotencyKey::MAX_LEN + 2))
                .pattern(Some(r#"^("[ -~]+"(;.*)?|[!#-~][!-~]*)$"#)),
        ))
        .build()
}

fn string(max_length: Option<usize>) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .max_length(max_length)
}

/// The headers the layer sets on every response of a protected route.
fn add_layer_headers(response: &mut Response) {
    let headers = [
        (
            IDEMPOTENT_REPLAYED,
            "`true` on a replay of the stored response, `false` otherwise.",
        ),
        (
            crate::correlation::DEFAULT_HEADER,
            "This attempt's correlation ID, echoed or generated by the correlation layer \
             in front (its header, if configured otherwise).",
        ),
        (IDEMPOTENCY_KEY, "The request's key, echoed."),
        (ATTEMPT_ID, "The request's attempt ID, echoed."),
        (
            ORIGINAL_ATTEMPT_ID,
            "On a replay: the attempt ID of the request that ran.",
        ),
        (
            IDEMPOTENCY_FIRST_SEEN,
            "On a replay: when the request that ran arrived (HTTP-date).",
        ),
        (
            IDEMPOTENCY_REQUEST_COUNT,
            "On a replay: requests seen with this key, this one included.",
        ),
        (
            IDEMPOTENCY_EXPIRES,
            "On a stored answer, first or replayed, where the route opts in: when it \
             expires and the key runs again (HTTP-date).",
        ),
    ];
    for (name, description) in headers {
        response
            .headers
            .entry(name.as_str().to_owned())
            .or_insert_with(|| {
                HeaderBuilder::new()
                    .schema(string(None))
                    .description(Some(description))
                    .build()
            });
    }
}

/// An RFC 9457 problem whose `code` is one of `codes`.
fn problem_content(codes: &[&str]) -> utoipa::openapi::Content {
    let types: Vec<String> = codes
        .iter()
        .map(|code| format!("{IDEMPOTENCY_PROBLEM_DOCS}{code}"))
        .collect();
    let schema = ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "RFC 9457 problem details. Match on `code`; `type` opens its documentation.",
        ))
        .property(
            "type",
            string(None).description(Some(format!(
                "The documentation of the problem (by default one of {types:?}, or the \
                 service's own base followed by the code)."
            ))),
        )
        .property("title", string(None))
        .property("status", ObjectBuilder::new().schema_type(Type::Integer))
        .property("detail", string(None))
        .property(
            "code",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(codes.iter().copied())),
        )
        .property("correlation_id", string(Some(128)))
        .property("idempotency_key", string(Some(IdempotencyKey::MAX_LEN)))
        .required("type")
        .required("status")
        .required("code");
    ContentBuilder::new().schema(Some(schema)).build()
}
