//! DB mode (`--database-url`): the commands, their outbox and the idempotency records in
//! PostgreSQL, shared by every replica started on the same database.
//!
//! A `POST` writes in the request's [`Transaction`], which the idempotency layer (over a
//! [`PostgresStore`] on the same pool) commits together with the response's record once
//! the handler has answered: a create's command row, its `command.created` message in
//! the library's outbox ([`Outbox::enqueue`], table `tower_ids_outbox`) and the
//! record commit together or not at all. The same transaction holds the key (the
//! store's transactional mode), so a process that dies before the commit leaves nothing
//! at all, and a retry runs at once; one that dies after it leaves the record, and a
//! retry replays the answer.
//!
//! The publisher is the library's relay ([`crate::relay`]): every replica runs one, and
//! they share the outbox's messages.

use std::{error::Error, num::NonZeroUsize, time::Duration};

use axum::Extension;
use serde_json::value::RawValue;
use sqlx::{
    postgres::{PgPoolOptions, PgRow},
    Connection, PgConnection, PgPool, Postgres, Row,
};
use time::OffsetDateTime;
use tower_ids::{
    idempotency::store::{PostgresMode, PostgresStore, Transaction, TransactionGuard},
    outbox::{Message, Outbox},
};
use uuid::Uuid;

use crate::{
    api::ApiError,
    broker::Event,
    publisher::Origin,
    routes::{Command, NewCommand, Status, Storage},
};

// Here rather than in `main.rs`: only DB mode connects to a database.
#[path = "../support/database.rs"]
mod database;

/// The demo's own table, created at start by every replica (`IF NOT EXISTS`), beside the
/// library's `tower_ids_outbox` ([`Outbox::migrate`]) and `tower_ids_idempotency`
/// ([`PostgresStore::migrate`]).
///
/// - `commands`: one row per command. `payload` is `json`, which keeps the text as it was
///   sent (`jsonb` would re-serialise it). `created_at` is the request transaction's
///   start, as the outbox message's `enqueued_at`: the publisher waits until
///   `--publish-delay-ms` after it.
///
/// (A database used by an earlier version of the demo also has a table `outbox`, its
/// hand-written outbox, which nothing reads any more.)
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS commands (
    id         uuid        PRIMARY KEY,
    device_id  text        NOT NULL,
    name       text        NOT NULL,
    payload    json        NOT NULL,
    status     text        NOT NULL CHECK (status IN ('queued', 'sent', 'cancelled')),
    created_at timestamptz NOT NULL DEFAULT now()
);
";

/// The advisory lock a starting replica holds while it creates the tables: two
/// `CREATE TABLE IF NOT EXISTS` of one table running at once can both try to create it,
/// and one fails. (The bytes of `cmds_ddl`.)
const SCHEMA_LOCK: i64 = 0x636d_6473_5f64_646c;

/// Connections in the pool. A `POST` with a key holds one from its first write until the
/// layer commits (`--commit-delay-ms` and a round trip or two), the layer's claims and
/// replays take one for a statement, and the publisher one per round and at most
/// [`PUBLISH_CONNECTIONS`](crate::relay::PUBLISH_CONNECTIONS) more: 32 serve far more
/// concurrent writes than the demo sees, and two replicas stay well within PostgreSQL's
/// default `max_connections` of 100. A request that finds none free within
/// [`DATABASE_ACQUIRE_TIMEOUT`] is answered `503`.
const DATABASE_MAX_CONNECTIONS: u32 = 32;

/// How long a request waits for a free connection: the store's own command timeout
/// ([`command_timeout`](tower_ids::idempotency::store::PostgresStoreBuilder::command_timeout)'s
/// default, 1 s), so a pool that is full fails as a slow database does.
const DATABASE_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(1);

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
/// idempotency layer's [`PostgresStore`], and the outbox on it.
#[derive(Clone)]
pub(crate) struct Database {
    pool: PgPool,
    outbox: Outbox,
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
                .acquire_timeout(DATABASE_ACQUIRE_TIMEOUT),
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
        let outbox = Outbox::new(pool.clone());
        outbox.migrate().await?;
        ddl.close().await?;
        tracing::info!(
            event = "commands.schema_ready",
            "tables commands, tower_ids_outbox and tower_ids_idempotency ready"
        );

        let list_limit = i64::try_from(list_limit.get()).unwrap_or(i64::MAX);
        Ok((
            Self {
                pool,
                outbox,
                list_limit,
            },
            store,
        ))
    }

    /// The pool, for the publisher.
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The outbox, for the publisher's relay.
    pub(crate) fn outbox(&self) -> &Outbox {
        &self.outbox
    }
}

impl Storage for Database {
    /// The request's transaction, offered by the idempotency layer to a request it runs
    /// (one with a key); a cancel sent without a key has none.
    type Transaction = Option<Extension<Transaction>>;

    /// Inserts the command and enqueues its `command.created` event, both on the
    /// request's transaction. The outbox records the request's correlation ID and trace
    /// context itself (the current ones), so `_origin` is not needed here.
    async fn create(
        &self,
        transaction: Self::Transaction,
        new: NewCommand,
        _origin: Origin,
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
        // The event as the broker gets it, partitioned by device: one device's commands
        // are published in the order they committed. On the guard already held (the
        // same transaction `Outbox::enqueue` would lock again).
        let id = command.id.to_string();
        let event = serde_json::to_vec(&Event {
            event: "command.created",
            command_id: &id,
            device_id: &command.device_id,
            name: &command.name,
            payload: &command.payload,
        })
        .expect("an event serialises");
        let message = Message::new("command.created", event).partition_key(&command.device_id);
        self.outbox
            .enqueue(writes.connection(), message)
            .await
            .map_err(|error| ApiError::database(&error, "enqueueing the event"))?;
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
