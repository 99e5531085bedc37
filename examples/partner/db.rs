//! Where the planner and the executor keep their state: in memory, or in PostgreSQL,
//! where a handler's writes go into the request's transaction, which the idempotency
//! layer commits with the answer it stores.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::{postgres::PgPoolOptions, PgConnection, PgPool, Row};
use tokio::sync::mpsc::UnboundedSender;
use tower_ids::{
    idempotency::{
        store::{PostgresMode, PostgresStore, Transaction, TransactionGuard},
        IdempotencyKey,
    },
    outbox::{Message, Outbox},
};

use crate::problem::Problem;

const SCHEMA: &str = r"
CREATE TABLE IF NOT EXISTS partner_movements (
    id text PRIMARY KEY,
    partner_id text NOT NULL,
    correlation_id text NOT NULL,
    warehouse_frn text NOT NULL,
    sku text NOT NULL,
    qty bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS partner_confirmations (
    id text PRIMARY KEY,
    partner_id text NOT NULL,
    window_key text NOT NULL,
    correlation_id text NOT NULL,
    warehouse_frn text NOT NULL,
    UNIQUE (partner_id, window_key)
);
CREATE TABLE IF NOT EXISTS partner_dispatch (
    seq bigserial PRIMARY KEY,
    executor_id text NOT NULL,
    planner_id text NOT NULL,
    correlation_id text NOT NULL UNIQUE,
    warehouse_frn text NOT NULL,
    movement_id text NOT NULL,
    webhook text NOT NULL DEFAULT 'pending',
    webhook_error text
);
CREATE TABLE IF NOT EXISTS partner_dispatch_acks (
    executor_id text PRIMARY KEY,
    seq bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS executor_events (
    planner_id text NOT NULL,
    correlation_id text NOT NULL,
    arrival bigserial,
    source text NOT NULL,
    warehouse_frn text NOT NULL,
    body jsonb NOT NULL,
    PRIMARY KEY (planner_id, correlation_id)
);
CREATE TABLE IF NOT EXISTS executor_cursor (
    executor_id text PRIMARY KEY,
    cursor text NOT NULL
);
";

/// Serialises the transactions that append to the dispatch feed, so that sequence
/// numbers become visible in the order they were taken: a poller that acked `n` can
/// never see `n - 1` appear afterwards.
const DISPATCH_LOCK: i64 = 0x0070_6172_746e_6572;

/// Connects (or fails within seconds, naming the host and port), creates the tables (the
/// example's and the idempotency store's) and returns the pool and the store on it.
pub(crate) async fn connect(
    url: &str,
) -> Result<(PgPool, PostgresStore), Box<dyn std::error::Error + Send + Sync>> {
    let pool = crate::database::connect(PgPoolOptions::new().max_connections(16), url).await?;
    sqlx::raw_sql(SCHEMA).execute(&pool).await?;
    let store = PostgresStore::builder(pool.clone())
        .mode(PostgresMode::Transactional)
        .build()?;
    store.migrate().await?;
    Ok((pool, store))
}

/// A movement booked by a realtime call.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Movement {
    pub(crate) movement_id: String,
    pub(crate) correlation_id: String,
    pub(crate) warehouse_frn: String,
    pub(crate) sku: String,
    pub(crate) qty: i64,
}

/// One event of the dispatch feed: what the planner sends an executor.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DispatchEvent {
    pub(crate) seq: i64,
    pub(crate) planner_id: String,
    pub(crate) correlation_id: String,
    pub(crate) warehouse_frn: String,
    pub(crate) movement_id: String,
}

/// What an ack did.
pub(crate) struct Acked {
    pub(crate) advanced: bool,
    /// The last acked sequence number, after this ack.
    pub(crate) seq: i64,
}

/// A dispatch event as a Kafka record: keyed by `warehouse_frn` (one warehouse's
/// events on one partition, in order), the event's `correlation_id` as its
/// `idempotency-key`, the event with its executor as the JSON payload.
#[derive(Debug)]
pub(crate) struct FeedRecord {
    pub(crate) key: String,
    pub(crate) idempotency_key: IdempotencyKey,
    pub(crate) payload: String,
}

impl FeedRecord {
    fn new(executor: &str, event: &DispatchEvent) -> Self {
        let payload = json!({
            "executor_id": executor,
            "planner_id": event.planner_id,
            "correlation_id": event.correlation_id,
            "warehouse_frn": event.warehouse_frn,
            "movement_id": event.movement_id,
        })
        .to_string();
        Self {
            key: event.warehouse_frn.clone(),
            idempotency_key: IdempotencyKey::new(&event.correlation_id)
                .expect("the planner's correlation IDs are UUIDs, valid keys"),
            payload,
        }
    }
}

/// The feed's Kafka topic on PostgreSQL (`--kafka-brokers`): each event enqueued in
/// the library outbox in the transaction that appends it, for the relay
/// (`crate::kafka::spawn_relay`) to publish once committed.
#[derive(Clone)]
pub(crate) struct KafkaOutbox {
    pub(crate) outbox: Outbox,
    pub(crate) topic: Arc<str>,
}

/// The planner's state. With `--kafka-brokers`, each new event also goes to Kafka: on
/// PostgreSQL through the outbox, in memory on a channel to a producer task.
#[derive(Clone)]
pub(crate) enum PlannerDb {
    Memory(Arc<Mutex<PlannerMemory>>),
    Postgres(PgPool, Option<KafkaOutbox>),
}

#[derive(Default)]
pub(crate) struct PlannerMemory {
    movements: Vec<(String, Movement)>,
    /// (partner, window key) to (confirmation ID, correlation ID).
    confirmations: HashMap<(String, String), (String, String)>,
    /// The feed: `seq` is the index plus one.
    dispatch: Vec<(String, DispatchEvent)>,
    /// Where new events go for Kafka (`crate::kafka::spawn_producer`), in feed order.
    kafka: Option<UnboundedSender<FeedRecord>>,
    acks: HashMap<String, i64>,
    /// Webhooks settled, by sequence number: delivered (`None`) or dead-lettered with
    /// the last error. Absent is pending.
    webhooks: HashMap<i64, Option<String>>,
}

/// Where a handler writes in PostgreSQL: the request's transaction, committed by the
/// idempotency layer with the stored answer.
async fn request_writes(
    transaction: Option<&Transaction>,
) -> Result<TransactionGuard<'_>, Problem> {
    let Some(transaction) = transaction else {
        // The route requires a key, so the layer always offers one.
        return Err(Problem::new(
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "partner.transaction_missing",
            "no request transaction: is the idempotency layer over the PostgresStore?",
        ));
    };
    transaction
        .lock()
        .await
        .map_err(|error| Problem::database(&error, "beginning the request's transaction"))
}

impl PlannerDb {
    /// The planner in memory; with `kafka`, each new event is sent there too.
    pub(crate) fn memory(kafka: Option<UnboundedSender<FeedRecord>>) -> Self {
        Self::Memory(Arc::new(Mutex::new(PlannerMemory {
            kafka,
            ..PlannerMemory::default()
        })))
    }

    /// Books a movement and appends its dispatch event for the partner's executor (and,
    /// with Kafka, its record: on PostgreSQL in the same transaction).
    pub(crate) async fn book(
        &self,
        transaction: Option<&Transaction>,
        partner: &str,
        planner_id: &str,
        movement: Movement,
    ) -> Result<Movement, Problem> {
        let event = |seq| DispatchEvent {
            seq,
            planner_id: planner_id.to_owned(),
            correlation_id: uuid::Uuid::now_v7().to_string(),
            warehouse_frn: movement.warehouse_frn.clone(),
            movement_id: movement.movement_id.clone(),
        };
        match self {
            Self::Memory(memory) => {
                let mut memory = memory.lock().unwrap();
                let seq = memory.dispatch.len() as i64 + 1;
                let event = event(seq);
                if let Some(kafka) = &memory.kafka {
                    // Under the lock: the channel holds the feed's order. The producer
                    // ends only with the process, so a send does not fail.
                    let _ = kafka.send(FeedRecord::new(partner, &event));
                }
                memory.dispatch.push((partner.to_owned(), event));
                memory
                    .movements
                    .push((partner.to_owned(), movement.clone()));
            }
            Self::Postgres(_, kafka) => {
                let mut writes = request_writes(transaction).await?;
                let connection: &mut PgConnection = &mut writes;
                let failed = |error: sqlx::Error| Problem::database(&error, "booking a movement");
                sqlx::query(
                    "INSERT INTO partner_movements (id, partner_id, correlation_id, warehouse_frn, sku, qty) \
                     VALUES ($1, $2, $3, $4, $5, $6)",
                )
                .bind(&movement.movement_id)
                .bind(partner)
                .bind(&movement.correlation_id)
                .bind(&movement.warehouse_frn)
                .bind(&movement.sku)
                .bind(movement.qty)
                .execute(&mut *connection)
                .await
                .map_err(failed)?;
                sqlx::query("SELECT pg_advisory_xact_lock($1)")
                    .bind(DISPATCH_LOCK)
                    .execute(&mut *connection)
                    .await
                    .map_err(failed)?;
                let event = event(0);
                sqlx::query(
                    "INSERT INTO partner_dispatch (executor_id, planner_id, correlation_id, warehouse_frn, movement_id) \
                     VALUES ($1, $2, $3, $4, $5)",
                )
                .bind(partner)
                .bind(&event.planner_id)
                .bind(&event.correlation_id)
                .bind(&event.warehouse_frn)
                .bind(&event.movement_id)
                .execute(&mut *connection)
                .await
                .map_err(failed)?;
                if let (Some(kafka), Some(_)) = (kafka, transaction) {
                    // In the request's transaction, after the feed's lock: the record
                    // commits with the event, and the outbox keeps each warehouse's
                    // records in commit order, which is feed order.
                    let record = FeedRecord::new(partner, &event);
                    let message = Message::new(&*kafka.topic, record.payload)
                        .partition_key(record.key)
                        .idempotency_key(record.idempotency_key);
                    kafka
                        .outbox
                        .enqueue(connection, message)
                        .await
                        .map_err(|error| Problem::database(&error, "enqueuing the Kafka record"))?;
                }
            }
        }
        Ok(movement)
    }

    /// Records a confirmation for its window, once: `(id, false)` for a new one, the
    /// window's first `(id, true)` when the window was confirmed before.
    pub(crate) async fn confirm(
        &self,
        transaction: Option<&Transaction>,
        partner: &str,
        window_key: &str,
        correlation_id: &str,
        warehouse_frn: &str,
    ) -> Result<(String, bool), Problem> {
        let id = uuid::Uuid::now_v7().to_string();
        match self {
            Self::Memory(memory) => {
                let mut memory = memory.lock().unwrap();
                let key = (partner.to_owned(), window_key.to_owned());
                if let Some((first, _)) = memory.confirmations.get(&key) {
                    return Ok((first.clone(), true));
                }
                memory
                    .confirmations
                    .insert(key, (id.clone(), correlation_id.to_owned()));
                Ok((id, false))
            }
            Self::Postgres(..) => {
                let mut writes = request_writes(transaction).await?;
                let connection: &mut PgConnection = &mut writes;
                let failed = |error: sqlx::Error| Problem::database(&error, "confirming");
                let inserted = sqlx::query(
                    "INSERT INTO partner_confirmations (id, partner_id, window_key, correlation_id, warehouse_frn) \
                     VALUES ($1, $2, $3, $4, $5) ON CONFLICT (partner_id, window_key) DO NOTHING",
                )
                .bind(&id)
                .bind(partner)
                .bind(window_key)
                .bind(correlation_id)
                .bind(warehouse_frn)
                .execute(&mut *connection)
                .await
                .map_err(failed)?;
                if inserted.rows_affected() == 1 {
                    return Ok((id, false));
                }
                let first: String = sqlx::query_scalar(
                    "SELECT id FROM partner_confirmations WHERE partner_id = $1 AND window_key = $2",
                )
                .bind(partner)
                .bind(window_key)
                .fetch_one(&mut *connection)
                .await
                .map_err(failed)?;
                Ok((first, true))
            }
        }
    }

    /// How many movements and confirmations the partner has: what a replay must not change.
    pub(crate) async fn counts(&self, partner: &str) -> Result<(i64, i64), Problem> {
        match self {
            Self::Memory(memory) => {
                let memory = memory.lock().unwrap();
                let movements = memory
                    .movements
                    .iter()
                    .filter(|(p, _)| p == partner)
                    .count();
                let confirmations = memory
                    .confirmations
                    .keys()
                    .filter(|(p, _)| p == partner)
                    .count();
                Ok((movements as i64, confirmations as i64))
            }
            Self::Postgres(pool, _) => {
                let row = sqlx::query(
                    "SELECT (SELECT count(*) FROM partner_movements WHERE partner_id = $1), \
                            (SELECT count(*) FROM partner_confirmations WHERE partner_id = $1)",
                )
                .bind(partner)
                .fetch_one(pool)
                .await
                .map_err(|error| Problem::database(&error, "counting"))?;
                Ok((row.get(0), row.get(1)))
            }
        }
    }

    /// The executor's events after `since`, at most `limit`, in feed order.
    pub(crate) async fn pending(
        &self,
        executor: &str,
        since: i64,
        limit: i64,
    ) -> Result<Vec<DispatchEvent>, Problem> {
        match self {
            Self::Memory(memory) => {
                let memory = memory.lock().unwrap();
                Ok(memory
                    .dispatch
                    .iter()
                    .filter(|(owner, event)| owner == executor && event.seq > since)
                    .take(usize::try_from(limit).unwrap_or(usize::MAX))
                    .map(|(_, event)| event.clone())
                    .collect())
            }
            Self::Postgres(pool, _) => {
                let rows = sqlx::query(
                    "SELECT seq, planner_id, correlation_id, warehouse_frn, movement_id \
                     FROM partner_dispatch WHERE executor_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
                )
                .bind(executor)
                .bind(since)
                .bind(limit)
                .fetch_all(pool)
                .await
                .map_err(|error| Problem::database(&error, "reading the feed"))?;
                Ok(rows.iter().map(dispatch_event).collect())
            }
        }
    }

    /// The executor's newest sequence number (0 when it has none).
    pub(crate) async fn newest(&self, executor: &str) -> Result<i64, Problem> {
        match self {
            Self::Memory(memory) => Ok(memory
                .lock()
                .unwrap()
                .dispatch
                .iter()
                .filter(|(owner, _)| owner == executor)
                .map(|(_, event)| event.seq)
                .max()
                .unwrap_or(0)),
            Self::Postgres(pool, _) => sqlx::query_scalar(
                "SELECT coalesce(max(seq), 0) FROM partner_dispatch WHERE executor_id = $1",
            )
            .bind(executor)
            .fetch_one(pool)
            .await
            .map_err(|error| Problem::database(&error, "reading the feed")),
        }
    }

    /// Moves the executor's ack to `seq` if it is further than the last one, atomically:
    /// two acks racing can only move it forward.
    pub(crate) async fn ack(&self, executor: &str, seq: i64) -> Result<Acked, Problem> {
        match self {
            Self::Memory(memory) => {
                let mut memory = memory.lock().unwrap();
                let last = memory.acks.entry(executor.to_owned()).or_insert(0);
                let advanced = seq > *last;
                *last = (*last).max(seq);
                Ok(Acked {
                    advanced,
                    seq: *last,
                })
            }
            Self::Postgres(pool, _) => {
                let failed = |error: sqlx::Error| Problem::database(&error, "acking");
                let moved: Option<i64> = sqlx::query_scalar(
                    "INSERT INTO partner_dispatch_acks (executor_id, seq) VALUES ($1, $2) \
                     ON CONFLICT (executor_id) DO UPDATE SET seq = excluded.seq \
                     WHERE partner_dispatch_acks.seq < excluded.seq RETURNING seq",
                )
                .bind(executor)
                .bind(seq)
                .fetch_optional(pool)
                .await
                .map_err(failed)?;
                if let Some(seq) = moved {
                    return Ok(Acked {
                        advanced: true,
                        seq,
                    });
                }
                let last = sqlx::query_scalar(
                    "SELECT seq FROM partner_dispatch_acks WHERE executor_id = $1",
                )
                .bind(executor)
                .fetch_one(pool)
                .await
                .map_err(failed)?;
                Ok(Acked {
                    advanced: false,
                    seq: last,
                })
            }
        }
    }

    /// The executor's last acked sequence number (0 before its first ack).
    pub(crate) async fn acked(&self, executor: &str) -> Result<i64, Problem> {
        match self {
            Self::Memory(memory) => Ok(*memory.lock().unwrap().acks.get(executor).unwrap_or(&0)),
            Self::Postgres(pool, _) => sqlx::query_scalar(
                "SELECT coalesce((SELECT seq FROM partner_dispatch_acks WHERE executor_id = $1), 0)",
            )
            .bind(executor)
            .fetch_one(pool)
            .await
            .map_err(|error| Problem::database(&error, "reading an ack")),
        }
    }
}

/// Webhook delivery: the head of each (executor, warehouse) lane, and its settling.
impl PlannerDb {
    /// For each of `executors` and each warehouse, the oldest event whose webhook is
    /// still pending: the only one of its lane that may be delivered now.
    pub(crate) async fn webhook_heads(
        &self,
        executors: &[String],
    ) -> Result<Vec<(String, DispatchEvent)>, Problem> {
        match self {
            Self::Memory(memory) => {
                let memory = memory.lock().unwrap();
                let mut lanes = std::collections::HashSet::new();
                Ok(memory
                    .dispatch
                    .iter()
                    .filter(|(owner, event)| {
                        executors.contains(owner) && !memory.webhooks.contains_key(&event.seq)
                    })
                    .filter(|(owner, event)| {
                        lanes.insert((owner.clone(), event.warehouse_frn.clone()))
                    })
                    .cloned()
                    .collect())
            }
            Self::Postgres(pool, _) => {
                let rows = sqlx::query(
                    "SELECT DISTINCT ON (executor_id, warehouse_frn) \
                       seq, planner_id, correlation_id, warehouse_frn, movement_id, executor_id \
                     FROM partner_dispatch WHERE webhook = 'pending' AND executor_id = ANY($1) \
                     ORDER BY executor_id, warehouse_frn, seq",
                )
                .bind(executors)
                .fetch_all(pool)
                .await
                .map_err(|error| Problem::database(&error, "reading the webhook lanes"))?;
                Ok(rows
                    .iter()
                    .map(|row| (row.get::<String, _>(5), dispatch_event(row)))
                    .collect())
            }
        }
    }

    /// Settles the webhook of event `seq`: delivered, or dead-lettered with `error`.
    pub(crate) async fn webhook_settled(
        &self,
        seq: i64,
        error: Option<String>,
    ) -> Result<(), Problem> {
        match self {
            Self::Memory(memory) => {
                memory.lock().unwrap().webhooks.insert(seq, error);
                Ok(())
            }
            Self::Postgres(pool, _) => sqlx::query(
                "UPDATE partner_dispatch SET webhook = CASE WHEN $2::text IS NULL THEN 'delivered' ELSE 'dead' END, \
                   webhook_error = $2 WHERE seq = $1",
            )
            .bind(seq)
            .bind(error)
            .execute(pool)
            .await
            .map(|_| ())
            .map_err(|error| Problem::database(&error, "settling a webhook")),
        }
    }

    /// The executor's dead-lettered webhooks, oldest first, with their last error.
    pub(crate) async fn dead_letters(
        &self,
        executor: &str,
    ) -> Result<Vec<(DispatchEvent, String)>, Problem> {
        match self {
            Self::Memory(memory) => {
                let memory = memory.lock().unwrap();
                Ok(memory
                    .dispatch
                    .iter()
                    .filter(|(owner, _)| owner == executor)
                    .filter_map(|(_, event)| match memory.webhooks.get(&event.seq) {
                        Some(Some(error)) => Some((event.clone(), error.clone())),
                        _ => None,
                    })
                    .collect())
            }
            Self::Postgres(pool, _) => {
                let rows = sqlx::query(
                    "SELECT seq, planner_id, correlation_id, warehouse_frn, movement_id, webhook_error \
                     FROM partner_dispatch WHERE executor_id = $1 AND webhook = 'dead' ORDER BY seq",
                )
                .bind(executor)
                .fetch_all(pool)
                .await
                .map_err(|error| Problem::database(&error, "reading dead letters"))?;
                Ok(rows
                    .iter()
                    .map(|row| {
                        (
                            dispatch_event(row),
                            row.get::<Option<String>, _>(5).unwrap_or_default(),
                        )
                    })
                    .collect())
            }
        }
    }
}

fn dispatch_event(row: &sqlx::postgres::PgRow) -> DispatchEvent {
    DispatchEvent {
        seq: row.get(0),
        planner_id: row.get(1),
        correlation_id: row.get(2),
        warehouse_frn: row.get(3),
        movement_id: row.get(4),
    }
}

/// An event the executor received, by whichever path.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Received {
    pub(crate) planner_id: String,
    pub(crate) correlation_id: String,
    pub(crate) source: String,
    pub(crate) warehouse_frn: String,
    pub(crate) body: Value,
}

/// The executor's state: the events it received (once each, by (planner, correlation
/// ID)) and the last cursor it acked.
#[derive(Clone)]
pub(crate) enum ExecutorDb {
    Memory(Arc<Mutex<ExecutorMemory>>),
    Postgres(PgPool),
}

#[derive(Default)]
pub(crate) struct ExecutorMemory {
    events: BTreeMap<u64, Received>,
    seen: HashMap<(String, String), u64>,
    cursor: Option<String>,
}

impl ExecutorDb {
    pub(crate) fn memory() -> Self {
        Self::Memory(Arc::default())
    }

    /// Stores `events` in one transaction, each once: an event seen before (by any
    /// path) is left as it is. Returns how many were new.
    pub(crate) async fn store(&self, events: &[Received]) -> Result<u64, Problem> {
        match self {
            Self::Memory(memory) => {
                let mut memory = memory.lock().unwrap();
                let mut new = 0;
                for event in events {
                    let key = (event.planner_id.clone(), event.correlation_id.clone());
                    if memory.seen.contains_key(&key) {
                        continue;
                    }
                    let arrival = memory.events.len() as u64 + 1;
                    memory.seen.insert(key, arrival);
                    memory.events.insert(arrival, event.clone());
                    new += 1;
                }
                Ok(new)
            }
            Self::Postgres(pool) => {
                let failed = |error: sqlx::Error| Problem::database(&error, "storing events");
                let mut transaction = pool.begin().await.map_err(failed)?;
                let mut new = 0;
                for event in events {
                    new += sqlx::query(
                        "INSERT INTO executor_events (planner_id, correlation_id, source, warehouse_frn, body) \
                         VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                    )
                    .bind(&event.planner_id)
                    .bind(&event.correlation_id)
                    .bind(&event.source)
                    .bind(&event.warehouse_frn)
                    .bind(&event.body)
                    .execute(&mut *transaction)
                    .await
                    .map_err(failed)?
                    .rows_affected();
                }
                transaction.commit().await.map_err(failed)?;
                Ok(new)
            }
        }
    }

    /// Every event received, in arrival order.
    pub(crate) async fn events(&self) -> Result<Vec<Received>, Problem> {
        match self {
            Self::Memory(memory) => Ok(memory.lock().unwrap().events.values().cloned().collect()),
            Self::Postgres(pool) => {
                let rows = sqlx::query(
                    "SELECT planner_id, correlation_id, source, warehouse_frn, body \
                     FROM executor_events ORDER BY arrival",
                )
                .fetch_all(pool)
                .await
                .map_err(|error| Problem::database(&error, "listing events"))?;
                Ok(rows
                    .iter()
                    .map(|row| Received {
                        planner_id: row.get(0),
                        correlation_id: row.get(1),
                        source: row.get(2),
                        warehouse_frn: row.get(3),
                        body: row.get(4),
                    })
                    .collect())
            }
        }
    }

    /// The last cursor this executor acked.
    pub(crate) async fn cursor(&self, executor: &str) -> Result<Option<String>, Problem> {
        match self {
            Self::Memory(memory) => Ok(memory.lock().unwrap().cursor.clone()),
            Self::Postgres(pool) => {
                sqlx::query_scalar("SELECT cursor FROM executor_cursor WHERE executor_id = $1")
                    .bind(executor)
                    .fetch_optional(pool)
                    .await
                    .map_err(|error| Problem::database(&error, "reading the cursor"))
            }
        }
    }

    /// Remembers `cursor` as the last one acked.
    pub(crate) async fn save_cursor(&self, executor: &str, cursor: &str) -> Result<(), Problem> {
        match self {
            Self::Memory(memory) => {
                memory.lock().unwrap().cursor = Some(cursor.to_owned());
                Ok(())
            }
            Self::Postgres(pool) => sqlx::query(
                "INSERT INTO executor_cursor (executor_id, cursor) VALUES ($1, $2) \
                 ON CONFLICT (executor_id) DO UPDATE SET cursor = excluded.cursor",
            )
            .bind(executor)
            .bind(cursor)
            .execute(pool)
            .await
            .map(|_| ())
            .map_err(|error| Problem::database(&error, "saving the cursor")),
        }
    }
}
