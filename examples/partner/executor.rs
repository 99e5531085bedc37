//! The executor: receives the planner's webhooks (keyed by `planner_id` and
//! `correlation_id`, kept 24 hours), polls the dispatch feed and acks each page only
//! after it stored it, and with `--features kafka` consumes the feed from Kafka. Every
//! path stores an event once, by (planner, correlation ID), whatever arrives twice.

use std::{sync::Arc, time::Duration};
use tower_ids::idempotency::Policy;

use axum::{
    extract::{Request, State},
    http::StatusCode,
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        Drain, IdempotencyLayer, IdempotencyStore, JsonReplayMarker, KeyFromJson, MokaStore,
    },
};

use crate::{
    db::{ExecutorDb, Received},
    problem::Problem,
    seconds, shutdown, Common, Stopping,
};

#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Options {
    /// This executor's partner ID at the planner: the partner `--token` names (it picks
    /// this executor's Kafka records and names its saved cursor).
    #[arg(long, default_value = "acme")]
    pub(crate) executor_id: String,
    /// The planner's base URL (`http://127.0.0.1:3000`); without it, no polling.
    #[arg(long)]
    planner_url: Option<String>,
    /// The bearer token this executor sends the planner.
    #[arg(long, default_value = "acme-token")]
    token: String,
    /// The bearer token the planner sends this executor's webhook.
    #[arg(long, default_value = "planner-token")]
    webhook_token: String,
    /// Seconds a webhook's (and a Kafka record's) outcome is replayed (the contract's
    /// 24 hours).
    #[arg(long = "webhook-retention-secs", value_parser = seconds, default_value = "86400")]
    pub(crate) webhook_retention: Duration,
    /// Pause between polls when the feed had nothing new.
    #[arg(long, default_value_t = 200)]
    poll_interval_ms: u64,
    /// Events asked for per page (the planner lowers it to its `--max-page`).
    #[arg(long, default_value_t = 100)]
    page_size: u32,
    /// Exit (status 3) right after storing the first page, before acking it: the
    /// crash the contract's "ack only after durable processing" is for.
    #[arg(long)]
    exit_after_storing_page: bool,
    /// Consume the feed from these Kafka brokers too (`host:port,...`).
    #[cfg(feature = "kafka")]
    #[arg(long)]
    pub(crate) kafka_brokers: Option<String>,
    /// The topic `--kafka-brokers` consumes.
    #[cfg(feature = "kafka")]
    #[arg(long, default_value = "dispatch")]
    pub(crate) kafka_topic: String,
    /// The consumer group.
    #[cfg(feature = "kafka")]
    #[arg(long, default_value = "executor")]
    pub(crate) kafka_group: String,
}

pub(crate) async fn run(
    options: Options,
    common: Common,
    listener: TcpListener,
    url: String,
    stopping: Stopping,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let (db, (app, webhook)) = match &common.database_url {
        Some(database) => {
            let (pool, store) = crate::db::connect(database).await?;
            let db = ExecutorDb::Postgres(pool);
            (db.clone(), routes(db, store, &options))
        }
        None => {
            let db = ExecutorDb::memory();
            (db.clone(), routes(db, MokaStore::new(), &options))
        }
    };
    if let Some(planner) = options.planner_url.clone() {
        tokio::spawn(poll(db.clone(), planner, options.clone()));
    }
    #[cfg(feature = "kafka")]
    let kafka = match &options.kafka_brokers {
        Some(brokers) => Some(crate::kafka::spawn_consumer(
            db.clone(),
            brokers,
            &options,
            &common,
            stopping.clone(),
        )?),
        None => None,
    };
    #[cfg(not(feature = "kafka"))]
    let kafka: Option<(tokio::task::JoinHandle<()>, Drain)> = None;
    tracing::info!(event = "partner.executor", executor_id = %options.executor_id, "executor ready");
    crate::serve(listener, &url, app, common.timeouts, stopping).await?;
    let mut drains = vec![webhook];
    if let Some((consumer, drain)) = kafka {
        // It stops polling on the same signal, once the record in hand is handled.
        let _ = consumer.await;
        drains.push(drain);
    }
    shutdown::drain(&drains, common.drain.timeout()).await;
    Ok(())
}

/// The executor's routes, and the [`Drain`] of the webhook's idempotency layer.
fn routes<St: IdempotencyStore>(db: ExecutorDb, store: St, options: &Options) -> (Router, Drain) {
    let webhook = IdempotencyLayer::with_store(store)
        .key(KeyFromJson::new("/correlation_id").client("/planner_id"))
        .require_key(true)
        .on_replay(JsonReplayMarker::new("replay").status(StatusCode::OK))
        .policy(Policy::new().ttl(options.webhook_retention))
        .expect("the default lease suits every store");
    let drain = webhook.drain();
    let token: Arc<str> = options.webhook_token.as_str().into();
    let routes = Router::new()
        .route(
            "/wes/v1/webhooks/dispatch",
            post(webhook_dispatch)
                .layer(webhook)
                .layer(middleware::from_fn_with_state(token, authenticate)),
        )
        .route("/wes/v1/events", get(events))
        .with_state(db)
        .layer(CorrelationLayer::new());
    (routes, drain)
}

async fn authenticate(State(token): State<Arc<str>>, request: Request, next: Next) -> Response {
    if crate::bearer(&request) == Some(&*token) {
        return next.run(request).await;
    }
    Problem::new(
        StatusCode::UNAUTHORIZED,
        "partner.unauthenticated",
        "send `Authorization: Bearer TOKEN` with the planner's webhook token",
    )
    .into_response()
}

/// The event a dispatch body describes, arrived by `source`.
pub(crate) fn received(source: &str, body: &Value) -> Result<Received, Problem> {
    let field = |name: &'static str| {
        body[name]
            .as_str()
            .filter(|text| !text.is_empty() && text.len() <= 200)
            .map(str::to_owned)
            .ok_or_else(|| {
                Problem::bad_request(
                    "partner.field_invalid",
                    format!("`{name}` must be a string of 1 to 200 characters"),
                )
            })
    };
    Ok(Received {
        planner_id: field("planner_id")?,
        correlation_id: field("correlation_id")?,
        source: source.to_owned(),
        warehouse_frn: field("warehouse_frn")?,
        body: body.clone(),
    })
}

/// A webhook: stored once; within the retention a retry is replayed by the layer,
/// after it the event is recognised by its key in the table and not stored again.
async fn webhook_dispatch(
    State(db): State<ExecutorDb>,
    body: Bytes,
) -> Result<impl IntoResponse, Problem> {
    let body: Value = serde_json::from_slice(&body)
        .map_err(|_| Problem::bad_request("partner.body_invalid", "the body must be JSON"))?;
    let event = received("webhook", &body)?;
    let new = db.store(std::slice::from_ref(&event)).await?;
    tracing::info!(event = "partner.webhook_received", correlation_id = %event.correlation_id, new = new == 1, "webhook");
    Ok((
        StatusCode::CREATED,
        Json(json!({"stored": new == 1, "replay": false})),
    ))
}

async fn events(State(db): State<ExecutorDb>) -> Result<Json<Value>, Problem> {
    Ok(Json(json!({ "events": db.events().await? })))
}

/// Polls the feed from the last acked cursor: stores each page, then acks it, then
/// remembers the ack. A crash between the store and the ack gets the page again, and
/// the store keeps each event once.
async fn poll(db: ExecutorDb, planner: String, options: Options) {
    let client = reqwest::Client::new();
    let pause = Duration::from_millis(options.poll_interval_ms);
    loop {
        match poll_once(&db, &client, &planner, &options).await {
            Ok(true) => {}
            Ok(false) => tokio::time::sleep(pause).await,
            Err(error) => {
                tracing::warn!(event = "partner.poll_failed", error = %error, "poll failed; retrying");
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// One page: `true` if it held events.
async fn poll_once(
    db: &ExecutorDb,
    client: &reqwest::Client,
    planner: &str,
    options: &Options,
) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    let since = db
        .cursor(&options.executor_id)
        .await
        .map_err(|p| format!("{p:?}"))?;
    let mut url = format!(
        "{planner}/wes/v1/dispatch/pending?limit={}",
        options.page_size
    );
    if let Some(since) = &since {
        url.push_str("&since=");
        url.push_str(since);
    }
    let page = client.get(url).bearer_auth(&options.token).send().await?;
    if page.status() != StatusCode::OK {
        return Err(format!("the feed answered {}", page.status()).into());
    }
    let page: Value = serde_json::from_slice(&page.bytes().await?)?;
    let events: Vec<Received> = page["events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|event| received("poll", event))
        .collect::<Result<_, _>>()
        .map_err(|p| format!("{p:?}"))?;
    let Some(next) = page["next_cursor"].as_str().filter(|next| !next.is_empty()) else {
        return Ok(false);
    };
    if events.is_empty() {
        return Ok(false);
    }
    let new = db.store(&events).await.map_err(|p| format!("{p:?}"))?;
    tracing::info!(
        event = "partner.page_stored",
        events = events.len(),
        new,
        "page stored"
    );
    if options.exit_after_storing_page {
        tracing::warn!(
            event = "partner.exiting_before_ack",
            "exiting after storing a page, before acking it"
        );
        std::process::exit(3);
    }
    let acked = client
        .post(format!("{planner}/wes/v1/dispatch/ack"))
        .bearer_auth(&options.token)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(json!({ "cursor": next }).to_string())
        .send()
        .await?;
    if acked.status() != StatusCode::OK {
        return Err(format!("the ack answered {}", acked.status()).into());
    }
    db.save_cursor(&options.executor_id, next)
        .await
        .map_err(|p| format!("{p:?}"))?;
    tracing::info!(event = "partner.page_acked", "page acked");
    Ok(true)
}
