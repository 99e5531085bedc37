//! What an operator reads and does: the backlog, the dead letters, a requeue.

use std::time::{Duration, SystemTime};

use sqlx::Row as _;

use super::{MessageId, Outbox, OutboxError};

/// A message the relay gave up on after its last attempt: it stays in the table,
/// readable, until [`Outbox::requeue`]d or deleted.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its ID.
    pub id: MessageId,
    /// Where it was going.
    pub destination: String,
    /// Its partition key.
    pub partition_key: Option<String>,
    /// Its own idempotency key.
    pub idempotency_key: String,
    /// Its body.
    pub payload: Vec<u8>,
    /// Publications tried.
    pub attempts: u32,
    /// What the broker said the last time.
    pub last_error: Option<String>,
    /// When it was enqueued.
    pub enqueued_at: SystemTime,
    /// When the relay gave up.
    pub dead_at: SystemTime,
}

impl Outbox {
    /// How many messages are pending (committed, neither published nor dead), and how
    /// long the oldest has waited.
    pub async fn backlog(&self) -> Result<(u64, Option<Duration>), OutboxError> {
        let row = sqlx::query(&self.shared.sql.backlog)
            .fetch_one(&self.shared.pool)
            .await
            .map_err(|e| OutboxError::database("could not measure the backlog", e))?;
        let count: i64 = row.get(0);
        let age: Option<f64> = row.get(1);
        Ok((
            u64::try_from(count).unwrap_or(0),
            age.map(|age| Duration::from_secs_f64(age.max(0.0))),
        ))
    }

    /// The dead letters, oldest first, up to `limit`.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetter>, OutboxError> {
        let rows = sqlx::query(&self.shared.sql.dead_letters)
            .bind(limit)
            .fetch_all(&self.shared.pool)
            .await
            .map_err(|e| OutboxError::database("could not read the dead letters", e))?;
        let at = |seconds: f64| SystemTime::UNIX_EPOCH + Duration::from_secs_f64(seconds.max(0.0));
        Ok(rows
            .iter()
            .map(|row| DeadLetter {
                id: MessageId(row.get("id")),
                destination: row.get("destination"),
                partition_key: row.get("partition_key"),
                idempotency_key: row.get("idempotency_key"),
                payload: row.get("payload"),
                attempts: u32::try_from(row.get::<i32, _>("attempts")).unwrap_or(0),
                last_error: row.get("last_error"),
                enqueued_at: at(row.get("enqueued_at")),
                dead_at: at(row.get("dead_at")),
            })
            .collect())
    }

    /// Puts a dead letter back in line, with its attempts reset; `false` if `id` is not
    /// a dead letter. It keeps its ID, so it goes before its key's pending messages
    /// that are younger than it; those of its key published while it was dead went
    /// before it: a requeued message breaks its key's commit order, as its dead letter
    /// did.
    pub async fn requeue(&self, id: MessageId) -> Result<bool, OutboxError> {
        let done = sqlx::query(&self.shared.sql.requeue)
            .bind(id.0)
            .execute(&self.shared.pool)
            .await
            .map_err(|e| OutboxError::database("could not requeue the message", e))?;
        Ok(done.rows_affected() == 1)
    }
}
