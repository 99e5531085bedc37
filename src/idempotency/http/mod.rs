//! The HTTP transport of the adapter (`adapter`): which requests a layer covers, where
//! their key, client and epoch come from, what a refusal and a replay are.
//!
//! In the order a request meets them: `layer` (the HTTP settings), `epoch` and
//! `extract` (what the head and body say), `transport` (what the adapter asks of
//! HTTP), `stored` and `replay` (a response kept and given back); `openapi` documents
//! it.

#[cfg(test)]
mod budget_tests;
mod epoch;
mod extract;
mod layer;
#[cfg(feature = "openapi")]
pub(crate) mod openapi;
mod replay;
mod stored;
mod transport;

pub use self::{
    epoch::{EpochFromExtension, EpochFromHeader, EpochRejection, ExtractEpoch, NoEpoch},
    extract::{ExtractKey, ExtractedKey, IntoExtractedKey, KeyFromHeader, KeyFromJson},
    layer::{
        Http, DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_RESPONSE_BYTES,
    },
    replay::{JsonReplayMarker, OnReplay},
};
#[cfg(all(feature = "postgres", feature = "axum"))]
pub use tower_ids_postgres::TransactionRejection;
