//! The HTTP adapter over the engine: a request's key, client, epoch and body become a
//! scope and a fingerprint; the engine's decision becomes a response.
//!
//! In the order a request meets them: [`layer`](IdempotencyLayer) (the settings),
//! `service` (the request's path through the layer), `epoch` and `extract` (what the
//! head and body say), `read` (the body, within its limits),
//! `answer` and `replay` (every response the layer writes); `openapi` documents it.

mod answer;
#[cfg(test)]
mod budget_tests;
mod epoch;
mod extract;
mod layer;
#[cfg(feature = "openapi")]
pub(crate) mod openapi;
mod read;
mod replay;
mod service;
mod stored;
#[cfg(all(feature = "postgres", feature = "axum"))]
mod transaction;

#[cfg(all(feature = "postgres", feature = "axum"))]
pub use self::transaction::TransactionRejection;
pub use self::{
    epoch::{EpochFromExtension, EpochFromHeader, EpochRejection, ExtractEpoch, NoEpoch},
    extract::{ExtractKey, ExtractedKey, IntoExtractedKey, KeyFromHeader, KeyFromJson},
    layer::{
        IdempotencyLayer, DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_REQUEST_BYTES,
        DEFAULT_MAX_RESPONSE_BYTES,
    },
    replay::{JsonReplayMarker, OnReplay},
    service::Idempotency,
};
