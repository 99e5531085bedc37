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
    // Partition locks in the order of each key's oldest message, with their keys and
    // how many of the window's messages they cover.
    let mut locks: Vec<(i32, Vec<&str>, usize)> = Vec::new();
    let mut slot: HashMap<i32, usize> = HashMap::new();
    for key in window.iter().flatten() {
        let lock = partition_lock(key);
        match slot.get(&lock) {
            Some(&at) => {
                let (_, keys, count) = &mut locks[at];
                if !keys.contains(&key.as_str()) {
                    keys.push(key);
                }
                *count += 1;
            }
            None => {
                slot.insert(lock, locks.len());
                locks.push((lock, vec![key], 1));
            }
        }
    }
    let mut held: Vec<&str> = Vec::new();
    let mut expected = 0;
    for chunk in locks.chunks(64) {
        if expected >= batch {
            break;
        }
        let tried: Vec<i32> = chunk.iter().map(|(lock, _, _)| *lock).collect();
        let granted: Vec<i32> = sqlx::query_scalar(sql.lock_keys)
            .bind(RELAY_LOCK_CLASS)
            .bind(&tried)
            .fetch_all(&mut *connection)
            .await
            .map_err(|e| OutboxError::database("could not lock partition keys", e))?;
        for lock in granted {
            let (_, keys, count) = &locks[slot[&lock]];
            expected += count;
            held.extend(keys.iter().copied());
        }
    }
    let mut taken = Vec::new();
    if !held.is_empty() {
        // Read after the locks were granted: what a previous holder marked is seen.
        let keyed = sqlx::query(&sql.keyed)
            .bind(&held)
            .bind(limit)
            .fetch_all(&mut *connection)
            .await
            .map_err(|e| OutboxError::database("could not read the outbox", e))?;
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
    }
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
