//! What a round takes: the partition keys no other relay holds, and their pending
//! messages in order.

use std::collections::HashMap;

use sqlx::{PgConnection, Row as _};

use super::{partition_lock, sql::Statements, OutboxError, RELAY_LOCK_CLASS};

/// A pending message, as a round reads it.
pub(super) struct Pending {
    pub(super) id: i64,
    pub(super) destination: String,
    pub(super) partition_key: Option<String>,
    pub(super) idempotency_key: String,
    pub(super) headers: String,
    pub(super) payload: Vec<u8>,
    pub(super) correlation_id: Option<String>,
    pub(super) traceparent: Option<String>,
    pub(super) tracestate: Option<String>,
    pub(super) attempts: i32,
    pub(super) due: bool,
}

/// Takes a round's messages: locks the partition keys of the oldest pending messages
/// that no other relay holds, enough for a batch, and reads their pending messages in
/// order (a partition whose oldest is waiting out a backoff is left whole), with the
/// due messages that have no key.
pub(super) async fn take(
    connection: &mut PgConnection,
    sql: &Statements,
    batch: usize,
) -> Result<Vec<Pending>, OutboxError> {
    let limit = i64::try_from(batch).unwrap_or(i64::MAX);
    // A window wider than a batch, so a relay finds keys another does not hold.
    let window: Vec<Option<String>> = sqlx::query_scalar(&sql.window)
        .bind(limit.saturating_mul(4))
        .fetch_all(&mut *connection)
        .await
        .map_err(|e| OutboxError::database("could not read the outbox", e))?;
    if window.is_empty() {
        return Ok(Vec::new());
    }
    let unkeyed = window.iter().filter(|key| key.is_none()).count();
    let partitions = Partitions::of(&window);
    let held = partitions.lock(connection, sql, batch).await?;
    let mut taken = if held.is_empty() {
        Vec::new()
    } else {
        keyed(connection, sql, &held, limit).await?
    };
    if unkeyed > 0 && taken.len() < batch {
        let rows = sqlx::query(&sql.unkeyed)
            .bind(i64::try_from(batch - taken.len()).unwrap_or(i64::MAX))
            .fetch_all(&mut *connection)
            .await
            .map_err(|e| OutboxError::database("could not read the outbox", e))?;
        for row in &rows {
            taken.push(pending(row)?);
        }
    }
    Ok(taken)
}

/// One partition lock of the window: the keys it covers and how many of the window's
/// messages they have.
struct Partition<'w> {
    lock: i32,
    keys: Vec<&'w str>,
    count: usize,
}

/// The window's partition locks, in the order of each one's oldest message.
struct Partitions<'w> {
    in_order: Vec<Partition<'w>>,
    /// Where each lock is in `in_order`.
    slot: HashMap<i32, usize>,
}

impl<'w> Partitions<'w> {
    fn of(window: &'w [Option<String>]) -> Self {
        let mut partitions = Self {
            in_order: Vec::new(),
            slot: HashMap::new(),
        };
        for key in window.iter().flatten() {
            let lock = partition_lock(key);
            match partitions.slot.get(&lock) {
                Some(&at) => {
                    let partition = &mut partitions.in_order[at];
                    if !partition.keys.contains(&key.as_str()) {
                        partition.keys.push(key);
                    }
                    partition.count += 1;
                }
                None => {
                    partitions.slot.insert(lock, partitions.in_order.len());
                    partitions.in_order.push(Partition {
                        lock,
                        keys: vec![key],
                        count: 1,
                    });
                }
            }
        }
        partitions
    }

    /// Tries the locks in order, 64 at a time, until those granted cover a batch of
    /// the window's messages; returns the keys of the locks granted (the others are
    /// another relay's).
    async fn lock(
        &self,
        connection: &mut PgConnection,
        sql: &Statements,
        batch: usize,
    ) -> Result<Vec<&'w str>, OutboxError> {
        let mut held: Vec<&str> = Vec::new();
        let mut expected = 0;
        for chunk in self.in_order.chunks(64) {
            if expected >= batch {
                break;
            }
            let tried: Vec<i32> = chunk.iter().map(|partition| partition.lock).collect();
            let granted: Vec<i32> = sqlx::query_scalar(sql.lock_keys)
                .bind(RELAY_LOCK_CLASS)
                .bind(&tried)
                .fetch_all(&mut *connection)
                .await
                .map_err(|e| OutboxError::database("could not lock partition keys", e))?;
            for lock in granted {
                let partition = &self.in_order[self.slot[&lock]];
                expected += partition.count;
                held.extend(partition.keys.iter().copied());
            }
        }
        Ok(held)
    }
}

/// The pending messages of the `held` keys, up to `limit`, in order, each key's only
/// up to its first message still waiting out a backoff (so none overtakes it).
async fn keyed(
    connection: &mut PgConnection,
    sql: &Statements,
    held: &[&str],
    limit: i64,
) -> Result<Vec<Pending>, OutboxError> {
    // Read after the locks were granted: what a previous holder marked is seen.
    let keyed = sqlx::query(&sql.keyed)
        .bind(held)
        .bind(limit)
        .fetch_all(&mut *connection)
        .await
        .map_err(|e| OutboxError::database("could not read the outbox", e))?;
    let mut taken = Vec::new();
    let mut blocked: Vec<String> = Vec::new();
    for row in &keyed {
        let message = pending(row)?;
        let key = message.partition_key.clone().unwrap_or_default();
        if blocked.contains(&key) {
            continue;
        }
        if !message.due {
            blocked.push(key);
            continue;
        }
        taken.push(message);
    }
    Ok(taken)
}

fn pending(row: &sqlx::postgres::PgRow) -> Result<Pending, OutboxError> {
    let read = || -> Result<Pending, sqlx::Error> {
        Ok(Pending {
            id: row.try_get("id")?,
            destination: row.try_get("destination")?,
            partition_key: row.try_get("partition_key")?,
            idempotency_key: row.try_get("idempotency_key")?,
            headers: row.try_get("headers")?,
            payload: row.try_get("payload")?,
            correlation_id: row.try_get("correlation_id")?,
            traceparent: row.try_get("traceparent")?,
            tracestate: row.try_get("tracestate")?,
            attempts: row.try_get("attempts")?,
            due: row.try_get("due")?,
        })
    };
    read().map_err(|e| OutboxError::database("could not read an outbox row", e))
}
