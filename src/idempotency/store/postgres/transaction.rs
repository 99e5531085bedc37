//! Transactional mode: the handler's writes and the request's record in one
//! PostgreSQL transaction.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use sqlx::{PgConnection, Postgres};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

use super::{
    bounded, bounded_until,
    commands::{epoch_i64, first_seen_ms, millis_i64, status_i16, token_bytes},
    Shared,
};
use crate::idempotency::{
    store::{
        codec::encode_record, Chain, Completion, HandlerTransaction, Lease, Record, Settlement,
        StoreError, TransactionOffer,
    },
    ScopeKey,
};

/// The request's database transaction, offered by the idempotency layer over a
/// [`PostgresStore`](super::PostgresStore) to the handler of a request it runs.
///
/// Take it (the axum extractor, or `request.extensions().get::<Transaction>()` in a
/// hyper service) and do the request's writes on it; the layer then stores the
/// response's record in the same transaction and commits, so the writes and the record
/// commit together or not at all. A process that dies before the commit leaves
/// nothing, and the retry runs again; after it, the retry replays. A response the
/// layer does not store (`408`, `429`, `503` by default, see
/// [`store_if`](crate::idempotency::IdempotencyLayer::store_if)), any 5xx of a handler
/// that took the transaction (whatever `store_if` says: the rollback undoes its
/// writes, so its retry may run again), and a handler that fails or panics roll the
/// transaction back and release the key. A handler that never takes it gets the
/// durable mode: claim, run, store.
///
/// A `COMMIT` that gets no answer within the store's timeout (an fsync stall, a slow
/// synchronous standby, a connection cut mid-commit) may still land. The layer then
/// asks the database for the transaction's status (`pg_xact_status` of the ID it read
/// in the transaction before committing; PostgreSQL 13 or later), every 100 ms for up
/// to five of the store's timeouts: if it committed, the client gets the handler's
/// answer; if it aborted, `503 idempotency.not_committed`; if the database cannot tell
/// in that time, `503 idempotency.outcome_unknown`: a retry
/// replays the outcome if it committed, and runs again once the database can tell it
/// did not (the layer's release waits behind the commit's lock on the claim's row, and
/// never removes a completed record).
///
/// The transaction begins on the first [`lock`](Self::lock), on a connection of the
/// store's pool, and stays open until the response is stored: keep the pool larger
/// than the number of such requests running at once.
///
/// ```no_run
/// use axum::Json;
/// use tower_ids::idempotency::store::Transaction;
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
    /// The transaction could not begin (no connection within the store's timeout, or
    /// the database refused).
    Begin(StoreError),
    /// The request's response was already stored: the transaction is over.
    Over,
}

impl std::fmt::Display for TransactionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Begin(error) => write!(f, "could not begin the request's transaction: {error}"),
            Self::Over => f.write_str("the request's transaction is over: its response was stored"),
        }
    }
}

impl std::error::Error for TransactionError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Begin(error) => Some(error),
            Self::Over => None,
        }
    }
}

struct Slot {
    shared: Arc<Shared>,
    state: Mutex<State>,
}

enum State {
    NotBegun,
    Open(sqlx::Transaction<'static, Postgres>),
    Over,
}

impl Transaction {
    /// The transaction's connection, beginning the transaction on first use.
    pub async fn lock(&self) -> Result<TransactionGuard<'_>, TransactionError> {
        let mut state = self.slot.state.lock().await;
        if matches!(*state, State::NotBegun) {
            let shared = &self.slot.shared;
            let begun = bounded(
                shared.timeout,
                "beginning a transaction in PostgreSQL",
                shared.pool.begin(),
            )
            .await
            .map_err(TransactionError::Begin)?;
            *state = State::Open(begun);
        }
        MutexGuard::try_map(state, |state| match state {
            State::Open(transaction) => Some(&mut **transaction),
            _ => None,
        })
        .map_err(|_| TransactionError::Over)
    }
}

/// The [`HandlerTransaction`] of one claimed request.
pub(super) struct Offered(Transaction);

impl Offered {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self(Transaction {
            slot: Arc::new(Slot {
                shared,
                state: Mutex::new(State::NotBegun),
            }),
        })
    }
}

impl HandlerTransaction for Offered {
    fn offer(&self) -> TransactionOffer {
        TransactionOffer::new(self.0.clone())
    }

    fn taken(&self) -> bool {
        // Locked: a task of the handler's still holds the connection, so it began.
        self.0
            .slot
            .state
            .try_lock()
            .map_or(true, |state| matches!(*state, State::Open(_)))
    }

    fn settle(
        self: Box<Self>,
        scope: ScopeKey,
        lease: Lease,
        outcome: Option<(Arc<Record>, Duration)>,
    ) -> Pin<Box<dyn Future<Output = Settlement> + Send>> {
        Box::pin(async move {
            let slot = &self.0.slot;
            // Waits for a handler's task still holding the connection.
            let taken = std::mem::replace(&mut *slot.state.lock().await, State::Over);
            let State::Open(transaction) = taken else {
                return Settlement::NotTaken;
            };
            match outcome {
                None => match transaction.rollback().await {
                    Ok(()) => Settlement::RolledBack,
                    // Dropped, the connection rolls back when the pool gets it back.
                    Err(_) => Settlement::RolledBack,
                },
                Some((record, ttl)) => {
                    match commit(&slot.shared, transaction, &scope, &lease, &record, ttl).await {
                        Ok(completion) => Settlement::Committed(completion),
                        Err(Uncommitted::Failed(error)) => Settlement::Failed(error),
                        Err(Uncommitted::Unanswered(completion, xid, error)) => {
                            find_out(&slot.shared, &xid, completion, error).await
                        }
                    }
                }
            }
        })
    }
}

/// Why [`commit`] did not answer `Ok`.
enum Uncommitted {
    /// Nothing committed: a statement before the commit failed, or the database
    /// refused the commit.
    Failed(StoreError),
    /// The commit was sent and its answer never came (a timeout, a broken
    /// connection): it may have committed, with this completion; the transaction's ID
    /// (`xid8`, as text) tells.
    Unanswered(Completion, String, StoreError),
}

/// Stores `record` in `transaction` for `lease`'s claim and commits; rolls back if
/// another request holds the key.
async fn commit(
    shared: &Shared,
    mut transaction: sqlx::Transaction<'static, Postgres>,
    scope: &ScopeKey,
    lease: &Lease,
    record: &Record,
    ttl: Duration,
) -> Result<Completion, Uncommitted> {
    let token = token_bytes(lease);
    let encoded = encode_record(record).map_err(Uncommitted::Failed)?;
    let status = status_i16(record);
    // The claim row is locked from here to the commit: one round trip.
    let stored = bounded(
        shared.timeout,
        "storing a record in the request's transaction",
        sqlx::query_scalar::<_, String>(&shared.sql.complete_in_transaction)
            .bind(&scope.as_bytes()[..])
            .bind(&token[..])
            .bind(status)
            .bind(&encoded)
            .bind(millis_i64(ttl))
            .fetch_optional(&mut *transaction),
    )
    .await
    .map_err(Uncommitted::Failed)?;
    let (completion, xid) = if let Some(xid) = stored {
        (Completion::Stored, xid)
    } else {
        let (give_up, deadline) = shared.deadline().await.map_err(Uncommitted::Failed)?;
        let late = bounded_until(
            give_up,
            shared.timeout,
            "storing a record in the request's transaction",
            sqlx::query_scalar::<_, i64>(&shared.sql.complete_late)
                .bind(&scope.as_bytes()[..])
                .bind(&token[..])
                .bind(&record.fingerprint.as_bytes()[..])
                .bind(first_seen_ms(lease))
                .bind(epoch_i64(record.epoch))
                .bind(status)
                .bind(&encoded)
                .bind(millis_i64(ttl))
                .bind(deadline)
                .fetch_one(&mut *transaction),
        )
        .await
        .map_err(Uncommitted::Failed)?;
        if late != 1 {
            // Dropping the transaction rolls the handler's writes back.
            return Err(Uncommitted::Failed(StoreError::new(
                "another request holds this key: the request's writes were rolled back",
            )));
        }
        let xid = bounded(
            shared.timeout,
            "reading the request's transaction ID",
            sqlx::query_scalar::<_, String>("SELECT pg_current_xact_id()::text")
                .fetch_one(&mut *transaction),
        )
        .await
        .map_err(Uncommitted::Failed)?;
        (Completion::StoredWithoutClaim, xid)
    };
    let timeout = shared.timeout;
    match tokio::time::timeout(timeout, transaction.commit()).await {
        Ok(Ok(())) => Ok(completion),
        // The database answered: it refused the commit (a deferred constraint, a
        // serialization failure), and a refused commit is a rollback.
        Ok(Err(sqlx::Error::Database(error))) => Err(Uncommitted::Failed(StoreError::with_source(
            "committing the request's transaction",
            error,
        ))),
        Ok(Err(error)) => Err(Uncommitted::Unanswered(
            completion,
            xid,
            StoreError::with_source("committing the request's transaction", error),
        )),
        Err(_) => Err(Uncommitted::Unanswered(
            completion,
            xid,
            StoreError::new(format!(
                "committing the request's transaction: no answer within {timeout:?}"
            )),
        )),
    }
}

/// How long a commit whose answer was lost is looked into before the layer says it
/// does not know: the store's timeout five times over, enough to outlast an fsync
/// stall or a slow synchronous standby of a few seconds.
const FIND_OUT_TIMEOUTS: u32 = 5;

/// Finds out whether a commit whose answer was lost committed: asks the database for
/// the transaction's status (`pg_xact_status`, which takes no lock, and is final once
/// the transaction has ended: `committed` or `aborted`), on another connection, every
/// 100 ms while it is `in progress` or the database does not answer, within
/// [`FIND_OUT_TIMEOUTS`] times the store's timeout.
async fn find_out(
    shared: &Shared,
    xid: &str,
    completion: Completion,
    unanswered: StoreError,
) -> Settlement {
    let until = tokio::time::Instant::now() + shared.timeout * FIND_OUT_TIMEOUTS;
    loop {
        let status = bounded(
            shared.timeout,
            "asking for the request's transaction status",
            sqlx::query_scalar::<_, Option<String>>(&shared.sql.transaction_status)
                .bind(xid)
                .fetch_one(&shared.pool),
        )
        .await;
        let last = match status.as_ref().map(|status| status.as_deref()) {
            Ok(Some("committed")) => {
                tracing::info!(
                    event = "idempotency.commit_confirmed",
                    error = %Chain(&unanswered),
                    "the commit's answer was lost, but the database says the transaction committed"
                );
                return Settlement::Committed(completion);
            }
            Ok(Some("aborted")) => {
                return Settlement::Failed(StoreError::with_source(
                    "the request's transaction did not commit (the database says it aborted after its commit's answer was lost)",
                    unanswered,
                ))
            }
            Ok(other) => format!("status {other:?}"),
            Err(error) => error.to_string(),
        };
        if tokio::time::Instant::now() >= until {
            return Settlement::Unknown(StoreError::with_source(
                format!("could not tell whether the commit landed ({last})"),
                unanswered,
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
