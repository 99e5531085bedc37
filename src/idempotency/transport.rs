//! What the adapter (`adapter`) asks of a transport, and the settings a layer holds
//! for it: the contract between the generic layer and [`Http`](crate::idempotency::Http)
//! or [`Grpc`](crate::idempotency::grpc::Grpc). The transports implement it and import
//! nothing of the adapter; the adapter names them only for its constructors.

use std::{sync::Arc, time::SystemTime};

use bytes::Bytes;
use http::{request, response, HeaderMap, HeaderName, Request, Response};

use crate::body::Body;
use crate::idempotency::{
    collect::Budget,
    core::{observe::LayerOrder, refusal::Answered, Answer, Classified, OutcomeClass},
    extract::ExtractKey,
    response::per_attempt_headers,
    store::Record,
    ClientId, Code, Fingerprint, IdempotencyKey, ScopeKey,
};
use tower_ids_core::DEFAULT_MAX_RESPONSE_BYTES;

/// The largest request body read by default (`max_request_bytes`'s docs say why).
const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;
/// The request bytes of all calls in flight by default: the moka store's default bound
/// too, so the two together stay within 128 MiB (`max_buffered_bytes`'s docs).
const DEFAULT_MAX_BUFFERED_BYTES: usize = 64 * 1024 * 1024;

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

impl<T> Settings<T> {
    /// Every transport's defaults, and `transport`'s own settings.
    pub(crate) fn new(transport: T) -> Self {
        Self {
            require_key: false,
            require_client: false,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            budget: Budget::new(DEFAULT_MAX_BUFFERED_BYTES),
            per_attempt: per_attempt_headers(),
            layer_order: Arc::default(),
            transport,
        }
    }

    /// These settings, every transport's, with `transport`'s own in place of `T`'s.
    #[cfg(feature = "grpc")]
    pub(crate) fn with_transport<U>(self, transport: U) -> Settings<U> {
        Settings {
            require_key: self.require_key,
            require_client: self.require_client,
            max_request_bytes: self.max_request_bytes,
            max_response_bytes: self.max_response_bytes,
            budget: self.budget,
            per_attempt: self.per_attempt,
            layer_order: self.layer_order,
            transport,
        }
    }
}

/// Whose key a scope is for: the client (if any) and the key.
pub(crate) struct KeyOwner<'a> {
    pub(crate) client: Option<&'a ClientId>,
    pub(crate) key: &'a IdempotencyKey,
}

/// A response read whole: its head, its body and its trailers.
pub(crate) struct CompleteResponse<'a> {
    pub(crate) parts: &'a response::Parts,
    pub(crate) body: &'a Bytes,
    /// Read by the gRPC transport only.
    #[cfg_attr(not(feature = "grpc"), allow(dead_code))]
    pub(crate) trailers: Option<&'a HeaderMap>,
}

/// What one transport decides for the adapter. The crate's own: its implementors are
/// [`Http`](crate::idempotency::Http) and [`Grpc`](crate::idempotency::grpc::Grpc),
/// each in its own module; the adapter (`adapter`) is generic over it.
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
    fn scope(settings: &Settings<Self>, parts: &request::Parts, owner: KeyOwner<'_>) -> ScopeKey;

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
    fn encode(
        settings: &Settings<Self>,
        status: Self::Status,
        complete: CompleteResponse<'_>,
    ) -> Classified;

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
