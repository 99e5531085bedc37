//! Faults at the worst moment against a throwaway PostgreSQL server of the test's own:
//! the whole server paused (SIGSTOP) or killed (SIGKILL) and restarted (crash recovery)
//! around the end of a 1 s handler, under two replicas. Durable mode: the handler ran
//! exactly once. Transactional mode: exactly one command row per key is committed, and
//! the retry replays the response that goes with it.
//!
//! Each trial prints one line (`cargo test -p tower-ids-postgres --test postgres faults -- --nocapture`).

use std::{
    collections::BTreeMap,
    sync::Mutex,
    time::{Duration, Instant},
};
use tower_ids::idempotency::Policy;

use axum::{extract::State, http::HeaderMap, response::Response, routing::post};
use http::StatusCode;
use serde_json::json;
use sqlx::{postgres::PgPoolOptions, PgPool};
use tower_ids::idempotency::{
    store::{PostgresMode, PostgresStore, Transaction, DEFAULT_POSTGRES_COMMAND_TIMEOUT},
    IdempotencyLayer,
};

use super::{
    replica::{created, Ledger, Replica},
    server::PostgresServer,
    support::Reply,
};

const HANDLER: Duration = Duration::from_secs(1);
/// Longer than any outage here (down 0.5 s, then crash recovery): a store that is gone
/// for longer than the lease cannot tell a worker cut off from it from a dead one, and
/// a retry may then run again (README, Guarantees under faults).
const LEASE: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Mode {
    /// A claim row with a lease: claim, run, store.
    Durable,
    /// The request's transaction holds the key; the handler inserts its command in it.
    Transactional,
}

async fn durable(State(ledger): State<Ledger>, headers: HeaderMap) -> Response {
    let (key, run) = count(&ledger, &headers);
    tokio::time::sleep(HANDLER).await;
    created(&key, run)
}

/// The transaction ID (`xid8`, as text) and backend process ID of each key's latest
/// transactional run, as its handler read them after its insert.
static TRANSACTIONS: Mutex<BTreeMap<String, (String, i32)>> = Mutex::new(BTreeMap::new());

/// The transaction ID and backend of `key`'s latest transactional run, once its
/// handler has inserted its command.
pub(super) fn transaction_of(key: &str) -> Option<(String, i32)> {
    TRANSACTIONS.lock().unwrap().get(key).cloned()
}

/// Inserts the key's command in the request's transaction, then takes [`HANDLER`], or
/// `x-delay-ms` if sent.
async fn transactional(
    State(ledger): State<Ledger>,
    tx: Transaction,
    headers: HeaderMap,
) -> Response {
    let (key, run) = count(&ledger, &headers);
    {
        let Ok(mut connection) = tx.lock().await else {
            return Response::builder()
                .status(503)
                .body(axum::body::Body::empty())
                .unwrap();
        };
        let inserted = sqlx::query_as::<_, (String, i32)>(
            "INSERT INTO commands (key, run) VALUES ($1, $2)
             RETURNING pg_current_xact_id()::text, pg_backend_pid()",
        )
        .bind(&key)
        .bind(run as i64)
        .fetch_one(&mut *connection)
        .await;
        let Ok(transaction) = inserted else {
            return Response::builder()
                .status(503)
                .body(axum::body::Body::empty())
                .unwrap();
        };
        TRANSACTIONS
            .lock()
            .unwrap()
            .insert(key.clone(), transaction);
    }
    let delay = headers
        .get("x-delay-ms")
        .and_then(|ms| ms.to_str().ok()?.parse().ok())
        .map_or(HANDLER, Duration::from_millis);
    tokio::time::sleep(delay).await;
    created(&key, run)
}

fn count(ledger: &Ledger, headers: &HeaderMap) -> (String, usize) {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let run = ledger.count(&key);
    (key, run)
}

pub(super) async fn pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(1))
        .connect(url)
        .await
        .expect("the throwaway server accepts connections")
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    Pause(Duration),
    Kill(Duration),
}

async fn trial(mode: Mode, fault: Fault, at: Duration) {
    let Some((server, setup, ledger, a, b)) = replicas(mode, true).await else {
        return;
    };
    let key = format!("{mode:?}-{fault:?}-{at:?}");

    let first = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move { a.post(&key).await }
    });
    ledger.started(&key).await;
    tokio::time::sleep(at).await;
    let (_server, back) = tokio::task::spawn_blocking(move || {
        let mut server = server;
        match fault {
            Fault::Pause(pause) => {
                server.pause();
                std::thread::sleep(pause);
                server.resume();
            }
            Fault::Kill(down) => {
                server.kill();
                std::thread::sleep(down);
                server.restart();
            }
        }
        (server, Instant::now())
    })
    .await
    .unwrap();
    let first = first.await.unwrap();

    // Retry on both replicas until one replays.
    let mut seen = Vec::new();
    let replay = loop {
        let node = if seen.len() % 2 == 0 { &b } else { &a };
        match node.post(&key).await {
            Some(reply) if reply.replayed_created() => break reply,
            Some(reply) => seen.push(reply.status.as_u16()),
            None => seen.push(0),
        }
        assert!(
            back.elapsed() < Duration::from_secs(30),
            "no replay within 30 s of the server returning: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let to_replay = back.elapsed();
    let rows: Vec<i64> = sqlx::query_scalar("SELECT run FROM commands WHERE key = $1")
        .bind(&key)
        .fetch_all(&setup)
        .await
        .unwrap();
    let runs = ledger.runs(&key);
    let first_status = first.as_ref().map(|r| r.status.as_u16());
    eprintln!(
        "{mode:?}, {fault:?} at {at:?} into the handler: handler runs {runs}, committed rows {rows:?}, first answer {first_status:?}, replay {to_replay:?} after the server returned, retries saw {seen:?}"
    );

    let replayed_run = replay.json()["run"].as_i64().unwrap();
    match mode {
        Mode::Durable => {
            assert_eq!(runs, 1, "the handler ran exactly once");
            let first = first.expect("the first client gets an answer");
            assert_eq!(first.status, StatusCode::CREATED);
            assert_eq!(replay.body, first.body);
        }
        Mode::Transactional => {
            assert_eq!(rows.len(), 1, "exactly one committed command: {rows:?}");
            assert_eq!(
                rows[0], replayed_run,
                "the replay is the committed run's answer"
            );
            if let Some(first) = first.filter(|f| f.status == StatusCode::CREATED) {
                assert_eq!(replay.body, first.body, "a 201 that was answered stands");
            }
        }
    }
    // A transaction that did not commit ran nothing: one retry may then run it (201).
    let fresh = seen.iter().filter(|s| **s == 201).count();
    let first_committed = first_status == Some(201);
    assert!(
        fresh == 0 || (mode == Mode::Transactional && fresh == 1 && !first_committed),
        "a second execution answered: {seen:?}"
    );
    assert!(
        seen.iter().all(|s| [201, 409, 503].contains(s)),
        "before the replay only 409 or 503: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_mode_through_a_paused_and_a_killed_server() {
    for (fault, at) in [
        (Fault::Pause(Duration::from_millis(500)), 950),
        (Fault::Pause(Duration::from_millis(2000)), 950),
        (Fault::Kill(Duration::from_millis(500)), 950),
        (Fault::Kill(Duration::from_millis(500)), 400),
    ] {
        trial(Mode::Durable, fault, Duration::from_millis(at)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_mode_through_a_paused_and_a_killed_server() {
    for (fault, at) in [
        (Fault::Pause(Duration::from_millis(500)), 950),
        (Fault::Pause(Duration::from_millis(2000)), 950),
        (Fault::Kill(Duration::from_millis(500)), 950),
        (Fault::Kill(Duration::from_millis(500)), 1010),
        (Fault::Kill(Duration::from_millis(500)), 400),
    ] {
        trial(Mode::Transactional, fault, Duration::from_millis(at)).await;
    }
}

/// What a client saw: `201 executed`, `201 replayed`, `503 idempotency.…`, or `none`
/// (the connection failed).
pub(super) fn seen(reply: Option<&Reply>) -> String {
    match reply {
        None => "none".to_owned(),
        Some(reply) if reply.status == StatusCode::CREATED => {
            let how = if reply.replayed_created() {
                "replayed"
            } else {
                "executed"
            };
            format!("201 {how}")
        }
        Some(reply) => format!(
            "{} {}",
            reply.status.as_u16(),
            reply.problem_code().unwrap_or_default()
        ),
    }
}

/// A replica whose pool tests (`SELECT 1`-like ping) an idle connection before it hands
/// it out, or not (sqlx's default is to test it). Without the test, a
/// command goes out on an idle connection at once, even to a server that does not
/// answer.
pub(super) async fn replica(
    database: &str,
    ledger: &Ledger,
    mode: Mode,
    ping: bool,
    timeout: Duration,
) -> Replica {
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(1))
        .test_before_acquire(ping)
        .connect(database)
        .await
        .expect("the throwaway server accepts connections");
    let store = PostgresStore::builder(pool)
        .command_timeout(timeout)
        .mode(match mode {
            Mode::Durable => PostgresMode::Durable,
            Mode::Transactional => PostgresMode::Transactional,
        })
        .build()
        .unwrap();
    let layer = IdempotencyLayer::with_store(store)
        .policy(Policy::new().lease(LEASE))
        .unwrap();
    let route = match mode {
        Mode::Durable => post(durable).layer(layer),
        Mode::Transactional => post(transactional).layer(layer),
    };
    Replica::serve(route, ledger).await
}

/// A throwaway server with the `commands` table and the store's table, and two replicas
/// on it (`mode`, pools that `ping` idle connections or not), sharing one ledger.
async fn replicas(
    mode: Mode,
    ping: bool,
) -> Option<(PostgresServer, PgPool, Ledger, Replica, Replica)> {
    replicas_with_timeout(mode, ping, DEFAULT_POSTGRES_COMMAND_TIMEOUT).await
}

/// [`replicas`] whose stores bound each call by `timeout`.
async fn replicas_with_timeout(
    mode: Mode,
    ping: bool,
    timeout: Duration,
) -> Option<(PostgresServer, PgPool, Ledger, Replica, Replica)> {
    let server = PostgresServer::start()?;
    let setup = pool(&server.url()).await;
    prepare(&setup).await;
    let ledger = Ledger::default();
    let a = replica(&server.url(), &ledger, mode, ping, timeout).await;
    let b = replica(&server.url(), &ledger, mode, ping, timeout).await;
    Some((server, setup, ledger, a, b))
}

/// Makes the `commands` table the handlers insert into, and the store's table.
pub(super) async fn prepare(setup: &PgPool) {
    sqlx::raw_sql("CREATE TABLE commands (key text NOT NULL, run bigint NOT NULL)")
        .execute(setup)
        .await
        .unwrap();
    PostgresStore::builder(setup.clone())
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
}

async fn committed_runs(pool: &PgPool, key: &str) -> Vec<i64> {
    sqlx::query_scalar("SELECT run FROM commands WHERE key = $1 ORDER BY run")
        .bind(key)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// What the COMMIT of a key's first execution does, by a deferred constraint trigger on
/// `commands`: it sleeps, then commits or fails.
#[derive(Clone, Copy, Debug)]
enum CommitFault {
    /// Sleeps this long, then commits.
    Slow(Duration),
    /// Sleeps this long, then raises: nothing of the transaction stands.
    Fails(Duration),
}

/// Makes the COMMIT of the first execution of a key listed in `commit_faults` sleep,
/// and fail if asked: checked at commit, after the record is stored in the transaction.
pub(super) const COMMIT_FAULTS: &str = "
    CREATE TABLE commit_faults (key text PRIMARY KEY, sleep float8 NOT NULL, fail boolean NOT NULL);
    CREATE FUNCTION commit_fault() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE fault commit_faults%ROWTYPE;
    BEGIN
      SELECT * INTO fault FROM commit_faults WHERE key = NEW.key AND NEW.run = 1;
      IF FOUND THEN
        PERFORM pg_sleep(fault.sleep);
        IF fault.fail THEN
          RAISE EXCEPTION 'the commit of % fails on purpose', NEW.key;
        END IF;
      END IF;
      RETURN NULL;
    END $$;
    CREATE CONSTRAINT TRIGGER commit_fault AFTER INSERT ON commands
      DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION commit_fault();";

/// One transactional request whose COMMIT is slow or fails, on replica A; then a retry
/// every 0.3 s, on B and A in turn, until one gets a `201`.
///
/// A COMMIT that took longer than the store's timeout may still have committed: the
/// layer must then not say `not_committed` (that tells the client nothing stands),
/// but either wait and answer the handler's `201`, or say `outcome_unknown`. The retry
/// replays the committed command. A COMMIT that failed leaves nothing, and the retry
/// runs again.
async fn commit_trial(
    (pool, ledger, a, b): (PgPool, Ledger, Replica, Replica),
    fault: CommitFault,
    trial: usize,
) -> (Option<String>, Duration) {
    let key = format!("commit-{fault:?}-{trial}");
    let (sleep, fail) = match fault {
        CommitFault::Slow(sleep) => (sleep, false),
        CommitFault::Fails(sleep) => (sleep, true),
    };
    sqlx::query("INSERT INTO commit_faults (key, sleep, fail) VALUES ($1, $2, $3)")
        .bind(&key)
        .bind(sleep.as_secs_f64())
        .bind(fail)
        .execute(&pool)
        .await
        .unwrap();

    let sent = Instant::now();
    let first = a.post(&key).await;
    let first_took = sent.elapsed();
    let mut retries = Vec::new();
    let last = loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let node = if retries.len() % 2 == 0 { &b } else { &a };
        let reply = node.post(&key).await;
        match reply {
            Some(reply) if reply.status == StatusCode::CREATED => break reply,
            other => retries.push(seen(other.as_ref())),
        }
        assert!(
            sent.elapsed() < Duration::from_secs(20),
            "no 201 within 20 s: first {}, retries {retries:?}",
            seen(first.as_ref())
        );
    };
    let settled = sent.elapsed();
    let rows = committed_runs(&pool, &key).await;
    let runs = ledger.runs(&key);
    let first_committed = rows.contains(&1);
    eprintln!(
        "S3 commit {fault:?}, trial {trial}: first answer {} after {first_took:?} (its row committed: {first_committed}), retries saw {retries:?}, then {} after {settled:?}; handler runs {runs}, committed runs {rows:?}",
        seen(first.as_ref()),
        seen(Some(&last)),
    );

    let first = first.expect("the first request is answered");
    let first_code = first.problem_code();
    assert!(
        retries
            .iter()
            .all(|r| r.starts_with("409 ") || r.starts_with("503 ")),
        "before the 201 only 409 or 503: {retries:?}"
    );
    assert!(
        !retries
            .iter()
            .any(|r| r.ends_with("idempotency.not_committed")),
        "no retry ran, so none can be not_committed: {retries:?}"
    );
    if first_committed {
        assert!(
            first.status == StatusCode::CREATED
                || first_code.as_deref() == Some("idempotency.outcome_unknown"),
            "the first execution committed, yet its client was answered {} {first_code:?}: only its 201 or idempotency.outcome_unknown are true",
            first.status
        );
        if first.status == StatusCode::CREATED {
            assert_eq!(first.header("idempotent-replayed"), Some("false"));
        } else {
            assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
        }
        assert!(
            last.replayed_created(),
            "the retry replays: {}",
            seen(Some(&last))
        );
        assert_eq!(last.json(), json!({ "key": key, "run": 1 }));
        assert_eq!(rows, [1], "exactly one command");
        assert_eq!(runs, 1, "the handler ran once");
    } else {
        assert!(
            matches!(fault, CommitFault::Fails(_)),
            "a slow COMMIT that only sleeps commits: {rows:?}"
        );
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
        match fault {
            // Failed at once, it is known not to have committed.
            CommitFault::Fails(sleep) if sleep.is_zero() => {
                assert_eq!(first_code.as_deref(), Some("idempotency.not_committed"));
            }
            _ => assert!(
                matches!(
                    first_code.as_deref(),
                    Some("idempotency.not_committed" | "idempotency.outcome_unknown")
                ),
                "nothing committed: {first_code:?}"
            ),
        }
        assert_eq!(
            last.header("idempotent-replayed"),
            Some("false"),
            "the retry runs again"
        );
        assert_eq!(last.json(), json!({ "key": key, "run": 2 }));
        assert_eq!(rows, [2], "only the retry's command");
        assert_eq!(runs, 2);
    }
    (first_code, settled)
}

/// (S3) COMMITs slower than the store's 1 s timeout (1.5 s, 3 s) and, as controls,
/// COMMITs that fail (at once, and after 1.5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_commit_is_never_answered_not_committed() {
    let Some((server, pool, ledger, a, b)) = replicas(Mode::Transactional, true).await else {
        return;
    };
    sqlx::raw_sql(COMMIT_FAULTS).execute(&pool).await.unwrap();
    let trials = [
        (CommitFault::Fails(Duration::ZERO), 1),
        (CommitFault::Slow(Duration::from_millis(1500)), 1),
        (CommitFault::Slow(Duration::from_millis(1500)), 2),
        (CommitFault::Slow(Duration::from_millis(1500)), 3),
        (CommitFault::Slow(Duration::from_secs(3)), 1),
        (CommitFault::Slow(Duration::from_secs(3)), 2),
        (CommitFault::Fails(Duration::from_millis(1500)), 1),
    ];
    // Every trial runs and prints its line; the failures are told at the end.
    let mut failed = Vec::new();
    for (fault, trial) in trials {
        let replicas = (pool.clone(), ledger.clone(), a.clone(), b.clone());
        if let Err(error) = tokio::spawn(commit_trial(replicas, fault, trial)).await {
            let panic = error.into_panic();
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            failed.push(format!("{fault:?} trial {trial}: {why}"));
        }
    }
    drop(server);
    assert!(
        failed.is_empty(),
        "{} trials failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[derive(Clone, Copy, Debug)]
enum Outage {
    /// SIGSTOP to every process of the server, then SIGCONT 2 s later.
    Paused,
    /// SIGKILL, then a restart 2 s later (crash recovery).
    Killed,
}

/// (S2) A request that reaches replica A while the server is down is refused, and its
/// claim must not land later: once the server is back, a retry (every 0.3 s, on B and
/// A in turn) runs the handler within 1 s. Durable mode; the replicas' connections are
/// warm (their statements prepared), as in a service that has been running. With `ping`
/// (sqlx's default) the refused claim waits behind the pool's test of the connection
/// and never leaves; without, it sits in the stopped server's socket and reaches it
/// when it resumes.
async fn outage_trial(outage: Outage, ping: bool) {
    let Some((server, pool, ledger, a, b)) = replicas(Mode::Durable, ping).await else {
        return;
    };
    for (node, key) in [(&a, "warm-a"), (&b, "warm-b")] {
        let warm = node.post(key).await.expect("answered");
        assert_eq!(warm.status, StatusCode::CREATED);
    }
    let key = format!("outage-{outage:?}-{ping}");

    let mut server = server;
    let down = Instant::now();
    match outage {
        Outage::Paused => server.pause(),
        Outage::Killed => server.kill(),
    }
    let asked = Instant::now();
    let refused = a.post(&key).await;
    let refused_took = asked.elapsed();
    let (server, back) = tokio::task::spawn_blocking(move || {
        std::thread::sleep(Duration::from_secs(2).saturating_sub(down.elapsed()));
        match outage {
            Outage::Paused => server.resume(),
            Outage::Killed => server.restart(),
        }
        (server, Instant::now())
    })
    .await
    .unwrap();

    let mut retries = Vec::new();
    // The first retry 0.3 s after the return: whatever the server had in its sockets
    // when it stopped has run by then.
    let (executed, sent_after) = loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let node = if retries.len() % 2 == 0 { &b } else { &a };
        let sent_after = back.elapsed();
        let reply = node.post(&key).await;
        match reply {
            Some(reply) if reply.status == StatusCode::CREATED => break (reply, sent_after),
            other => retries.push(seen(other.as_ref())),
        }
        assert!(
            back.elapsed() < Duration::from_secs(15),
            "no 201 within 15 s of the server's return: {retries:?}"
        );
    };
    let answered_after = back.elapsed();
    let runs = ledger.runs(&key);
    // Every request that reached the store for a key is counted on its row.
    let counts: Vec<i64> = sqlx::query_scalar(
        "SELECT request_count::bigint FROM tower_ids_idempotency WHERE completed ORDER BY first_seen_ms",
    )
    .fetch_all(&pool)
    .await
    .unwrap_or_default();
    let records = counts.len();
    eprintln!(
        "S2-pg {outage:?}, pool pings idle connections: {ping}: refused request {} after {refused_took:?}; retries after the server's return saw {retries:?}, then {} (sent {sent_after:?} after the return, answered after {answered_after:?}); handler runs {runs}, completed records {records} (2 warm-ups + 1) with request counts {counts:?}",
        seen(refused.as_ref()),
        seen(Some(&executed)),
    );

    let refused = refused.expect("the refused request is answered");
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.problem_code().as_deref(),
        Some("idempotency.store_unavailable")
    );
    assert!(
        refused_took < Duration::from_secs(2),
        "refused within about the store's 1 s timeout: {refused_took:?}"
    );
    assert_eq!(
        executed.header("idempotent-replayed"),
        Some("false"),
        "the retry runs the handler"
    );
    assert_eq!(runs, 1, "the handler ran once");
    assert!(
        sent_after < Duration::from_secs(1),
        "the refused request left a claim behind: the retry that ran was sent {sent_after:?} after the server's return, earlier ones saw {retries:?}"
    );
    assert_eq!(records, 3, "a record for each key");
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_while_the_server_is_paused_leaves_no_claim() {
    for ping in [true, false] {
        outage_trial(Outage::Paused, ping).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_while_the_server_is_down_leaves_no_claim() {
    for ping in [true, false] {
        outage_trial(Outage::Killed, ping).await;
    }
}

/// A COMMIT whose answer is lost and that the store cannot read back in time (stores
/// with a 200 ms timeout, so five timeouts are 1 s; the COMMIT takes 3 s): the layer
/// says `outcome_unknown`, never `not_committed`. Committed, the retry replays it;
/// failed, the retry runs again as soon as the commit has ended (the release waits
/// behind it), not a claim's length later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_cannot_be_read_back_in_time_is_outcome_unknown() {
    let timeout = Duration::from_millis(200);
    let Some((server, pool, ledger, a, b)) =
        replicas_with_timeout(Mode::Transactional, true, timeout).await
    else {
        return;
    };
    sqlx::raw_sql(COMMIT_FAULTS).execute(&pool).await.unwrap();
    for (fault, trial) in [
        (CommitFault::Slow(Duration::from_secs(3)), 1),
        (CommitFault::Slow(Duration::from_secs(3)), 2),
        (CommitFault::Fails(Duration::from_secs(3)), 1),
        (CommitFault::Fails(Duration::from_secs(3)), 2),
    ] {
        let replicas = (pool.clone(), ledger.clone(), a.clone(), b.clone());
        let (first, settled) = commit_trial(replicas, fault, trial).await;
        // The commit ends 4 s after the request (the 1 s handler, then 3 s); the retry
        // that runs after it takes the handler's 1 s. The claim alone would hold the
        // key until 7.5 s.
        assert!(
            settled < Duration::from_millis(6000),
            "{fault:?}: the retry got its 201 {settled:?} after the first was sent, not soon after the commit ended"
        );
        assert_eq!(
            first.as_deref(),
            Some("idempotency.outcome_unknown"),
            "{fault:?}: the store could not tell within 1 s"
        );
    }
    drop(server);
}
