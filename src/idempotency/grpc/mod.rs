//! Idempotent gRPC calls through tonic: each unary call runs once per
//! `idempotency-key`, and every retry gets its response back, as gRPC statuses a
//! client's retry policy can act on.
//!
//! tonic servers are tower services over HTTP/2, so the HTTP layer would run on them,
//! but its answers are HTTP: a duplicate in flight would get `409` with a JSON body,
//! which a gRPC client reads as a transport failure, and a replay would lose the
//! trailers that carry `grpc-status`. [`IdempotencyLayer::new_for_grpc`] makes the
//! layer with the gRPC transport ([`Grpc`]), as tower-http's `TraceLayer::new_for_grpc`
//! picks its classifier, and [`for_grpc`] turns a layer
//! over another store to it: the same layer and service, the same engine, stores, claim, lease
//! renewal, completion rules, events and metrics; the key comes from the call's
//! metadata, the fingerprint covers the method and the request message, the whole
//! response is kept (initial metadata, messages, trailers), and every refusal is a
//! `tonic::Status` with `google.rpc` details. [`GrpcIdempotencyLayer`] names the
//! gRPC layer. The HTTP layer's own settings (methods, key extractors, epochs,
//! replay hooks) mean nothing to a call, so a gRPC layer does not have them;
//! [`store_if`](GrpcIdempotencyLayer::store_if) takes a gRPC code.
//!
//! [`IdempotencyLayer::new_for_grpc`]: crate::idempotency::IdempotencyLayer::new_for_grpc
//! [`for_grpc`]: crate::idempotency::IdempotencyLayer::for_grpc

//! # Example
//!
//! ```no_run
//! use tonic::{service::Routes, transport::Server};
//! use tower_ids::{correlation::CorrelationLayer, idempotency::IdempotencyLayer};
//!
//! # async fn serve(routes: Routes) -> Result<(), Box<dyn std::error::Error>> {
//! // `routes`: your services, `Routes::new(LedgerServer::new(ledger))`.
//! Server::builder()
//!     .layer(CorrelationLayer::new())
//!     .layer(IdempotencyLayer::new_for_grpc())
//!     .add_routes(routes)
//!     .serve("127.0.0.1:50051".parse()?)
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! A client sends the key as metadata, the same on every retry of one user action:
//!
//! ```
//! # fn call(message: ()) {
//! let mut request = tonic::Request::new(message);
//! request.metadata_mut().insert("idempotency-key", "transfer-7f3a".parse().unwrap());
//! # }
//! ```
//!
//! [`client::RetryLayer`](crate::client::RetryLayer) is HTTP-shaped; with tonic, retry with the
//! same request metadata (tonic's generated clients are `Clone`).
//!
//! # What a call gets
//!
//! Every response of a call through the layer carries `idempotent-replayed: true` or
//! `false` in its metadata (in the initial metadata, or with the status of a
//! trailers-only answer), and echoes the key and `attempt-id`. A replay also carries
//! `idempotency-first-seen`, `idempotency-request-count` and `original-attempt-id`,
//! as the HTTP layer's do, and an `ABORTED` for a call in flight carries the first two,
//! except where the call is held by another call's open transaction (a PostgreSQL store
//! in [transactional mode](crate::idempotency::store::PostgresMode::Transactional)):
//! the store sees only the lock, not when the first call arrived nor how many came, so
//! that `ABORTED` carries neither, as the HTTP layer's `409` does.
//!
//! | Case | Status | `ErrorInfo.reason` | `RetryInfo` |
//! |---|---|---|---|
//! | first call | the handler's | - | - |
//! | retry after it completed | the handler's, replayed: same messages, metadata and trailers | - | - |
//! | key malformed, repeated, or two keys | `INVALID_ARGUMENT` | `idempotency.key_invalid`, `idempotency.key_repeated`, `idempotency.keys_disagree` | - |
//! | `attempt-id` malformed | `INVALID_ARGUMENT` | `idempotency.attempt_id_invalid` | - |
//! | no key, with [`require_key`](GrpcIdempotencyLayer::require_key) | `INVALID_ARGUMENT` | `idempotency.key_missing` | - |
//! | client refused by its extractor | `INVALID_ARGUMENT` | `idempotency.client_invalid` | - |
//! | no client, with [`require_client`](GrpcIdempotencyLayer::require_client) | `UNAUTHENTICATED` | `idempotency.client_missing` | - |
//! | same key and method, another message | `FAILED_PRECONDITION` | `idempotency.fingerprint_mismatch` | - |
//! | same key while the first call runs | `ABORTED` | `idempotency.in_flight` | the delay |
//! | the call waited for failed ([`InFlight::Wait`](crate::idempotency::InFlight::Wait)) | `ABORTED` | `idempotency.original_failed` | `1s` |
//! | retry of a call whose response was not kept (over [`max_response_bytes`](GrpcIdempotencyLayer::max_response_bytes)) | `FAILED_PRECONDITION` | `idempotency.not_replayable` | - |
//! | store down (fail closed): nothing ran | `UNAVAILABLE` | `idempotency.store_unavailable` | `1s` |
//! | no connection of the store's pool free in time: nothing ran | `RESOURCE_EXHAUSTED` | `idempotency.pool_exhausted` | `1s` |
//! | byte budget full: nothing ran | `UNAVAILABLE` | `idempotency.overloaded` | `1s` |
//! | the outcome's transaction did not commit, or its commit is unknown | `UNAVAILABLE` | `idempotency.not_committed`, `idempotency.outcome_unknown` | `1s` |
//! | the handler failed (its service's `Err`) on a passing fault: its database unreachable, a deadlock ([`transient_if`](crate::idempotency::IdempotencyLayer::transient_if)) | `UNAVAILABLE` | `idempotency.handler_unavailable` | `1s` |
//! | request over [`max_request_bytes`](GrpcIdempotencyLayer::max_request_bytes) | `RESOURCE_EXHAUSTED` | `idempotency.body_too_large` | - |
//! | a keyed call that sent more or fewer than one message | `UNIMPLEMENTED` | `idempotency.streaming_unsupported` | - |
//! | a body that is not length-prefixed messages, or could not be read | `INVALID_ARGUMENT` | `idempotency.message_invalid`, `idempotency.body_unreadable` | - |
//! | the response failed while it was read: nothing stored | `INTERNAL` | `idempotency.response_failed` | - |
//!
//! `ErrorInfo.domain` is [`ERROR_DOMAIN`]; read the details with
//! `tonic_types::StatusExt::get_details_error_info`. The reasons are the HTTP layer's
//! problem codes, so one dashboard or alert serves both transports.
//!
//! **Why these codes.** gRPC clients retry only the codes their retry policy lists
//! (`retryableStatusCodes`), and most list `UNAVAILABLE` alone:
//!
//! - `UNAVAILABLE` is kept for "nothing ran, and a retry may succeed": the store down,
//!   the budget full, an outcome's commit that did not land. A policy that retries it
//!   with backoff is right, since the key makes the retry safe.
//! - `ABORTED` is "in flight", not `UNAVAILABLE`: the server is fine and the user's own
//!   earlier attempt is running. gRPC defines `ABORTED` for concurrency conflicts, to be
//!   retried by the caller; `RetryInfo` says when. A client that adds `ABORTED` to its
//!   policy for keyed methods gets the replay once the first call ends; one that does
//!   not sees the conflict, which is what happened. Not `ALREADY_EXISTS`, which means
//!   "do not retry".
//! - `FAILED_PRECONDITION` is "reused with another message": no retry of that call can
//!   succeed (the key's state, not the message alone, is what is wrong, hence not
//!   `INVALID_ARGUMENT`), and no retry policy retries it. It is the HTTP layer's `422`.
//!
//! # Streaming
//!
//! The layer deduplicates unary calls. A keyed call's request is read whole before
//! anything runs (as the HTTP layer reads a body), so a keyed call with a request stream
//! of more or fewer than one message is refused (`UNIMPLEMENTED`) once that stream
//! ends, and the handler never runs. Send streaming calls without the key: they pass
//! through, not deduplicated. Do not key a bidirectional call whose client waits for a
//! response before it closes its stream: the layer would wait for the end of the
//! stream. A keyed server-streaming call runs, and its response is read whole (up to
//! [`max_response_bytes`](GrpcIdempotencyLayer::max_response_bytes)) before it is sent,
//! so it is replayed as a whole, but no longer streamed.
//!
//! # Scope and fingerprint
//!
//! A key is scoped by client (from [`client`](GrpcIdempotencyLayer::client): any
//! [`IdentifyClient`](crate::idempotency::extract::IdentifyClient) reads the call's
//! metadata and extensions as it reads HTTP headers), the method's path
//! (`/ledger.v1.Ledger/Transfer`) and the key. gRPC calls are scoped apart from HTTP
//! requests, so one store can serve both layers; the same key on another method is
//! another call. The fingerprint covers the request message as sent (its length prefix
//! included): the same key on the same method with another message is
//! `FAILED_PRECONDITION`. A client that compresses its messages sends other
//! bytes for the same message than one that does not; keep one setting per client.
//!
//! # Storage rule
//!
//! By [`StorageRule::Default`](crate::idempotency::StorageRule), `OK` and the server
//! errors are stored; the handler's refusals (`INVALID_ARGUMENT`, `NOT_FOUND`,
//! `PERMISSION_DENIED`, ...) and `UNAVAILABLE`, `RESOURCE_EXHAUSTED` and `ABORTED`
//! release the key so a retry (or a corrected call) runs again, as the HTTP layer
//! treats 4xx and `503`. Choose another rule with the [`Policy`](crate::idempotency::Policy),
//! or a rule of your own with [`store_if`](GrpcIdempotencyLayer::store_if). A handler that
//! took the PostgreSQL transaction (see the store's docs) and answered a server error
//! (`UNKNOWN`, `DEADLINE_EXCEEDED`, `UNIMPLEMENTED`, `INTERNAL`, `UNAVAILABLE`,
//! `DATA_LOSS`) has its writes rolled back and its key released, as with HTTP `5xx`.
//!
//! A response over [`max_response_bytes`](GrpcIdempotencyLayer::max_response_bytes) is
//! streamed on as it comes, and its key is kept (its retries are `FAILED_PRECONDITION
//! idempotency.not_replayable`) whatever status it ends with: a gRPC status comes after
//! the messages, past the point where the layer must settle the key without holding
//! them. A handler's transaction is committed then too. Keep such calls under the
//! limit, or unkeyed.
//!
//! # A handler in the request's transaction, with the outbox
//!
//! Over a PostgreSQL store in transactional mode, the layer begins the call's
//! transaction, holds the key in it, and offers it to the handler twice: in the call's
//! extensions (`request.extensions().get::<Transaction>()`) and as
//! [`Transaction::current()`](crate::idempotency::store::Transaction::current) inside
//! the call's task. The handler writes on it, and enqueues its messages on the same
//! connection ([`Outbox::enqueue`](crate::outbox::Outbox::enqueue), feature `outbox`):
//! its rows, its messages and the stored reply commit together, or none of them does.
//! A server error (`INTERNAL`, `UNAVAILABLE`, ...) rolls them all back and frees the
//! key.
//!
//! ```no_run
//! # #[cfg(feature = "outbox")] {
//! use tonic::{Request, Response, Status};
//! use tower_ids::{
//!     idempotency::{
//!         store::{PostgresMode, PostgresStore, Transaction},
//!         IdempotencyKey, IdempotencyLayer,
//!     },
//!     outbox::{Message, Outbox},
//! };
//! # #[derive(Clone, PartialEq, prost::Message)]
//! # struct PlaceOrder { #[prost(string, tag = "1")] order_id: String, #[prost(string, tag = "2")] sku: String }
//! # #[derive(Clone, PartialEq, prost::Message)]
//! # struct OrderPlaced { #[prost(string, tag = "1")] order_id: String }
//!
//! struct Orders {
//!     outbox: Outbox,
//! }
//!
//! impl Orders {
//!     // The body of `place_order` in your `impl orders_server::Orders for Orders`.
//!     async fn place_order(
//!         &self,
//!         request: Request<PlaceOrder>,
//!     ) -> Result<Response<OrderPlaced>, Status> {
//!         let transaction = request
//!             .extensions()
//!             .get::<Transaction>()
//!             .cloned()
//!             .ok_or_else(|| Status::internal("no transaction: is the store transactional?"))?;
//!         let order = request.into_inner();
//!         let mut connection = transaction
//!             .lock()
//!             .await
//!             .map_err(|e| Status::internal(e.to_string()))?;
//!         sqlx::query("INSERT INTO orders (id, sku) VALUES ($1, $2)")
//!             .bind(&order.order_id)
//!             .bind(&order.sku)
//!             .execute(&mut *connection)
//!             .await
//!             .map_err(|e| Status::internal(e.to_string()))?;
//!         // The order's events in commit order (its partition key), and one key per
//!         // business event (the outbox gives each message a key of its own): two
//!         // calls that place one order send one `orders.placed` to the inbox.
//!         let event = format!("{}.placed", order.order_id);
//!         let placed = Message::new("orders.placed", format!(r#"{{"order":"{}"}}"#, order.order_id))
//!             .partition_key(order.order_id.clone())
//!             .idempotency_key(IdempotencyKey::new(&event).map_err(|e| Status::invalid_argument(e.to_string()))?);
//!         self.outbox
//!             .enqueue(&mut connection, placed)
//!             .await
//!             .map_err(|e| Status::internal(e.to_string()))?;
//!         Ok(Response::new(OrderPlaced { order_id: order.order_id }))
//!     }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/orders").await?;
//! let store = PostgresStore::builder(pool.clone())
//!     .mode(PostgresMode::Transactional)
//!     .build()?;
//! store.migrate().await?;
//! let outbox = Outbox::new(pool);
//! outbox.migrate().await?;
//! let orders = Orders { outbox };
//! // Server::builder().layer(IdempotencyLayer::with_store(store).for_grpc())
//! //     .add_service(OrdersServer::new(orders))
//! # let _ = (IdempotencyLayer::with_store(store).for_grpc(), orders);
//! # Ok(())
//! # }
//! # }
//! ```
//!
//! A failed statement aborts the whole transaction (the reply can then not be stored
//! with it, and the call is answered `UNAVAILABLE idempotency.not_committed`): run one
//! that may fail in a savepoint, as the
//! [store's docs](crate::idempotency::store::PostgresMode) say.
//!
//! # Code generation without `protoc`
//!
//! tonic's generated servers and clients come from `tonic-prost-build`, which by
//! default runs `protoc`. [`protox`](https://docs.rs/protox), a `.proto` compiler in
//! Rust, hands it the descriptors instead, so a build needs no system package. In
//! `Cargo.toml`:
//!
//! ```toml
//! [dependencies]
//! tonic = "0.14"
//! tonic-prost = "0.14"
//! prost = "0.14"
//!
//! [build-dependencies]
//! tonic-prost-build = "0.14"
//! protox = "0.10"
//! ```
//!
//! and a `build.rs`:
//!
//! ```no_run
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     println!("cargo:rerun-if-changed=proto");
//!     let descriptors = protox::compile(["orders.proto"], ["proto"])?;
//!     tonic_prost_build::configure().compile_fds(descriptors)?;
//!     Ok(())
//! }
//! ```
//!
//! then `tonic::include_proto!("orders.v1");` (the proto's package) in your crate. The
//! crate's own gRPC tests are built so (`tests/grpc`, with the generated code checked
//! in and compared on every run).
//!
//! # Correlation
//!
//! Put [`CorrelationLayer`](crate::correlation::CorrelationLayer) outside this layer, as
//! the example does: gRPC metadata is HTTP/2 headers, so the correlation ID is read
//! from `x-correlation-id` metadata (or generated), carried in the span, and echoed in
//! the response metadata; with the `opentelemetry` feature, `traceparent` metadata
//! continues the caller's trace. On the client, wrap tonic's `Channel` in
//! [`OutboundCorrelationLayer`](crate::correlation::OutboundCorrelationLayer) (a tower
//! layer) to send the current ID on every call.

// The transport: its settings, what the adapter asks of gRPC, and a call kept. The
// layer's gRPC constructors are the adapter's; this module gathers the names.
mod call;
mod settings;
mod transport;

pub use self::{settings::Grpc, transport::ERROR_DOMAIN};
pub use super::adapter::{GrpcIdempotency, GrpcIdempotencyLayer};
