//! The Command Service, in memory: tower-ids' demo of correlation IDs across an HTTP
//! request and the queue message it sends, and of idempotency keys on its `POST` routes.
//!
//! A client asks for a command to be sent to a device; the service stores it as
//! `queued`, answers `201`, and puts a message on a queue (an in-process tokio channel
//! standing in for the broker). A background publisher takes each message, waits
//! until `--publish-delay-ms` after it was queued, and marks the command `sent` unless it
//! was cancelled meanwhile.
//!
//! Every line logged while handling a request carries that request's `correlation_id`
//! (from `x-correlation-id`, else `x-request-id`, else a fresh UUIDv7); every line the
//! publisher logs for a delivery carries that ID extended for the delivery
//! (`<id>.Aq9`, see [`CorrelationId::extend_redelivery`]), so one search finds the
//! request and everything it caused.
//!
//! The two `POST` routes carry an [`IdempotencyLayer`] each, sharing one [`MokaStore`]
//! (or, with `--redis-url`, one `RedisStore`, so that several replicas share records):
//! `POST /commands` requires an `Idempotency-Key`, `POST /commands/{id}/cancel` takes
//! one if sent. Keys are scoped by the `x-api-key` header (the client), so two clients
//! may use the same key; a request with a key but without `x-api-key` is refused with
//! `401` (`require_client`), so no two anonymous callers can share a scope. A retry
//! with the same key and the same request gets the first response back
//! (`idempotent-replayed: true`) and creates nothing; the `GET` routes have no
//! idempotency layer. See [`tower_ids::idempotency`] for the whole contract.
//!
//! # Run
//!
//! ```sh
//! cargo run --release --example commands
//! cargo run --release --example commands -- \
//!     --addr 127.0.0.1:0 --log-format json --publish-delay-ms 1000
//! cargo run --release --example commands -- --handler-delay-ms 2000
//! RUST_LOG=debug cargo run --release --example commands
//!
//! # Two replicas sharing one Redis: a retry on either replays the first answer.
//! redis-server --port 6379 --save '' --appendonly no &
//! cargo run --release --example commands --features redis -- \
//!     --addr 127.0.0.1:3000 --redis-url redis://127.0.0.1:6379
//! cargo run --release --example commands --features redis -- \
//!     --addr 127.0.0.1:3001 --redis-url redis://127.0.0.1:6379
//! ```
//!
//! | Flag | Default | Meaning |
//! |---|---|---|
//! | `--addr` | `127.0.0.1:3000` | address to bind; port `0` picks a free one |
//! | `--log-format` | `pretty` | `pretty` (human, one line per event) or `json` (one object per line, with span fields) |
//! | `--publish-delay-ms` | `200` | time from queueing to publishing, so a client can see `queued` turn into `sent` |
//! | `--handler-delay-ms` | `0` | time the two `POST` handlers sleep before doing anything, so a retry can overlap the first request (keep `--publish-delay-ms` above it to cancel a command before it is sent) |
//! | `--idempotency-ttl-secs` | `86400` | how long an idempotency key's outcome is replayed |
//! | `--header-read-timeout-ms` | `10000` | how long a connection may take to send a request's head, and may stay idle between requests; then the server closes it |
//! | `--body-timeout-ms` | `10000` | how long a request body may go without sending a byte; then `408` and the connection is closed |
//! | `--request-timeout-ms` | `30000` | how long a request may take from its head to its answer; then `408` and the connection is closed |
//! | `--max-body-bytes` | `65536` | largest request body; a larger one gets `413` |
//! | `--max-concurrent-requests` | `512` | requests handled at once; more are shed at once with `503` and `Retry-After: 1` |
//! | `--max-commands` | `1000` | commands the in-memory list keeps; creating one more drops the oldest |
//! | `--load-routes` | off | also serve `POST /load/bare` (no layer), `POST /load/noop` (a layer that does nothing), `POST /load/tower-http` (tower-http's request-ID pair), `POST /load/correlated` (correlation layer), `POST /load/idempotent` (both layers, key required) and `GET /load/executions` (handler runs so far), one trivial handler behind each, for `benches/load.sh` |
//! | `--redis-url` | none (in memory) | with `--features redis`: keep idempotency records in this Redis (or Valkey), shared by every replica started with the same URL; if it cannot be reached at start the service exits, if it goes away later the `POST` routes answer `503` until it is back |
//!
//! Once bound, the service logs `listening on http://ADDR` with the real address, so a
//! script can start it on port `0` and grep the log for the URL. `RUST_LOG` sets the
//! filter (default `info`). Ctrl-C (or SIGTERM) stops it gracefully: it stops accepting,
//! closes idle connections, lets in-flight requests finish (each within the timeouts
//! below) and drains the queue.
//!
//! # Limits
//!
//! The demo runs as a service facing slow or greedy clients should, and every bound is a
//! flag above. The connection-level bounds cover every route; the request-level bounds
//! cover the service's routes (the `/load/*` routes of `--load-routes` stay as bare as
//! `benches/load.sh` measures them).
//!
//! - **HTTP/1.1 only**, served by hyper's own connection builder with a timer, so that
//!   hyper's header-read timeout (`--header-read-timeout-ms`) covers a connection that
//!   sends nothing, one that sends part of a request head, and one kept alive and idle
//!   after a response (hyper starts the timer again whenever a connection goes idle). The
//!   server closes such a connection without an answer. (hyper-util's auto builder, which
//!   axum's `serve` uses, first waits without any timeout for the bytes that tell HTTP/1
//!   from HTTP/2.)
//! - At start the service raises its open-files limit (soft `RLIMIT_NOFILE`) to the hard
//!   limit, since each connection is a file descriptor, and logs it (`commands.limits`).
//! - Per request, outermost first, all tower and tower-http layers:
//!   1. tower's `LoadShedLayer` over a `GlobalConcurrencyLimitLayer`
//!      (`--max-concurrent-requests`): a request over the limit is answered `503`
//!      `server.overloaded` with `Retry-After: 1` at once, never queued (axum's
//!      `HandleErrorLayer` turns the shed error into the answer);
//!   2. tower-http's `RequestBodyLimitLayer` (`--max-body-bytes`): a declared
//!      `Content-Length` over it gets `413` before the body is read; a body that grows past
//!      it, `413` when it does (the idempotency layer's own limit is set to the same);
//!   3. tower-http's `TimeoutLayer` (`--request-timeout-ms`): `408` `request.timeout`;
//!      bounds how long a request holds its concurrency slot, even when its client sends
//!      the body a byte at a time, each just before `--body-timeout-ms`;
//!   4. tower-http's `RequestBodyTimeoutLayer` (`--body-timeout-ms`): a body that stalls
//!      gets `408` `request.body_timeout`, whatever the route made of the failed read.
//!
//!   The `408` and `413` answers carry `Connection: close`: the server closes the
//!   connection after them, as the rest of the body may still be on its way.
//! - The command list keeps the latest `--max-commands` commands: creating one more drops
//!   the oldest (`commands.evicted`), which then answers `404`; if it was still queued,
//!   the publisher skips it. With bodies of at most `--max-body-bytes`, the list holds at
//!   most `--max-commands` × `--max-body-bytes` of payload (64 MiB with the defaults).
//! - Every refusal is RFC 9457 problem details (`application/problem+json`) with a stable
//!   `code`, `404` for an unknown path and `405` (with `Allow`) for a known path with
//!   another method included.
//!
//! # Try it
//!
//! ```sh
//! BODY='{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}'
//!
//! # Create a command; the response echoes the correlation ID (and the optional
//! # attempt-id). -> 201, idempotent-replayed: false, attempt-id: a1,
//! #    {"id": ID, "status": "queued", ...}
//! curl -si localhost:3000/commands \
//!     -H 'content-type: application/json' -H 'x-correlation-id: demo-1' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: create-1' -H 'attempt-id: a1' \
//!     -d "$BODY"
//!
//! # The client did not see the answer and retries: same key, same body, new attempt.
//! # -> 201, idempotent-replayed: true, the same body (same ID), attempt-id: a2,
//! #    original-attempt-id: a1, idempotency-first-seen: <HTTP-date>,
//! #    idempotency-request-count: 2; no second command is created.
//! curl -si localhost:3000/commands \
//!     -H 'content-type: application/json' -H 'x-correlation-id: demo-2' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: create-1' -H 'attempt-id: a2' \
//!     -d "$BODY"
//!
//! # Another client may use the same key: a new command.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-b' -H 'idempotency-key: create-1' -d "$BODY"
//!
//! # The same key with another body: 422 idempotency.fingerprint_mismatch, nothing runs.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: create-1' \
//!     -d '{"device_id":"thermostat-42","name":"reboot","payload":{}}'
//!
//! # No key: 400 idempotency.key_missing.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-a' -d "$BODY"
//!
//! # With --handler-delay-ms 2000, a retry while the first is still running:
//! # the first answers 201 after 2 s, the overlapping one 409 idempotency.in_flight
//! # with Retry-After: 1; retried after that, it is a replay.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: create-2' -d "$BODY" &
//! sleep 0.5
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: create-2' -d "$BODY"
//!
//! # List all commands (oldest first), fetch one: no idempotency headers on GET.
//! curl -s localhost:3000/commands
//! curl -s localhost:3000/commands/$ID
//!
//! # Cancel one, with a key (a retry replays the answer) or without (runs each time;
//! # cancelling twice is not an error).
//! curl -si -X POST localhost:3000/commands/$ID/cancel \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: cancel-1'
//! curl -si -X POST localhost:3000/commands/$ID/cancel
//!
//! # Errors are RFC 9457 problem details.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: bad-json-1' -d '{"device_id":'
//! # A key without a client: 401 idempotency.client_missing, nothing runs.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'idempotency-key: anonymous-1' -d "$BODY"
//! curl -si localhost:3000/commands/0190b6c4-0000-7000-8000-000000000000
//! ```
//!
//! # Routes
//!
//! | Route | Idempotency key | Success | Errors (`application/problem+json`, `code`) |
//! |---|---|---|---|
//! | `POST /commands` | required | `201` the new command, `status: "queued"`; a replay of the first answer | `400` `body.invalid_json`, `415` `body.not_json`, `422` `body.invalid_fields`, `413` `body.unreadable`, `503` `commands.publisher_stopped`; idempotency: `400` `idempotency.key_missing` / `idempotency.key_invalid` / `idempotency.client_invalid`, `401` `idempotency.client_missing`, `409` `idempotency.in_flight` (with `Retry-After`), `422` `idempotency.fingerprint_mismatch` |
//! | `GET /commands` | none | `200` every command, oldest first | |
//! | `GET /commands/{id}` | none | `200` the command | `404` `commands.not_found` |
//! | `POST /commands/{id}/cancel` | optional | `200` the command, `status: "cancelled"`; a replay of the first answer | `404` `commands.not_found`, `409` `commands.already_sent`; idempotency: as `POST /commands`, less `key_missing` |
//! | any other path | | | `404` `route.not_found` |
//! | any other method on these paths | | | `405` `route.method_not_allowed`, with `Allow` |
//!
//! Any route may also answer `503` `server.overloaded` (with `Retry-After: 1`), `408`
//! `request.timeout` or `request.body_timeout`, and `413` `request.body_too_large` (see
//! [Limits](#limits)).
//!
//! Every response of a `POST` route carries `idempotent-replayed` (`true` on a replay,
//! else `false`), and echoes `attempt-id` when the client sent one; a replay, a `409`
//! and a `410` also carry `idempotency-first-seen` and `idempotency-request-count`, and
//! a replay `original-attempt-id` when the first attempt sent an `attempt-id`. A replay
//! is the first response byte for byte (status, headers, body) except for the
//! per-attempt headers (`x-correlation-id`, `attempt-id`, `date`). Only answers below
//! 500 (and not `408` or `429`) are kept: after a `503` the retry runs again. A cancel
//! sent without a key runs every time.
//!
//! A command is `{"id", "device_id", "name", "payload", "status", "created_at"}`: `id` is
//! the command's own UUID (not the correlation ID, which names one attempt), `status` is
//! `queued`, `sent` or `cancelled`, and `created_at` is RFC 3339 in UTC.
//!
//! # Events
//!
//! | `event` | Level | When |
//! |---|---|---|
//! | `commands.limits` | INFO | at start: every limit and timeout in force, and the open-files limit |
//! | `commands.listening` | INFO | the listener is bound |
//! | `commands.store` | INFO | where idempotency records are kept: `store` = `memory` or `redis` |
//! | `commands.created` | INFO | a command was stored and queued |
//! | `commands.cancelled` | INFO | a command was cancelled |
//! | `commands.published` | INFO | the publisher sent a command |
//! | `commands.publish_skipped` | INFO | the publisher found the command cancelled (`reason` = `cancelled`) or dropped from the list (`evicted`) |
//! | `commands.evicted` | INFO | the list was full: its oldest command was dropped |
//! | `commands.bad_request` | WARN | a create request's body was refused (the body is never logged) |
//! | `commands.body_refused` | INFO | a request body stalled (`reason` = `timeout`) or grew past the limit (`too_large`) |
//! | `commands.not_found` | INFO | an unknown command ID was asked for |
//! | `commands.overloaded` | DEBUG | a request was shed (DEBUG: under overload, a line per request would add to it) |
//! | `commands.connection_closed` | DEBUG | a connection ended in an error: the client hung up, or sent no request head within `--header-read-timeout-ms` |
//! | `commands.open_files_limit_failed` | WARN | the open-files limit could not be raised |
//! | `commands.internal_error` | ERROR | an error reached the limits' error handler that was not a shed request (none is expected) |
//! | `commands.accept_failed` | WARN | accepting a connection failed (for example out of file descriptors); the loop pauses 100 ms |
//!
//! The idempotency layer adds its own events (`idempotency.replayed`,
//! `idempotency.stored`, `idempotency.in_flight`, `idempotency.conflict`, ...), inside
//! the request's correlation span; see [`tower_ids::idempotency`].

use std::{
    collections::{HashMap, VecDeque},
    net::SocketAddr,
    num::{NonZeroU64, NonZeroUsize},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, OnceLock, PoisonError,
    },
    time::Duration,
};

use axum::{
    body::{Body, Bytes, HttpBody},
    error_handling::HandleErrorLayer,
    extract::{rejection::JsonRejection, Path, Query, Request, State},
    http::{header, HeaderName, HeaderValue, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
    BoxError, Json, Router,
};
use clap::{Parser, ValueEnum};
use http_body_util::BodyExt;
use hyper::server::conn::http1;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
    service::TowerToHyperService,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use time::OffsetDateTime;
use tokio::{
    net::{TcpListener, TcpSocket},
    sync::mpsc,
    time::Instant,
};
use tower::{
    limit::GlobalConcurrencyLimitLayer,
    load_shed::{error::Overloaded, LoadShedLayer},
    util::MapRequestLayer,
    ServiceBuilder,
};
use tower_http::{
    limit::RequestBodyLimitLayer,
    request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer},
    timeout::{RequestBodyTimeoutLayer, TimeoutError, TimeoutLayer},
};
use tower_ids::{
    correlation::{CorrelationId, CorrelationLayer},
    idempotency::{ClientFromHeader, IdempotencyLayer, IdempotencyStore, MokaStore},
    PROBLEM_JSON,
};
use tracing_subscriber::{filter::LevelFilter, EnvFilter};
use uuid::Uuid;

/// Messages the queue holds before the publisher blocks new commands (backpressure).
const QUEUE_CAPACITY: usize = 1024;

/// Default `--header-read-timeout-ms`: how long a connection may take to send a request's
/// head (request line and headers), and may stay idle between two requests. A client on
/// a working network sends a few hundred bytes of headers in milliseconds; 10 s leaves
/// room for a slow mobile link and a client's pooled connection, while a client that
/// opens connections and sends nothing holds each for 10 s at most.
const HEADER_READ_TIMEOUT_MS: NonZeroU64 = NonZeroU64::new(10_000).unwrap();

/// Default `--body-timeout-ms`: how long a request body may go without sending a byte
/// (tower-http's `RequestBodyTimeoutLayer`, which starts again at every chunk). A command
/// is a few hundred bytes, sent in one go; 10 s of silence means a stalled client, and
/// every second it waits it holds a connection and a concurrency slot.
const BODY_TIMEOUT_MS: NonZeroU64 = NonZeroU64::new(10_000).unwrap();

/// Default `--request-timeout-ms`: how long a request may take from its head to its answer
/// (tower-http's `TimeoutLayer`). The handlers answer in microseconds (plus
/// `--handler-delay-ms`); 30 s bounds how long one request can hold a concurrency slot,
/// even when its client trickles the body a byte at a time, each just in time for
/// `--body-timeout-ms`.
const REQUEST_TIMEOUT_MS: NonZeroU64 = NonZeroU64::new(30_000).unwrap();

/// Default `--max-body-bytes`: the largest request body (tower-http's
/// `RequestBodyLimitLayer`, and the idempotency layer's own limit). A command is a small
/// JSON object (under 100 bytes in the examples above); 64 KiB leaves room for a large
/// payload, while `MAX_COMMANDS` commands hold at most 64 MiB of payload and
/// `MAX_CONCURRENT_REQUESTS` bodies in flight at most 32 MiB.
const MAX_BODY_BYTES: NonZeroUsize = NonZeroUsize::new(64 * 1024).unwrap();

/// Default `--max-concurrent-requests`: requests handled at once; over it, new requests
/// are shed with `503` at once rather than queued. Far above what the demo needs
/// (`benches/load.sh` opens 256 connections at most), and low enough that
/// `MAX_CONCURRENT_REQUESTS` bodies of `MAX_BODY_BYTES` take 32 MiB, where 3,000
/// unbounded requests of 1 MiB took 2.6 GiB.
const MAX_CONCURRENT_REQUESTS: NonZeroUsize = NonZeroUsize::new(512).unwrap();

/// Default `--max-commands`: commands the in-memory list keeps. Creating one more drops
/// the oldest, as a user of a demo expects it to keep taking commands (refusing new ones
/// would stop it for good); a real service keeps them in a database. 1,000 commands of
/// at most `MAX_BODY_BYTES` hold at most 64 MiB of payload, which is also the most a
/// `GET /commands` answer carries.
const MAX_COMMANDS: NonZeroUsize = NonZeroUsize::new(1000).unwrap();

/// `Retry-After` on a request shed over `--max-concurrent-requests`, in seconds: the
/// requests holding the slots take milliseconds, so a second later is likely to succeed.
const OVERLOADED_RETRY_AFTER_SECS: u64 = 1;

/// Connections the kernel completes and queues before the accept loop takes them (the
/// listen backlog; Linux caps it at `net.core.somaxconn`, 4,096 by default). A burst of
/// new connections larger than the queue has its handshakes dropped and retried a second
/// later. std's and tokio's `TcpListener::bind` ask for 128; 4,096 lets a burst of
/// thousands wait their turn instead.
const LISTEN_BACKLOG: u32 = 4096;

/// How long the accept loop pauses after an error that is not the connection's own (out
/// of file descriptors, `EMFILE`): long enough for connections closing meanwhile to free
/// some instead of the loop spinning on the error, short enough not to stall the service.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// The Command Service, in memory: tower-ids' demo of correlation IDs.
#[derive(Debug, Parser)]
struct Args {
    /// Address to listen on; port 0 picks a free port (the log says which).
    #[arg(long, default_value = "127.0.0.1:3000")]
    addr: SocketAddr,

    /// Log format, written to stdout.
    #[arg(long, value_enum, default_value_t = LogFormat::Pretty)]
    log_format: LogFormat,

    /// Milliseconds from queueing a command to publishing it.
    #[arg(long, default_value_t = 200)]
    publish_delay_ms: u64,

    /// Milliseconds the POST handlers sleep before doing anything, so that a retry can
    /// overlap the first request (and get 409).
    #[arg(long, default_value_t = 0)]
    handler_delay_ms: u64,

    /// Seconds an idempotency key's outcome is replayed.
    #[arg(long, default_value_t = 86_400)]
    idempotency_ttl_secs: u64,

    /// Milliseconds a connection may take to send a request's head, and may stay idle
    /// between requests, before the server closes it.
    #[arg(long, default_value_t = HEADER_READ_TIMEOUT_MS)]
    header_read_timeout_ms: NonZeroU64,

    /// Milliseconds a request body may go without sending a byte before the request is
    /// answered 408 and its connection closed.
    #[arg(long, default_value_t = BODY_TIMEOUT_MS)]
    body_timeout_ms: NonZeroU64,

    /// Milliseconds a request may take from its head to its answer before it is answered
    /// 408 and its connection closed.
    #[arg(long, default_value_t = REQUEST_TIMEOUT_MS)]
    request_timeout_ms: NonZeroU64,

    /// Largest request body in bytes; a larger one is answered 413.
    #[arg(long, default_value_t = MAX_BODY_BYTES)]
    max_body_bytes: NonZeroUsize,

    /// Requests handled at once; more are shed at once with 503 and Retry-After.
    #[arg(long, default_value_t = MAX_CONCURRENT_REQUESTS)]
    max_concurrent_requests: NonZeroUsize,

    /// Commands the in-memory list keeps; creating one more drops the oldest.
    #[arg(long, default_value_t = MAX_COMMANDS)]
    max_commands: NonZeroUsize,

    /// Redis (or Valkey) URL for the idempotency records, shared by every replica
    /// started with it (`redis://HOST:PORT`); without it, records are kept in memory.
    #[cfg(feature = "redis")]
    #[arg(long, value_name = "URL")]
    redis_url: Option<String>,

    /// Also serve the `/load/*` routes that `benches/load.sh` drives: one trivial
    /// handler behind no layer, a layer that does nothing, tower-http's request-ID
    /// pair, the correlation layer, and both layers.
    #[arg(long)]
    load_routes: bool,
}

/// The bounds on what one request may take (see [Limits](self#limits)), from the flags.
#[derive(Debug, Clone, Copy)]
struct Limits {
    header_read_timeout: Duration,
    body_timeout: Duration,
    request_timeout: Duration,
    max_body_bytes: usize,
    max_concurrent_requests: usize,
}

impl From<&Args> for Limits {
    fn from(args: &Args) -> Self {
        Self {
            header_read_timeout: Duration::from_millis(args.header_read_timeout_ms.get()),
            body_timeout: Duration::from_millis(args.body_timeout_ms.get()),
            request_timeout: Duration::from_millis(args.request_timeout_ms.get()),
            max_body_bytes: args.max_body_bytes.get(),
            max_concurrent_requests: args.max_concurrent_requests.get(),
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable, one line per event, prefixed by its spans and their fields.
    Pretty,
    /// One JSON object per line, with the current span and the span list.
    Json,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    init_tracing(args.log_format);
    let open_files = raise_open_files_limit();
    let limits = Limits::from(&args);
    tracing::info!(
        event = "commands.limits",
        header_read_timeout_ms = args.header_read_timeout_ms.get(),
        body_timeout_ms = args.body_timeout_ms.get(),
        request_timeout_ms = args.request_timeout_ms.get(),
        max_body_bytes = limits.max_body_bytes,
        max_concurrent_requests = limits.max_concurrent_requests,
        max_commands = args.max_commands.get(),
        open_files_limit = open_files,
        "limits in force"
    );

    // Connect first: a replica that cannot reach its Redis should not start listening.
    #[cfg(feature = "redis")]
    let redis = match &args.redis_url {
        Some(url) => Some(
            tower_ids::idempotency::store::RedisStore::connect(url.as_str())
                .await
                .map_err(std::io::Error::other)?,
        ),
        None => None,
    };

    let commands = Commands::new(args.max_commands);
    let (queue, deliveries) = mpsc::channel(QUEUE_CAPACITY);
    let publisher = tokio::spawn(publish(
        commands.clone(),
        deliveries,
        Duration::from_millis(args.publish_delay_ms),
    ));

    let listener = listen(args.addr)?;
    let addr = listener.local_addr()?;
    tracing::info!(event = "commands.listening", %addr, "listening on http://{addr}");

    let state = AppState {
        commands,
        queue,
        handler_delay: Duration::from_millis(args.handler_delay_ms),
    };
    let ttl = Duration::from_secs(args.idempotency_ttl_secs);
    let load = args.load_routes;
    #[cfg(feature = "redis")]
    let app = match redis {
        Some(store) => app(state, ttl, store, "redis", load, limits),
        None => app(state, ttl, MokaStore::new(), "memory", load, limits),
    };
    #[cfg(not(feature = "redis"))]
    let app = app(state, ttl, MokaStore::new(), "memory", load, limits);
    serve(listener, app, limits.header_read_timeout).await;

    // The router, and with it every queue sender, is gone: the publisher drains what is
    // left in the queue and returns.
    if let Err(error) = publisher.await {
        tracing::error!(event = "commands.publisher_failed", %error, "publisher task failed");
    }
    tracing::info!(event = "commands.stopped", "stopped");
    Ok(())
}

/// A listener on `addr` with a backlog of [`LISTEN_BACKLOG`].
fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // As tokio's `bind` does: a restarted service can bind while its old connections
    // wait out TIME_WAIT.
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Serves `app` on `listener` until Ctrl-C or SIGTERM, then stops accepting, closes the
/// idle connections and waits for the others to finish their request.
///
/// HTTP/1.1 only, on hyper's own connection builder with a timer, so that hyper's
/// header-read timeout applies from the first byte a connection could send: to a
/// connection that sends nothing, to one that sends part of a request head, and to one
/// kept alive and idle after a response (hyper starts the timer again whenever the
/// connection goes idle, so this is also the idle timeout). hyper-util's auto builder
/// (axum's `serve`) first reads the bytes that tell HTTP/1 from HTTP/2 with no timeout
/// at all, and hyper's HTTP/2 has no header-read timeout.
async fn serve(listener: TcpListener, app: Router, header_read_timeout: Duration) {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    let connections = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown_signal());
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    accept_failed(error).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let connection =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let connection = connections.watch(connection);
        tokio::spawn(async move {
            // A client that hangs up or times out: the client's doing, not an error.
            if let Err(error) = connection.await {
                tracing::debug!(event = "commands.connection_closed", %error, "connection closed");
            }
        });
    }
    drop(listener);
    connections.shutdown().await;
}

/// A failed `accept`. The connection's own failure (reset before it was accepted) costs
/// nothing; any other, such as running out of file descriptors, is logged and the loop
/// pauses [`ACCEPT_ERROR_PAUSE`], as axum's `serve` does, instead of spinning on it.
async fn accept_failed(error: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        error.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::warn!(event = "commands.accept_failed", %error, "cannot accept a connection");
    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
}

/// Raises this process's open-files limit (the soft `RLIMIT_NOFILE`) to the hard limit and
/// returns it. Every connection is a file descriptor, and the soft limit is often 1,024:
/// that many idle connections would stop the service from accepting any other.
#[cfg(unix)]
fn raise_open_files_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => Some(limit),
        Err(error) => {
            tracing::warn!(event = "commands.open_files_limit_failed", %error, "cannot raise the open-files limit");
            None
        }
    }
}

#[cfg(not(unix))]
fn raise_open_files_limit() -> Option<u64> {
    None
}

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::INFO.into())
        .from_env_lossy();
    // Colours only for a terminal: a log file or a pipe gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    match format {
        LogFormat::Pretty => subscriber.init(),
        LogFormat::Json => subscriber
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
}

/// The service's routes, wrapped in the request-level limits, then in the correlation
/// layer.
///
/// `CorrelationLayer` is applied last, so it is outermost: every handler, extractor
/// rejection and inner layer runs inside its span, and every attempt (replays
/// included, and the requests the limits refuse) gets its own correlation ID. The
/// idempotency layers go on the `POST` method routers only: `MethodRouter::layer` wraps
/// the methods added before it, so the `GET` added after it on `/commands` is not
/// covered. Both layers share one store (clones of the layer share it, a `MokaStore`'s
/// cache or a `RedisStore`'s connection); the routes' paths keep their keys apart.
/// `kind` names the store in the `commands.store` event; `load_routes` adds the
/// `/load/*` routes ([`LoadState`]), outside the limits.
fn app<St: IdempotencyStore>(
    state: AppState,
    idempotency_ttl: Duration,
    store: St,
    kind: &'static str,
    load_routes: bool,
    limits: Limits,
) -> Router {
    tracing::info!(
        event = "commands.store",
        store = kind,
        "idempotency records kept in {kind}"
    );
    let idempotent = IdempotencyLayer::with_store(store)
        .client(ClientFromHeader::new(HeaderName::from_static("x-api-key")))
        .require_client(true)
        .ttl(idempotency_ttl)
        .max_request_bytes(limits.max_body_bytes);

    let load = LoadState::default();
    let request_id = HeaderName::from_static("x-request-id");
    let routes = Router::new()
        .route(
            "/commands",
            post(create_command)
                .layer(idempotent.clone().require_key(true))
                .get(list_commands),
        )
        .route("/commands/{id}", get(get_command))
        .route(
            "/commands/{id}/cancel",
            post(cancel_command).layer(idempotent.clone()),
        )
        .fallback(unknown_route)
        // After every route: it replaces axum's empty 405 on each route added so far.
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state);
    let mut routes = with_request_limits(routes, limits);
    if load_routes {
        routes = routes.merge(
            Router::new()
                .route("/load/correlated", post(load_handler))
                .route(
                    "/load/idempotent",
                    post(load_handler).layer(idempotent.require_key(true)),
                )
                .with_state(load.clone()),
        );
    }
    let routes = routes.layer(CorrelationLayer::new().accept(request_id.clone()));
    if !load_routes {
        return routes;
    }
    // Merged after the correlation layer, so outside it: no layer at all, a layer that
    // does nothing, or tower-http's request-ID pair for comparison.
    routes.merge(
        Router::new()
            .route("/load/bare", post(load_handler))
            .route(
                "/load/noop",
                post(load_handler).layer(MapRequestLayer::new(|request: Request| request)),
            )
            .route(
                "/load/tower-http",
                post(load_handler).layer(
                    ServiceBuilder::new()
                        .layer(SetRequestIdLayer::new(request_id.clone(), MakeRequestUuid))
                        .layer(PropagateRequestIdLayer::new(request_id)),
                ),
            )
            .route("/load/executions", get(load_executions))
            .with_state(load),
    )
}

/// `routes` in the request-level limits, outermost first (see [Limits](self#limits)):
/// tower's and tower-http's own layers. What is ours only turns their refusals into
/// problem details: [`refused`] (the shed error), [`tower_http_refusals`] (their empty or
/// plain-text answers) and [`body_failures`] (a body that failed in them).
///
/// `Router::layer` wraps each route (and the fallback) in its own copy of these layers,
/// so the concurrency limit is tower's `GlobalConcurrencyLimitLayer`, whose copies share
/// one semaphore: a `ConcurrencyLimitLayer` makes a semaphore per copy, which here would
/// be a limit per route.
fn with_request_limits(routes: Router, limits: Limits) -> Router {
    routes.layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(refused))
            .layer(LoadShedLayer::new())
            .layer(GlobalConcurrencyLimitLayer::new(
                limits.max_concurrent_requests,
            ))
            .map_response(move |response| tower_http_refusals(response, limits))
            .layer(RequestBodyLimitLayer::new(limits.max_body_bytes))
            .layer(TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                limits.request_timeout,
            ))
            .layer(RequestBodyTimeoutLayer::new(limits.body_timeout))
            .map_request(into_axum_body)
            .layer(middleware::from_fn_with_state(limits, body_failures)),
    )
}

/// The request with axum's `Body` around tower-http's, which axum's middleware takes.
fn into_axum_body<B>(request: Request<B>) -> Request
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    request.map(Body::new)
}

/// The answer to a request the load shedder refused (`--max-concurrent-requests`
/// reached), through axum's `HandleErrorLayer`.
async fn refused(error: BoxError) -> ApiError {
    if error.is::<Overloaded>() {
        tracing::debug!(event = "commands.overloaded", "request shed");
        ApiError::Overloaded
    } else {
        // No inner layer fails: every error of theirs is already a response.
        tracing::error!(event = "commands.internal_error", %error, "unexpected error");
        ApiError::Internal
    }
}

/// tower-http's own refusals, as problem details: `TimeoutLayer`'s empty `408`, and
/// `RequestBodyLimitLayer`'s plain-text `413` for a declared `Content-Length` over the
/// limit. Every other answer (problem details already) passes unchanged.
fn tower_http_refusals<B>(response: Response<B>, limits: Limits) -> Response
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| value == PROBLEM_JSON);
    match response.status() {
        _ if problem => response.map(Body::new),
        StatusCode::REQUEST_TIMEOUT => {
            ApiError::RequestTimeout(limits.request_timeout).into_response()
        }
        StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::BodyTooLarge(limits.max_body_bytes).into_response()
        }
        _ => response.map(Body::new),
    }
}

/// How a request body failed in tower-http's layers.
#[derive(Debug, Clone, Copy)]
enum BodyFailure {
    /// `RequestBodyTimeoutLayer`: no byte for `--body-timeout-ms`.
    Stalled,
    /// `RequestBodyLimitLayer`: more than `--max-body-bytes`, without a `Content-Length`
    /// saying so up front.
    TooLarge,
}

impl BodyFailure {
    /// The failure `error` (or an error it wraps) stands for, if any.
    fn of(error: &(dyn std::error::Error + 'static)) -> Option<Self> {
        std::iter::successors(Some(error), |error| error.source()).find_map(|error| {
            if error.is::<TimeoutError>() {
                Some(Self::Stalled)
            } else if error.is::<http_body_util::LengthLimitError>() {
                Some(Self::TooLarge)
            } else {
                None
            }
        })
    }
}

/// Answers `408` or `413` for a request whose body stalled or grew past the limit,
/// whatever the route made of the failed read: the idempotency layer, which reads the
/// body of the `POST` routes first, would answer `400 idempotency.body_unreadable`.
///
/// The body failures happen in tower-http's layers outside this one; the body is wrapped
/// here so that its failure is noted on the way to whoever reads it.
async fn body_failures(State(limits): State<Limits>, request: Request, next: Next) -> Response {
    let failure = Arc::new(OnceLock::new());
    let noted = failure.clone();
    let request = request.map(|body| {
        Body::new(body.map_err(move |error| {
            if let Some(kind) = BodyFailure::of(&error) {
                let _ = noted.set(kind);
            }
            error
        }))
    });
    let response = next.run(request).await;
    let Some(failure) = failure.get() else {
        return response;
    };
    let (error, reason) = match failure {
        BodyFailure::Stalled => (ApiError::BodyTimeout(limits.body_timeout), "timeout"),
        BodyFailure::TooLarge => (ApiError::BodyTooLarge(limits.max_body_bytes), "too_large"),
    };
    tracing::info!(
        event = "commands.body_refused",
        reason,
        status = error.status().as_u16(),
        "request body refused"
    );
    error.into_response()
}

/// The `/load/*` routes, for `benches/load.sh` (`--load-routes`): the same handler on
/// every route, so that the difference between two routes is the layers around it.
///
/// | Route | Layers |
/// |---|---|
/// | `POST /load/bare` | none |
/// | `POST /load/noop` | a layer that does nothing (`MapRequestLayer` with the identity): what wrapping a route costs |
/// | `POST /load/tower-http` | tower-http's `SetRequestIdLayer` (UUIDv4 in `x-request-id`) and `PropagateRequestIdLayer`, the peer of `CorrelationLayer` |
/// | `POST /load/correlated` | `CorrelationLayer` |
/// | `POST /load/idempotent` | `CorrelationLayer`, then `IdempotencyLayer` (key required, client `x-api-key`, the commands' store) |
/// | `GET /load/executions` | none; how many times the handler has run, in total |
///
/// The handler reads the whole request body, sleeps `?sleep_ms=` if given (so that a
/// burst of duplicates overlaps the first run), counts the run and answers `201` with a
/// small JSON body naming the run.
#[derive(Clone, Default)]
struct LoadState {
    executions: Arc<AtomicU64>,
}

#[derive(Deserialize)]
struct LoadParams {
    sleep_ms: Option<u64>,
}

async fn load_handler(
    State(load): State<LoadState>,
    Query(params): Query<LoadParams>,
    body: Bytes,
) -> (StatusCode, Json<serde_json::Value>) {
    if let Some(ms) = params.sleep_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let run = load.executions.fetch_add(1, Ordering::Relaxed) + 1;
    let answer = serde_json::json!({ "run": run, "received_bytes": body.len() });
    (StatusCode::CREATED, Json(answer))
}

async fn load_executions(State(load): State<LoadState>) -> String {
    load.executions.load(Ordering::Relaxed).to_string()
}

/// What every handler shares.
#[derive(Clone)]
struct AppState {
    commands: Commands,
    /// The broker, as far as the handlers know.
    queue: mpsc::Sender<Publish>,
    /// How long the `POST` handlers sleep first (`--handler-delay-ms`).
    handler_delay: Duration,
}

/// A queue message: publish this command. The correlation ID travels with it, as it
/// would in a broker message's headers.
#[derive(Debug)]
struct Publish {
    command_id: Uuid,
    correlation_id: CorrelationId,
    /// When the message was queued, as a broker's message timestamp.
    queued_at: Instant,
}

/// The body of `POST /commands`.
#[derive(Debug, Deserialize)]
struct NewCommand {
    device_id: String,
    name: String,
    /// Kept as the JSON text it was sent in: no larger than the body it came in, where a
    /// parsed `serde_json::Value` can take many times its size (16 times for `[0,0,...]`).
    payload: Box<RawValue>,
}

#[derive(Debug, Clone, Serialize)]
struct Command {
    /// The command's own ID, stable for its life (not the correlation ID).
    id: Uuid,
    device_id: String,
    name: String,
    payload: Box<RawValue>,
    status: Status,
    #[serde(with = "time::serde::rfc3339")]
    created_at: OffsetDateTime,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Status {
    Queued,
    Sent,
    Cancelled,
}

impl AppState {
    /// Sleeps `--handler-delay-ms`, standing in for a slow downstream call.
    async fn simulate_work(&self) {
        if !self.handler_delay.is_zero() {
            tokio::time::sleep(self.handler_delay).await;
        }
    }
}

/// The command store: the latest `--max-commands` commands in creation order, indexed by
/// ID. Creating one more drops the oldest (see [`MAX_COMMANDS`] for why).
#[derive(Clone)]
struct Commands(Arc<Mutex<Store>>);

struct Store {
    commands: VecDeque<Command>,
    /// Each command's sequence number: its position in `commands`, plus `dropped`.
    index: HashMap<Uuid, u64>,
    /// Commands dropped from the front so far.
    dropped: u64,
    max: NonZeroUsize,
}

impl Commands {
    fn new(max: NonZeroUsize) -> Self {
        Self(Arc::new(Mutex::new(Store {
            commands: VecDeque::new(),
            index: HashMap::new(),
            dropped: 0,
            max,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Store> {
        // The store holds plain data that every write leaves consistent.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Store {
    /// Stores `command`, and returns the oldest one if it had to go to make room.
    fn insert(&mut self, command: Command) -> Option<Command> {
        let oldest = if self.commands.len() >= self.max.get() {
            self.commands.pop_front()
        } else {
            None
        };
        if let Some(oldest) = &oldest {
            self.index.remove(&oldest.id);
            self.dropped += 1;
        }
        let sequence = self.dropped + self.commands.len() as u64;
        self.index.insert(command.id, sequence);
        self.commands.push_back(command);
        oldest
    }

    fn position(&self, id: Uuid) -> Option<usize> {
        usize::try_from(self.index.get(&id)? - self.dropped).ok()
    }

    fn get(&self, id: Uuid) -> Option<&Command> {
        self.commands.get(self.position(id)?)
    }

    fn get_mut(&mut self, id: Uuid) -> Option<&mut Command> {
        let position = self.position(id)?;
        self.commands.get_mut(position)
    }
}

async fn create_command(
    State(state): State<AppState>,
    correlation_id: CorrelationId,
    body: Result<Json<NewCommand>, JsonRejection>,
) -> Result<(StatusCode, Json<Command>), ApiError> {
    state.simulate_work().await;
    let Json(new) = body.map_err(ApiError::bad_request)?;
    // Take a queue slot first, so a stored command is always queued.
    let slot = state
        .queue
        .reserve()
        .await
        .map_err(|_| ApiError::PublisherStopped)?;

    let command = Command {
        id: Uuid::now_v7(),
        device_id: new.device_id,
        name: new.name,
        payload: new.payload,
        status: Status::Queued,
        created_at: OffsetDateTime::now_utc(),
    };
    let dropped = state.commands.lock().insert(command.clone());
    if let Some(dropped) = dropped {
        tracing::info!(
            event = "commands.evicted",
            command_id = %dropped.id,
            status = ?dropped.status,
            "command list full: oldest command dropped"
        );
    }
    slot.send(Publish {
        command_id: command.id,
        correlation_id,
        queued_at: Instant::now(),
    });

    tracing::info!(
        event = "commands.created",
        command_id = %command.id,
        device_id = command.device_id.as_str(),
        name = command.name.as_str(),
        "command created"
    );
    Ok((StatusCode::CREATED, Json(command)))
}

async fn list_commands(State(state): State<AppState>) -> Json<Vec<Command>> {
    let commands: Vec<Command> = state.commands.lock().commands.iter().cloned().collect();
    tracing::debug!(
        event = "commands.listed",
        count = commands.len(),
        "commands listed"
    );
    Json(commands)
}

async fn get_command(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Command>, ApiError> {
    let id = parse_id(&id)?;
    let store = state.commands.lock();
    let command = store.get(id).ok_or_else(|| ApiError::not_found(id))?;
    Ok(Json(command.clone()))
}

async fn cancel_command(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Command>, ApiError> {
    state.simulate_work().await;
    let id = parse_id(&id)?;
    let mut store = state.commands.lock();
    let command = store.get_mut(id).ok_or_else(|| ApiError::not_found(id))?;
    match command.status {
        Status::Queued => {
            command.status = Status::Cancelled;
            tracing::info!(event = "commands.cancelled", command_id = %id, "command cancelled");
        }
        // Cancelling twice is not an error: the command is cancelled either way.
        Status::Cancelled => {}
        Status::Sent => return Err(ApiError::AlreadySent),
    }
    Ok(Json(command.clone()))
}

async fn unknown_route() -> ApiError {
    ApiError::UnknownRoute
}

/// A known path with another method; axum adds the `Allow` header.
async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// A path segment that is not a UUID names no command.
fn parse_id(id: &str) -> Result<Uuid, ApiError> {
    Uuid::try_parse(id).map_err(|_| {
        tracing::info!(
            event = "commands.not_found",
            reason = "not_a_uuid",
            "unknown command"
        );
        ApiError::NotFound
    })
}

/// The publisher: takes each queue message and publishes its command.
///
/// Each delivery runs under its own extension of the message's correlation ID, as a
/// consumer of a real broker would: a redelivered message gets a different one, and
/// both lead back to the request. Messages are handled one at a time, in order; each is
/// published `delay` after it was queued, so a burst is not slowed down by the delay.
async fn publish(commands: Commands, mut deliveries: mpsc::Receiver<Publish>, delay: Duration) {
    while let Some(message) = deliveries.recv().await {
        let command_id = message.command_id;
        message
            .correlation_id
            .extend_redelivery()
            .scope(async {
                tokio::time::sleep_until(message.queued_at + delay).await;
                let mut store = commands.lock();
                let Some(command) = store.get_mut(command_id) else {
                    tracing::info!(
                        event = "commands.publish_skipped",
                        command_id = %command_id,
                        reason = "evicted",
                        "command dropped from the list before publishing"
                    );
                    return;
                };
                match command.status {
                    Status::Queued => {
                        command.status = Status::Sent;
                        tracing::info!(
                            event = "commands.published",
                            command_id = %command_id,
                            device_id = command.device_id.as_str(),
                            "command published"
                        );
                    }
                    Status::Cancelled => tracing::info!(
                        event = "commands.publish_skipped",
                        command_id = %command_id,
                        reason = "cancelled",
                        "command cancelled before publishing"
                    ),
                    Status::Sent => {}
                }
            })
            .await;
    }
}

/// Everything a handler or a limit can refuse with, answered as RFC 9457 problem
/// details.
#[derive(Debug)]
enum ApiError {
    /// The create body was not a JSON command.
    BadRequest(JsonRejection),
    NotFound,
    AlreadySent,
    PublisherStopped,
    UnknownRoute,
    MethodNotAllowed,
    /// The request was not answered within `--request-timeout-ms`.
    RequestTimeout(Duration),
    /// The request body sent nothing for `--body-timeout-ms`.
    BodyTimeout(Duration),
    /// The request body is over `--max-body-bytes`.
    BodyTooLarge(usize),
    /// Shed: `--max-concurrent-requests` were being handled.
    Overloaded,
    Internal,
}

impl ApiError {
    fn bad_request(rejection: JsonRejection) -> Self {
        let error = Self::BadRequest(rejection);
        // The status and the code only: the rejection's text can quote the body.
        tracing::warn!(
            event = "commands.bad_request",
            status = error.status().as_u16(),
            code = error.code(),
            "create request refused"
        );
        error
    }

    fn not_found(id: Uuid) -> Self {
        tracing::info!(event = "commands.not_found", command_id = %id, "unknown command");
        Self::NotFound
    }

    fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(rejection) => rejection.status(),
            Self::NotFound | Self::UnknownRoute => StatusCode::NOT_FOUND,
            Self::AlreadySent => StatusCode::CONFLICT,
            Self::PublisherStopped | Self::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::RequestTimeout(_) | Self::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A stable code a client can match on.
    fn code(&self) -> &'static str {
        match self {
            Self::BadRequest(JsonRejection::JsonSyntaxError(_)) => "body.invalid_json",
            Self::BadRequest(JsonRejection::JsonDataError(_)) => "body.invalid_fields",
            Self::BadRequest(JsonRejection::MissingJsonContentType(_)) => "body.not_json",
            Self::BadRequest(_) => "body.unreadable",
            Self::NotFound => "commands.not_found",
            Self::AlreadySent => "commands.already_sent",
            Self::PublisherStopped => "commands.publisher_stopped",
            Self::UnknownRoute => "route.not_found",
            Self::MethodNotAllowed => "route.method_not_allowed",
            Self::RequestTimeout(_) => "request.timeout",
            Self::BodyTimeout(_) => "request.body_timeout",
            Self::BodyTooLarge(_) => "request.body_too_large",
            Self::Overloaded => "server.overloaded",
            Self::Internal => "server.internal_error",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Self::BadRequest(_) => "Invalid command request",
            Self::NotFound => "Command not found",
            Self::AlreadySent => "Command already sent",
            Self::PublisherStopped => "Service shutting down",
            Self::UnknownRoute => "Not found",
            Self::MethodNotAllowed => "Method not allowed",
            Self::RequestTimeout(_) => "Request timeout",
            Self::BodyTimeout(_) => "Request body timeout",
            Self::BodyTooLarge(_) => "Request body too large",
            Self::Overloaded => "Service overloaded",
            Self::Internal => "Internal error",
        }
    }

    fn detail(&self) -> String {
        match self {
            Self::BadRequest(rejection) => rejection.body_text(),
            Self::NotFound => "no command has this id".to_owned(),
            Self::AlreadySent => {
                "the command was sent to the device and can no longer be cancelled".to_owned()
            }
            Self::PublisherStopped => "the command publisher has stopped; retry later".to_owned(),
            Self::UnknownRoute => "no route matches this path".to_owned(),
            Self::MethodNotAllowed => {
                "this path does not take this method; the Allow header lists those it takes"
                    .to_owned()
            }
            Self::RequestTimeout(limit) => format!(
                "the request was not answered within {} ms; a create or cancel may still \
                 complete: retry it with the same idempotency key",
                limit.as_millis()
            ),
            Self::BodyTimeout(limit) => format!(
                "the request body sent nothing for {} ms",
                limit.as_millis()
            ),
            Self::BodyTooLarge(limit) => {
                format!("a request body may be at most {limit} bytes")
            }
            Self::Overloaded => format!(
                "the service is handling as many requests as it takes at once; retry in {OVERLOADED_RETRY_AFTER_SECS} s"
            ),
            Self::Internal => "the service failed to answer".to_owned(),
        }
    }
}

/// RFC 9457 problem details.
#[derive(Serialize)]
struct Problem {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'static str,
    status: u16,
    detail: String,
    code: &'static str,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let problem = Problem {
            type_uri: format!("urn:tower-ids:example:commands:{}", self.code()),
            title: self.title(),
            status: status.as_u16(),
            detail: self.detail(),
            code: self.code(),
        };
        let mut response = (status, Json(problem)).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        match self {
            Self::Overloaded => {
                headers.insert(
                    header::RETRY_AFTER,
                    HeaderValue::from(OVERLOADED_RETRY_AFTER_SECS),
                );
            }
            // The rest of the body may still be on its way: hyper closes the connection
            // after this answer instead of reading on for the next request.
            Self::RequestTimeout(_) | Self::BodyTimeout(_) | Self::BodyTooLarge(_) => {
                headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        response
    }
}

/// Resolves on Ctrl-C, or on SIGTERM on Unix.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();

    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!(event = "commands.shutting_down", "shutting down");
}
