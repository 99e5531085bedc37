//! Transactional mode: the request's own PostgreSQL transaction holds its key (an
//! advisory lock on the scope), and commits the handler's writes with its record.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use sqlx::{PgConnection, Postgres};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

use super::{
    bounded,
    commands::{live_row, millis_i64},
    commit::{commit, find_out, Uncommitted},
    serialization_failure, within, Shared,
};
use tower_ids_core::{
    store::{
        Begin, HandlerTransaction, Lease, Record, StoreError, TransactionEnd, TransactionOffer,
        Waited,
    },
    ScopeKey,
};

/// The request's database transaction, offered by the idempotency layer over a
/// [`PostgresStore`](super::PostgresStore) in [`PostgresMode::Transactional`] to the
/// handler of a request it runs.
///
/// The transaction holds the request's key from the moment the layer claims it (an
/// advisory lock on the scope, taken in it): a duplicate on any replica is told the
/// request is in flight (or, waiting, is woken the moment it ends) for as long as it
/// lives. Take it (the axum extractor, `request.extensions().get::<Transaction>()` in a
/// hyper service, or [`Transaction::current`] in a message consumer) and do the
/// request's writes on it; the layer then stores the outcome in the same transaction
/// and commits, so the writes and the record commit together or not at all. A process
/// that dies, a backend that is terminated, a connection that is cut: the transaction
/// aborts, its writes vanish, the lock goes with it, and a retry runs at once. A
/// response the layer does not store (by default a handler's 4xx and `503`, see
/// [`StorageRule`](tower_ids_core::StorageRule)), any 5xx of a handler that used
/// the transaction (whatever the rule: the rollback undoes its writes, so its retry may
/// run again), and a handler that fails or panics roll it back.
///
/// A `COMMIT` that gets no answer within the store's timeout (an fsync stall, a slow
/// synchronous standby, a connection cut mid-commit, the server's crash) may still land.
/// The layer then finds out from what the transaction wrote, never from its transaction
/// ID (a server that crashed before the ID reached its disk hands it to another
/// transaction, and a promoted standby may never have seen it): every 100 ms, for up to
/// five of the store's timeouts, it asks the server that answers whether the
/// transaction still runs in its backend there. While it does, the commit is under way;
/// once it cannot commit any more (it ended, its backend gone, the server restarted, or a promoted
/// standby on a later timeline of the same cluster answering), the record the
/// transaction stored, marked with the request's random token, tells: there, the client
/// gets the handler's answer; absent, `503 idempotency.not_committed`. A standby,
/// another cluster or an older timeline cannot tell; if nothing tells in time, `503
/// idempotency.outcome_unknown`, and the key stays held as long as the transaction may
/// commit: a retry replays the outcome if it committed, and runs again once it is over
/// without.
///
/// The transaction holds one connection of the store's pool from the claim to the
/// commit: see [`PostgresMode::Transactional`] for sizing the pool.
///
/// [`PostgresMode::Transactional`]: super::PostgresMode::Transactional
///
/// ```no_run
/// use axum::Json;
/// use tower_ids_postgres::Transaction;
///
/// async fn create(tx: Transaction, Json(name): Json<String>) -> Result<&'static str, String> {
///     let mut connection = tx.lock().await.map_err(|e| e.to_string())?;
///     sqlx::query("INSERT INTO commands (name) VALUES ($1)")
///         .bind(name)
///         .execute(&mut *connection)
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok("created")
/// }
/// ```
#[derive(Clone)]
pub struct Transaction {
    slot: Arc<Slot>,
}

impl std::fmt::Debug for Transaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transaction").finish_non_exhaustive()
    }
}

/// The connection of a [`Transaction`], held until dropped: run queries on
/// `&mut *guard`.
pub type TransactionGuard<'a> = MappedMutexGuard<'a, PgConnection>;

/// Why [`Transaction::lock`] failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum TransactionError {
    /// The request's response was already stored, or its transaction rolled back: the
    /// transaction is over.
    Over,
}

impl std::fmt::Display for TransactionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Over => f.write_str(
                "the request's transaction is over: its response was stored, or it was rolled back",
            ),
        }
    }
}

impl std::error::Error for TransactionError {}

struct Slot {
    shared: Arc<Shared>,
    state: Mutex<State>,
}

enum State {
    Open {
        transaction: sqlx::Transaction<'static, Postgres>,
        /// Whether the handler locked it.
        used: bool,
    },
    Over,
}

impl Transaction {
    /// The transaction of the request or message whose handler is running, for a
    /// handler whose input carries no extensions (a message consumer's): set while the
    /// layer polls the handler's future, not in tasks it spawns. `None` outside such a
    /// handler, or over a store in durable mode.
    pub fn current() -> Option<Self> {
        TransactionOffer::current::<Self>()
    }

    /// The transaction's connection, for the handler's writes.
    pub async fn lock(&self) -> Result<TransactionGuard<'_>, TransactionError> {
        let state = self.slot.state.lock().await;
        MutexGuard::try_map(state, |state| match state {
            State::Open { transaction, used } => {
                *used = true;
                Some(&mut **transaction)
            }
            State::Over => None,
        })
        .map_err(|_| TransactionError::Over)
    }
}

/// The [`HandlerTransaction`] of one claimed request.
struct Offered {
    handle: Transaction,
    lease: Lease,
}

impl HandlerTransaction for Offered {
    fn offer(&self) -> TransactionOffer {
        TransactionOffer::new(self.handle.clone())
    }

    fn taken(&self) -> bool {
        // Locked: a task of the handler's holds the connection now.
        self.handle.slot.state.try_lock().map_or(true, |state| {
            matches!(*state, State::Open { used: true, .. })
        })
    }

    fn settle(
        self: Box<Self>,
        scope: ScopeKey,
        outcome: Option<(Arc<Record>, Duration)>,
    ) -> Pin<Box<dyn Future<Output = TransactionEnd> + Send>> {
        Box::pin(async move {
            let slot = &self.handle.slot;
            // Waits for a handler's task still holding the connection.
            let taken = std::mem::replace(&mut *slot.state.lock().await, State::Over);
            let State::Open { transaction, .. } = taken else {
                return TransactionEnd::RolledBack;
            };
            let Some((record, ttl)) = outcome else {
                // A rollback fails only on a connection that broke (lost, its backend
                // terminated, the server gone or stalled): what the handler saw fail was
                // then the database, not the handler. Dropped unanswered, the
                // connection rolls back as the pool takes it back: the lock is gone.
                return match tokio::time::timeout(slot.shared.timeout, transaction.rollback())
                    .await
                {
                    Ok(Ok(())) => TransactionEnd::RolledBack,
                    Ok(Err(error)) => TransactionEnd::Failed(StoreError::with_source(
                        "the request's transaction broke under its handler",
                        error,
                    )),
                    Err(_) => TransactionEnd::Failed(StoreError::new(
                        "the request's transaction broke under its handler: its rollback got no answer in time",
                    )),
                };
            };
            match commit(&slot.shared, transaction, &scope, &self.lease, &record, ttl).await {
                Ok(()) => TransactionEnd::Committed,
                Err(Uncommitted::Failed(error)) => TransactionEnd::Failed(error),
                Err(Uncommitted::Unanswered(backend, error)) => {
                    find_out(&slot.shared, &scope, &self.lease, backend, error).await
                }
            }
        })
    }
}

/// The advisory lock that marks `scope` in flight: the digest's first 8 bytes. Another
/// lock of the application's with the same 64-bit key would only make one wait for the
/// other.
fn lock_key(scope: &ScopeKey) -> i64 {
    let bytes = scope.as_bytes();
    i64::from_be_bytes([
        bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5], bytes[6], bytes[7],
    ])
}

/// What a claim finds of the scope's row: a live record (counted), a live claim of
/// the durable mode, or nothing that holds the key.
enum Found {
    Record {
        record: Arc<Record>,
        request_count: u64,
    },
    Claimed(Begin),
    Free,
}

async fn find(
    shared: &Shared,
    scope: &ScopeKey,
    connection: &mut PgConnection,
) -> Result<Found, StoreError> {
    let give_up = std::time::Instant::now() + shared.timeout;
    let row = loop {
        let read = sqlx::query(&shared.sql.find)
            .bind(&scope.as_bytes()[..])
            .fetch_optional(&mut *connection);
        match tokio::time::timeout_at(give_up.into(), read).await {
            // Outside a transaction, at a stricter default isolation: run again.
            Ok(Err(error)) if serialization_failure(&error) => tokio::task::yield_now().await,
            answered => break within(answered, shared.timeout, "reading a key in PostgreSQL")?,
        }
    };
    let Some(row) = row else {
        return Ok(Found::Free);
    };
    Ok(match live_row(&row)? {
        Begin::Completed {
            record,
            request_count,
        } => Found::Record {
            record,
            request_count,
        },
        in_flight => Found::Claimed(in_flight),
    })
}

/// The isolation every transaction of transactional mode runs at, whatever the
/// database's default: each statement sees what committed before it began, so the read
/// that follows a granted lock sees the commit of the transaction that held it. (At
/// REPEATABLE READ or SERIALIZABLE the snapshot would be taken before the lock wait,
/// and a duplicate woken by the owner's commit would not see its record.)
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Begins a transaction on a connection of the pool (at [`BEGIN`]'s isolation), then
/// runs `settings` in it if given (`SET LOCAL ...`). A pool whose every connection
/// stayed in use until the store's timeout is an [`exhausted`](StoreError::exhausted)
/// error.
///
/// The begin runs in a task of its own, never cancelled half-way: sqlx counts a
/// transaction only once its `BEGIN` is answered, so a begin dropped between the two
/// would hand the connection back to the pool still inside a transaction. A begin that
/// outlives the timeout finishes in its task and is rolled back as it is dropped.
async fn begin_transaction(
    shared: &Shared,
    settings: Option<String>,
) -> Result<sqlx::Transaction<'static, Postgres>, StoreError> {
    let what = "beginning a transaction in PostgreSQL";
    let statement: std::borrow::Cow<'static, str> = match settings {
        Some(settings) => format!("{BEGIN}; {settings}").into(),
        None => BEGIN.into(),
    };
    let pool = shared.pool.clone();
    let begun = tokio::spawn(async move { pool.begin_with(statement).await });
    let exhausted = || {
        StoreError::new(format!(
            "{what}: every connection of the pool ({}) was in use for {:?}",
            shared.pool.options().get_max_connections(),
            shared.timeout
        ))
        .exhausted()
    };
    match tokio::time::timeout(shared.timeout, begun).await {
        Ok(Ok(Ok(transaction))) => Ok(transaction),
        // A pool that could not open a connection (the database is down) times out
        // too: exhausted only if every connection was open and in use.
        Ok(Ok(Err(sqlx::Error::PoolTimedOut))) if pool_full(&shared.pool) => Err(exhausted()),
        Ok(Ok(Err(error))) => Err(StoreError::with_source(what, error)),
        Ok(Err(panicked)) => Err(StoreError::with_source(what, panicked)),
        Err(_) if pool_full(&shared.pool) => Err(exhausted()),
        Err(_) => Err(StoreError::new(format!(
            "{what}: timed out after {:?}",
            shared.timeout
        ))),
    }
}

/// Whether every connection the pool may open is open and in use.
fn pool_full(pool: &sqlx::PgPool) -> bool {
    pool.num_idle() == 0 && pool.size() >= pool.options().get_max_connections()
}

/// Claims `scope` for a request in transactional mode: a live record answers at once
/// (one statement, no transaction); else a transaction is begun and takes the scope's
/// advisory lock, and holds the key until it ends.
pub(super) async fn claim(shared: &Arc<Shared>, scope: &ScopeKey) -> Result<Begin, StoreError> {
    {
        let mut connection = acquire(shared).await?;
        match find(shared, scope, &mut connection).await? {
            Found::Record {
                record,
                request_count,
            } => {
                return Ok(Begin::Completed {
                    record,
                    request_count,
                })
            }
            Found::Claimed(in_flight) => return Ok(in_flight),
            Found::Free => {}
        }
    }
    let mut transaction = begin_transaction(shared, None).await?;
    let locked = bounded(
        shared.timeout,
        "claiming a key in PostgreSQL",
        sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock($1)")
            .bind(lock_key(scope))
            .fetch_one(&mut *transaction),
    )
    .await?;
    if !locked {
        end(shared, transaction).await;
        return Ok(Begin::Locked);
    }
    // Read again under the lock, in a statement that began after it was granted: a
    // holder that committed since the first read is visible now.
    match find(shared, scope, &mut transaction).await? {
        Found::Record {
            record,
            request_count,
        } => {
            bounded(
                shared.timeout,
                "counting a request in PostgreSQL",
                transaction.commit(),
            )
            .await?;
            Ok(Begin::Completed {
                record,
                request_count,
            })
        }
        Found::Claimed(in_flight) => {
            end(shared, transaction).await;
            Ok(in_flight)
        }
        Found::Free => {
            let (lease, transaction) = held(shared, transaction);
            Ok(Begin::ClaimedByTransaction { lease, transaction })
        }
    }
}

/// Rolls back a transaction that holds nothing, so its connection goes back to the
/// pool idle (dropped, it would roll back only once the pool takes it back). An error
/// changes nothing: the pool then closes the connection, which rolls back too.
async fn end(shared: &Shared, transaction: sqlx::Transaction<'static, Postgres>) {
    let _ = tokio::time::timeout(shared.timeout, transaction.rollback()).await;
}

/// A claim held by `transaction`, which holds the scope's lock: its lease (a token and
/// when it was made, for the record) and the transaction to offer the handler.
fn held(
    shared: &Arc<Shared>,
    transaction: sqlx::Transaction<'static, Postgres>,
) -> (Lease, Box<dyn HandlerTransaction>) {
    let lease = Lease::new(rand::random(), std::time::SystemTime::now());
    let offered = Offered {
        handle: Transaction {
            slot: Arc::new(Slot {
                shared: shared.clone(),
                state: Mutex::new(State::Open {
                    transaction,
                    used: false,
                }),
            }),
        },
        lease: lease.clone(),
    };
    (lease, Box::new(offered))
}

/// A connection of the pool, within the store's timeout; an
/// [`exhausted`](StoreError::exhausted) error if every one stayed in use.
pub(super) async fn acquire(
    shared: &Shared,
) -> Result<sqlx::pool::PoolConnection<Postgres>, StoreError> {
    let what = "reading a key in PostgreSQL";
    match tokio::time::timeout(shared.timeout, shared.pool.acquire()).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(sqlx::Error::PoolTimedOut)) if pool_full(&shared.pool) => Err(StoreError::new(
            format!("{what}: every connection of the pool was in use"),
        )
        .exhausted()),
        Ok(Err(error)) => Err(StoreError::with_source(what, error)),
        Err(_) if pool_full(&shared.pool) => Err(StoreError::new(format!(
            "{what}: every connection of the pool ({}) was in use for {:?}",
            shared.pool.options().get_max_connections(),
            shared.timeout
        ))
        .exhausted()),
        Err(_) => Err(StoreError::new(format!(
            "{what}: timed out after {:?}",
            shared.timeout
        ))),
    }
}

/// Waits up to `timeout` for the transaction that holds `scope` to end: in a lock wait
/// on its advisory lock, which the database grants the moment that transaction commits,
/// rolls back or dies; then reads what it left, or, if it left nothing, keeps the lock:
/// the waiting request holds the key and runs. One connection per waiting duplicate, at
/// most half the pool's; a duplicate past that is told it is in flight, to come back in
/// a second.
pub(super) async fn wait(
    shared: &Arc<Shared>,
    scope: &ScopeKey,
    timeout: Duration,
) -> Result<Waited, StoreError> {
    // Held to the end, the reading of what the holder left included.
    let Ok(_waiting) = shared.waiters.try_acquire() else {
        return Ok(Waited::TimedOut);
    };
    match lock_wait(shared, scope, timeout).await? {
        Some(transaction) => after_the_holder(shared, scope, transaction).await,
        None => Ok(Waited::TimedOut),
    }
}

/// A transaction that holds `scope`'s lock, once the transaction that held it has
/// ended; `None` if it still held it after `timeout` (the server's lock timeout, or
/// the store's timeout on top of it here, with the wait cancelled).
async fn lock_wait(
    shared: &Arc<Shared>,
    scope: &ScopeKey,
    timeout: Duration,
) -> Result<Option<sqlx::Transaction<'static, Postgres>>, StoreError> {
    // `lock_timeout` is an int4 of milliseconds.
    let millis = millis_i64(timeout).min(i64::from(i32::MAX));
    let settings = format!("SET LOCAL lock_timeout = {millis}");
    let mut transaction = begin_transaction(shared, Some(settings)).await?;
    let backend: i32 = bounded(
        shared.timeout,
        "waiting for a key in PostgreSQL",
        sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *transaction),
    )
    .await?;
    // A waiter whose request goes away (its client hung up) must not leave its
    // connection in the lock wait until the lock timeout: the wait is cancelled.
    let mut abandoned = CancelOnDrop {
        pool: shared.pool.clone(),
        backend: Some(backend),
    };
    let granted = tokio::time::timeout(
        timeout + shared.timeout,
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(lock_key(scope))
            .execute(&mut *transaction),
    )
    .await;
    // Answered (granted, or cancelled by the server's lock timeout): nothing to cancel.
    // Timed out here: the wait is cancelled as the guard drops.
    if granted.is_ok() {
        abandoned.backend = None;
    }
    drop(abandoned);
    match granted {
        Ok(Ok(_)) => Ok(Some(transaction)),
        // 55P03, lock_not_available: the lock timeout.
        Ok(Err(sqlx::Error::Database(error))) if error.code().as_deref() == Some("55P03") => {
            end(shared, transaction).await;
            Ok(None)
        }
        Ok(Err(error)) => Err(StoreError::with_source(
            "waiting for a key in PostgreSQL",
            error,
        )),
        Err(_) => Ok(None),
    }
}

/// What the holder of `scope` left, read under its lock by `transaction`: its record,
/// a durable mode's claim (still running), or nothing, and then `transaction` keeps
/// the lock and the waiting request holds the key.
async fn after_the_holder(
    shared: &Arc<Shared>,
    scope: &ScopeKey,
    mut transaction: sqlx::Transaction<'static, Postgres>,
) -> Result<Waited, StoreError> {
    let settled = match find(shared, scope, &mut transaction).await? {
        Found::Record {
            record,
            request_count,
        } => Waited::Completed {
            record,
            request_count: Some(request_count),
        },
        // A claim of the durable mode on the same scope: still running.
        Found::Claimed(_) => Waited::TimedOut,
        Found::Free => {
            // The handler's statements get the database's lock timeout, not the wait's.
            bounded(
                shared.timeout,
                "claiming a key in PostgreSQL",
                sqlx::query("SET LOCAL lock_timeout TO DEFAULT").execute(&mut *transaction),
            )
            .await?;
            let (lease, transaction) = held(shared, transaction);
            return Ok(Waited::ClaimedByTransaction { lease, transaction });
        }
    };
    // The answer is read: the duplicate replays now, and the lock and the count are
    // committed behind it (a count lost with the commit changes no answer).
    let timeout = shared.timeout;
    tokio::spawn(async move {
        let _ = tokio::time::timeout(timeout, transaction.commit()).await;
    });
    Ok(settled)
}

/// Cancels the statement `backend` runs when dropped while it is set: a lock wait
/// whose waiter went away.
struct CancelOnDrop {
    pool: sqlx::PgPool,
    backend: Option<i32>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let Some(backend) = self.backend.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pool = self.pool.clone();
        runtime.spawn(async move {
            let cancel = sqlx::query("SELECT pg_cancel_backend($1)")
                .bind(backend)
                .execute(&pool);
            let _ = tokio::time::timeout(Duration::from_secs(5), cancel).await;
        });
    }
}
