//! DB mode (`--database-url`): the commands, their outbox and the idempotency records in
//! PostgreSQL, shared by every replica started on the same database.
//!
//! A `POST` writes in the request's [`Transaction`], which the idempotency layer (over a
//! [`PostgresStore`] on the same pool) commits together with the response's record once
//! the handler has answered: a create's command row, its `command.created` outbox row
//! and the record commit together or not at all. The same transaction holds the key
//! (the store's transactional mode), so a process that dies before the commit leaves
//! nothing at all, and a retry runs at once; one that dies after it leaves the record,
//! and a retry replays the answer.
//!
//! The publisher ([`publish`]) relays the outbox: every replica runs one; each takes
//! pending rows with `FOR UPDATE SKIP LOCKED`, so replicas share the rows and never
//! take the same one, publishes them, and marks them sent in the same transaction. A
//! publisher that dies before its commit leaves its rows pending, and they are published
//! again (at least once, as from any outbox), each delivery under its own extension of
//! the request's correlation ID. With `--amqp-url` each event also goes to RabbitMQ
//! before its row is marked; a row the broker did not confirm stays pending and is
//! published again in the next round.

use std::{error::Error, num::NonZeroUsize, sync::Arc, time::Duration};

use axum::Extension;
use serde_json::value::RawValue;
use sqlx::{
    postgres::{PgPoolOptions, PgRow},
    Connection, PgConnection, PgPool, Postgres, Row,
};
use time::OffsetDateTime;
use tokio::sync::oneshot::{self, error::TryRecvError};
use tower_ids::{
    correlation::CorrelationId,
    idempotency::{
        store::{
            PostgresMode, PostgresStore, Transaction, TransactionGuard,
            DEFAULT_POSTGRES_COMMAND_TIMEOUT,
        },
        IdempotencyKey,
    },
};
use uuid::Uuid;

use crate::{
    api::ApiError,
    broker::{Broker, Event},
    publisher::Origin,
    routes::{Command, NewCommand, Status, Storage},
};

// Here rather than in `main.rs`: only DB mode connects to a database.
#[path = "../support/database.rs"]
mod database;

/// The demo's tables, created at start by every replica (`IF NOT EXISTS`).
///
/// - `commands`: one row per command. `payload` is `json`, which keeps the text as it was
///   sent (`jsonb` would re-serialise it).
/// - `outbox`: one row per event to publish, written in the transaction that wrote the
///   command, with the correlation ID and the idempotency key of the request that
///   caused it. A row is pending until the publisher sets `sent_at`, or `skipped_at` for
///   a command cancelled first. (`idempotency_key` is added to a table made before it.)
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS commands (
    id         uuid        PRIMARY KEY,
    device_id  text        NOT NULL,
    name       text        NOT NULL,
    payload    json        NOT NULL,
    status     text        NOT NULL CHECK (status IN ('queued', 'sent', 'cancelled')),
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS outbox (
    id             bigserial   PRIMARY KEY,
    command_id     uuid        NOT NULL REFERENCES commands (id),
    event          text        NOT NULL,
    correlation_id text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    sent_at        timestamptz,
    skipped_at     timestamptz
);
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS idempotency_key text;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS traceparent text;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS tracestate text;
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (id)
    WHERE sent_at IS NULL AND skipped_at IS NULL;
";

/// The advisory lock a starting replica holds while it creates the tables: two
/// `CREATE TABLE IF NOT EXISTS` of one table running at once can both try to create it,
/// and one fails. (The bytes of `cmds_ddl`.)
const SCHEMA_LOCK: i64 = 0x636d_6473_5f64_646c;

/// Connections in the pool. A `POST` with a key holds one from its first write until the
/// layer commits (`--commit-delay-ms` and a round trip or two), the layer's claims and
/// replays take one for a statement, and the publisher one per batch: 32 serve far more
/// concurrent writes than the demo sees, and two replicas stay well within PostgreSQL's
/// default `max_connections` of 100. A request that finds none free within
/// `DEFAULT_POSTGRES_COMMAND_TIMEOUT` (1 s) is answered `503`.
const DATABASE_MAX_CONNECTIONS: u32 = 32;

/// How long the publisher waits before looking at the outbox again after a look that
/// found less than a batch: a command is published within `--publish-delay-ms` plus
/// this, and an idle replica asks the database ten times a second (an index scan of
/// the pending rows, none).
const OUTBOX_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Outbox rows the publisher takes, publishes and marks in one transaction: enough to
/// drain a burst quickly, few enough that a transaction holds its row locks for
/// milliseconds.
const OUTBOX_BATCH: i64 = 100;

/// The columns of a [`Command`], as [`command`] reads them: the UUID and the payload as
/// text (the pool has no `uuid` or `json` decoding), the creation time in microseconds
/// since the epoch.
macro_rules! command_columns {
    () => {
        "id::text AS id, device_id, name, payload::text AS payload, status, \
         (extract(epoch FROM created_at) * 1000000)::int8 AS created_at_us"
    };
}

/// DB mode's storage: the pool the handlers and the publisher share with the
/// idempotency layer's [`PostgresStore`].
#[derive(Clone)]
pub(crate) struct Database {
    pool: PgPool,
    /// How many of the newest commands `GET /commands` answers (`--max-commands`).
    list_limit: i64,
}

impl Database {
    /// Connects to `url`, creates the tables (the demo's and the store's) if they are
    /// missing, and returns the storage and the idempotency store on one pool.
    pub(crate) async fn connect(
        url: &str,
        list_limit: NonZeroUsize,
        store_timeout: Option<Duration>,
    ) -> Result<(Self, PostgresStore), Box<dyn Error + Send + Sync>> {
        let pool = database::connect(
            PgPoolOptions::new()
                .max_connections(DATABASE_MAX_CONNECTIONS)
                .acquire_timeout(DEFAULT_POSTGRES_COMMAND_TIMEOUT),
            url,
        )
        .await?;
        // The request's own transaction holds its key: a crashed request frees it at
        // once, and its writes commit with its record.
        let mut store = PostgresStore::builder(pool.clone()).mode(PostgresMode::Transactional);
        if let Some(timeout) = store_timeout {
            store = store.command_timeout(timeout);
        }
        let store = store.build()?;

        // On a connection of its own, so that closing it releases the lock whatever
        // happened in between.
        let mut ddl = PgConnection::connect(url).await?;
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(SCHEMA_LOCK)
            .execute(&mut ddl)
            .await?;
        sqlx::raw_sql(SCHEMA).execute(&mut ddl).await?;
        store.migrate().await?;
        ddl.close().await?;
        tracing::info!(
            event = "commands.schema_ready",
            "tables commands, outbox and tower_ids_idempotency ready"
        );

        let list_limit = i64::try_from(list_limit.get()).unwrap_or(i64::MAX);
        Ok((Self { pool, list_limit }, store))
    }

    /// The pool, for the publisher.
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }
}

impl Storage for Database {
    /// The request's transaction, offered by the idempotency layer to a request it runs
    /// (one with a key); a cancel sent without a key has none.
    type Transaction = Option<Extension<Transaction>>;

    async fn create(
        &self,
        transaction: Self::Transaction,
        new: NewCommand,
        origin: Origin,
    ) -> Result<Command, ApiError> {
        // `POST /commands` requires a key, so the layer always offers one.
        let Some(Extension(transaction)) = transaction else {
            tracing::error!(
                event = "commands.transaction_missing",
                "no request transaction on POST /commands: is the idempotency layer over a PostgresStore?"
            );
            return Err(ApiError::Internal);
        };
        if new.device_id.contains('\0') || new.name.contains('\0') {
            return Err(ApiError::NulInText);
        }
        let mut writes = Writes::request(&transaction).await?;
        let inserted = sqlx::query(concat!(
            "INSERT INTO commands (id, device_id, name, payload, status) \
             VALUES ($1::uuid, $2, $3, $4::json, 'queued') RETURNING ",
            command_columns!()
        ))
        .bind(Uuid::now_v7().to_string())
        .bind(&new.device_id)
        .bind(&new.name)
        .bind(new.payload.get())
        .fetch_one(writes.connection())
        .await
        .map_err(|error| ApiError::database(&error, "inserting a command"))?;
        let command = command(&inserted)?;
        sqlx::query(
            "INSERT INTO outbox \
               (command_id, event, correlation_id, idempotency_key, traceparent, tracestate) \
             VALUES ($1::uuid, 'command.created', $2, $3, $4, $5)",
        )
        .bind(command.id.to_string())
        .bind(origin.correlation_id.as_str())
        .bind(origin.idempotency_key.as_ref().map(IdempotencyKey::as_str))
        .bind(origin.traceparent.as_deref())
        .bind(origin.tracestate.as_deref())
        .execute(writes.connection())
        .await
        .map_err(|error| ApiError::database(&error, "inserting an outbox row"))?;
        writes.finish().await?;
        Ok(command)
    }

    /// The newest `--max-commands` commands, oldest first (IDs are UUIDv7, so their
    /// order is the order of creation, to the millisecond across replicas).
    async fn list(&self) -> Result<Vec<Command>, ApiError> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            command_columns!(),
            " FROM (SELECT * FROM commands ORDER BY id DESC LIMIT $1) AS newest ORDER BY id"
        ))
        .bind(self.list_limit)
        .fetch_all(&self.pool)
        .await
        .map_err(|error| ApiError::database(&error, "listing commands"))?;
        rows.iter().map(command).collect()
    }

    async fn get(&self, id: Uuid) -> Result<Command, ApiError> {
        let row = sqlx::query(concat!(
            "SELECT ",
            command_columns!(),
            " FROM commands WHERE id = $1::uuid"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await
        .map_err(|error| ApiError::database(&error, "reading a command"))?;
        command(&row.ok_or_else(|| ApiError::not_found(id))?)
    }

    async fn cancel(&self, transaction: Self::Transaction, id: Uuid) -> Result<Command, ApiError> {
        let transaction = transaction.map(|Extension(transaction)| transaction);
        let mut writes = match &transaction {
            Some(transaction) => Writes::request(transaction).await?,
            None => Writes::own(&self.pool).await?,
        };
        // Locked until the commit: a publisher taking it now waits, then sees it
        // cancelled; one that took it first makes this wait, then answer 409.
        let row = sqlx::query(concat!(
            "SELECT ",
            command_columns!(),
            " FROM commands WHERE id = $1::uuid FOR UPDATE"
        ))
        .bind(id.to_string())
        .fetch_optional(writes.connection())
        .await
        .map_err(|error| ApiError::database(&error, "reading a command"))?;
        let mut command = command(&row.ok_or_else(|| ApiError::not_found(id))?)?;
        match command.status {
            Status::Queued => {
                sqlx::query("UPDATE commands SET status = 'cancelled' WHERE id = $1::uuid")
                    .bind(id.to_string())
                    .execute(writes.connection())
                    .await
                    .map_err(|error| ApiError::database(&error, "cancelling a command"))?;
                command.status = Status::Cancelled;
                tracing::info!(event = "commands.cancelled", command_id = %id, "command cancelled");
            }
            // Cancelling twice is not an error: the command is cancelled either way.
            Status::Cancelled => {}
            Status::Sent => return Err(ApiError::AlreadySent),
        }
        writes.finish().await?;
        Ok(command)
    }
}

/// Where a `POST` handler writes.
enum Writes<'a> {
    /// The request's transaction: the idempotency layer commits it with the record.
    Request(TransactionGuard<'a>),
    /// A transaction of the handler's own, for a cancel sent without a key (no record
    /// to commit with): committed by [`finish`](Self::finish).
    Own(sqlx::Transaction<'static, Postgres>),
}

impl<'a> Writes<'a> {
    async fn request(transaction: &'a Transaction) -> Result<Self, ApiError> {
        match transaction.lock().await {
            Ok(guard) => Ok(Self::Request(guard)),
            Err(error) => {
                tracing::error!(event = "commands.transaction_over", error = %error, "the request's transaction is over");
                Err(ApiError::Internal)
            }
        }
    }

    async fn own(pool: &PgPool) -> Result<Self, ApiError> {
        let transaction = pool
            .begin()
            .await
            .map_err(|error| ApiError::database(&error, "beginning a transaction"))?;
        Ok(Self::Own(transaction))
    }

    fn connection(&mut self) -> &mut PgConnection {
        match self {
            Self::Request(guard) => guard,
            Self::Own(transaction) => transaction,
        }
    }

    /// Commits a transaction of the handler's own; the request's is the layer's to
    /// commit.
    async fn finish(self) -> Result<(), ApiError> {
        match self {
            Self::Request(_) => Ok(()),
            Self::Own(transaction) => transaction
                .commit()
                .await
                .map_err(|error| ApiError::database(&error, "committing")),
        }
    }
}

/// A command from a row of [`command_columns`].
fn command(row: &PgRow) -> Result<Command, ApiError> {
    let decoded = (|| -> Result<Command, Box<dyn Error + Send + Sync>> {
        let status = match row.try_get::<&str, _>("status")? {
            "queued" => Status::Queued,
            "sent" => Status::Sent,
            "cancelled" => Status::Cancelled,
            other => return Err(format!("unknown status {other:?}").into()),
        };
        let created_at_us: i64 = row.try_get("created_at_us")?;
        Ok(Command {
            id: Uuid::try_parse(row.try_get("id")?)?,
            device_id: row.try_get("device_id")?,
            name: row.try_get("name")?,
            payload: RawValue::from_string(row.try_get("payload")?)?,
            status,
            created_at: OffsetDateTime::from_unix_timestamp_nanos(
                i128::from(created_at_us) * 1000,
            )?,
        })
    })();
    decoded.map_err(|error| ApiError::database(&*error, "reading a command row"))
}

/// The outbox relay, DB mode's publisher: until `stop`, takes up to [`OUTBOX_BATCH`]
/// pending rows at least `delay` old, publishes each (by log and, with `--amqp-url`, to
/// the `broker`), marks them, and commits; looks again at once after a batch that
/// settled every row it took, else after [`OUTBOX_POLL_INTERVAL`].
///
/// Each delivery runs under its own extension of the correlation ID stored on the row
/// (see [`CorrelationId::extend_redelivery`]), as in memory: a row published again
/// after a crash gets another one, and both lead back to the request. Rows whose
/// command is locked (a cancel in flight) are skipped until it commits.
pub(crate) async fn publish(
    pool: PgPool,
    delay: Duration,
    broker: Option<Arc<Broker>>,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let full = match publish_batch(&pool, delay, broker.as_deref()).await {
            Ok(settled) => settled as i64 == OUTBOX_BATCH,
            Err(error) => {
                tracing::warn!(
                    event = "commands.publish_failed",
                    error = %error,
                    "could not publish from the outbox; its rows stay pending, trying again"
                );
                false
            }
        };
        if full && matches!(stop.try_recv(), Err(TryRecvError::Empty)) {
            continue;
        }
        tokio::select! {
            biased;
            _ = &mut stop => return,
            () = tokio::time::sleep(OUTBOX_POLL_INTERVAL) => {}
        }
    }
}

/// One transaction of the relay; returns how many rows it settled (marked sent or
/// skipped). A row the broker failed stays pending and does not count, so a broker that
/// is down does not make the relay spin on a full batch.
async fn publish_batch(
    pool: &PgPool,
    delay: Duration,
    broker: Option<&Broker>,
) -> Result<usize, sqlx::Error> {
    let mut transaction = pool.begin().await?;
    let pending = sqlx::query(
        "SELECT o.id, o.command_id::text AS command_id, o.event, o.correlation_id, \
                o.idempotency_key, o.traceparent, o.tracestate, c.status, c.device_id, c.name, c.payload::text AS payload \
         FROM outbox o JOIN commands c ON c.id = o.command_id \
         WHERE o.sent_at IS NULL AND o.skipped_at IS NULL \
           AND o.created_at <= now() - make_interval(secs => $1) \
         ORDER BY o.id LIMIT $2 \
         FOR UPDATE OF o, c SKIP LOCKED",
    )
    .bind(delay.as_secs_f64())
    .bind(OUTBOX_BATCH)
    .fetch_all(&mut *transaction)
    .await?;
    let mut settled = 0;
    for row in &pending {
        let correlation_id = match CorrelationId::parse(row.try_get("correlation_id")?) {
            Ok(id) => id,
            Err(invalid) => {
                // Stored by the correlation layer, which validated it: not expected.
                tracing::warn!(
                    event = "commands.correlation_id_invalid",
                    reason = invalid.code(),
                    "outbox row with an invalid correlation ID; delivering under a new one"
                );
                CorrelationId::new()
            }
        };
        let origin = Origin {
            correlation_id,
            // Validated by the idempotency layer before it was stored; rows written
            // before the column existed have none.
            idempotency_key: row
                .try_get::<Option<&str>, _>("idempotency_key")?
                .and_then(|key| IdempotencyKey::new(key).ok()),
            traceparent: row.try_get("traceparent")?,
            tracestate: row.try_get("tracestate")?,
        };
        let delivery = Delivery {
            outbox_id: row.try_get("id")?,
            command_id: row.try_get("command_id")?,
            event: row.try_get("event")?,
            idempotency_key: origin.idempotency_key.clone(),
            status: row.try_get("status")?,
            device_id: row.try_get("device_id")?,
            name: row.try_get("name")?,
            payload: row.try_get("payload")?,
        };
        let done = origin
            .publishing(delivery.deliver(&mut transaction, broker))
            .await?;
        settled += usize::from(done);
    }
    transaction.commit().await?;
    Ok(settled)
}

/// One pending outbox row, with its command.
struct Delivery<'r> {
    outbox_id: i64,
    command_id: &'r str,
    event: &'r str,
    idempotency_key: Option<IdempotencyKey>,
    status: &'r str,
    device_id: &'r str,
    name: &'r str,
    payload: &'r str,
}

impl Delivery<'_> {
    /// Publishes the row, or skips it if its command is no longer queued, and marks it;
    /// `false` when the broker failed it and it stays pending.
    async fn deliver(
        &self,
        connection: &mut PgConnection,
        broker: Option<&Broker>,
    ) -> Result<bool, sqlx::Error> {
        let command_id = self.command_id;
        if self.status != "queued" {
            let reason = if self.status == "cancelled" {
                "cancelled"
            } else {
                "already_sent"
            };
            tracing::info!(
                event = "commands.publish_skipped",
                command_id,
                reason,
                "command not queued any more: not publishing"
            );
            sqlx::query("UPDATE outbox SET skipped_at = now() WHERE id = $1")
                .bind(self.outbox_id)
                .execute(&mut *connection)
                .await?;
            return Ok(true);
        }
        // Sent to the broker before the row is marked: a crash before the commit sends
        // it again (at least once).
        if let Some(broker) = broker {
            if let Err(error) = self.publish_to(broker).await {
                tracing::warn!(
                    event = "commands.amqp_publish_failed",
                    command_id,
                    error = %error,
                    "could not publish the event to the AMQP broker; the row stays pending"
                );
                return Ok(false);
            }
        }
        tracing::info!(
            event = "commands.published",
            command_id,
            device_id = self.device_id,
            amqp = broker.is_some(),
            "command published"
        );
        sqlx::query("UPDATE outbox SET sent_at = now() WHERE id = $1")
            .bind(self.outbox_id)
            .execute(&mut *connection)
            .await?;
        sqlx::query("UPDATE commands SET status = 'sent' WHERE id = $1::uuid")
            .bind(self.command_id)
            .execute(&mut *connection)
            .await?;
        Ok(true)
    }

    async fn publish_to(&self, broker: &Broker) -> Result<(), Box<dyn Error + Send + Sync>> {
        let payload: &RawValue = serde_json::from_str(self.payload)?;
        let event = Event {
            event: self.event,
            command_id: self.command_id,
            device_id: self.device_id,
            name: self.name,
            payload,
        };
        broker.publish(&event, self.idempotency_key.as_ref()).await
    }
}
