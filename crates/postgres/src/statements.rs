//! The store's SQL, written once for its table, and the guard that makes a change
//! fail when it reaches the server past its caller's deadline.

/// The statements, written once for the store's table.
///
/// Every statement that changes a row takes a deadline, by the database's clock, and
/// fails instead of acting if it acts past it ([`in_time`]): a statement that sat in a
/// paused server's socket, or behind another transaction's lock, after its caller gave
/// up changes nothing. Statements inside the handler's transaction need none: nothing
/// there stands without the commit.
pub(super) struct Statements {
    pub(super) begin: String,
    pub(super) renew: String,
    pub(super) restore: String,
    pub(super) complete: String,
    pub(super) find: String,
    /// Where the server tells its lineage, and where it does not.
    pub(super) store_in_transaction: [String; 2],
    pub(super) complete_late: String,
    pub(super) completed_by: String,
    pub(super) stored_by: String,
    pub(super) release: String,
    pub(super) poll: String,
    pub(super) remove_expired: String,
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

/// The server's lineage, where it tells it: the cluster's system identifier (a
/// streaming standby has its primary's) and its timeline (a promotion starts a new
/// one). A managed service may refuse these functions: [`LINEAGE`] finds out.
const SYSTEM: &str = "(SELECT system_identifier FROM pg_control_system())";
const TIMELINE: &str = "('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int";

/// Whether the server tells its lineage: run once, in a savepoint.
pub(super) fn lineage() -> String {
    format!("SELECT {SYSTEM}, {TIMELINE}")
}

/// Where the statement's transaction runs: its backend's process ID and the
/// transaction's start, in microseconds since the Unix epoch (together they name one
/// transaction of one server: a process ID alone does not across restarts, and a
/// backend outlives its transaction, back in the pool), and, with `lineage`, its
/// server's.
fn backend(lineage: bool) -> String {
    let (system, timeline) = if lineage {
        (SYSTEM, TIMELINE)
    } else {
        ("NULL::bigint", "NULL::int")
    };
    format!(
        "pg_backend_pid() AS pid,
         (SELECT (extract(epoch FROM xact_start) * 1000000)::bigint
            FROM pg_stat_get_activity(pg_backend_pid())) AS started,
         {system} AS system, {timeline} AS timeline"
    )
}

/// Asked after a commit's answer was lost, of the server that answers now: whether it
/// is a standby, whether the transaction begun at `$2` (microseconds) still runs in
/// the backend `$1` there,
/// and, with `lineage`, the server's lineage (no timeline on a standby).
pub(super) fn backend_running(lineage: bool) -> String {
    let (system, timeline) = if lineage {
        (SYSTEM, TIMELINE)
    } else {
        ("NULL::bigint", "NULL::int")
    };
    format!(
        "SELECT pg_is_in_recovery() AS standby,
           EXISTS (SELECT 1 FROM pg_stat_get_activity($1)
                    WHERE (extract(epoch FROM xact_start) * 1000000)::bigint = $2) AS running,
           {system} AS system,
           CASE WHEN pg_is_in_recovery() THEN NULL ELSE {timeline} END AS timeline"
    )
}

impl Statements {
    pub(super) fn for_table(t: &str) -> Self {
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
        // Transactional mode: a live row (a record, or a durable claim) counted and
        // read; the lock, not a row, marks a request in flight.
        let find = format!(
            "UPDATE {t} SET request_count = request_count + 1
             WHERE scope = $1 AND expires_at > statement_timestamp()
             RETURNING completed, record, request_count, fingerprint, first_seen_ms, epoch"
        );
        // Transactional mode, under the scope's lock: the record, over nothing or an
        // expired row only. Returns where the transaction runs ([`backend`]), to settle a
        // commit whose answer is lost. (The transaction began at the claim: its `now()`
        // is that early, so the statement's own time is read.)
        let store_in_transaction = |lineage: bool| {
            format!(
                "INSERT INTO {t} AS t (scope, token, completed, fingerprint, first_seen_ms, epoch,
                                    status, record, expires_at)
             VALUES ($1, $2, true, $3, $4, $5, $6, $7,
                     statement_timestamp() + $8 * interval '1 millisecond')
             ON CONFLICT (scope) DO UPDATE SET
               token = EXCLUDED.token, completed = true, fingerprint = EXCLUDED.fingerprint,
               first_seen_ms = EXCLUDED.first_seen_ms, epoch = EXCLUDED.epoch,
               status = EXCLUDED.status, record = EXCLUDED.record,
               expires_at = EXCLUDED.expires_at, request_count = 1
             WHERE t.expires_at <= statement_timestamp()
             RETURNING {}",
                backend(lineage)
            )
        };
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
        // Whether the record of the transaction whose lease token is `$2` stands: read
        // only once that transaction can no longer commit.
        let stored_by = format!(
            "SELECT EXISTS (SELECT 1 FROM {t} WHERE scope = $1 AND token = $2 AND completed)"
        );
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
            find,
            store_in_transaction: [store_in_transaction(true), store_in_transaction(false)],
            complete_late,
            completed_by,
            stored_by,
            release,
            poll,
            remove_expired,
        }
    }
}
