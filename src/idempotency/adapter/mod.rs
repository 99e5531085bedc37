//! The one adapter over the engine for calls that carry an HTTP request and answer an
//! HTTP response: HTTP routes and unary gRPC calls alike. A call's key, client and
//! epoch become a scope, its body a fingerprint, and the engine's decision a response.
//!
//! What tells the two apart (what a call's status is, which outcomes are kept and how,
//! how a refusal or a replay is written) is a [`Transport`], the last type parameter of
//! [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) and
//! [`Idempotency`](crate::idempotency::Idempotency): [`Http`](crate::idempotency::Http)
//! or [`Grpc`](crate::idempotency::grpc::Grpc). It is the shape of tower-http's `trace`
//! module, whose classifier is a type parameter.
//!
//! In the order a call meets them: `layer` (the settings every transport has),
//! `service` (the call's path through the layer), `read` (its body, within its limits),
//! `reply` (every answer the layer writes, in the transport's form).

mod layer;
mod read;
mod reply;
mod service;

use std::{sync::Arc, time::SystemTime};

use bytes::Bytes;
use http::{request, response, HeaderMap, HeaderName, Request, Response};

pub(crate) use self::reply::Reply;
pub use self::{layer::IdempotencyLayer, service::Idempotency};

use crate::body::Body;
use crate::idempotency::{
    collect::Budget,
    core::{observe::LayerOrder, refusal::Answered, Answer, Classified, OutcomeClass},
    extract::ExtractKey,
    store::Record,
    ClientId, Code, Fingerprint, IdempotencyKey, ScopeKey,
};

/// The settings of a layer: those every transport has, and the transport's own.
#[derive(Clone)]
pub(crate) struct Settings<T> {
    pub(crate) require_key: bool,
    pub(crate) require_client: bool,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) budget: Arc<Budget>,
    pub(crate) per_attempt: Vec<HeaderName>,
    /// Warns once, for this layer and its clones, of a call without a correlation ID.
    pub(crate) layer_order: Arc<LayerOrder>,
    pub(crate) transport: T,
}

/// Whose key a scope is for: the client (if any) and the key.
pub(crate) struct Owner<'a> {
    pub(crate) client: Option<&'a ClientId>,
    pub(crate) key: &'a IdempotencyKey,
}

/// A response read whole: its head, its body and its trailers.
pub(crate) struct Whole<'a> {
    pub(crate) parts: &'a response::Parts,
    pub(crate) body: &'a Bytes,
    /// Read by the gRPC transport only.
    #[cfg_attr(not(feature = "grpc"), allow(dead_code))]
    pub(crate) trailers: Option<&'a HeaderMap>,
}

/// What one transport decides for the adapter. The crate's own: its implementors are
/// [`Http`](crate::idempotency::Http) and [`Grpc`](crate::idempotency::grpc::Grpc).
pub(crate) trait Transport: Clone + Send + Sync + Sized + 'static {
    /// How a response says it went: an HTTP status, a gRPC code.
    type Status: Copy;

    /// What the transport calls one of its calls, in the layer's texts.
    const NOUN: &'static str;

    /// Whether a response's trailers reach the client on a first execution.
    const KEEPS_TRAILERS: bool;

    /// How a refusal with `code` is answered, for its WARN line.
    fn answered(code: Code) -> Answered;

    /// Whether the layer deduplicates `request` at all (HTTP: its method).
    fn covers<B>(settings: &Settings<Self>, request: &Request<B>) -> bool;

    /// Where the key comes from.
    fn key(settings: &Settings<Self>) -> &dyn ExtractKey;

    /// The scope of `owner`'s key on the call whose head is `parts`.
    fn scope(settings: &Settings<Self>, parts: &request::Parts, owner: Owner<'_>) -> ScopeKey;

    /// A body read whole that the transport cannot deduplicate: the refusal's reason,
    /// code and text.
    fn check_body(body: &[u8]) -> Result<(), (&'static str, Code, &'static str)>;

    /// The call's fingerprint; `shared` when every caller shares its scope, so only a
    /// collision-resistant hash will do.
    fn fingerprint(parts: &request::Parts, body: &[u8], shared: bool) -> Fingerprint;

    /// `answer` as the transport writes it.
    fn render<B>(
        settings: &Settings<Self>,
        key: Option<&IdempotencyKey>,
        answer: Answer,
    ) -> Response<Body<B>>;

    /// The status of a response read whole.
    fn status(parts: &response::Parts, trailers: Option<&HeaderMap>) -> Self::Status;

    /// The status of a response before its body is read, if the transport says it
    /// there (HTTP does; gRPC says it after the messages).
    fn status_before_body(parts: &response::Parts) -> Option<Self::Status>;

    /// What `status` says, for the policy's storage rule.
    fn class(status: Self::Status) -> OutcomeClass;

    /// Whether `status` is a server error (a handler's transaction is rolled back).
    fn is_server_error(status: Self::Status) -> bool;

    /// Whether the layer's own `store_if` keeps an outcome with `status`, if it has one.
    fn store_if(settings: &Settings<Self>, status: Self::Status) -> Option<bool>;

    /// A complete response with `status` as a record's payload.
    fn encode(settings: &Settings<Self>, status: Self::Status, whole: Whole<'_>) -> Classified;

    /// The response a record keeps, as a replay (before the headers every replay
    /// carries); `None` when this transport cannot read it.
    fn replay<B>(
        settings: &Settings<Self>,
        record: &Record,
        request_count: u64,
    ) -> Option<Response<Body<B>>>;

    /// The first answer of a call whose outcome is kept until `expires_at`.
    fn kept(settings: &Settings<Self>, parts: &mut response::Parts, expires_at: Option<SystemTime>);
}
