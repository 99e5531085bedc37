//! The service's routes and their handlers, and the layers around them.

use std::{future::Future, time::Duration};
use tower_ids::idempotency::{Policy, PolicyError};

use axum::{
    extract::{rejection::JsonRejection, FromRequestParts, Path, Request, State},
    http::{HeaderMap, HeaderName, StatusCode},
    routing::{get, post},
    Json, Router,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use time::OffsetDateTime;
use tower::{util::MapRequestLayer, ServiceBuilder};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_ids::{
    correlation::{CorrelationId, CorrelationLayer},
    idempotency::{ClientFromHeader, Drain, IdempotencyKey, IdempotencyLayer, IdempotencyStore},
};
use uuid::Uuid;

use crate::{
    api::ApiError,
    load::{load_executions, load_handler, LoadState},
    publisher::Origin,
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
/// cache, a `RedisStore`'s connection or a `PostgresStore`'s pool); the routes' paths
/// keep their keys apart. With a `PostgresStore` the layers offer each request they run
/// its transaction, which the `POST` handlers of [`Database`](crate::postgres::Database)
/// write in. `kind` names the store in the `commands.store` event; `load_routes` adds the
/// `/load/*` routes ([`LoadState`](crate::load::LoadState)), outside the limits.
///
/// Every route's layer is a clone of one, so the [`Drain`] returned with the router
/// waits for all of them at shutdown.
pub(crate) fn app<S: Storage, St: IdempotencyStore>(
    state: AppState<S>,
    idempotency_ttl: Duration,
    idempotency_lease: Duration,
    store: St,
    kind: &'static str,
    load_routes: bool,
    limits: Limits,
) -> Result<(Router, Drain), PolicyError> {
    tracing::info!(
        event = "commands.store",
        store = kind,
        "idempotency records kept in {kind}"
    );
    let idempotent = IdempotencyLayer::with_store(store)
        .client(ClientFromHeader::new(HeaderName::from_static("x-api-key")))
        .require_client(true)
        .policy(Policy::new().ttl(idempotency_ttl).lease(idempotency_lease))?
        .max_request_bytes(limits.max_body_bytes);
    let drain = idempotent.drain();

    let load = LoadState::default();
    let request_id = HeaderName::from_static("x-request-id");
    let routes = Router::new()
        .route(
            "/commands",
            post(create_command::<S>)
                .layer(idempotent.clone().require_key(true))
                .get(list_commands::<S>),
        )
        .route("/commands/{id}", get(get_command::<S>))
        .route(
            "/commands/{id}/cancel",
            post(cancel_command::<S>).layer(idempotent.clone()),
        )
        .fallback(unknown_route)
        // After every route: it replaces axum's empty 405 on each route added so far.
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state);
    #[cfg(feature = "metrics")]
    let routes = routes.route("/metrics", get(crate::metrics::render));
    #[cfg(feature = "openapi")]
    let routes = {
        let document = openapi_document(&idempotent.clone().require_key(true), &idempotent);
        routes.route(
            "/openapi.json",
            get(move || async move {
                ([(http::header::CONTENT_TYPE, "application/json")], document)
            }),
        )
    };
    // One access line per request, whoever answers it (the limits included).
    let mut routes = with_request_limits(routes, limits).layer(
        CorrelationLayer::new()
            .accept(request_id.clone())
            .access_log(),
    );
    if load_routes {
        // The correlation layer alone, as `benches/load.sh` measures it.
        routes = routes.merge(
            Router::new()
                .route("/load/correlated", post(load_handler))
                .route(
                    "/load/idempotent",
                    post(load_handler).layer(idempotent.clone().require_key(true)),
                )
                .with_state(load.clone())
                .layer(CorrelationLayer::new().accept(request_id.clone())),
        );
        // Behind the service's own correlation layer, with its access line: one line
        // per request at INFO on either method, as on `/commands`.
        routes = routes.merge(
            Router::new()
                .route(
                    "/load/logged",
                    post(load_handler)
                        .layer(idempotent.require_key(true))
                        .get(load_handler),
                )
                .with_state(load.clone())
                .layer(
                    CorrelationLayer::new()
                        .accept(request_id.clone())
                        .access_log(),
                ),
        );
    }
    if !load_routes {
        return Ok((routes, drain));
    }
    // Merged after the correlation layer, so outside it: no layer at all, a layer that
    // does nothing, or tower-http's request-ID pair for comparison.
    let routes = routes.merge(
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
    );
    Ok((routes, drain))
}

/// Where the commands are kept: in memory ([`Memory`](crate::memory::Memory)), or in
/// PostgreSQL with `--database-url` ([`Database`](crate::postgres::Database)). The
/// handlers below parse the request, call one of these and log; every method answers
/// the command as the client sees it, or the refusal.
pub(crate) trait Storage: Clone + Send + Sync + 'static {
    /// What a `POST` handler takes from the request to write in: nothing in memory; in
    /// PostgreSQL the request's transaction, which the idempotency layer commits with
    /// the response's record (there when the request carries a key).
    type Transaction: FromRequestParts<AppState<Self>> + Send;

    /// Stores a new command, `queued`, and queues it for the publisher with the
    /// `origin` of the request that created it (the publisher puts its correlation ID,
    /// idempotency key and trace context in the event's AMQP headers).
    fn create(
        &self,
        transaction: Self::Transaction,
        new: NewCommand,
        origin: Origin,
    ) -> impl Future<Output = Result<Command, ApiError>> + Send;

    /// The commands `GET /commands` answers, oldest first.
    fn list(&self) -> impl Future<Output = Result<Vec<Command>, ApiError>> + Send;

    fn get(&self, id: Uuid) -> impl Future<Output = Result<Command, ApiError>> + Send;

    /// Cancels a `queued` command; a cancelled one stays so, a sent one is refused.
    fn cancel(
        &self,
        transaction: Self::Transaction,
        id: Uuid,
    ) -> impl Future<Output = Result<Command, ApiError>> + Send;
}

/// What every handler shares.
#[derive(Clone)]
pub(crate) struct AppState<S> {
    pub(crate) storage: S,
    /// How long the `POST` handlers sleep first (`--handler-delay-ms`).
    pub(crate) handler_delay: Duration,
    /// How long the `POST` handlers wait after their writes (`--commit-delay-ms`).
    pub(crate) commit_delay: Duration,
    /// The share of `POST` handlers that fail after their writes, in percent
    /// (`--fail-after-write-percent`).
    pub(crate) fail_after_write_percent: u8,
}

/// How deep a command's `payload` may nest arrays and objects (`{"celsius":21.5}` is 1
/// deep, `[[1]]` 2); a deeper one is refused with `422 body.too_deep`, in every mode.
///
/// Why a limit at all: the payload is kept as the text it was sent in, which serde_json
/// checks without recursing, so any depth that fits in `--max-body-bytes` would pass in
/// memory (32,000 in 64 KiB), while PostgreSQL's `json` input recurses and gives up
/// between 10,000 and 20,000 levels (`stack depth limit exceeded`, with the default
/// `max_stack_depth` of 2 MB): the same body would be `201` in memory and a `503` in DB
/// mode. Why 32: a device's settings are a level or two deep, and an event consumer
/// that parses the payload into a `serde_json::Value` stops at 128 levels (the event
/// wraps the payload in one more); 32 leaves room for any real command and keeps every
/// consumer well within its own limit.
pub(crate) const MAX_PAYLOAD_DEPTH: usize = 32;

/// The body of `POST /commands`.
#[derive(Debug, Deserialize)]
pub(crate) struct NewCommand {
    pub(crate) device_id: String,
    pub(crate) name: String,
    /// Kept as the JSON text it was sent in: no larger than the body it came in, where a
    /// parsed `serde_json::Value` can take many times its size (16 times for `[0,0,...]`).
    pub(crate) payload: Box<RawValue>,
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

impl<S> AppState<S> {
    /// Sleeps `--handler-delay-ms`, standing in for a slow downstream call.
    async fn simulate_work(&self) {
        if !self.handler_delay.is_zero() {
            tokio::time::sleep(self.handler_delay).await;
        }
    }

    /// Sleeps `--commit-delay-ms` after a handler's writes: in PostgreSQL, with the
    /// request's transaction open, since the layer commits once the handler answers.
    async fn wait_before_answering(&self) {
        if !self.commit_delay.is_zero() {
            tokio::time::sleep(self.commit_delay).await;
        }
    }

    /// Fails `--fail-after-write-percent` of the requests with `500` after their
    /// writes, as a handler that fails after its side effect does: in memory the writes
    /// stand (and the layer stores the `500`, so a retry replays it); in PostgreSQL the
    /// layer rolls the request's transaction back and releases the key, so a retry runs
    /// again.
    fn fail_after_write(&self) -> Result<(), ApiError> {
        if self.fail_after_write_percent > 0
            && rand::random_range(0..100) < self.fail_after_write_percent
        {
            tracing::warn!(
                event = "commands.failed_after_write",
                "failing on purpose after the writes (--fail-after-write-percent)"
            );
            return Err(ApiError::FailedAfterWrite);
        }
        Ok(())
    }
}

/// How deep `json`, valid JSON text, nests arrays and objects: `1` is 0, `{"a":1}` 1,
/// `[[1]]` 2. One pass over the bytes, no recursion: brackets inside strings do not
/// count.
fn nesting_depth(json: &str) -> usize {
    let (mut depth, mut deepest) = (0_usize, 0_usize);
    let (mut in_string, mut escaped) = (false, false);
    for byte in json.bytes() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

async fn create_command<S: Storage>(
    State(state): State<AppState<S>>,
    correlation_id: CorrelationId,
    transaction: S::Transaction,
    headers: HeaderMap,
    body: Result<Json<NewCommand>, JsonRejection>,
) -> Result<(StatusCode, Json<Command>), ApiError> {
    state.simulate_work().await;
    let Json(new) = body.map_err(ApiError::bad_request)?;
    // What DB mode cannot store is refused in every mode: the answer to a client's
    // mistake does not depend on where the commands are kept.
    if new.device_id.contains('\0') || new.name.contains('\0') {
        return Err(ApiError::NulInText.create_refused());
    }
    if nesting_depth(new.payload.get()) > MAX_PAYLOAD_DEPTH {
        return Err(ApiError::PayloadTooDeep.create_refused());
    }
    // The idempotency layer validated it before the handler ran (the route requires
    // one); the layer keeps it to itself, so it is read again here.
    let idempotency_key = IdempotencyKey::from_carrier(&headers).ok().flatten();
    let origin = Origin::current(correlation_id, idempotency_key);
    let command = state.storage.create(transaction, new, origin).await?;
    // DEBUG: the access line is the request's one line at INFO, and says it ran
    // (`idempotency_outcome = "executed"`, status 201).
    tracing::debug!(
        event = "commands.created",
        command_id = %command.id,
        device_id = command.device_id.as_str(),
        name = command.name.as_str(),
        "command created"
    );
    state.wait_before_answering().await;
    state.fail_after_write()?;
    Ok((StatusCode::CREATED, Json(command)))
}

async fn list_commands<S: Storage>(
    State(state): State<AppState<S>>,
) -> Result<Json<Vec<Command>>, ApiError> {
    let commands = state.storage.list().await?;
    tracing::debug!(
        event = "commands.listed",
        count = commands.len(),
        "commands listed"
    );
    Ok(Json(commands))
}

async fn get_command<S: Storage>(
    State(state): State<AppState<S>>,
    Path(id): Path<String>,
) -> Result<Json<Command>, ApiError> {
    let id = parse_id(&id)?;
    Ok(Json(state.storage.get(id).await?))
}

async fn cancel_command<S: Storage>(
    State(state): State<AppState<S>>,
    transaction: S::Transaction,
    Path(id): Path<String>,
) -> Result<Json<Command>, ApiError> {
    state.simulate_work().await;
    let id = parse_id(&id)?;
    let command = state.storage.cancel(transaction, id).await?;
    state.wait_before_answering().await;
    state.fail_after_write()?;
    Ok(Json(command))
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

/// The service's OpenAPI document (feature `openapi`): its two protected operations,
/// each documented by the layer that protects it.
#[cfg(feature = "openapi")]
fn openapi_document<St, C, E>(
    create_layer: &IdempotencyLayer<St, C, E>,
    cancel_layer: &IdempotencyLayer<St, C, E>,
) -> String {
    use utoipa::openapi::{
        path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn, PathItem},
        schema::{ObjectBuilder, Type},
        InfoBuilder, OpenApiBuilder, PathsBuilder, Required, ResponseBuilder,
    };

    let mut create = OperationBuilder::new()
        .operation_id(Some("createCommand"))
        .summary(Some("Create a command for a device"))
        .parameter(
            ParameterBuilder::new()
                .name("x-api-key")
                .parameter_in(ParameterIn::Header)
                .required(Required::True)
                .description(Some("The client: its keys are its own"))
                .schema(Some(ObjectBuilder::new().schema_type(Type::String))),
        )
        .response(
            "201",
            ResponseBuilder::new().description("The command, created"),
        )
        .build();
    create_layer.document(&mut create);
    let mut cancel = OperationBuilder::new()
        .operation_id(Some("cancelCommand"))
        .summary(Some("Cancel a command"))
        .parameter(
            ParameterBuilder::new()
                .name("id")
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .schema(Some(ObjectBuilder::new().schema_type(Type::String))),
        )
        .response(
            "200",
            ResponseBuilder::new().description("The command, cancelled"),
        )
        .response("404", ResponseBuilder::new().description("No such command"))
        .build();
    cancel_layer.document(&mut cancel);
    let paths = PathsBuilder::new()
        .path("/commands", PathItem::new(HttpMethod::Post, create))
        .path(
            "/commands/{id}/cancel",
            PathItem::new(HttpMethod::Post, cancel),
        )
        .build();
    OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("Command Service")
                .version("1")
                .build(),
        )
        .paths(paths)
        .build()
        .to_pretty_json()
        .expect("a document of strings serialises")
}
