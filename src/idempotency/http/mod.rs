//! The HTTP adapter over the engine: a request's key, client, epoch and body become a
//! scope and a fingerprint; the engine's decision becomes a response.
//!
//! In the order a request meets them: [`layer`](IdempotencyLayer) (the settings),
//! `service` (the request's path through the layer), `client`, `epoch` and `extract`
//! (what the head and body say), `budget` and `read` (the body, within its limits),
//! `answer` and `replay` (every response the layer writes); `openapi` documents it.

mod answer;
pub(crate) mod budget;
mod client;
mod epoch;
mod extract;
mod layer;
#[cfg(feature = "openapi")]
pub(crate) mod openapi;
pub(crate) mod read;
mod replay;
mod service;

// The gRPC adapter's share of the HTTP one.
#[cfg(feature = "grpc")]
pub(crate) use self::{
    answer::{key_refusal, replay_headers},
    budget::Budget,
    layer::per_attempt_headers,
    service::{unclaimed, BoxError},
};

pub use self::{
    client::{
        ClientFromAuthorization, ClientFromExtension, ClientFromHeader, IdentifyClient,
        IntoClientIdentity, InvalidClient, NoClient,
    },
    epoch::{EpochFromExtension, EpochFromHeader, ExtractEpoch, InvalidEpoch, NoEpoch},
    extract::{
        ExtractKey, ExtractedKey, IntoExtractedKey, KeyFromHeader, KeyFromJson, KeyRejection,
    },
    layer::{
        IdempotencyLayer, DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_REQUEST_BYTES,
        DEFAULT_MAX_RESPONSE_BYTES,
    },
    replay::{JsonReplayMarker, OnReplay, ReplayInfo},
    service::{Idempotency, ResponseFuture},
};
