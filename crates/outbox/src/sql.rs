//! The outbox's SQL, written once for its table when the [`Outbox`](super::Outbox) is
//! made.

/// The statements, for one table.
pub(super) struct Statements {
    /// Inserts a message and notifies the table's channel (delivered at commit).
    pub(super) enqueue: String,
    /// The same, after taking the enqueue lock `$10` (class `$9`) of its partition key:
    /// its ID is drawn once the lock is granted, so in commit order.
    pub(super) enqueue_keyed: String,
    /// The partition keys of the oldest pending messages, a window of `$1`.
    pub(super) window: String,
    /// Takes the relay's lock on each key of `$2` (class `$1`) that no other holds.
    pub(super) lock_keys: &'static str,
    /// The pending messages of the keys `$1`, in order, up to `$2`, locked.
    pub(super) keyed: String,
    /// Due pending messages without a key, up to `$1`, that no other relay holds.
    pub(super) unkeyed: String,
    /// Marks the messages `$1` published.
    pub(super) mark: String,
    /// Deletes the messages `$1`, published (a retention of zero).
    pub(super) forget: String,
    /// Counts an attempt for each message refused, and dead-letters those at the last.
    pub(super) refused: String,
    /// When the next pending message waiting out a backoff is due, in seconds from now
    /// (`NULL`: none).
    pub(super) next_due: String,
    /// Removes up to 1,000 messages published before `$1` seconds ago.
    pub(super) trim: String,
    pub(super) backlog: String,
    pub(super) dead_letters: String,
    pub(super) requeue: String,
}

/// The relay's columns of a pending message.
const PENDING: &str = "id, destination, partition_key, idempotency_key, headers::text AS headers, \
    payload, correlation_id, traceparent, tracestate, attempts, next_attempt_at <= now() AS due";

/// A row neither published nor dead.
const IS_PENDING: &str = "published_at IS NULL AND dead_at IS NULL";

/// An enqueue into `t`, its values selected `from` (nothing, or a lock taken first), and
/// the notification of `t`'s channel.
fn enqueue(t: &str, from: &str) -> String {
    format!(
        "WITH enqueued AS (
           INSERT INTO {t} (destination, partition_key, idempotency_key, headers, payload,
                            correlation_id, traceparent, tracestate)
           SELECT $1::text, $2::text, $3::text, $4::jsonb, $5::bytea, $6::text, $7::text,
                  $8::text {from}
           RETURNING id)
         SELECT e.id FROM enqueued e, LATERAL (SELECT pg_notify('{t}', '')) AS woken"
    )
}

impl Statements {
    /// For `table`, already checked to be plain identifiers (so it cannot close a
    /// literal); its channel is its name.
    pub(super) fn for_table(t: &str) -> Self {
        Self {
            enqueue: enqueue(t, ""),
            enqueue_keyed: enqueue(t, "FROM (SELECT pg_advisory_xact_lock($9, $10)) AS locked"),
            // Without the keys whose oldest message waits out a backoff (blocked until
            // it is due, they must not fill the window and stall every other key), and
            // without unkeyed messages that are not due.
            window: format!(
                "SELECT partition_key FROM {t}
                 WHERE {IS_PENDING}
                   AND (CASE WHEN partition_key IS NULL THEN next_attempt_at <= now()
                        ELSE partition_key NOT IN (SELECT partition_key FROM {t}
                          WHERE {IS_PENDING} AND partition_key IS NOT NULL
                            AND next_attempt_at > now()) END)
                 ORDER BY id LIMIT $1"
            ),
            lock_keys: "SELECT k FROM unnest($2::int4[]) WITH ORDINALITY AS l(k, n) \
                        WHERE pg_try_advisory_xact_lock($1, k) ORDER BY n",
            keyed: format!(
                "SELECT {PENDING} FROM {t}
                 WHERE {IS_PENDING} AND partition_key = ANY($1)
                 ORDER BY id LIMIT $2 FOR UPDATE"
            ),
            unkeyed: format!(
                "SELECT {PENDING} FROM {t}
                 WHERE {IS_PENDING} AND partition_key IS NULL AND next_attempt_at <= now()
                 ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
            ),
            mark: format!(
                "UPDATE {t} SET published_at = now(), attempts = attempts + 1, last_error = NULL
                 WHERE id = ANY($1)"
            ),
            forget: format!("DELETE FROM {t} WHERE id = ANY($1)"),
            refused: format!(
                "UPDATE {t} AS t SET attempts = t.attempts + 1, last_error = r.error,
                   next_attempt_at = now() + make_interval(secs => r.delay),
                   dead_at = CASE WHEN t.attempts + 1 >= $4 THEN now() END
                 FROM unnest($1::int8[], $2::text[], $3::float8[]) AS r(id, error, delay)
                 WHERE t.id = r.id
                 RETURNING t.id, t.destination, t.attempts, t.dead_at IS NOT NULL AS dead"
            ),
            next_due: format!(
                "SELECT EXTRACT(EPOCH FROM min(next_attempt_at) - now())::float8 FROM {t}
                 WHERE {IS_PENDING} AND next_attempt_at > now()"
            ),
            trim: format!(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t}
                   WHERE published_at < now() - make_interval(secs => $1)
                   ORDER BY published_at LIMIT 1000 FOR UPDATE SKIP LOCKED)"
            ),
            backlog: format!(
                "SELECT count(*), EXTRACT(EPOCH FROM now() - min(enqueued_at))::float8
                 FROM {t} WHERE {IS_PENDING}"
            ),
            dead_letters: format!(
                "SELECT id, destination, partition_key, idempotency_key, payload, attempts,
                   last_error, EXTRACT(EPOCH FROM enqueued_at)::float8 AS enqueued_at,
                   EXTRACT(EPOCH FROM dead_at)::float8 AS dead_at
                 FROM {t} WHERE dead_at IS NOT NULL ORDER BY id LIMIT $1"
            ),
            requeue: format!(
                "UPDATE {t} SET dead_at = NULL, attempts = 0, next_attempt_at = now()
                 WHERE id = $1 AND dead_at IS NOT NULL"
            ),
        }
    }
}
