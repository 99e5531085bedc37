//! The service's routes and their handlers, and the layers around them.

use std::time::Duration;

use axum::{
    extract::{rejection::JsonRejection, Path, Request, State},
    http::{HeaderName, StatusCode},
    routing::{get, post},
    Json, Router,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use time::OffsetDateTime;
use tokio::{sync::mpsc, time::Instant};
use tower::{util::MapRequestLayer, ServiceBuilder};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_ids::{
    correlation::{CorrelationId, CorrelationLayer},
    idempotency::{ClientFromHeader, IdempotencyLayer, IdempotencyStore},
};
use uuid::Uuid;

use crate::{
    api::ApiError,
    load::{load_executions, load_handler, LoadState},
    memory::Commands,
    publisher::Publish,
    server::{with_request_limits, Limits},
};

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
/// `/load/*` routes ([`LoadState`](crate::load::LoadState)), outside the limits.
pub(crate) fn app<St: IdempotencyStore>(
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

/// What every handler shares.
#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) commands: Commands,
    /// The broker, as far as the handlers know.
    pub(crate) queue: mpsc::Sender<Publish>,
    /// How long the `POST` handlers sleep first (`--handler-delay-ms`).
    pub(crate) handler_delay: Duration,
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
pub(crate) struct Command {
    /// The command's own ID, stable for its life (not the correlation ID).
    pub(crate) id: Uuid,
    pub(crate) device_id: String,
    pub(crate) name: String,
    pub(crate) payload: Box<RawValue>,
    pub(crate) status: Status,
    #[serde(with = "time::serde::rfc3339")]
    pub(crate) created_at: OffsetDateTime,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Status {
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
