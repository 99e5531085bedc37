//! The planner: realtime calls and confirmations from partners, each keyed by the
//! body's `correlation_id` and scoped by the authenticated partner, with its own
//! retention on one store; and the dispatch feed partners poll and ack.

use std::{collections::HashMap, sync::Arc, time::Duration};
use tower_ids::idempotency::Policy;

use axum::{
    extract::{Query, Request, State},
    http::StatusCode,
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
    Extension, Json, Router,
};
use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine as _};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        store::Transaction, ClientFromExtension, Drain, IdempotencyLayer, IdempotencyStore,
        JsonReplayMarker, KeyFromJson, MokaStore,
    },
};

use crate::{
    db::{Movement, PlannerDb},
    problem::Problem,
    seconds, shutdown, Common, Stopping,
};

#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Options {
    /// A partner and its bearer token, `ID=TOKEN`; repeat for more.
    #[arg(long = "partner", value_parser = partner, default_values = ["acme=acme-token", "globex=globex-token"])]
    partners: Vec<(String, String)>,
    /// The planner's ID, in every dispatch event.
    #[arg(long, default_value = "planner-1")]
    planner_id: String,
    /// Seconds a realtime call's answer is replayed (30 days).
    #[arg(long = "realtime-retention-secs", value_parser = seconds, default_value = "2592000")]
    realtime_retention: Duration,
    /// Seconds a confirmation's answer is replayed (30 days).
    #[arg(long = "confirmation-retention-secs", value_parser = seconds, default_value = "2592000")]
    confirmation_retention: Duration,
    /// Deliver a partner's feed to its executor's webhook too, `ID=URL` (the executor's
    /// base URL); repeat for more.
    #[arg(long = "webhook", value_parser = partner)]
    webhooks: Vec<(String, String)>,
    /// The bearer token webhooks carry.
    #[arg(long, default_value = "planner-token")]
    webhook_token: String,
    /// Attempts per webhook before it is dead-lettered and its warehouse's next event
    /// goes.
    #[arg(long, default_value_t = 5)]
    webhook_attempts: u32,
    /// The pause after a webhook's first failed attempt, doubled after each.
    #[arg(long, default_value_t = 200)]
    webhook_backoff_ms: u64,
    /// Most events one page of the feed holds.
    #[arg(long, default_value_t = 100)]
    max_page: i64,
    /// Publish the feed to these Kafka brokers too (`host:port,...`), keyed by
    /// `warehouse_frn`.
    #[cfg(feature = "kafka")]
    #[arg(long)]
    kafka_brokers: Option<String>,
    /// The topic `--kafka-brokers` publishes to.
    #[cfg(feature = "kafka")]
    #[arg(long, default_value = "dispatch")]
    kafka_topic: String,
}

fn partner(text: &str) -> Result<(String, String), String> {
    let (id, token) = text
        .split_once('=')
        .ok_or_else(|| format!("{text}: expected ID=TOKEN"))?;
    Ok((id.to_owned(), token.to_owned()))
}

/// The partner a request authenticated as; the idempotency layer scopes keys by it.
#[derive(Clone, Debug)]
pub(crate) struct Partner(pub(crate) String);

impl AsRef<[u8]> for Partner {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

#[derive(Clone)]
struct Planner {
    db: PlannerDb,
    planner_id: Arc<str>,
    max_page: i64,
}

pub(crate) async fn run(
    options: Options,
    common: Common,
    listener: TcpListener,
    url: String,
    stopping: Stopping,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let planner_id: Arc<str> = options.planner_id.as_str().into();
    // With `--kafka-brokers`, each new event goes to Kafka too: on PostgreSQL through
    // the outbox and its relay (which stops on the same signal, after its round), in
    // memory through a producer task.
    #[cfg_attr(not(feature = "kafka"), allow(unused_mut))]
    let mut relay: Option<tokio::task::JoinHandle<()>> = None;
    let (db, (app, drain)) = match &common.database_url {
        Some(database) => {
            let (pool, store) = crate::db::connect(database).await?;
            #[cfg_attr(not(feature = "kafka"), allow(unused_mut))]
            let mut outbox = None;
            #[cfg(feature = "kafka")]
            if let Some(brokers) = &options.kafka_brokers {
                let (kafka, task) = crate::kafka::spawn_relay(
                    pool.clone(),
                    brokers,
                    &options.kafka_topic,
                    stopping.clone(),
                )
                .await?;
                outbox = Some(kafka);
                relay = Some(task);
            }
            let db = PlannerDb::Postgres(pool, outbox);
            (db.clone(), routes(db, store, &options))
        }
        None => {
            #[cfg_attr(not(feature = "kafka"), allow(unused_mut))]
            let mut producer = None;
            #[cfg(feature = "kafka")]
            if let Some(brokers) = &options.kafka_brokers {
                producer = Some(crate::kafka::spawn_producer(brokers, &options.kafka_topic)?);
            }
            let db = PlannerDb::memory(producer);
            (db.clone(), routes(db, MokaStore::new(), &options))
        }
    };
    if !options.webhooks.is_empty() {
        crate::webhooks::spawn(
            db.clone(),
            crate::webhooks::Delivery {
                urls: options.webhooks.iter().cloned().collect(),
                token: options.webhook_token.clone(),
                attempts: options.webhook_attempts.max(1),
                backoff: Duration::from_millis(options.webhook_backoff_ms),
            },
        );
    }
    let tokens: Arc<HashMap<String, String>> = Arc::new(
        options
            .partners
            .iter()
            .map(|(id, token)| (token.clone(), id.clone()))
            .collect(),
    );
    let app = app
        .layer(middleware::from_fn_with_state(tokens, authenticate))
        .layer(CorrelationLayer::new());
    tracing::info!(event = "partner.planner", planner_id = %planner_id, "planner ready");
    crate::serve(listener, &url, app, common.timeouts, stopping).await?;
    if let Some(relay) = relay {
        let _ = relay.await;
    }
    shutdown::drain(&[drain], common.drain.timeout()).await;
    Ok(())
}

/// The planner's routes, and the [`Drain`] of their idempotency layers (variants of
/// one, so one drain waits for both).
fn routes<St: IdempotencyStore>(db: PlannerDb, store: St, options: &Options) -> (Router, Drain) {
    // One store, a retention per route; keys are the body's `correlation_id`, scoped by
    // the authenticated partner (and the body's `partner_id`, which must agree).
    let keyed = IdempotencyLayer::with_store(store)
        .client(ClientFromExtension::<Partner>::new())
        .require_client(true)
        .key(KeyFromJson::new("/correlation_id").client("/partner_id"))
        .require_key(true)
        .on_replay(JsonReplayMarker::new("replay").status(StatusCode::OK));
    let drain = keyed.drain();
    let planner = Planner {
        db,
        planner_id: options.planner_id.as_str().into(),
        max_page: options.max_page,
    };
    let routes = Router::new()
        .route(
            "/wes/v1/realtime",
            post(realtime).layer(
                keyed
                    .clone()
                    .policy(Policy::new().ttl(options.realtime_retention))
                    .expect("the default lease suits every store"),
            ),
        )
        .route(
            "/wes/v1/confirmations",
            post(confirmation).layer(
                keyed
                    .policy(Policy::new().ttl(options.confirmation_retention))
                    .expect("the default lease suits every store"),
            ),
        )
        .route("/wes/v1/dispatch/pending", get(pending))
        .route("/wes/v1/dispatch/ack", post(ack))
        .route("/wes/v1/counts", get(counts))
        .route("/wes/v1/webhooks/dead", get(dead_letters))
        .with_state(planner);
    (routes, drain)
}

/// `Authorization: Bearer TOKEN` names the partner; anything else is `401`.
async fn authenticate(
    State(tokens): State<Arc<HashMap<String, String>>>,
    mut request: Request,
    next: Next,
) -> Response {
    match crate::bearer(&request).and_then(|token| tokens.get(token)) {
        Some(partner) => {
            request.extensions_mut().insert(Partner(partner.clone()));
            next.run(request).await
        }
        None => Problem::new(
            StatusCode::UNAUTHORIZED,
            "partner.unauthenticated",
            "send `Authorization: Bearer TOKEN` with your partner token",
        )
        .into_response(),
    }
}

/// The body, which the idempotency layer already found to be JSON with a key.
fn json_object(body: &[u8]) -> Result<Value, Problem> {
    serde_json::from_slice::<Value>(body)
        .ok()
        .filter(Value::is_object)
        .ok_or_else(|| {
            Problem::bad_request("partner.body_invalid", "the body must be a JSON object")
        })
}

/// The body's partner must be the caller.
fn same_partner(partner: &Partner, body: &Value) -> Result<(), Problem> {
    if body["partner_id"].as_str() == Some(partner.0.as_str()) {
        return Ok(());
    }
    Err(Problem::new(
        StatusCode::FORBIDDEN,
        "partner.partner_mismatch",
        "`partner_id` in the body is not the partner your token names",
    ))
}

fn text<'a>(body: &'a Value, field: &'static str) -> Result<&'a str, Problem> {
    body[field]
        .as_str()
        .filter(|text| !text.is_empty() && text.len() <= 200)
        .ok_or_else(|| {
            Problem::bad_request(
                "partner.field_invalid",
                format!("`{field}` must be a string of 1 to 200 characters"),
            )
        })
}

#[derive(Deserialize)]
struct RealtimeCall {
    correlation_id: String,
    warehouse_frn: String,
    sku: String,
    qty: i64,
}

/// A realtime movement: booked once, and one dispatch event for the partner.
async fn realtime(
    State(planner): State<Planner>,
    Extension(partner): Extension<Partner>,
    transaction: Option<Extension<Transaction>>,
    body: Bytes,
) -> Result<impl IntoResponse, Problem> {
    let body = json_object(&body)?;
    same_partner(&partner, &body)?;
    let call: RealtimeCall = serde_json::from_value(body).map_err(|_| {
        Problem::bad_request(
            "partner.body_invalid",
            "a realtime call is {partner_id, correlation_id, warehouse_frn, sku, qty}",
        )
    })?;
    let movement = Movement {
        movement_id: format!("mv-{}", uuid::Uuid::now_v7()),
        correlation_id: call.correlation_id,
        warehouse_frn: call.warehouse_frn,
        sku: call.sku,
        qty: call.qty,
    };
    let transaction = transaction.as_ref().map(|Extension(t)| t);
    let movement = planner
        .db
        .book(transaction, &partner.0, &planner.planner_id, movement)
        .await?;
    tracing::info!(event = "partner.movement_booked", movement_id = %movement.movement_id, "movement booked");
    let mut answer = serde_json::to_value(&movement).unwrap_or_default();
    answer["replay"] = json!(false);
    Ok((StatusCode::CREATED, Json(answer)))
}

/// A confirmation: one per window; a second one for the window answers the first.
async fn confirmation(
    State(planner): State<Planner>,
    Extension(partner): Extension<Partner>,
    transaction: Option<Extension<Transaction>>,
    body: Bytes,
) -> Result<impl IntoResponse, Problem> {
    let body = json_object(&body)?;
    same_partner(&partner, &body)?;
    let window_key = text(&body, "window_key")?;
    let correlation_id = text(&body, "correlation_id")?;
    let warehouse_frn = text(&body, "warehouse_frn")?;
    let transaction = transaction.as_ref().map(|Extension(t)| t);
    let (confirmation_id, window_confirmed_before) = planner
        .db
        .confirm(
            transaction,
            &partner.0,
            window_key,
            correlation_id,
            warehouse_frn,
        )
        .await?;
    tracing::info!(
        event = "partner.confirmed",
        confirmation_id,
        window_confirmed_before,
        "confirmation"
    );
    let status = if window_confirmed_before {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Ok((
        status,
        Json(json!({
            "confirmation_id": confirmation_id,
            "window_key": window_key,
            "window_confirmed_before": window_confirmed_before,
            "replay": false,
        })),
    ))
}

/// A cursor: the partner it belongs to and a position in the feed, opaque to clients.
fn encode_cursor(executor: &str, seq: i64) -> String {
    URL_SAFE_NO_PAD.encode(format!("v1:{executor}:{seq}"))
}

/// The position `cursor` names in `executor`'s feed: `400` if it is not a cursor,
/// `403` if it is another partner's.
fn decode_cursor(executor: &str, cursor: &str) -> Result<i64, Problem> {
    let invalid = || {
        Problem::bad_request(
            "dispatch.cursor_invalid",
            "not a cursor this planner issued",
        )
    };
    let text = URL_SAFE_NO_PAD
        .decode(cursor)
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .ok_or_else(invalid)?;
    let mut parts = text.splitn(3, ':');
    let (Some("v1"), Some(owner), Some(seq)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(invalid());
    };
    let seq: i64 = seq
        .parse()
        .ok()
        .filter(|seq| *seq >= 1)
        .ok_or_else(invalid)?;
    if owner != executor {
        return Err(Problem::new(
            StatusCode::FORBIDDEN,
            "dispatch.cursor_foreign",
            "this cursor belongs to another partner's feed",
        ));
    }
    Ok(seq)
}

/// A cursor past the end of the partner's feed: never one this planner gave, or one
/// from a feed it has lost (a planner in memory restarted).
fn cursor_ahead() -> Problem {
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "dispatch.cursor_ahead",
        "this cursor is past the end of your feed: use only cursors the feed gave you",
    )
}

#[derive(Deserialize)]
struct PendingQuery {
    since: Option<String>,
    limit: Option<i64>,
}

/// `GET /dispatch/pending?since=CURSOR&limit=N`: the next page of the partner's feed.
/// A cursor is refused as an ack refuses it: one past the feed's end is `422`.
async fn pending(
    State(planner): State<Planner>,
    Extension(partner): Extension<Partner>,
    Query(query): Query<PendingQuery>,
) -> Result<Json<Value>, Problem> {
    let since = match query.since.as_deref().filter(|s| !s.is_empty()) {
        Some(cursor) => decode_cursor(&partner.0, cursor)?,
        None => 0,
    };
    let limit = query
        .limit
        .unwrap_or(planner.max_page)
        .clamp(1, planner.max_page);
    let events = planner.db.pending(&partner.0, since, limit).await?;
    if events.is_empty() && since > planner.db.newest(&partner.0).await? {
        return Err(cursor_ahead());
    }
    let next = events.last().map_or(since, |event| event.seq);
    let events: Vec<Value> = events
        .iter()
        .map(|event| {
            json!({
                "cursor": encode_cursor(&partner.0, event.seq),
                "planner_id": event.planner_id,
                "correlation_id": event.correlation_id,
                "warehouse_frn": event.warehouse_frn,
                "movement_id": event.movement_id,
            })
        })
        .collect();
    Ok(Json(json!({
        "events": events,
        "next_cursor": if next == 0 { String::new() } else { encode_cursor(&partner.0, next) },
    })))
}

#[derive(Deserialize)]
struct AckBody {
    cursor: String,
}

/// `POST /dispatch/ack {"cursor"}`: moves the partner's ack forward; an earlier or
/// equal cursor changes nothing and says so; one past the feed's end is `422`.
async fn ack(
    State(planner): State<Planner>,
    Extension(partner): Extension<Partner>,
    body: Result<Json<AckBody>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, Problem> {
    let Json(body) = body.map_err(|_| {
        Problem::bad_request("dispatch.body_invalid", "an ack is {\"cursor\": \"...\"}")
    })?;
    let seq = decode_cursor(&partner.0, &body.cursor)?;
    if seq > planner.db.newest(&partner.0).await? {
        return Err(cursor_ahead());
    }
    let acked = planner.db.ack(&partner.0, seq).await?;
    tracing::info!(
        event = "partner.acked",
        advanced = acked.advanced,
        seq = acked.seq,
        "dispatch ack"
    );
    Ok(Json(json!({
        "advanced": acked.advanced,
        "cursor": encode_cursor(&partner.0, acked.seq),
    })))
}

/// `GET /wes/v1/counts`: the partner's movements, confirmations and acked position,
/// to see that a replay changed nothing.
async fn counts(
    State(planner): State<Planner>,
    Extension(partner): Extension<Partner>,
) -> Result<Json<Value>, Problem> {
    let (movements, confirmations) = planner.db.counts(&partner.0).await?;
    let acked = planner.db.acked(&partner.0).await?;
    Ok(Json(json!({
        "movements": movements,
        "confirmations": confirmations,
        "acked": if acked == 0 { String::new() } else { encode_cursor(&partner.0, acked) },
    })))
}

/// `GET /wes/v1/webhooks/dead`: the partner's dead-lettered webhooks, oldest first.
async fn dead_letters(
    State(planner): State<Planner>,
    Extension(partner): Extension<Partner>,
) -> Result<Json<Value>, Problem> {
    let dead: Vec<Value> = planner
        .db
        .dead_letters(&partner.0)
        .await?
        .into_iter()
        .map(|(event, error)| {
            json!({
                "cursor": encode_cursor(&partner.0, event.seq),
                "correlation_id": event.correlation_id,
                "warehouse_frn": event.warehouse_frn,
                "error": error,
            })
        })
        .collect();
    Ok(Json(json!({ "dead": dead })))
}
