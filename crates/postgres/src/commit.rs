//! A request's `COMMIT`, and what settles one whose answer was lost: not the
//! transaction ID (another transaction may be given it after a crash), but whether the
//! transaction still runs where it ran, and whether the record it wrote stands.

use std::time::Duration;
use tower_ids_core::event;

use sqlx::{PgConnection, Postgres};

use super::{
    bounded,
    commands::{epoch_i64, first_seen_ms, millis_i64, status_i16, token_bytes},
    statements::{backend_running, lineage},
    transaction::acquire,
    Shared,
};
use tower_ids_core::{
    store::{codec::encode_record, Chain, Lease, Record, StoreError, TransactionEnd},
    ScopeKey,
};

/// Where a transaction ran, read in it before its `COMMIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Backend {
    pid: i32,
    /// When its transaction started, in microseconds since the Unix epoch.
    started: i64,
    /// The server's, where the database tells it.
    server: Option<Lineage>,
}

/// A primary's place in its cluster's history: the cluster's system identifier (a
/// streaming standby has its primary's) and the timeline (a promotion starts a new one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lineage {
    system: i64,
    timeline: i32,
}

impl Lineage {
    fn of(system: Option<i64>, timeline: Option<i32>) -> Option<Self> {
        Some(Self {
            system: system?,
            timeline: timeline?,
        })
    }
}

/// Whether the database tells a server's lineage ([`Lineage`]): asked once, in a
/// savepoint of the first transaction to commit, as a managed service may refuse the
/// functions that tell it. Where it does not, a commit whose answer was lost is settled
/// by its backend alone: a promoted standby still never runs it, but another cluster
/// behind the same address, or an older timeline, is not told apart.
async fn tells_lineage(shared: &Shared, connection: &mut PgConnection) -> Result<bool, StoreError> {
    if let Some(tells) = shared.tells_lineage.get() {
        return Ok(*tells);
    }
    let what = "asking whether PostgreSQL tells its lineage";
    let mut savepoint = bounded(shared.timeout, what, sqlx::Connection::begin(connection)).await?;
    let asked = tokio::time::timeout(
        shared.timeout,
        sqlx::query(&lineage()).execute(&mut *savepoint),
    )
    .await;
    let tells = match asked {
        Ok(Ok(_)) => {
            bounded(shared.timeout, what, savepoint.commit()).await?;
            true
        }
        // Refused (not permitted, no such function, not supported; a managed service's
        // own refusal): the savepoint takes the error back. Any other error is this
        // transaction's, and the next one asks again.
        Ok(Err(sqlx::Error::Database(refused)))
            if refused
                .code()
                .is_some_and(|code| ["42", "0A", "XX"].iter().any(|c| code.starts_with(c))) =>
        {
            bounded(shared.timeout, what, savepoint.rollback()).await?;
            tracing::info!(
                target: "tower_ids::idempotency::store",
                event = event::LINEAGE_UNTOLD,
                error = %refused,
                "PostgreSQL does not tell its system identifier and timeline: a lost commit is settled by its backend alone"
            );
            false
        }
        Ok(Err(error)) => return Err(StoreError::with_source(what, error)),
        Err(_) => {
            return Err(StoreError::new(format!(
                "{what}: timed out after {:?}",
                shared.timeout
            )))
        }
    };
    let _ = shared.tells_lineage.set(tells);
    Ok(tells)
}

/// Why [`commit`] did not answer `Ok`.
pub(super) enum Uncommitted {
    /// Nothing committed: a statement before the commit failed, or the database
    /// refused the commit.
    Failed(StoreError),
    /// The commit was sent and its answer never came (a timeout, a broken
    /// connection): it may have committed. Where it ran, and the lease whose token its
    /// record carries, tell.
    Unanswered(Backend, StoreError),
}

/// Stores `record` in `transaction` and commits; rolls back if a row that holds the
/// key is in the way (a durable claim or a record made without the lock).
pub(super) async fn commit(
    shared: &Shared,
    mut transaction: sqlx::Transaction<'static, Postgres>,
    scope: &ScopeKey,
    lease: &Lease,
    record: &Record,
    ttl: Duration,
) -> Result<(), Uncommitted> {
    let token = token_bytes(lease);
    let encoded = encode_record(record).map_err(Uncommitted::Failed)?;
    let lineage = tells_lineage(shared, &mut transaction)
        .await
        .map_err(Uncommitted::Failed)?;
    let statement = &shared.sql.store_in_transaction[usize::from(!lineage)];
    let stored = bounded(
        shared.timeout,
        "storing a record in the request's transaction",
        sqlx::query_as::<_, (i32, Option<i64>, Option<i64>, Option<i32>)>(statement)
            .bind(&scope.as_bytes()[..])
            .bind(&token[..])
            .bind(&record.fingerprint.as_bytes()[..])
            .bind(first_seen_ms(lease))
            .bind(epoch_i64(record.epoch))
            .bind(status_i16(record))
            .bind(&encoded)
            .bind(millis_i64(ttl))
            .fetch_optional(&mut *transaction),
    )
    .await
    .map_err(Uncommitted::Failed)?;
    let Some((pid, started, system, timeline)) = stored else {
        // Dropping the transaction rolls the handler's writes back.
        return Err(Uncommitted::Failed(StoreError::new(
            "another request holds this key: the request's writes were rolled back",
        )));
    };
    let backend = Backend {
        pid,
        // A backend always has a start time; a missing one matches none found later,
        // so the commit is settled only by the record, once the server restarted.
        started: started.unwrap_or(i64::MIN),
        server: Lineage::of(system, timeline),
    };
    let timeout = shared.timeout;
    match tokio::time::timeout(timeout, transaction.commit()).await {
        Ok(Ok(())) => Ok(()),
        // The database answered: it refused the commit (a deferred constraint, a
        // serialization failure), and a refused commit is a rollback. Not so an error of
        // the server itself (an operator intervention, a system or internal error: SQLSTATE
        // classes 57, 58, XX), which may come after the commit's record was flushed:
        // that one is found out, as a lost answer is.
        Ok(Err(sqlx::Error::Database(error)))
            if !error
                .code()
                .is_some_and(|code| ["57", "58", "XX"].iter().any(|c| code.starts_with(c))) =>
        {
            Err(Uncommitted::Failed(StoreError::with_source(
                "committing the request's transaction",
                error,
            )))
        }
        Ok(Err(error)) => Err(Uncommitted::Unanswered(
            backend,
            StoreError::with_source("committing the request's transaction", error),
        )),
        Err(_) => Err(Uncommitted::Unanswered(
            backend,
            StoreError::new(format!(
                "committing the request's transaction: no answer within {timeout:?}"
            )),
        )),
    }
}

/// How long a commit whose answer was lost is looked into before the layer says it
/// does not know: the store's timeout five times over, enough to outlast an fsync
/// stall, a slow synchronous standby of a few seconds, or a server's crash recovery.
const FIND_OUT_TIMEOUTS: u32 = 5;

/// What the server that answers now can tell of a transaction whose commit's answer
/// was lost.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// The transaction can no longer commit there (it ended, its backend is gone, the server
    /// restarted, or it is a promoted successor that never ran it): whether its record
    /// stands is final.
    Over,
    /// It still runs in its backend there: the commit is under way (an fsync, a wait for a
    /// synchronous standby), and may yet land.
    Running,
    /// It cannot tell: a standby, another cluster, or an older timeline than the one the
    /// transaction ran on.
    Elsewhere(&'static str),
}

/// What the server that answers now says of itself and of a backend.
#[derive(Debug, Clone, Copy)]
struct Answer {
    standby: bool,
    /// Whether a backend of the transaction's process ID and start time runs there.
    running: bool,
    lineage: Option<Lineage>,
}

impl Backend {
    /// What the server that gave `answer` can tell of this backend's transaction.
    fn seen_from(&self, answer: Answer) -> Seen {
        if answer.standby {
            return Seen::Elsewhere("the server that answers is a standby");
        }
        if let (Some(then), Some(now)) = (self.server, answer.lineage) {
            if now.system != then.system {
                return Seen::Elsewhere("the server that answers is of another cluster");
            }
            if now.timeline < then.timeline {
                return Seen::Elsewhere(
                    "the server that answers is on an older timeline than the one the transaction ran on",
                );
            }
            if now.timeline > then.timeline {
                return Seen::Over;
            }
        }
        if answer.running {
            Seen::Running
        } else {
            Seen::Over
        }
    }
}

/// Finds out whether a commit whose answer was lost committed, by what it wrote, never
/// by its transaction ID (a server that crashed before the ID reached its disk hands
/// the same ID to another transaction, and a promoted standby may never have seen it):
/// on one connection of the pool, asks the server that answers whether the
/// transaction still runs in its backend there; once it cannot commit the transaction any
/// more ([`Seen::Over`]), reads whether the record carrying the lease's token stands.
/// Every 100 ms, within [`FIND_OUT_TIMEOUTS`] times the store's timeout; past that,
/// unknown, and the key stays held for as long as the transaction may commit (its
/// advisory lock is the transaction's).
pub(super) async fn find_out(
    shared: &Shared,
    scope: &ScopeKey,
    lease: &Lease,
    backend: Backend,
    unanswered: StoreError,
) -> TransactionEnd {
    let until = tokio::time::Instant::now() + shared.timeout * FIND_OUT_TIMEOUTS;
    loop {
        let last = match look(shared, scope, lease, &backend).await {
            Ok(Some(true)) => {
                tracing::info!(
                    target: "tower_ids::idempotency::store",
                    event = event::COMMIT_CONFIRMED,
                    error = %Chain(&unanswered),
                    "the commit's answer was lost, but its record stands: the transaction committed"
                );
                return TransactionEnd::Committed;
            }
            Ok(Some(false)) => {
                return TransactionEnd::Failed(StoreError::with_source(
                    "the request's transaction did not commit (its commit's answer was lost, the transaction can no longer commit, and its record is not there)",
                    unanswered,
                ))
            }
            Ok(None) => "the transaction's backend is still committing it".to_owned(),
            Err(error) => error.to_string(),
        };
        if tokio::time::Instant::now() >= until {
            return TransactionEnd::Unknown(StoreError::with_source(
                format!("could not tell whether the commit landed ({last})"),
                unanswered,
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One look: `Some(stored)` once the transaction can no longer commit, `None` while it
/// may; an error if the server cannot tell (down, a standby, another cluster).
async fn look(
    shared: &Shared,
    scope: &ScopeKey,
    lease: &Lease,
    backend: &Backend,
) -> Result<Option<bool>, StoreError> {
    let what = "finding out whether the request's transaction committed";
    let mut connection = acquire(shared).await?;
    let lineage = backend.server.is_some();
    let (standby, running, system, timeline) = bounded(
        shared.timeout,
        what,
        sqlx::query_as::<_, (bool, bool, Option<i64>, Option<i32>)>(&backend_running(lineage))
            .bind(backend.pid)
            .bind(backend.started)
            .fetch_one(&mut *connection),
    )
    .await?;
    let answer = Answer {
        standby,
        running,
        lineage: Lineage::of(system, timeline),
    };
    match backend.seen_from(answer) {
        Seen::Running => Ok(None),
        Seen::Elsewhere(why) => Err(StoreError::new(format!("{what}: {why}"))),
        // Read on the same connection, so of the same server, in a statement that
        // began after the backend was seen gone: what it shows is final.
        Seen::Over => bounded(
            shared.timeout,
            what,
            sqlx::query_scalar::<_, bool>(&shared.sql.stored_by)
                .bind(&scope.as_bytes()[..])
                .bind(&token_bytes(lease)[..])
                .fetch_one(&mut *connection),
        )
        .await
        .map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRIMARY: Lineage = Lineage {
        system: 7,
        timeline: 1,
    };

    fn backend() -> Backend {
        Backend {
            pid: 42,
            started: 1_000,
            server: Some(PRIMARY),
        }
    }

    fn answer(running: bool, lineage: Lineage) -> Answer {
        Answer {
            standby: false,
            running,
            lineage: Some(lineage),
        }
    }

    #[test]
    fn a_backend_still_running_on_its_own_server_may_yet_commit() {
        assert_eq!(backend().seen_from(answer(true, PRIMARY)), Seen::Running);
        assert_eq!(backend().seen_from(answer(false, PRIMARY)), Seen::Over);
    }

    #[test]
    fn a_promoted_standby_can_no_longer_commit_what_its_old_primary_ran() {
        let promoted = Lineage {
            timeline: 2,
            ..PRIMARY
        };
        // Even a backend of the same process ID and start: the promoted server's is
        // another.
        assert_eq!(backend().seen_from(answer(true, promoted)), Seen::Over);
    }

    #[test]
    fn a_standby_another_cluster_or_an_older_timeline_cannot_tell() {
        let standby = Answer {
            standby: true,
            running: false,
            lineage: None,
        };
        let other = answer(
            false,
            Lineage {
                system: 8,
                ..PRIMARY
            },
        );
        let older = Backend {
            server: Some(Lineage {
                timeline: 3,
                ..PRIMARY
            }),
            ..backend()
        };
        for (backend, answer) in [
            (backend(), standby),
            (backend(), other),
            (older, answer(false, PRIMARY)),
        ] {
            assert!(
                matches!(backend.seen_from(answer), Seen::Elsewhere(_)),
                "{backend:?} seen from {answer:?}"
            );
        }
    }

    #[test]
    fn without_a_lineage_the_backend_alone_tells() {
        let untold = Backend {
            server: None,
            ..backend()
        };
        let answer = |running| Answer {
            standby: false,
            running,
            lineage: None,
        };
        assert_eq!(untold.seen_from(answer(true)), Seen::Running);
        assert_eq!(untold.seen_from(answer(false)), Seen::Over);
    }
}
