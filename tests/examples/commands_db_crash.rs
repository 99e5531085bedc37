//! The whole PostgreSQL server SIGKILLed while a request's `COMMIT` runs, through the
//! demos as a user runs them: two replicas of `examples/commands` in DB mode, then two
//! of `examples/outbox serve`, each on a throwaway PostgreSQL server of the test's own
//! (`crates/test-support/src/postgres_server.rs`), made again for every trial.
//!
//! A trial sends its key to replica A. Its handler writes (a command and its outbox
//! message; a payment and its message) and answers, and the layer's `COMMIT` then
//! stalls [`SLOW_COMMIT`]: a deferred constraint trigger, which runs inside the `COMMIT`,
//! sleeps for the rows of the trial's key, on the server as first started only (so the
//! retries after the restart commit at once). As soon as `pg_stat_activity` shows A's
//! backend, the one holding the key's advisory lock, running that `COMMIT`, the test
//! reads its transaction ID (`backend_xid`), waits 30 to 70 ms, SIGKILLs every process
//! of the server with one kill(1), and starts it again [`DOWN`] later. The
//! transaction's WAL had not left the server's memory (nothing committed meanwhile, and
//! the WAL writer sleeps [`WAL_WRITER_DELAY`]), so crash recovery knows nothing of its
//! ID: from the restart on, [`CLIENTS`] clients send fresh keys to replica B, and their
//! transactions are given the lost ID again (the test writes nothing after the restart
//! until the checks, so that the traffic's transactions are the first). A layer that asked the server for the lost
//! ID's status (`pg_xact_status`) would be told `committed`, and answer `201` for a
//! request that never committed.
//!
//! Each trial checks: A's answer is never `201` unless A's row stands after recovery;
//! every key of B's answered `201` has its row; the key retried (on B and A in turn
//! every 200 ms until a `201`, answered only `409` or `503` before it) has exactly one
//! row, and not retried at most one. It prints one line (A's answer and when it came
//! after the server's return, the key's rows, the lost transaction ID and whether a
//! row of B's traffic carries it as its `xmin`), and each test a summary line. The
//! server's return is when `pg_isready` first answered, polled every 50 ms: an answer a
//! few tens of milliseconds "before" it came from the server already back. Every trial
//! runs and prints its line; the failed checks are told at the end; and a test fails
//! too if no trial's lost ID went to B's traffic (the hazard was not staged).
//!
//! `cargo test --all-features --test commands_db_crash -- --nocapture`: 3 trials per
//! demo, 12 with `TOWER_IDS_FULL_TRIALS=1`. Without the PostgreSQL server binaries
//! (`initdb`, `postgres`) it prints `SKIPPED` and passes, except in CI (`CI` set).

#[path = "demo.rs"]
mod demo;
// The crash tests of the library use the rest of it (standbys, pauses).
use tower_ids_test_support as support;
#[allow(dead_code)]
use tower_ids_test_support::postgres_server as server;

use std::{
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use demo::Demo;
use http::StatusCode;
use serde_json::json;
use server::PostgresServer;
use sqlx::{Connection, PgConnection};
use support::{client, full_trials, try_send, HttpClient, Reply};

/// How long the stalled `COMMIT` would take had the server lived: the kill lands in it.
const SLOW_COMMIT: Duration = Duration::from_secs(3);

/// How long the server stays down before its restart (crash recovery then runs).
const DOWN: Duration = Duration::from_millis(300);

/// How long the server's WAL writer sleeps between its flushes (PostgreSQL's default is
/// 200 ms, its longest 10 s): the kill must land before the WAL of A's writes reaches
/// the disk, and a flush in the 30 to 70 ms before it (likelier on a busy machine, which
/// stretches them) would tell crash recovery of the ID. Nothing else flushes meanwhile:
/// no other transaction commits.
const WAL_WRITER_DELAY: &str = "10s";

/// B's clients sending fresh keys from the server's return on.
const CLIENTS: usize = 4;

/// How long A's `COMMIT` may take to be seen running before the trial fails.
const WATCH_LIMIT: Duration = Duration::from_secs(5);

/// The retries of the key (B and A in turn) stop after this from the server's return.
const GIVE_UP: Duration = Duration::from_secs(20);

/// `--publish-delay-ms` of the `commands` replicas: longer than a trial, so that no
/// command turns `sent` (an `UPDATE`, a new `xmin`) and each row keeps the ID of the
/// transaction that created it.
const PUBLISH_DELAY_MS: &str = "600000";

/// A's and B's `application_name`, by which `pg_stat_activity` tells their backends.
const REPLICA_A: &str = "replica-a";
const REPLICA_B: &str = "replica-b";

/// The two demos under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Example {
    /// `examples/commands` in DB mode: `POST /commands`, a command row (`device_id` the
    /// trial's key) and its outbox message.
    Commands,
    /// `examples/outbox serve`: `POST /payments`, one payment (its `account` the
    /// trial's key) and its outbox message.
    Outbox,
}

impl fmt::Display for Example {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Commands => "commands",
            Self::Outbox => "outbox serve",
        })
    }
}

impl Example {
    /// Starts a replica on `url` (blocking: it waits for the demo to say where it
    /// listens).
    fn start(self, url: &str) -> Demo {
        match self {
            // `--log-sync`: a line is written before the demo goes on.
            Self::Commands => Demo::start_with_env(
                &[
                    "--database-url",
                    url,
                    "--publish-delay-ms",
                    PUBLISH_DELAY_MS,
                    "--log-sync",
                ],
                &[],
            ),
            // `serve` only: no relay, so nothing but the requests writes.
            Self::Outbox => Demo::example("outbox", &["serve", "--database-url", url], &[]),
        }
    }

    /// The table of the handler's rows, and the column that holds the request's key.
    fn rows(self) -> (&'static str, &'static str) {
        match self {
            Self::Commands => ("commands", "device_id"),
            Self::Outbox => ("sent_payments", "account"),
        }
    }

    /// Sends `key` to the replica at `url`.
    async fn send(self, http: &HttpClient, url: &str, key: &str) -> Result<Reply, String> {
        let (path, body) = match self {
            Self::Commands => (
                "commands",
                json!({"device_id": key, "name": "reboot", "payload": {"key": key}}),
            ),
            Self::Outbox => (
                "payments",
                json!({"payments": [{"account": key, "amount": 1}]}),
            ),
        };
        try_send(
            http,
            "POST",
            format!("{url}/{path}"),
            &[
                ("content-type", "application/json"),
                ("x-api-key", "db-crash"),
                ("idempotency-key", key),
            ],
            &body.to_string(),
        )
        .await
        .map_err(|error| error.to_string())
    }

    /// The deferred constraint trigger that stalls the `COMMIT` of a transaction that
    /// wrote a row of a key in `commit_stalls`, for that key's `seconds`, on the server
    /// as it was when the key was put there: once the server has restarted (its
    /// postmaster's start time differs), the key's `COMMIT`s run at once. (Removing the
    /// key after the restart would be a write, whose transaction would take the lost ID
    /// before the traffic could.)
    fn commit_stall(self) -> String {
        let (table, column) = self.rows();
        format!(
            "CREATE TABLE commit_stalls (
                 key text PRIMARY KEY,
                 seconds float8 NOT NULL,
                 server_start timestamptz NOT NULL DEFAULT pg_postmaster_start_time());
             CREATE FUNCTION stall_commit() RETURNS trigger LANGUAGE plpgsql AS $$
             DECLARE pause float8;
             BEGIN
                 SELECT seconds INTO pause FROM commit_stalls
                     WHERE key = NEW.{column} AND server_start = pg_postmaster_start_time();
                 IF FOUND THEN
                     PERFORM pg_sleep(pause);
                 END IF;
                 RETURN NULL;
             END $$;
             CREATE CONSTRAINT TRIGGER stall_commit AFTER INSERT ON {table}
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION stall_commit();"
        )
    }
}

/// `url` with `application_name=name`.
fn named(url: &str, name: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}application_name={name}")
}

/// `201`, `503 CODE`, or `no answer`.
fn label(answer: &Result<Reply, String>) -> String {
    match answer {
        Ok(reply) => match reply.problem_code() {
            Some(code) => format!("{} {code}", reply.status.as_str()),
            None => reply.status.as_str().to_owned(),
        },
        Err(_) => "no answer".to_owned(),
    }
}

/// Polls `pg_stat_activity` until A's backend that holds the key's advisory lock (the
/// one-key form, `objsubid` 1) runs its `COMMIT`; that transaction's ID.
async fn committing(observer: &mut PgConnection) -> String {
    let until = Instant::now() + WATCH_LIMIT;
    loop {
        let row: Option<(Option<String>, Option<String>, Option<String>)> = sqlx::query_as(
            "SELECT a.state, a.query, a.backend_xid::text FROM pg_stat_activity a \
             JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted \
                 AND l.objsubid = 1 \
             WHERE a.application_name = $1 LIMIT 1",
        )
        .bind(REPLICA_A)
        .fetch_optional(&mut *observer)
        .await
        .unwrap();
        if let Some((Some(state), Some(query), Some(xid))) = row {
            if state == "active" && query == "COMMIT" {
                return xid;
            }
        }
        assert!(
            Instant::now() < until,
            "A's COMMIT was not seen running within {WATCH_LIMIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Fresh keys sent to B by [`CLIENTS`] clients until `stop`, each a transaction that
/// takes a transaction ID; every key answered `201`.
async fn traffic(example: Example, b: String, trial: usize, stop: Arc<AtomicBool>) -> Vec<String> {
    let clients = (0..CLIENTS).map(|client_n| {
        let (b, stop) = (b.clone(), stop.clone());
        tokio::spawn(async move {
            let http = client();
            let mut created = Vec::new();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let key = format!("traffic-{trial}-{client_n}-{n}");
                match example.send(&http, &b, &key).await {
                    Ok(reply) if reply.status == StatusCode::CREATED => created.push(key),
                    // The server is still recovering, or B's pool reconnecting.
                    _ => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
            created
        })
    });
    let mut created = Vec::new();
    for client in clients {
        created.extend(client.await.unwrap());
    }
    created
}

/// Connects to `url`, trying for up to 10 s (the server may still be recovering).
async fn connect(url: &str) -> PgConnection {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        match PgConnection::connect(url).await {
            Ok(connection) => return connection,
            Err(error) => {
                assert!(Instant::now() < until, "cannot connect to {url}: {error}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// What one trial saw, for the summary.
struct Seen {
    answer: String,
    committed: bool,
    /// From the server's return to A's answer; negative if A answered before it.
    after_return_ms: i128,
    xid_reused: bool,
    /// The checks this trial failed.
    problems: Vec<String>,
}

/// One trial: `key` to A, the server killed `kill_at` after A's `COMMIT` was seen
/// running and started again; B's traffic from its return on; then, if `retry`, the
/// key sent to B and A in turn until a `201`. `None` without server binaries.
async fn trial(example: Example, n: usize, retry: bool, kill_at: Duration) -> Option<Seen> {
    let mut server = PostgresServer::start()?;
    let mut observer = connect(&server.url()).await;
    for statement in [
        format!("ALTER SYSTEM SET wal_writer_delay = '{WAL_WRITER_DELAY}'"),
        "SELECT pg_reload_conf()".to_owned(),
    ] {
        sqlx::raw_sql(&statement)
            .execute(&mut observer)
            .await
            .unwrap();
    }
    let (a_url, b_url) = (
        named(&server.url(), REPLICA_A),
        named(&server.url(), REPLICA_B),
    );
    let (a, b) = tokio::join!(
        tokio::task::spawn_blocking(move || example.start(&a_url)),
        tokio::task::spawn_blocking(move || example.start(&b_url)),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let key = format!("crash-{n}-{}", if retry { "retried" } else { "alone" });
    let (table, column) = example.rows();

    sqlx::raw_sql(&example.commit_stall())
        .execute(&mut observer)
        .await
        .unwrap();
    sqlx::query("INSERT INTO commit_stalls (key, seconds) VALUES ($1, $2)")
        .bind(&key)
        .bind(SLOW_COMMIT.as_secs_f64())
        .execute(&mut observer)
        .await
        .unwrap();

    let first = tokio::spawn({
        let (url, key) = (a.url.clone(), key.clone());
        async move {
            let answer =
                tokio::time::timeout(Duration::from_secs(20), example.send(&client(), &url, &key))
                    .await
                    .unwrap_or_else(|_| Err("no answer within 20 s".to_owned()));
            (answer, Instant::now())
        }
    });
    // The handler wrote and answered; the layer stored the record and sent the COMMIT,
    // which the trigger stalls. The kill lands in it, before the WAL of the
    // transaction's writes has left the server's memory: its ID is lost.
    let lost = committing(&mut observer).await;
    tokio::time::sleep(kill_at).await;
    drop(observer);
    let (server, back) = tokio::task::spawn_blocking(move || {
        server.kill();
        std::thread::sleep(DOWN);
        server.restart();
        (server, Instant::now())
    })
    .await
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = tokio::spawn(traffic(example, b.url.clone(), n, stop.clone()));

    let (first, first_at) = first.await.unwrap();
    let mut retries = Vec::new();
    let mut created_by_retry = None;
    if retry {
        let http = client();
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let node = if retries.len() % 2 == 0 { &b } else { &a };
            let answer = example.send(&http, &node.url, &key).await;
            retries.push(label(&answer));
            if let Ok(reply) = answer {
                if reply.status == StatusCode::CREATED {
                    created_by_retry = Some(reply);
                    break;
                }
            }
            assert!(
                back.elapsed() < GIVE_UP,
                "{example}: no 201 within {GIVE_UP:?} of the server's return: {retries:?}"
            );
        }
    } else {
        // Long enough for the traffic to take the lost transaction ID.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let created = traffic.await.unwrap();

    let mut check = connect(&server.url()).await;
    let rows: i64 =
        sqlx::query_scalar(&format!("SELECT count(*) FROM {table} WHERE {column} = $1"))
            .bind(&key)
            .fetch_one(&mut check)
            .await
            .unwrap();
    let stored: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT {column} FROM {table} WHERE {column} = ANY($1)"
    ))
    .bind(&created)
    .fetch_all(&mut check)
    .await
    .unwrap();
    let missing: Vec<&String> = created.iter().filter(|k| !stored.contains(k)).collect();
    // The rows whose creating transaction was given the lost ID again.
    let reused_by: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT {column} FROM {table} WHERE xmin::text = $1"
    ))
    .bind(&lost)
    .fetch_all(&mut check)
    .await
    .unwrap();
    let xid_reused = reused_by.iter().any(|k| created.contains(k));
    // What `pg_xact_status` says of the lost ID now: what the layer used to trust.
    let status: String = sqlx::query_scalar(
        "SELECT CASE WHEN $1::text::xid8 < pg_snapshot_xmax(pg_current_snapshot()) \
             THEN coalesce(pg_xact_status($1::text::xid8), 'unknown') \
             ELSE 'never handed out again' END",
    )
    .bind(&lost)
    .fetch_one(&mut check)
    .await
    .unwrap();
    drop(check);

    let answer = label(&first);
    // A's request committed if its row stands: alone, the key's one row; retried, a
    // row the retry's 201 replays (a retry that ran again made its own, and A's did not
    // commit).
    let committed = rows == 1 && created_by_retry.as_ref().is_none_or(Reply::replayed);
    let after_return_ms = match first_at.checked_duration_since(back) {
        Some(after) => after.as_millis() as i128,
        None => -(back.duration_since(first_at).as_millis() as i128),
    };
    eprintln!(
        "{example}, trial {n}, retried: {retry}, killed {} ms into the COMMIT: A answered {answer} {after_return_ms} ms after the server's return; retries {retries:?}; rows of the key {rows}, A's request committed: {committed}; traffic: {} keys answered 201, {} missing; lost transaction {lost} reused by the traffic: {xid_reused} (rows with it as xmin: {reused_by:?}; pg_xact_status now: {status})",
        kill_at.as_millis(),
        created.len(),
        missing.len(),
    );
    drop((a, b, server));

    // What went wrong, told at the end of the test: every trial runs and prints its
    // line.
    let mut problems = Vec::new();
    if !missing.is_empty() {
        problems.push(format!("B answered 201 for keys with no row: {missing:?}"));
    }
    let a_created = matches!(&first, Ok(reply) if reply.status == StatusCode::CREATED);
    if a_created && !committed {
        problems.push(format!(
            "A answered 201 for a request whose row is not in the database after recovery (rows of the key {rows}, retries {retries:?}; lost transaction {lost}, reused by the traffic: {xid_reused})"
        ));
    }
    if let (true, Ok(first), Some(retried)) = (a_created, &first, &created_by_retry) {
        if first.body != retried.body {
            problems.push("the retry's 201 is not A's".to_owned());
        }
    }
    if retry {
        if rows != 1 {
            problems.push(format!("{rows} rows for the retried key, not exactly one"));
        }
        let before = &retries[..retries.len() - 1];
        if !before
            .iter()
            .all(|r| r.starts_with("409 ") || r.starts_with("503 "))
        {
            problems.push(format!("before the 201 not only 409 or 503: {retries:?}"));
        }
    } else if rows > 1 {
        problems.push(format!("{rows} rows for the key, more than one"));
    }
    Some(Seen {
        answer,
        committed,
        after_return_ms,
        xid_reused,
        problems: problems
            .into_iter()
            .map(|problem| format!("{example}, trial {n}: {problem}"))
            .collect(),
    })
}

/// Runs the trials of `example` and prints the summary (nothing without server
/// binaries).
async fn trials(example: Example) {
    // One test at a time: the staging is a matter of milliseconds, and two servers
    // and four demos at once on a small machine would move them.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = ONE_AT_A_TIME.lock().await;
    let trials = if full_trials() { 12 } else { 3 };
    let mut seen = Vec::new();
    for n in 0..trials {
        let kill_at = Duration::from_millis(30 + 20 * (n as u64 % 3));
        let Some(one) = trial(example, n, n % 2 == 0, kill_at).await else {
            return;
        };
        seen.push(one);
    }
    let reused = seen.iter().filter(|s| s.xid_reused).count();
    let mut answers: Vec<(String, usize)> = Vec::new();
    for s in &seen {
        match answers.iter_mut().find(|(answer, _)| *answer == s.answer) {
            Some((_, count)) => *count += 1,
            None => answers.push((s.answer.clone(), 1)),
        }
    }
    let committed = seen.iter().filter(|s| s.committed).count();
    let after: Vec<i128> = seen.iter().map(|s| s.after_return_ms).collect();
    eprintln!(
        "{example}: {trials} trials; A answered {answers:?} (ms after the server's return: {after:?}); the key's first request committed in {committed}; the lost transaction ID reused by B's traffic in {reused}; {} trials failed a check",
        seen.iter().filter(|s| !s.problems.is_empty()).count()
    );
    let problems: Vec<&String> = seen.iter().flat_map(|s| &s.problems).collect();
    assert!(
        problems.is_empty(),
        "{} problems: {problems:#?}",
        problems.len()
    );
    assert!(
        reused > 0,
        "{example}: no trial's lost transaction ID was handed out again to B's traffic: the trials no longer stage the hazard they are for"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_never_answers_201_for_a_commit_the_server_crash_took() {
    trials(Example::Commands).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_serve_never_answers_201_for_a_commit_the_server_crash_took() {
    trials(Example::Outbox).await;
}
