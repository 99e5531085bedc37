//! The one adapter over the engine for calls that carry an HTTP request and answer an
//! HTTP response: HTTP routes and unary gRPC calls alike. A call's key, client and
//! epoch become a scope, its body a fingerprint, and the engine's decision a response.
//!
//! What tells the two apart (what a call's status is, which outcomes are kept and how,
//! how a refusal or a replay is written) is a `Transport` (module `transport`), the last type parameter of
//! [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) and
//! [`Idempotency`](crate::idempotency::Idempotency): [`Http`](crate::idempotency::Http)
//! or [`Grpc`](crate::idempotency::grpc::Grpc). It is the shape of tower-http's `trace`
//! module, whose classifier is a type parameter.
//!
//! In the order a call meets them: `layer` (the settings every transport has), `http`
//! and `grpc` (each transport's constructors and setters; `openapi` documents an HTTP
//! route), `service` (the call's path through the layer), `read` (its body, within its limits),
//! `reply` (every answer the layer writes, in the transport's form).

#[cfg(feature = "grpc")]
mod grpc;
mod http;
mod layer;
#[cfg(feature = "openapi")]
pub(crate) mod openapi;
mod read;
mod reply;
mod service;

#[cfg(feature = "grpc")]
pub use self::grpc::{GrpcIdempotency, GrpcIdempotencyLayer};
pub(crate) use self::reply::Reply;
pub use self::{layer::IdempotencyLayer, service::Idempotency};
