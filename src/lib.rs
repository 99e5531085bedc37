//! Tower middleware for the two identifiers every retried request needs.
//!
//! - A **correlation ID** names one attempt: restored from the incoming header or
//!   generated, carried in a tracing span and a task-local, echoed on the response,
//!   propagated on outgoing calls, and extended, replaced, combined or restored as work
//!   splits and merges. See [`correlation`].
//! - An **idempotency key** stays the same across every retry of one user action, so
//!   the server runs the action once and replays its response to every retry. See
//!   [`idempotency`].
//! - On the calling side, a **retry layer** for HTTP clients sends one idempotency key
//!   across every attempt, a new correlation ID and `attempt-id` per attempt, and backs
//!   off as the server asks. See [`client`].
//!
//! Every error a layer answers with is an RFC 9457 `application/problem+json` body with
//! a stable `code`.
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "correlation")]
pub mod body;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "correlation")]
pub mod correlation;
#[cfg(feature = "idempotency")]
pub mod idempotency;
#[cfg(feature = "correlation")]
mod problem;

#[cfg(feature = "correlation")]
pub use problem::PROBLEM_JSON;

#[cfg(feature = "client")]
pub use client::RetryLayer;
#[cfg(feature = "correlation")]
pub use correlation::{CorrelationId, CorrelationLayer, OutboundCorrelationLayer};
#[cfg(feature = "idempotency")]
pub use idempotency::{IdempotencyLayer, MokaStore};
