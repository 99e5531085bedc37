//! The transactional outbox: messages enqueued in the request's own PostgreSQL
//! transaction, and a [`Relay`] that publishes them once that transaction has committed.
//!
//! A handler that writes to the database and must tell a broker about it cannot do both
//! atomically: publish first and a rollback leaves a message about nothing; commit first
//! and a crash loses the message. [`Outbox::enqueue`] writes the message as a row in the
//! request's [`Transaction`](tower_ids_postgres::Transaction) (the one the idempotency layer over a
//! [`PostgresStore`](tower_ids_postgres::PostgresStore) in
//! [transactional mode](tower_ids_postgres::PostgresMode::Transactional) offers),
//! so it commits with the handler's writes and the stored answer, or not at all. A
//! [`Relay`], run by every replica, publishes committed rows to a [`Sink`]
//! ([`AmqpSink`](amqp::AmqpSink) for RabbitMQ, [`KafkaSink`](kafka::KafkaSink) for Kafka,
//! or your own) and marks them published.
//!
//! Each message carries, as headers, its own idempotency key (`idempotency-key`), the
//! enqueuing request's correlation ID (`x-correlation-id`, extended per publication) and,
//! with the `opentelemetry` feature, its W3C trace context (`traceparent`,
//! `tracestate`). The [guide page](https://docs.rs/tower-ids/latest/tower_ids/guide/outbox/index.html) says what is guaranteed, what is
//! not, and how to run several relays.
//!
//! ```no_run
//! use axum::{routing::post, Json, Router};
//! use tower_ids::{
//!     idempotency::{store::{PostgresMode, PostgresStore, Transaction}, IdempotencyLayer},
//!     outbox::{Message, Outbox},
//! };
//!
//! async fn create_order(
//!     tx: Transaction,
//!     axum::Extension(outbox): axum::Extension<Outbox>,
//!     Json(order): Json<serde_json::Value>,
//! ) -> Result<&'static str, String> {
//!     let id = order["id"].as_str().unwrap_or_default().to_owned();
//!     let mut connection = tx.lock().await.map_err(|e| e.to_string())?;
//!     sqlx::query("INSERT INTO orders (id) VALUES ($1)")
//!         .bind(&id)
//!         .execute(&mut *connection)
//!         .await
//!         .map_err(|e| e.to_string())?;
//!     let message = Message::new("order.created", order.to_string()).partition_key(id);
//!     outbox.enqueue(&mut connection, message).await.map_err(|e| e.to_string())?;
//!     Ok("created")
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
//! let store = PostgresStore::builder(pool.clone())
//!     .mode(PostgresMode::Transactional)
//!     .build()?;
//! store.migrate().await?;
//! let outbox = Outbox::new(pool);
//! outbox.migrate().await?;
//! let app: Router = Router::new()
//!     .route("/orders", post(create_order))
//!     .layer(IdempotencyLayer::with_store(store))
//!     .layer(axum::Extension(outbox.clone()));
//! # let _ = app;
//! # Ok(())
//! # }
//! ```

mod enqueue;
mod inspect;
mod publish;
mod relay;
mod sink;
mod sql;
mod take;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "kafka")]
pub mod kafka;

use std::{fmt, sync::Arc};

use sqlx::PgPool;

use self::sql::Statements;
use tower_ids_postgres::migration::{migrate_from_template, valid_table};

pub use enqueue::{Message, MessageId};
pub use inspect::DeadLetter;
pub use relay::{
    Relay, RelayBuilder, Round, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_OUTAGE_BACKOFF,
    DEFAULT_MAX_RETRY_BACKOFF, DEFAULT_OBSERVE_INTERVAL, DEFAULT_PUBLISH_TIMEOUT,
    DEFAULT_RELAY_BATCH_SIZE, DEFAULT_RELAY_POLL_INTERVAL, DEFAULT_RETENTION,
    DEFAULT_RETRY_BACKOFF, DEFAULT_TRIM_INTERVAL,
};
pub use sink::{Confirm, Outgoing, Sink, SinkError};

/// The table [`Outbox::new`] uses.
pub const DEFAULT_OUTBOX_TABLE: &str = "tower_ids_outbox";

const MIGRATION: &str = include_str!("../migrations/20261126000000_tower_ids_outbox.sql");

/// The metric names of the relay (feature `metrics`), on the `metrics` facade.
pub mod metrics {
    /// Gauge: messages committed and not yet published nor dead-lettered.
    pub const BACKLOG: &str = "tower_ids_outbox_backlog";
    /// Gauge: how long the oldest pending message has waited, in seconds (0 when none).
    pub const OLDEST_PENDING_AGE: &str = "tower_ids_outbox_oldest_pending_age_seconds";
    /// Counter: publications the broker took, by `destination` (a message published
    /// again after a relay died before marking it counts again).
    pub const PUBLISHED: &str = "tower_ids_outbox_published_total";
    /// Counter: failed publications, by `destination` and `reason` (`unavailable`: the
    /// broker could not be reached, the message is tried again without counting an
    /// attempt; `full`: the destination had no room, the same; `rejected`: the broker
    /// refused this message, an attempt is counted).
    pub const FAILURES: &str = "tower_ids_outbox_failures_total";
    /// Counter: messages dead-lettered after their last attempt, by `destination`.
    pub const DEAD_LETTERED: &str = "tower_ids_outbox_dead_lettered_total";

    /// Describes the relay's metrics to the installed recorder (help text and unit).
    #[cfg(feature = "metrics")]
    pub fn describe() {
        ::metrics::describe_gauge!(BACKLOG, "Outbox messages committed and not yet published");
        ::metrics::describe_gauge!(
            OLDEST_PENDING_AGE,
            ::metrics::Unit::Seconds,
            "Age of the oldest outbox message not yet published"
        );
        ::metrics::describe_counter!(PUBLISHED, "Outbox messages published, by destination");
        ::metrics::describe_counter!(
            FAILURES,
            "Failed outbox publications, by destination and reason"
        );
        ::metrics::describe_counter!(
            DEAD_LETTERED,
            "Outbox messages dead-lettered after their last attempt, by destination"
        );
    }
}

/// An outbox table on a pool: where handlers [`enqueue`](Self::enqueue) messages and
/// from which [`Relay`]s publish them.
///
/// # Clone
///
/// Clones share the pool and the table name: clone it into every handler and relay.
#[derive(Clone)]
pub struct Outbox {
    shared: Arc<Shared>,
}

struct Shared {
    pool: PgPool,
    table: String,
    sql: Statements,
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.shared.table)
            .finish_non_exhaustive()
    }
}

/// Why an outbox call failed.
#[derive(Debug)]
pub struct OutboxError {
    what: &'static str,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl OutboxError {
    fn new(what: &'static str) -> Self {
        Self { what, source: None }
    }

    fn database(what: &'static str, error: sqlx::Error) -> Self {
        Self {
            what,
            source: Some(Box::new(error)),
        }
    }
}

// Its cause is its `source()`, not part of its text, so that an error reporter that
// walks the chain prints it once.
impl fmt::Display for OutboxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.what)
    }
}

impl std::error::Error for OutboxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as _)
    }
}

impl Outbox {
    /// The outbox in [`DEFAULT_OUTBOX_TABLE`] on `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self::on(pool, DEFAULT_OUTBOX_TABLE.to_owned())
    }

    fn on(pool: PgPool, table: String) -> Self {
        Self {
            shared: Arc::new(Shared {
                pool,
                sql: Statements::for_table(&table),
                table,
            }),
        }
    }

    /// The same outbox in another table (`name` or `schema.name`, plain identifiers:
    /// letters, digits, `_`, not starting with a digit; it is written into SQL).
    pub fn table(self, table: impl Into<String>) -> Result<Self, OutboxError> {
        let table = table.into();
        if !valid_table(&table) {
            return Err(OutboxError::new(
                "the outbox table must be `name` or `schema.name` of plain identifiers",
            ));
        }
        Ok(Self::on(self.shared.pool.clone(), table))
    }

    /// The pool the outbox uses.
    pub fn pool(&self) -> &PgPool {
        &self.shared.pool
    }

    /// Creates the table and its indexes if they do not exist; replicas that start
    /// together may all call it (they take turns, under an advisory lock).
    pub async fn migrate(&self) -> Result<(), OutboxError> {
        migrate_from_template(
            &self.shared.pool,
            MIGRATION,
            DEFAULT_OUTBOX_TABLE,
            &self.shared.table,
        )
        .await
        .map_err(|e| OutboxError::database("could not create the outbox table", e))
    }

    /// A relay that publishes this outbox's messages to `sink`; configure it, then
    /// [`run`](Relay::run) it.
    pub fn relay<S: Sink>(&self, sink: S) -> RelayBuilder<S> {
        RelayBuilder::new(self.clone(), sink)
    }
}

/// The 32-bit lock key of a partition key: the first four bytes of its SHA-256. Two
/// keys that share it only take turns.
fn partition_lock(partition_key: &str) -> i32 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(partition_key.as_bytes());
    i32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]])
}

/// The advisory lock class (the first of the two-key form) an enqueue takes on its
/// partition key: enqueues of one key commit one after the other, so their IDs are in
/// commit order. ("txob")
const ENQUEUE_LOCK_CLASS: i32 = 0x7478_6f62;
/// The class a relay takes on the partition keys it publishes: one relay at a time per
/// key. ("txor")
const RELAY_LOCK_CLASS: i32 = 0x7478_6f72;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_table_name_that_is_not_plain_identifiers_is_refused() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://localhost/none")
            .unwrap();
        let refused = Outbox::new(pool.clone()).table("outbox; DROP TABLE x");
        assert!(refused.is_err_and(|e| e.to_string().contains("plain identifiers")));
        assert!(Outbox::new(pool).table("app.events").is_ok());
    }

    #[test]
    fn the_migration_renames_its_table_and_every_index_of_it() {
        let outbox =
            tower_ids_postgres::migration::for_table(MIGRATION, "tower_ids_outbox", "app.events");
        assert!(outbox.contains("CREATE TABLE IF NOT EXISTS app.events ("));
        assert!(outbox.contains("INDEX IF NOT EXISTS events_pending\n    ON app.events"));
        assert!(!outbox.contains("tower_ids_outbox"));
    }
}
