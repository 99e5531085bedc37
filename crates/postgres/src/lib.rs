//! The PostgreSQL store, [`PostgresStore`]: its public type, its builder and
//! connection, the table's migration, the cleaner of expired rows, and the bound on
//! every database call. Its commands are in `commands`, their SQL in `statements`.

use std::{
    sync::{Arc, Weak},
    time::{Duration, Instant},
};
use tower_ids_core::event;

use sqlx::{postgres::PgPoolOptions, PgPool};

use self::{
    migration::{migrate_from_template, valid_table},
    statements::Statements,
};
use tower_ids_core::store::{
    deadline::{read_in_background, StoreClock},
    StoreError,
};

mod commands;
mod commit;
#[cfg(feature = "axum")]
mod extract;
pub mod migration;
mod statements;
mod transaction;
mod transient;

#[cfg(feature = "axum")]
pub use self::extract::TransactionRejection;
pub use self::transaction::{Transaction, TransactionError, TransactionGuard};
pub use self::transient::is_transient;
#[doc(hidden)]
pub use self::transient::passing_fault;

// The defaults, which the builder's docs give with their reasons.
#[doc(hidden)]
pub const DEFAULT_POSTGRES_TABLE: &str = "tower_ids_idempotency";

#[doc(hidden)]
pub const DEFAULT_POSTGRES_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);

#[doc(hidden)]
pub const DEFAULT_POSTGRES_CLEANUP_INTERVAL: Duration = Duration::from_secs(60);

#[doc(hidden)]
pub const DEFAULT_POSTGRES_CLEANUP_BATCH: i64 = 1000;

/// The schema, as shipped in `migrations/` for users who run their own migrations.
const MIGRATION: &str = include_str!("../migrations/20261122000000_tower_ids_idempotency.sql");

/// A store in PostgreSQL: records that survive restarts of the service and of the
/// database, shared by every replica.
///
/// One row per scope, in one table (`tower_ids_idempotency` unless
/// [`table`](PostgresStoreBuilder::table) names another, created by
/// [`migrate`](Self::migrate) or by the migration in the crate's `migrations/`). Every
/// state change is one statement, atomic on the server: claiming (an upsert that takes
/// the row only if it is free or its lease ran out, with a random 128-bit fencing
/// token), renewing, completing and releasing (each only for the token that claimed).
/// Expiry uses the database's clock, so replicas never disagree about it. A first
/// execution is two round trips (claim, complete), a replay one. Records are the same
/// compact binary as the Redis store's, with the status in a column of its own for
/// operators.
///
/// It marks a request in flight one of two ways, its [`PostgresMode`]:
///
/// - **durable** (the default): a claim row, committed at once, with a lease renewed
///   while the handler runs. It outlives the request's connection, so it suits handlers
///   whose effects leave the database (a payment provider, an email). A process that
///   dies leaves its key claimed until the lease runs out (one and a half leases, 15 s
///   by default). Waiting for a request in flight polls with backoff (10 ms doubling to
///   200 ms).
/// - **transactional** ([`with_mode`](Self::with_mode)): the request's own
///   [`Transaction`] holds the key, with an advisory lock, and the handler writes in it;
///   its writes and its record commit together or not at all. No claim row, no lease,
///   no renewals: a process, backend or connection that dies frees the key at once.
///   Waiting duplicates wait on the lock and are woken the moment it is released: they
///   replay what it committed, or one of them takes the key and runs.
///
/// A background task removes expired rows every [`cleanup_interval`], a batch at a time;
/// it ends when the last clone of the store is dropped.
///
/// Every call is bounded by [`command_timeout`](PostgresStoreBuilder::command_timeout); a timeout or a
/// connection failure is a [`StoreError`] (so the layer answers `503`, failing
/// closed), and the pool reconnects by itself. Every statement that changes a row also
/// carries its caller's deadline by the database's clock (read with
/// `clock_timestamp()` once a second; the clocks need not agree) and fails instead of
/// acting past it, so a statement that reaches the server after its caller gave up
/// changes nothing. A transactional `COMMIT` whose answer is lost is read back before
/// the layer answers (see [`Transaction`]).
///
/// [`cleanup_interval`]: PostgresStoreBuilder::cleanup_interval
///
/// # Clone
///
/// Clones share the pool, the statements and the cleaner.
#[derive(Clone)]
pub struct PostgresStore {
    shared: Arc<Shared>,
    mode: PostgresMode,
}

/// How a [`PostgresStore`] marks the key of a request that runs.
///
/// | | Durable | Transactional |
/// |---|---|---|
/// | In flight | a claim row with a lease, renewed every quarter lease | the request's transaction (an advisory lock in it) |
/// | The handler's writes | its own, committed apart from the record | in the request's [`Transaction`], committed with the record |
/// | A process that dies mid-handler | key locked for up to one and a half leases (15 s by default), then runs again | key free at once (as soon as PostgreSQL sees the connection close); its writes are gone |
/// | Connection lost mid-handler, process alive | the claim holds; the handler finishes and its record is stored | the transaction aborts: the key is free and a retry may run while the handler still runs, so effects outside the database could happen twice |
/// | Connections held | one per statement | one per running request for its whole life, and one per waiting duplicate |
/// | Writes per request | claim, a renewal per quarter lease, record | record |
///
/// Choose transactional for a handler whose effects are all writes in this database:
/// it runs exactly once by construction, and a crash costs a retry nothing. Choose
/// durable for a handler with effects elsewhere (they cannot be rolled back, so the key
/// must outlive a lost connection).
///
/// One route, one mode: a transactional request treats a durable claim on its scope as
/// in flight, but a durable request does not see a transactional one's lock. To switch
/// a route's mode, let the requests in flight under the old one finish first.
///
/// # What transactional mode asks of the handler and the deployment
///
/// - **READ COMMITTED.** The request's transaction runs at READ COMMITTED, whatever the
///   database's default: the read after a granted lock must see the commit that
///   released it. A handler that needs more takes row locks (`SELECT ... FOR UPDATE`).
/// - **Savepoints for statements that may fail.** A failed statement aborts the whole
///   transaction: the record cannot be stored in it, and the layer answers `503
///   idempotency.not_committed` instead of the handler's own answer. Run a statement
///   that may fail (a unique violation the handler turns into a `409`) in a savepoint:
///   `connection.begin()` on the transaction's connection.
/// - **The connection back before the handler returns.** The layer commits once the
///   handler has answered, after every [`TransactionGuard`] is dropped: a task the
///   handler spawned that keeps one holds the commit, and the key, until it lets go.
/// - **"At once" is when PostgreSQL sees the connection close.** A process that dies,
///   a backend terminated, a connection cut: within milliseconds. A host that vanishes
///   or a network partition leaves the backend idle in its transaction, holding the
///   key, until TCP keepalive notices (two hours by PostgreSQL's default): set the
///   server's `tcp_keepalives_idle`/`_interval`/`_count`, or an
///   `idle_in_transaction_session_timeout` longer than your slowest handler.
/// - **A gRPC response over `max_response_bytes`** is recorded as run whatever its
///   trailing status, so it commits: its status comes after the limit.
///
/// # Sizing the pool in transactional mode
///
/// A request holds a connection from its claim to its commit, so the pool's
/// `max_connections` must cover the requests running at once (arrival rate times
/// handler time, Little's law: 200 requests/s of 50 ms handlers hold 10), plus the
/// duplicates waiting on them (at most half the pool waits; a duplicate past that is
/// answered `409` with `Retry-After: 1`), plus whatever else the application runs on
/// the pool. When
/// no connection is free within the store's command timeout (or the pool's acquire
/// timeout, if shorter), the request runs nothing and is answered `503
/// idempotency.pool_exhausted` (gRPC `RESOURCE_EXHAUSTED`; a retryable refusal for a
/// message), never a hang.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PostgresMode {
    /// A committed claim row with a lease holds the key.
    #[default]
    Durable,
    /// The request's own transaction holds the key and commits its writes with its
    /// record.
    Transactional,
}

struct Shared {
    pool: PgPool,
    table: String,
    timeout: Duration,
    sql: Statements,
    /// What the database's clock is known to read, for every statement's deadline.
    clock: Arc<StoreClock>,
    /// Connections duplicates may hold while they wait in transactional mode.
    waiters: tokio::sync::Semaphore,
    /// Whether the database tells a server's lineage (its system identifier and
    /// timeline), asked by the first transaction to commit.
    tells_lineage: tokio::sync::OnceCell<bool>,
}

impl Shared {
    /// When a call starting now gives up, and that moment by the database's clock
    /// (microseconds since the Unix epoch), which the statement is refused past.
    async fn deadline(&self) -> Result<(Instant, i64), StoreError> {
        let give_up = Instant::now() + self.timeout;
        let deadline = self
            .clock
            .deadline_or_read(give_up, self.timeout, || read_time(self.pool.clone()))
            .await?;
        Ok((give_up, deadline))
    }
}

/// The database's clock, in microseconds since the Unix epoch.
async fn read_time(pool: PgPool) -> Result<i64, StoreError> {
    sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
        .fetch_one(&pool)
        .await
        .map_err(|e| StoreError::with_source("reading PostgreSQL's clock", e))
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.shared.table)
            .field("timeout", &self.shared.timeout)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// Builds a [`PostgresStore`].
#[must_use]
pub struct PostgresStoreBuilder {
    pool: PgPool,
    table: String,
    timeout: Duration,
    cleanup_interval: Duration,
    cleanup_batch: i64,
    mode: PostgresMode,
}

impl PostgresStoreBuilder {
    /// How a request that runs marks its key. Default [`PostgresMode::Durable`].
    pub fn mode(mut self, mode: PostgresMode) -> Self {
        self.mode = mode;
        self
    }

    /// The table to keep records in, optionally schema-qualified (`app.idempotency`).
    /// Default `tower_ids_idempotency`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The longest a database call may take. Default 1 second: a healthy PostgreSQL
    /// answers these statements in a millisecond or two; past a second the database is
    /// failing, and the layer answers by its store-failure rule rather than hang the
    /// request.
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How often expired rows are removed. Default every minute, a small batch at a
    /// time, so the table holds about a TTL's worth of keys and the cleaner never holds
    /// many locks.
    pub fn cleanup_interval(mut self, interval: Duration) -> Self {
        self.cleanup_interval = interval;
        self
    }

    /// Rows removed per statement. Default 1,000, a few milliseconds of work that
    /// never blocks requests for long.
    pub fn cleanup_batch(mut self, rows: i64) -> Self {
        self.cleanup_batch = rows.max(1);
        self
    }

    /// The store, with its cleaner running.
    ///
    /// # Errors
    ///
    /// If the table name is not one or two plain SQL identifiers (letters, digits and
    /// `_`, not starting with a digit), since it is written into the statements.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime (the cleaner is a task).
    pub fn build(self) -> Result<PostgresStore, StoreError> {
        if !valid_table(&self.table) {
            return Err(StoreError::new(format!(
                "invalid table name {:?}: use letters, digits and _ (optionally schema.table)",
                self.table
            )));
        }
        let clock = Arc::new(StoreClock::new(self.timeout));
        read_in_background(Arc::downgrade(&clock), self.timeout, {
            let pool = self.pool.clone();
            move || read_time(pool.clone())
        });
        let waiters = (self.pool.options().get_max_connections() / 2).max(1);
        let shared = Arc::new(Shared {
            waiters: tokio::sync::Semaphore::new(usize::try_from(waiters).unwrap_or(1)),
            pool: self.pool,
            sql: Statements::for_table(&self.table),
            table: self.table,
            timeout: self.timeout,
            clock,
            tells_lineage: tokio::sync::OnceCell::new(),
        });
        tokio::spawn(clean(
            Arc::downgrade(&shared),
            self.cleanup_interval,
            self.cleanup_batch,
        ));
        tokio::spawn(check_durability(Arc::downgrade(&shared)));
        Ok(PostgresStore {
            shared,
            mode: self.mode,
        })
    }
}

impl PostgresStore {
    /// A builder for a store on `pool`.
    pub fn builder(pool: PgPool) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            pool,
            table: DEFAULT_POSTGRES_TABLE.to_owned(),
            timeout: DEFAULT_POSTGRES_COMMAND_TIMEOUT,
            cleanup_interval: DEFAULT_POSTGRES_CLEANUP_INTERVAL,
            cleanup_batch: DEFAULT_POSTGRES_CLEANUP_BATCH,
            mode: PostgresMode::Durable,
        }
    }

    /// This store in `mode`, sharing its pool, table and cleaner: a route whose
    /// handler writes only in the database takes `store.with_mode(PostgresMode::Transactional)`
    /// while the others keep the durable store.
    #[must_use]
    pub fn with_mode(&self, mode: PostgresMode) -> Self {
        Self {
            shared: self.shared.clone(),
            mode,
        }
    }

    /// How a request that runs marks its key.
    pub fn mode(&self) -> PostgresMode {
        self.mode
    }

    /// Connects a pool to `url` (`postgres://user@host/db`) and builds a store on it
    /// with the defaults. Waiting for a connection is bounded by the timeout too.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .acquire_timeout(DEFAULT_POSTGRES_COMMAND_TIMEOUT)
            .connect(url)
            .await
            .map_err(|e| StoreError::with_source("could not connect to PostgreSQL", e))?;
        Self::builder(pool).build()
    }

    /// The pool the store uses.
    pub fn pool(&self) -> &PgPool {
        &self.shared.pool
    }

    /// Creates the table and its index if they do not exist; replicas that start
    /// together may all call it (they take turns, under an advisory lock).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let table = &self.shared.table;
        // An index lives in its table's schema, so its name is never qualified.
        migrate_from_template(&self.shared.pool, MIGRATION, DEFAULT_POSTGRES_TABLE, table)
            .await
            .map_err(|e| StoreError::with_source("could not create the idempotency table", e))
    }

    /// Removes expired rows now, a batch at a time; returns how many.
    pub async fn remove_expired(&self) -> Result<u64, StoreError> {
        remove_expired(&self.shared, DEFAULT_POSTGRES_CLEANUP_BATCH).await
    }

    async fn bounded<T>(
        &self,
        what: &'static str,
        call: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        bounded(self.shared.timeout, what, call).await
    }

    /// Runs the statement `call` makes, given its deadline, under the timeout; the
    /// statement refuses to act past the deadline (see [`Statements`]). A statement
    /// refused for a serialization failure is run again (see [`serialization_failure`]).
    async fn bounded_by_deadline<T, F>(
        &self,
        what: &'static str,
        call: impl Fn(i64) -> F,
    ) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        let (give_up, deadline) = self.shared.deadline().await?;
        loop {
            match tokio::time::timeout_at(give_up.into(), call(deadline)).await {
                Ok(Err(error)) if serialization_failure(&error) => {
                    tokio::task::yield_now().await;
                }
                answered => return within(answered, self.shared.timeout, what),
            }
        }
    }
}

/// Whether `error` is the database's refusal of a statement that met a concurrent
/// change (SQLSTATE `40001`), which at READ COMMITTED it would have waited for and
/// applied. The store's statements outside a transaction run at the database's default
/// isolation: where that is REPEATABLE READ or SERIALIZABLE, a claim racing its
/// duplicate is refused so, changes nothing, and is simply run again.
fn serialization_failure(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.code().as_deref() == Some("40001"))
}

async fn bounded<T>(
    timeout: Duration,
    what: &'static str,
    call: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, StoreError> {
    bounded_until(Instant::now() + timeout, timeout, what, call).await
}

async fn bounded_until<T>(
    give_up: Instant,
    timeout: Duration,
    what: &'static str,
    call: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, StoreError> {
    within(
        tokio::time::timeout_at(give_up.into(), call).await,
        timeout,
        what,
    )
}

/// A call's answer, or its timeout, as the store's result.
fn within<T>(
    answered: Result<Result<T, sqlx::Error>, tokio::time::error::Elapsed>,
    timeout: Duration,
    what: &'static str,
) -> Result<T, StoreError> {
    match answered {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(StoreError::with_source(what, error)),
        Err(_) => Err(StoreError::new(format!(
            "{what}: timed out after {timeout:?}"
        ))),
    }
}

/// How often the durability check is tried again while the database does not answer.
const DURABILITY_CHECK_RETRY: Duration = Duration::from_secs(5);

/// Reads, once, whether a COMMIT on the store's connections waits for its WAL to reach
/// disk, and warns (WARN `idempotency.store_not_durable`) if it does not: with
/// `synchronous_commit = off` (for the server, the database, the role or the
/// connection) PostgreSQL answers a COMMIT before it is on disk, and with `fsync = off`
/// it never waits for the disk at all, so a crash of the server can lose what the layer
/// already answered for (a transactional `201` with no row behind it, a durable claim
/// that is gone, so its handler runs again). Tried again while the database does not
/// answer; ends with the store.
async fn check_durability(shared: Weak<Shared>) {
    loop {
        let Some(store) = shared.upgrade() else {
            return;
        };
        let read = bounded(
            store.timeout,
            "reading PostgreSQL's durability settings",
            sqlx::query_as::<_, (String, String)>(
                "SELECT current_setting('synchronous_commit'), current_setting('fsync')",
            )
            .fetch_one(&store.pool),
        )
        .await;
        match read {
            Ok((synchronous_commit, fsync)) => {
                if synchronous_commit == "off" || fsync == "off" {
                    tracing::warn!(
                        target: "tower_ids::idempotency::store",
                        event = event::STORE_NOT_DURABLE,
                        table = %store.table,
                        synchronous_commit,
                        fsync,
                        "PostgreSQL answers COMMITs before they are on disk: a crash of the server can lose keys and outcomes the layer already answered for; set synchronous_commit = on and fsync = on for this database"
                    );
                }
                return;
            }
            Err(_) => {
                drop(store);
                tokio::time::sleep(DURABILITY_CHECK_RETRY).await;
            }
        }
    }
}

/// Removes expired rows every `interval` while the store lives.
async fn clean(shared: Weak<Shared>, interval: Duration, batch: i64) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match remove_expired(&shared, batch).await {
            Ok(0) => {}
            Ok(rows) => tracing::debug!(
                target: "tower_ids::idempotency::store",
                event = event::EXPIRED_REMOVED,
                rows,
                "removed expired idempotency rows"
            ),
            Err(error) => tracing::warn!(
                target: "tower_ids::idempotency::store",
                event = event::STORE_FAILED,
                error = %tower_ids_core::store::Chain(&error),
                phase = "cleanup",
                "could not remove expired idempotency rows; trying again later"
            ),
        }
    }
}

async fn remove_expired(shared: &Shared, batch: i64) -> Result<u64, StoreError> {
    let mut removed = 0;
    loop {
        let rows = bounded(
            shared.timeout,
            "removing expired rows from PostgreSQL",
            sqlx::query(&shared.sql.remove_expired)
                .bind(batch)
                .execute(&shared.pool),
        )
        .await?
        .rows_affected();
        removed += rows;
        if rows < u64::try_from(batch).unwrap_or(0) {
            return Ok(removed);
        }
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::for_table;

    #[test]
    fn table_names_are_plain_identifiers() {
        for good in ["tower_ids_idempotency", "app.idem", "_t1"] {
            assert!(valid_table(good), "{good}");
        }
        for bad in ["", "1t", "a.b.c", "t; drop table x", "t-1", "\"t\"", "a."] {
            assert!(!valid_table(bad), "{bad}");
        }
    }

    #[test]
    fn a_migration_renames_its_table_and_every_index_of_it() {
        let store = for_table(MIGRATION, DEFAULT_POSTGRES_TABLE, "app.idem");
        assert!(store.contains("CREATE TABLE IF NOT EXISTS app.idem ("));
        assert!(store.contains("INDEX IF NOT EXISTS idem_expires_at\n    ON app.idem"));
        assert!(!store.contains(DEFAULT_POSTGRES_TABLE));
    }
}
