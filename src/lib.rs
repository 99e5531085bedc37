//! Tower middleware for the two identifiers every retried request needs.
//!
//! - A **correlation ID** names one attempt: restored from the incoming header or
//!   generated, carried in a tracing span and a task-local, echoed on the response,
//!   propagated on outgoing calls, and extended, replaced, combined or restored as work
//!   splits and merges. See [`correlation`].
//! - An **idempotency key** stays the same across every retry of one user action, so
//!   the server can run the action once and replay its outcome.
//!
//! Every error a layer answers with is an RFC 9457 `application/problem+json` body with
//! a stable `code`.
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

pub mod body;
#[cfg(feature = "correlation")]
pub mod correlation;
mod problem;

pub use problem::PROBLEM_JSON;

#[cfg(feature = "correlation")]
pub use correlation::{CorrelationId, CorrelationLayer, OutboundCorrelationLayer};
