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
//! may use the same key; a request without `x-api-key` shares one global scope. A retry
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
//! | `--load-routes` | off | also serve `POST /load/bare` (no layer), `POST /load/noop` (a layer that does nothing), `POST /load/tower-http` (tower-http's request-ID pair), `POST /load/correlated` (correlation layer), `POST /load/idempotent` (both layers, key required) and `GET /load/executions` (handler runs so far), one trivial handler behind each, for `benches/load.sh` |
//! | `--redis-url` | none (in memory) | with `--features redis`: keep idempotency records in this Redis (or Valkey), shared by every replica started with the same URL; if it cannot be reached at start the service exits, if it goes away later the `POST` routes answer `503` until it is back |
//!
//! Once bound, the service logs `listening on http://ADDR` with the real address, so a
//! script can start it on port `0` and grep the log for the URL. `RUST_LOG` sets the
//! filter (default `info`). Ctrl-C (or SIGTERM) stops it gracefully: in-flight requests
//! finish and the queue is drained.
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
//!     -H 'idempotency-key: bad-json-1' -d '{"device_id":'
//! curl -si localhost:3000/commands/0190b6c4-0000-7000-8000-000000000000
//! ```
//!
//! # Routes
//!
//! | Route | Idempotency key | Success | Errors (`application/problem+json`, `code`) |
//! |---|---|---|---|
//! | `POST /commands` | required | `201` the new command, `status: "queued"`; a replay of the first answer | `400` `body.invalid_json`, `415` `body.not_json`, `422` `body.invalid_fields`, `413` `body.unreadable`, `503` `commands.publisher_stopped`; idempotency: `400` `idempotency.key_missing` / `idempotency.key_invalid`, `409` `idempotency.in_flight` (with `Retry-After`), `422` `idempotency.fingerprint_mismatch`, `413` `idempotency.body_too_large` |
//! | `GET /commands` | none | `200` every command, oldest first | |
//! | `GET /commands/{id}` | none | `200` the command | `404` `commands.not_found` |
//! | `POST /commands/{id}/cancel` | optional | `200` the command, `status: "cancelled"`; a replay of the first answer | `404` `commands.not_found`, `409` `commands.already_sent`; idempotency: as `POST /commands`, less `key_missing` |
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
//! | `commands.listening` | INFO | the listener is bound |
//! | `commands.store` | INFO | where idempotency records are kept: `store` = `memory` or `redis` |
//! | `commands.created` | INFO | a command was stored and queued |
//! | `commands.cancelled` | INFO | a command was cancelled |
//! | `commands.published` | INFO | the publisher sent a command |
//! | `commands.publish_skipped` | INFO | the publisher found the command cancelled |
//! | `commands.bad_request` | WARN | a create request's body was refused (the body is never logged) |
//! | `commands.not_found` | INFO | an unknown command ID was asked for |
//!
//! The idempotency layer adds its own events (`idempotency.replayed`,
//! `idempotency.stored`, `idempotency.in_flight`, `idempotency.conflict`, ...), inside
//! the request's correlation span; see [`tower_ids::idempotency`].

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::Duration,
};

use axum::{
    body::Bytes,
    extract::{rejection::JsonRejection, Path, Query, Request, State},
    http::{header, HeaderName, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio::{net::TcpListener, sync::mpsc, time::Instant};
use tower::{util::MapRequestLayer, ServiceBuilder};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_ids::{
    correlation::{CorrelationId, CorrelationLayer},
    idempotency::{ClientFromHeader, IdempotencyLayer, IdempotencyStore, MokaStore},
    PROBLEM_JSON,
};
use tracing_subscriber::{filter::LevelFilter, EnvFilter};
use uuid::Uuid;

/// Messages the queue holds before the publisher blocks new commands (backpressure).
const QUEUE_CAPACITY: usize = 1024;

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

    let commands = Commands::default();
    let (queue, deliveries) = mpsc::channel(QUEUE_CAPACITY);
    let publisher = tokio::spawn(publish(
        commands.clone(),
        deliveries,
        Duration::from_millis(args.publish_delay_ms),
    ));

    let listener = TcpListener::bind(args.addr).await?;
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
        Some(store) => app(state, ttl, store, "redis", load),
        None => app(state, ttl, MokaStore::new(), "memory", load),
    };
    #[cfg(not(feature = "redis"))]
    let app = app(state, ttl, MokaStore::new(), "memory", load);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;

    // The router, and with it every queue sender, is gone: the publisher drains what is
    // left in the queue and returns.
    if let Err(error) = publisher.await {
        tracing::error!(event = "commands.publisher_failed", %error, "publisher task failed");
    }
    tracing::info!(event = "commands.stopped", "stopped");
    Ok(())
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

/// The service's routes, wrapped in the correlation layer.
///
/// `CorrelationLayer` is applied last, so it is outermost: every handler, extractor
/// rejection and inner layer runs inside its span, and every attempt (replays
/// included) gets its own correlation ID. The idempotency layers go on the `POST`
/// method routers only: `MethodRouter::layer` wraps the methods added before it, so
/// the `GET` added after it on `/commands` is not covered. Both layers share one
/// store (clones of the layer share it, a `MokaStore`'s cache or a `RedisStore`'s
/// connection); the routes' paths keep their keys apart. `kind` names the store in the
/// `commands.store` event; `load_routes` adds the `/load/*` routes ([`LoadState`]).
fn app<St: IdempotencyStore>(
    state: AppState,
    idempotency_ttl: Duration,
    store: St,
    kind: &'static str,
    load_routes: bool,
) -> Router {
    tracing::info!(
        event = "commands.store",
        store = kind,
        "idempotency records kept in {kind}"
    );
    let idempotent = IdempotencyLayer::with_store(store)
        .client(ClientFromHeader::new(HeaderName::from_static("x-api-key")))
        .ttl(idempotency_ttl);

    let load = LoadState::default();
    let request_id = HeaderName::from_static("x-request-id");
    let mut routes = Router::new()
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
        .with_state(state);
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
    payload: serde_json::Value,
}

#[derive(Debug, Clone, Serialize)]
struct Command {
    /// The command's own ID, stable for its life (not the correlation ID).
    id: Uuid,
    device_id: String,
    name: String,
    payload: serde_json::Value,
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

/// The command store: commands in creation order, indexed by ID.
#[derive(Clone, Default)]
struct Commands(Arc<Mutex<Store>>);

#[derive(Default)]
struct Store {
    commands: Vec<Command>,
    index: HashMap<Uuid, usize>,
}

impl Commands {
    fn lock(&self) -> MutexGuard<'_, Store> {
        // The store holds plain data that every write leaves consistent.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Store {
    fn insert(&mut self, command: Command) {
        self.index.insert(command.id, self.commands.len());
        self.commands.push(command);
    }

    fn get(&self, id: Uuid) -> Option<&Command> {
        self.commands.get(*self.index.get(&id)?)
    }

    fn get_mut(&mut self, id: Uuid) -> Option<&mut Command> {
        self.commands.get_mut(*self.index.get(&id)?)
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
    state.commands.lock().insert(command.clone());
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
    let commands = state.commands.lock().commands.clone();
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

/// Everything a handler can refuse with, answered as RFC 9457 problem details.
#[derive(Debug)]
enum ApiError {
    /// The create body was not a JSON command.
    BadRequest(JsonRejection),
    NotFound,
    AlreadySent,
    PublisherStopped,
    UnknownRoute,
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
            Self::PublisherStopped => StatusCode::SERVICE_UNAVAILABLE,
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
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Self::BadRequest(_) => "Invalid command request",
            Self::NotFound => "Command not found",
            Self::AlreadySent => "Command already sent",
            Self::PublisherStopped => "Service shutting down",
            Self::UnknownRoute => "Not found",
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
        let content_type = [(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON))];
        (status, content_type, Json(problem)).into_response()
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
