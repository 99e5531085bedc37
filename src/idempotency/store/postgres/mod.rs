use std::{
    sync::{Arc, Weak},
    time::{Duration, Instant},
};

use sqlx::{postgres::PgPoolOptions, PgPool, Row};

use super::{
    codec::{decode_record, encode_record, from_millis, millis},
    deadline::{read_in_background, StoreClock},
    Begin, Claim, Completion, HandlerTransaction, IdempotencyStore, Lease, Payload, Record,
    Renewal, SentClaim, Settled, StoreError,
};

mod transaction;

#[cfg(feature = "axum")]
pub use self::transaction::TransactionMissing;
pub use self::transaction::{Transaction, TransactionError, TransactionGuard};
use crate::idempotency::{Fingerprint, ScopeKey};

/// The table the store keeps its records in, unless built with another.
pub const DEFAULT_POSTGRES_TABLE: &str = "tower_ids_idempotency";

/// Default bound on one database call: 1 second. A healthy PostgreSQL answers these
/// statements in a millisecond or two; past a second the database is failing, and the
/// layer answers by its store-failure rule rather than hang the request.
pub const DEFAULT_POSTGRES_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);

/// How often expired rows are removed: every minute, a small batch at a time, so the
/// table holds about a TTL's worth of keys and the cleaner never holds many locks.
pub const DEFAULT_POSTGRES_CLEANUP_INTERVAL: Duration = Duration::from_secs(60);

/// Rows removed per statement by the cleaner: 1,000, a few milliseconds of work that
/// never blocks requests for long.
pub const DEFAULT_POSTGRES_CLEANUP_BATCH: i64 = 1000;

/// The schema, as shipped in `migrations/` for users who run their own migrations.
const MIGRATION: &str =
    include_str!("../../../../migrations/20261122000000_tower_ids_idempotency.sql");

/// A store in PostgreSQL: records that survive restarts of the service and of the
/// database, shared by every replica.
///
/// One row per scope, in one table ([`DEFAULT_POSTGRES_TABLE`], created by
/// [`migrate`](Self::migrate) or by the migration in the crate's `migrations/`). Every
/// state change is one statement, atomic on the server: claiming (an upsert that takes
/// the row only if it is free or its lease ran out, with a random 128-bit fencing
/// token), renewing, completing and releasing (each only for the token that claimed).
/// Expiry uses the database's clock, so replicas never disagree about it. A first
/// execution is two round trips (claim, complete), a replay one. Records are the same
/// compact binary as the Redis store's, with the status in a column of its own for
/// operators.
///
/// The handler of a request it runs is offered the request's own [`Transaction`]: writes
/// made on it commit together with the record (transactional mode), so a crash between
/// the handler's commit and the record's can no longer run the action twice.
///
/// Waiting for a request in flight polls with backoff (10 ms doubling to 200 ms). A
/// background task removes expired rows every [`cleanup_interval`], a batch at a time;
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
}

struct Shared {
    pool: PgPool,
    table: String,
    timeout: Duration,
    sql: Statements,
    /// What the database's clock is known to read, for every statement's deadline.
    clock: Arc<StoreClock>,
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
}

impl PostgresStoreBuilder {
    /// The table to keep records in, optionally schema-qualified (`app.idempotency`).
    /// Default [`DEFAULT_POSTGRES_TABLE`].
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The longest a database call may take. Default [`DEFAULT_POSTGRES_COMMAND_TIMEOUT`].
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How often expired rows are removed. Default [`DEFAULT_POSTGRES_CLEANUP_INTERVAL`].
    pub fn cleanup_interval(mut self, interval: Duration) -> Self {
        self.cleanup_interval = interval;
        self
    }

    /// Rows removed per statement. Default [`DEFAULT_POSTGRES_CLEANUP_BATCH`].
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
        let shared = Arc::new(Shared {
            pool: self.pool,
            sql: Statements::for_table(&self.table),
            table: self.table,
            timeout: self.timeout,
            clock,
        });
        tokio::spawn(clean(
            Arc::downgrade(&shared),
            self.cleanup_interval,
            self.cleanup_batch,
        ));
        Ok(PostgresStore { shared })
    }
}

fn valid_table(table: &str) -> bool {
    let parts: Vec<&str> = table.split('.').collect();
    parts.len() <= 2
        && parts.iter().all(|part| {
            let mut chars = part.chars();
            chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
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
        }
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
        let bare = table.rsplit('.').next().unwrap_or(table);
        let default_index = format!("{DEFAULT_POSTGRES_TABLE}_expires_at");
        let sql = MIGRATION
            .replace(&default_index, "\u{0}")
            .replace(DEFAULT_POSTGRES_TABLE, table)
            .replace('\u{0}', &format!("{bare}_expires_at"));
        // Replicas starting together would race on `CREATE ... IF NOT EXISTS` (it can
        // fail on the catalog's unique index): one at a time, under a lock on the name.
        // One simple query is one transaction, so the lock is held to its end. (The
        // name was checked to be plain identifiers, so it cannot close the literal.)
        let locked =
            format!("SELECT pg_advisory_xact_lock(hashtext('tower-ids migrate {table}'));\n{sql}");
        sqlx::raw_sql(&locked)
            .execute(&self.shared.pool)
            .await
            .map_err(|e| StoreError::with_source("could not create the idempotency table", e))?;
        Ok(())
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
    /// statement refuses to act past the deadline (see [`Statements`]).
    async fn bounded_by_deadline<T, F>(
        &self,
        what: &'static str,
        call: impl FnOnce(i64) -> F,
    ) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        let (give_up, deadline) = self.shared.deadline().await?;
        bounded_until(give_up, self.shared.timeout, what, call(deadline)).await
    }
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
    match tokio::time::timeout_at(give_up.into(), call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(StoreError::with_source(what, error)),
        Err(_) => Err(StoreError::new(format!(
            "{what}: timed out after {timeout:?}"
        ))),
    }
}

/// The statements, written once for the store's table.
///
/// Every statement that changes a row takes a deadline, by the database's clock, and
/// fails instead of acting if it acts past it ([`in_time`]): a statement that sat in a
/// paused server's socket, or behind another transaction's lock, after its caller gave
/// up changes nothing. Statements inside the handler's transaction need none: nothing
/// there stands without the commit.
struct Statements {
    begin: String,
    renew: String,
    restore: String,
    complete: String,
    complete_in_transaction: String,
    complete_late: String,
    completed_by: String,
    transaction_status: String,
    release: String,
    poll: String,
    remove_expired: String,
}

/// True while the statement runs no later than `$n` (microseconds since the Unix
/// epoch, by the database's clock); past it, an error that names the deadline. The
/// error's text is built from `clock_timestamp()` so the planner cannot fold it into a
/// constant and raise it whether or not the branch is taken.
fn in_time(n: u8) -> String {
    format!(
        "(CASE WHEN (extract(epoch FROM clock_timestamp()) * 1000000)::bigint <= ${n} THEN true
          ELSE ('tower-ids: ' || clock_timestamp()::text || ' is past the deadline: the caller gave up')::boolean END)"
    )
}

/// `change` (an `INSERT`, `UPDATE` or `DELETE` with a `RETURNING` list), refused past
/// the deadline in `$n`: the deadline is checked on each row the change returns, so
/// after the row was changed, and after any wait for its lock; past it, the error
/// undoes the whole statement. (Checked in the change's own `WHERE`, it would be read
/// before such a wait, and a lock whose holder rolls back is not checked again.)
/// Returns what `change` returns, or, with `count`, how many rows it changed.
fn guarded(change: &str, n: u8, count: bool) -> String {
    let select = if count { "count(*)" } else { "*" };
    format!(
        "WITH changed AS ({change}) SELECT {select} FROM changed WHERE {}",
        in_time(n)
    )
}

impl Statements {
    fn for_table(t: &str) -> Self {
        // A live row keeps everything; a free or lapsed one is taken, carrying the
        // count of a lost claim (its requests were real) but not of an expired record.
        let begin = format!(
            "INSERT INTO {t} AS t (scope, token, fingerprint, first_seen_ms, epoch, expires_at)
             VALUES ($1, $2, $3, $4, $5, now() + $6 * interval '1 millisecond')
             ON CONFLICT (scope) DO UPDATE SET
               token = CASE WHEN t.expires_at > now() THEN t.token ELSE EXCLUDED.token END,
               completed = t.completed AND t.expires_at > now(),
               fingerprint = CASE WHEN t.expires_at > now() THEN t.fingerprint ELSE EXCLUDED.fingerprint END,
               first_seen_ms = CASE WHEN t.expires_at > now() THEN t.first_seen_ms ELSE EXCLUDED.first_seen_ms END,
               epoch = CASE WHEN t.expires_at > now() THEN t.epoch ELSE EXCLUDED.epoch END,
               status = CASE WHEN t.expires_at > now() THEN t.status END,
               record = CASE WHEN t.expires_at > now() THEN t.record END,
               request_count = CASE WHEN t.expires_at > now() OR NOT t.completed
                                    THEN t.request_count + 1 ELSE 1 END,
               expires_at = CASE WHEN t.expires_at > now() THEN t.expires_at ELSE EXCLUDED.expires_at END
             RETURNING token, completed, fingerprint, first_seen_ms, epoch, request_count, record,
               (extract(epoch FROM expires_at - now()) * 1000)::bigint AS ms_left"
        );
        let begin = guarded(&begin, 7, false);
        let renew = guarded(
            &format!(
                "UPDATE {t} SET expires_at = now() + $3 * interval '1 millisecond'
                 WHERE scope = $1 AND token = $2 AND NOT completed AND expires_at > now()
                 RETURNING 1"
            ),
            4,
            true,
        );
        let restore = format!(
            "INSERT INTO {t} AS t (scope, token, fingerprint, first_seen_ms, epoch, expires_at)
             VALUES ($1, $2, $3, $4, $5, now() + $6 * interval '1 millisecond')
             ON CONFLICT (scope) DO UPDATE SET
               token = EXCLUDED.token, completed = false, fingerprint = EXCLUDED.fingerprint,
               first_seen_ms = EXCLUDED.first_seen_ms, epoch = EXCLUDED.epoch, status = NULL,
               record = NULL, expires_at = EXCLUDED.expires_at,
               request_count = CASE WHEN t.token = EXCLUDED.token THEN t.request_count ELSE 1 END
             WHERE (t.token = EXCLUDED.token AND NOT t.completed) OR t.expires_at <= now()
             RETURNING 1"
        );
        let restore = guarded(&restore, 7, true);
        let complete = guarded(
            &format!(
                "UPDATE {t} SET completed = true, status = $3, record = $4,
                   expires_at = now() + $5 * interval '1 millisecond'
                 WHERE scope = $1 AND token = $2 AND NOT completed AND expires_at > now()
                 RETURNING 1"
            ),
            6,
            true,
        );
        // In the handler's transaction the claim is kept by renewal until the handler
        // returns; its lease running out since is no reason to roll the writes back.
        // Returns the transaction's ID, to ask its status if its commit's answer is lost.
        let complete_in_transaction = format!(
            "UPDATE {t} SET completed = true, status = $3, record = $4,
               expires_at = now() + $5 * interval '1 millisecond'
             WHERE scope = $1 AND token = $2 AND NOT completed
             RETURNING pg_current_xact_id()::text"
        );
        let complete_late = format!(
            "INSERT INTO {t} AS t (scope, token, completed, fingerprint, first_seen_ms, epoch,
                                    status, record, expires_at)
             VALUES ($1, $2, true, $3, $4, $5, $6, $7, now() + $8 * interval '1 millisecond')
             ON CONFLICT (scope) DO UPDATE SET
               token = EXCLUDED.token, completed = true, fingerprint = EXCLUDED.fingerprint,
               first_seen_ms = EXCLUDED.first_seen_ms, epoch = EXCLUDED.epoch,
               status = EXCLUDED.status, record = EXCLUDED.record, expires_at = EXCLUDED.expires_at,
               request_count = CASE WHEN t.completed THEN 1 ELSE t.request_count END
             WHERE (t.token = EXCLUDED.token AND NOT t.completed) OR t.expires_at <= now()
             RETURNING 1"
        );
        let complete_late = guarded(&complete_late, 9, true);
        let completed_by =
            format!("SELECT token = $2 AND completed AS ours, completed FROM {t} WHERE scope = $1");
        let release = guarded(
            &format!(
                "DELETE FROM {t} WHERE scope = $1 AND token = $2 AND NOT completed RETURNING 1"
            ),
            3,
            true,
        );
        let poll = format!(
            "SELECT completed, record, expires_at > now() AS live FROM {t} WHERE scope = $1"
        );
        let remove_expired = format!(
            "DELETE FROM {t} WHERE scope IN (
               SELECT scope FROM {t} WHERE expires_at < now()
               ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)"
        );
        Self {
            begin,
            renew,
            restore,
            complete,
            complete_in_transaction,
            complete_late,
            completed_by,
            transaction_status: "SELECT pg_xact_status($1::xid8)".to_owned(),
            release,
            poll,
            remove_expired,
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
                event = "idempotency.expired_removed",
                rows,
                "removed expired idempotency rows"
            ),
            Err(error) => tracing::warn!(
                event = "idempotency.store_failed",
                error = %super::Chain(&error),
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

fn token_bytes(lease: &Lease) -> [u8; 16] {
    lease.token.to_be_bytes()
}

fn millis_i64(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis())
        .unwrap_or(i64::MAX)
        .max(1)
}

fn epoch_i64(epoch: Option<u64>) -> Option<i64> {
    epoch.map(|e| i64::try_from(e).unwrap_or(i64::MAX))
}

/// The `status` column, for operators: the HTTP status, `0` for a message outcome
/// (as the record's encoding writes it), `NULL` for an outcome too large to keep.
fn status_i16(record: &Record) -> Option<i16> {
    match record.payload.as_ref()? {
        Payload::Http(response) => {
            Some(i16::try_from(response.status.as_u16()).unwrap_or(i16::MAX))
        }
        _ => Some(0),
    }
}

fn first_seen_ms(lease: &Lease) -> i64 {
    i64::try_from(millis(lease.first_seen)).unwrap_or(i64::MAX)
}

impl IdempotencyStore for PostgresStore {
    fn recovery_time(&self) -> Duration {
        // The pool opens a connection on demand, within the command's own bound.
        self.shared.timeout
    }

    fn handler_transaction(&self) -> Option<Box<dyn HandlerTransaction>> {
        Some(Box::new(transaction::Offered::new(self.shared.clone())))
    }

    async fn begin(&self, scope: &ScopeKey, claim: Claim) -> Result<Begin, StoreError> {
        let lease = Lease {
            token: rand::random(),
            first_seen: std::time::SystemTime::now(),
        };
        let token = token_bytes(&lease);
        let sent = SentClaim::new(self, *scope, lease.clone(), claim.lease);
        let row = self
            .bounded_by_deadline("claiming a key in PostgreSQL", |deadline| {
                sqlx::query(&self.shared.sql.begin)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(&claim.fingerprint.as_bytes()[..])
                    .bind(first_seen_ms(&lease))
                    .bind(epoch_i64(claim.epoch))
                    .bind(millis_i64(claim.lease))
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        sent.answered();
        let corrupt = |e| StoreError::with_source("corrupt row in PostgreSQL", e);
        let held: Vec<u8> = row.try_get("token").map_err(corrupt)?;
        if held == token {
            return Ok(Begin::Claimed { lease });
        }
        let request_count: i64 = row.try_get("request_count").map_err(corrupt)?;
        let request_count = u64::try_from(request_count).unwrap_or(0);
        if row.try_get::<bool, _>("completed").map_err(corrupt)? {
            let record: Vec<u8> = row.try_get("record").map_err(corrupt)?;
            return Ok(Begin::Completed {
                record: Arc::new(decode_record(&record)?),
                request_count,
            });
        }
        let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(corrupt)?;
        let fingerprint: [u8; 32] = fingerprint
            .try_into()
            .map_err(|_| StoreError::new("corrupt row in PostgreSQL: fingerprint"))?;
        let first_seen: i64 = row.try_get("first_seen_ms").map_err(corrupt)?;
        let epoch: Option<i64> = row.try_get("epoch").map_err(corrupt)?;
        Ok(Begin::InFlight {
            fingerprint: Fingerprint::from_bytes(fingerprint),
            first_seen: from_millis(u64::try_from(first_seen).unwrap_or(0)),
            epoch: epoch.map(|e| u64::try_from(e).unwrap_or(0)),
            request_count,
        })
    }

    async fn renew(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        claim: &Claim,
    ) -> Result<Renewal, StoreError> {
        let token = token_bytes(lease);
        let extended = self
            .bounded_by_deadline("renewing a claim in PostgreSQL", |deadline| {
                sqlx::query_scalar::<_, i64>(&self.shared.sql.renew)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(millis_i64(claim.lease))
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        if extended == 1 {
            return Ok(Renewal::Extended);
        }
        let restored = self
            .bounded_by_deadline("restoring a claim in PostgreSQL", |deadline| {
                sqlx::query_scalar::<_, i64>(&self.shared.sql.restore)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(&claim.fingerprint.as_bytes()[..])
                    .bind(first_seen_ms(lease))
                    .bind(epoch_i64(claim.epoch))
                    .bind(millis_i64(claim.lease))
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        Ok(if restored == 1 {
            Renewal::Restored
        } else {
            Renewal::Lost
        })
    }

    async fn complete(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Result<Completion, StoreError> {
        let token = token_bytes(lease);
        let encoded = encode_record(&record)?;
        let status = status_i16(&record);
        let stored = self
            .bounded_by_deadline("storing a record in PostgreSQL", |deadline| {
                sqlx::query_scalar::<_, i64>(&self.shared.sql.complete)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(status)
                    .bind(&encoded)
                    .bind(millis_i64(ttl))
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        if stored == 1 {
            return Ok(Completion::Stored);
        }
        // The claim is not live: the lease ran out, the row is gone, or this is a
        // repeat of a completion whose answer was lost.
        let late = self
            .bounded_by_deadline("storing a record in PostgreSQL", |deadline| {
                sqlx::query_scalar::<_, i64>(&self.shared.sql.complete_late)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(&record.fingerprint.as_bytes()[..])
                    .bind(first_seen_ms(lease))
                    .bind(epoch_i64(record.epoch))
                    .bind(status)
                    .bind(&encoded)
                    .bind(millis_i64(ttl))
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        if late == 1 {
            return Ok(Completion::StoredWithoutClaim);
        }
        let holder: Option<(bool, bool)> = self
            .bounded(
                "reading a record in PostgreSQL",
                sqlx::query_as(&self.shared.sql.completed_by)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .fetch_optional(&self.shared.pool),
            )
            .await?;
        Ok(match holder {
            Some((true, _)) => Completion::Stored,
            Some((false, true)) => Completion::Superseded,
            // Another live claim; or none since the late insert (released meanwhile):
            // either way, try again.
            Some((false, false)) | None => Completion::ClaimedByAnother,
        })
    }

    async fn release(&self, scope: &ScopeKey, lease: &Lease) -> Result<bool, StoreError> {
        let token = token_bytes(lease);
        let released = self
            .bounded_by_deadline("releasing a key in PostgreSQL", |deadline| {
                sqlx::query_scalar::<_, i64>(&self.shared.sql.release)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        Ok(released == 1)
    }

    async fn wait(&self, scope: &ScopeKey, timeout: Duration) -> Result<Settled, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pause = Duration::from_millis(10);
        loop {
            let poll = self.bounded(
                "polling a key in PostgreSQL",
                sqlx::query(&self.shared.sql.poll)
                    .bind(&scope.as_bytes()[..])
                    .fetch_optional(&self.shared.pool),
            );
            let Ok(polled) = tokio::time::timeout_at(deadline, poll).await else {
                return Ok(Settled::TimedOut);
            };
            let Some(row) = polled? else {
                return Ok(Settled::Released);
            };
            let corrupt = |e| StoreError::with_source("corrupt row in PostgreSQL", e);
            let live: bool = row.try_get("live").map_err(corrupt)?;
            let completed: bool = row.try_get("completed").map_err(corrupt)?;
            match (completed, live) {
                (true, true) => {
                    let record: Vec<u8> = row.try_get("record").map_err(corrupt)?;
                    return Ok(Settled::Completed {
                        record: Arc::new(decode_record(&record)?),
                    });
                }
                (_, false) => return Ok(Settled::Released),
                (false, true) => {}
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(Settled::TimedOut);
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_plain_identifiers() {
        for good in ["tower_ids_idempotency", "app.idem", "_t1"] {
            assert!(valid_table(good), "{good}");
        }
        for bad in ["", "1t", "a.b.c", "t; drop table x", "t-1", "\"t\"", "a."] {
            assert!(!valid_table(bad), "{bad}");
        }
    }
}
