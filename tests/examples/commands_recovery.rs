//! Measured recovery in DB mode: how long after its owner dies a duplicate on another
//! replica gets its `201`.
//!
//! Two replicas of the `commands` demo on one PostgreSQL database: A, whose database
//! connections go through a TCP proxy run by this test, and B, connected directly. In
//! each trial a fresh key is sent to A, the fault is applied at a random moment inside
//! the placement's window, and the same key is sent to B every 10 ms until B answers
//! `201`; the time from the fault to that `201` is the recovery. The faults:
//!
//! - SIGKILL of A (then A is started again);
//! - `pg_terminate_backend` of the backend of A's open transaction;
//! - every connection of A's through the proxy closed, both sides (a cut): new ones
//!   pass at once, or, in one variant, are refused until A has answered, so that A
//!   cannot ask the database what became of a `COMMIT` it sent.
//!
//! The placements, told from `pg_stat_activity` (the backend that holds the key's
//! advisory lock, A's by its `application_name`): while A's handler sleeps before its
//! writes (`--handler-delay-ms`), while it sleeps after them (`--commit-delay-ms`), and
//! while its `COMMIT` runs. A `COMMIT` on a quiet local database takes well under a
//! millisecond, too short to land a fault in; so the test's database stalls A's commits
//! by [`COMMIT_STALL_MS`] (a deferred constraint trigger on the outbox table,
//! `tower_ids_outbox`, that sleeps, which runs inside the `COMMIT`), as an fsync stall
//! or a slow synchronous standby would.
//! Each trial is classified afterwards from what committed and from A's log (written
//! line by line, `--log-sync`): in the claim (its last answer cut on its way to A),
//! before the writes, after them and before the `COMMIT`, during the `COMMIT` (it
//! committed and A never learned it, or A learned it only by asking, or A was told the
//! `COMMIT` failed), after it.
//!
//! Every trial checks: B's `201` within a second of the fault; exactly one command and
//! one outbox row for the key, committed by A's attempt if B's `201` is a replay and
//! by B's if not; an answer of A's, when there is one, that never claims what did not
//! happen (a `201` only for A's committed command, the same bytes B replays; else a
//! `503` `idempotency.not_committed` when nothing of A's committed,
//! `idempotency.outcome_unknown` when A could not tell, the handler's own `503`
//! `commands.database_unavailable` for a fault before its writes, or `503`
//! `idempotency.store_unavailable` for a claim that failed); and a later retry that
//! replays B's `201` byte for byte.
//!
//! The figures (trials, min/median/max recovery per fault and placement, where each
//! fault landed) are printed:
//! `cargo test --all-features --test commands_recovery -- --nocapture`. Like the other
//! PostgreSQL tests it creates a database of its own on `TOWER_IDS_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/postgres`), drops it at the end, and
//! without a server prints `SKIPPED` and passes, except in CI (`CI` set).

use tower_ids_test_support::postgres as database;
#[path = "demo.rs"]
mod demo;
use tower_ids_test_support as support;

use std::{
    collections::BTreeMap,
    fmt,
    net::SocketAddr,
    ops::Range,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use database::TestDatabase;
use demo::Demo;
use http::StatusCode;
use rand::seq::SliceRandom;
use serde_json::{json, Value};
use sqlx::{postgres::PgConnectOptions, PgConnection};
use support::{client, try_send, HttpClient, Reply};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinHandle,
};

/// Trials per fault and placement.
const TRIALS: usize = 20;

/// `--handler-delay-ms` of A: its handler sleeps this long, holding the key, before
/// its writes.
const HANDLER_DELAY_MS: u64 = 60;

/// `--commit-delay-ms` of A: its handler sleeps this long after its writes, before it
/// answers and the layer commits.
const COMMIT_DELAY_MS: u64 = 60;

/// How long each `COMMIT` of A's takes: a deferred trigger sleeps this long inside it.
const COMMIT_STALL_MS: u64 = 40;

/// `--store-timeout-ms` of A: a `COMMIT` that gets no answer is looked into for five
/// of these (1 s) before A answers `outcome_unknown`.
const STORE_TIMEOUT_MS: u64 = 200;

/// The pause between two of B's attempts.
const RETRY_PAUSE: Duration = Duration::from_millis(10);

/// What the issue asks: B's `201` within this of the fault.
const RECOVERY_LIMIT: Duration = Duration::from_secs(1);

/// B's attempts stop after this (a failed trial).
const GIVE_UP: Duration = Duration::from_secs(10);

/// How long the test waits to see A's transaction reach a placement's window.
const WATCH_LIMIT: Duration = Duration::from_secs(3);

/// A's `application_name`, by which `pg_stat_activity` tells its backends.
const REPLICA_A: &str = "replica-a";

/// The fault applied to A.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    /// SIGKILL of the process.
    Kill,
    /// `pg_terminate_backend` of its open transaction's backend.
    Terminate,
    /// Every connection through the proxy closed, both sides; new ones pass.
    Cut,
    /// A cut, and the proxy refuses new connections until A has answered.
    CutAndRefuse,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Kill => "SIGKILL of A",
            Self::Terminate => "pg_terminate_backend",
            Self::Cut => "proxy cut",
            Self::CutAndRefuse => "proxy cut, A refused until it answers",
        })
    }
}

/// Where in A's request the fault is aimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Placement {
    /// The key held, the handler sleeping before its writes.
    BeforeWrites,
    /// The writes done, the handler sleeping before it answers.
    BeforeCommit,
    /// The `COMMIT` running (in its stall).
    InCommit,
}

impl Placement {
    /// When the fault comes, after the window was seen to open.
    fn window(self) -> Range<u64> {
        match self {
            Self::BeforeWrites => 0..HANDLER_DELAY_MS - 20,
            Self::BeforeCommit => 0..COMMIT_DELAY_MS - 20,
            Self::InCommit => 0..COMMIT_STALL_MS - 15,
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::BeforeWrites => "before the handler's writes",
            Self::BeforeCommit => "after the writes, before the COMMIT",
            Self::InCommit => "during the COMMIT",
        })
    }
}

/// Where the fault landed, told afterwards from what committed and from A's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Landed {
    /// The layer had not logged the key accepted (`idempotency.accepted`): the fault
    /// cut the claim's last answer on its way to A, and the handler never ran.
    InClaim,
    /// The handler had not logged its writes (`commands.created`).
    BeforeWrites,
    /// It had, and nothing says its `COMMIT` was sent.
    BeforeCommit,
    /// The `COMMIT` was sent and the fault cut it: it committed and A never logged
    /// the record stored, or A had to ask the database (`commit_confirmed`,
    /// `outcome_unknown`), or A was told the `COMMIT` itself failed.
    InCommit,
    /// A's `COMMIT` had returned (`idempotency.stored` logged).
    AfterCommit,
}

impl fmt::Display for Landed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InClaim => "in the claim (the handler never ran)",
            Self::BeforeWrites => "before the writes",
            Self::BeforeCommit => "between the writes and the COMMIT",
            Self::InCommit => "during the COMMIT",
            Self::AfterCommit => "after the COMMIT",
        })
    }
}

/// The faults and placements measured, [`TRIALS`] each.
const MATRIX: [(Fault, Placement); 10] = [
    (Fault::Kill, Placement::BeforeWrites),
    (Fault::Kill, Placement::BeforeCommit),
    (Fault::Kill, Placement::InCommit),
    (Fault::Terminate, Placement::BeforeWrites),
    (Fault::Terminate, Placement::BeforeCommit),
    (Fault::Terminate, Placement::InCommit),
    (Fault::Cut, Placement::BeforeWrites),
    (Fault::Cut, Placement::BeforeCommit),
    (Fault::Cut, Placement::InCommit),
    (Fault::CutAndRefuse, Placement::InCommit),
];

/// One trial's figures.
struct Trial {
    fault: Fault,
    placement: Placement,
    landed: Landed,
    /// From the fault to B's `201`.
    recovery: Duration,
    /// `no answer`, `201`, or `503 CODE`.
    answered: String,
    committed_by_a: bool,
    /// B's answers before its `201`.
    waited: Vec<String>,
}

/// A TCP proxy to the database for A's connections, which the test can cut.
struct Proxy {
    addr: SocketAddr,
    cut: Arc<watch::Sender<u64>>,
    refusing: Arc<AtomicBool>,
}

impl Proxy {
    async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(watch::channel(0_u64).0);
        let refusing = Arc::new(AtomicBool::new(false));
        let (cuts, refuse) = (cut.clone(), refusing.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                if refuse.load(Ordering::SeqCst) {
                    continue;
                }
                let mut cut = cuts.subscribe();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    // The protocol's small messages go at once, as on a direct connection.
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.changed() => {}
                    }
                    // Both dropped here: each side sees its connection closed.
                });
            }
        });
        Self {
            addr,
            cut,
            refusing,
        }
    }

    /// Closes every connection through the proxy, both sides.
    fn cut(&self) {
        self.cut.send_modify(|generation| *generation += 1);
    }

    fn refuse(&self, refuse: bool) {
        self.refusing.store(refuse, Ordering::SeqCst);
    }
}

/// `host:port` of the database `url` names.
fn upstream(url: &str) -> String {
    let options: PgConnectOptions = url.parse().unwrap();
    format!("{}:{}", options.get_host(), options.get_port())
}

/// `url` with its host and port replaced by `proxy`, and A's `application_name`.
fn through(url: &str, proxy: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let user = authority
        .rsplit_once('@')
        .map(|(user, _)| format!("{user}@"))
        .unwrap_or_default();
    let separator = if path.contains('?') { '&' } else { '?' };
    format!("{scheme}://{user}{proxy}/{path}{separator}application_name={REPLICA_A}")
}

/// The deferred trigger that makes each `COMMIT` of A's take [`COMMIT_STALL_MS`]: it
/// runs inside the `COMMIT`, before the commit record is written. B's commits are not
/// stalled.
fn commit_stall() -> String {
    format!(
        "CREATE FUNCTION stall_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF current_setting('application_name') = '{REPLICA_A}' THEN
                 PERFORM pg_sleep({seconds});
             END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER stall_commit AFTER INSERT ON tower_ids_outbox
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION stall_commit();",
        seconds = COMMIT_STALL_MS as f64 / 1000.0
    )
}

/// Starts a replica on `url` with `extra` flags (off the runtime's threads: it waits
/// for the demo to say where it listens).
fn start(url: &str, extra: &[String]) -> JoinHandle<Demo> {
    let mut args = vec!["--database-url".to_owned(), url.to_owned()];
    args.extend_from_slice(extra);
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // The handler's `commands.created` and the layer's `idempotency.stored` (DEBUG)
        // say where a fault landed.
        Demo::start_with_env(
            &args,
            &[("RUST_LOG", "info,commands=debug,tower_ids=debug")],
        )
    })
}

/// Starts replica A on `url` (the proxy's).
fn start_a(url: &str) -> JoinHandle<Demo> {
    let flags = [
        ("--handler-delay-ms", HANDLER_DELAY_MS),
        ("--commit-delay-ms", COMMIT_DELAY_MS),
        ("--store-timeout-ms", STORE_TIMEOUT_MS),
    ];
    let mut extra: Vec<String> = flags
        .iter()
        .flat_map(|(flag, ms)| [(*flag).to_owned(), ms.to_string()])
        .collect();
    // The log is the record of what ran before a kill: no line may die queued.
    extra.push("--log-sync".to_owned());
    start(url, &extra)
}

fn create_body(key: &str) -> String {
    json!({"device_id": key, "name": "reboot", "payload": {"key": key}}).to_string()
}

async fn create(
    http: &HttpClient,
    url: &str,
    key: &str,
    correlation_id: &str,
) -> Result<Reply, String> {
    try_send(
        http,
        "POST",
        format!("{url}/commands"),
        &[
            ("content-type", "application/json"),
            ("x-api-key", "recovery"),
            ("idempotency-key", key),
            ("x-correlation-id", correlation_id),
        ],
        &create_body(key),
    )
    .await
    .map_err(|error| error.to_string())
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

/// What A's request's transaction was seen doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Idle in transaction after the claim's last statement (the read under the key's
    /// lock, an `UPDATE` that counts the request), nothing written.
    Held,
    /// Idle in transaction after the outbox insert.
    Written,
    /// Running its `COMMIT`.
    Committing,
    Other,
}

impl Placement {
    fn seen(self) -> Seen {
        match self {
            Self::BeforeWrites => Seen::Held,
            Self::BeforeCommit => Seen::Written,
            Self::InCommit => Seen::Committing,
        }
    }
}

/// Polls `pg_stat_activity` until the backend of A's that holds the key's advisory lock
/// is in `placement`'s window; its PID, or `None` if it was not seen there within
/// [`WATCH_LIMIT`]. The key's lock is the one-key form (`objsubid` 1); the outbox's
/// locks, on a partition key in the request's transaction and in the relay's rounds, are
/// the two-key form (2).
async fn watch_for(observer: &mut PgConnection, placement: Placement) -> Option<i32> {
    let until = Instant::now() + WATCH_LIMIT;
    while Instant::now() < until {
        let row: Option<(i32, Option<String>, Option<String>)> = sqlx::query_as(
            "SELECT a.pid, a.state, a.query FROM pg_stat_activity a \
             JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted \
                 AND l.objsubid = 1 \
             WHERE a.datname = current_database() AND a.application_name = $1 \
             LIMIT 1",
        )
        .bind(REPLICA_A)
        .fetch_optional(&mut *observer)
        .await
        .unwrap();
        if let Some((pid, state, query)) = row {
            let (state, query) = (state.unwrap_or_default(), query.unwrap_or_default());
            let seen = match state.as_str() {
                "active" if query == "COMMIT" => Seen::Committing,
                // The enqueue's one statement: its `INSERT` inside a `WITH`.
                "idle in transaction" if query.contains("INSERT INTO tower_ids_outbox") => {
                    Seen::Written
                }
                "idle in transaction" if query.starts_with("UPDATE") => Seen::Held,
                _ => Seen::Other,
            };
            if seen == placement.seen() {
                return Some(pid);
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    None
}

/// Sends `key` to B every [`RETRY_PAUSE`] from `fault` until it answers `201`: that
/// answer, its attempt's correlation ID, when it came, and every answer before it.
async fn retry_on_b(
    http: &HttpClient,
    b: &str,
    key: &str,
    fault: Instant,
) -> (Option<(Reply, String)>, Duration, Vec<String>) {
    let mut waited = Vec::new();
    for n in 1.. {
        let correlation_id = format!("{key}:B{n}");
        let answer = create(http, b, key, &correlation_id).await;
        if matches!(&answer, Ok(reply) if reply.status == StatusCode::CREATED) {
            return (
                Some((answer.unwrap(), correlation_id)),
                fault.elapsed(),
                waited,
            );
        }
        waited.push(label(&answer));
        if fault.elapsed() > GIVE_UP {
            break;
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
    (None, fault.elapsed(), waited)
}

/// The `event` codes A logged in the request with `correlation_id`, with each line.
fn events_of<'a>(lines: &'a [Value], correlation_id: &str) -> Vec<(&'a str, &'a Value)> {
    lines
        .iter()
        .filter(|line| line["span"]["correlation_id"] == correlation_id)
        .filter_map(|line| Some((line["fields"]["event"].as_str()?, line)))
        .collect()
}

/// The replicas, the proxy and the connection that watches and counts.
struct Bench {
    http: HttpClient,
    b: Demo,
    a: Option<Demo>,
    /// A started again after a kill, in the background.
    next_a: Option<JoinHandle<Demo>>,
    a_url: String,
    proxy: Proxy,
    observer: PgConnection,
}

impl Bench {
    /// One trial; `None` if A's transaction was not seen in the placement's window (the
    /// request ran to its end untouched, and the trial is run again).
    async fn trial(
        &mut self,
        fault: Fault,
        placement: Placement,
        n: usize,
        problems: &mut Vec<String>,
    ) -> Option<Trial> {
        if self.a.is_none() {
            let next = match self.next_a.take() {
                Some(next) => next,
                None => start_a(&self.a_url),
            };
            self.a = Some(next.await.unwrap());
        }
        let a = self.a.as_ref().unwrap();
        let key = format!("{fault:?}-{placement:?}-{n}").to_lowercase();
        let a_attempt = format!("{key}:A");
        let sent = {
            let (http, url, key, id) = (client(), a.url.clone(), key.clone(), a_attempt.clone());
            tokio::spawn(async move { create(&http, &url, &key, &id).await })
        };

        let Some(pid) = watch_for(&mut self.observer, placement).await else {
            let answered = sent.await.unwrap();
            println!(
                "{key}: not seen {placement}; A answered {}",
                label(&answered)
            );
            return None;
        };
        let offset = rand::random_range(placement.window());
        tokio::time::sleep(Duration::from_millis(offset)).await;

        let fault_at = Instant::now();
        let mut killed = None;
        match fault {
            Fault::Kill => {
                let mut dead = self.a.take().unwrap();
                killed = Some(tokio::task::spawn_blocking(move || {
                    dead.kill();
                    dead.lines()
                }));
            }
            Fault::Terminate => {
                sqlx::query("SELECT pg_terminate_backend($1)")
                    .bind(pid)
                    .execute(&mut self.observer)
                    .await
                    .unwrap();
            }
            Fault::Cut => self.proxy.cut(),
            Fault::CutAndRefuse => {
                self.proxy.refuse(true);
                self.proxy.cut();
            }
        }
        let (created, recovery, waited) = retry_on_b(&self.http, &self.b.url, &key, fault_at).await;
        let answered = tokio::time::timeout(Duration::from_secs(10), sent)
            .await
            .map_or_else(|_| Err("A took over 10 s".to_owned()), Result::unwrap);
        self.proxy.refuse(false);

        // A's log: all of it when it was killed (and A is started again meanwhile), else
        // once its access line for this request has been read.
        let lines = match killed {
            Some(killed) => {
                self.next_a = Some(start_a(&self.a_url));
                killed.await.unwrap()
            }
            None => {
                let a = self.a.as_ref().unwrap();
                for _ in 0..200 {
                    let lines = a.lines();
                    if events_of(&lines, &a_attempt)
                        .iter()
                        .any(|(event, _)| *event == "http.access")
                    {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                a.lines()
            }
        };

        let mut problem =
            |what: String| problems.push(format!("{key} ({fault}, {placement}): {what}"));
        let Some((created, b_attempt)) = created else {
            problem(format!("B never answered 201: {waited:?}"));
            return None;
        };
        if recovery >= RECOVERY_LIMIT {
            problem(format!("B's 201 came {recovery:?} after the fault"));
        }
        if let Some(other) = waited.iter().find(|w| *w != "409 idempotency.in_flight") {
            problem(format!("B answered {other} before its 201"));
        }

        // Exactly one command and one outbox row, committed by A if B replayed, else by B.
        let rows: Vec<(String, i64, Option<String>)> = sqlx::query_as(
            "SELECT c.id::text, count(o.id), min(o.correlation_id) \
             FROM commands c LEFT JOIN tower_ids_outbox o \
               ON convert_from(o.payload, 'UTF8')::json ->> 'command_id' = c.id::text \
             WHERE c.device_id = $1 GROUP BY c.id",
        )
        .bind(&key)
        .fetch_all(&mut self.observer)
        .await
        .unwrap();
        let [(id, outbox_rows, committed_by)] = &rows[..] else {
            problem(format!("{} commands", rows.len()));
            return None;
        };
        let committed_by = committed_by.as_deref().unwrap_or_default();
        if *outbox_rows != 1 {
            problem(format!("{outbox_rows} outbox rows"));
        }
        if created.json()["id"] != id.as_str() {
            problem(format!(
                "B answered {} for command {id}",
                created.json()["id"]
            ));
        }
        let committed_by_a = committed_by == a_attempt;
        let expected = if created.replayed() {
            &a_attempt
        } else {
            &b_attempt
        };
        if committed_by != expected {
            problem(format!(
                "committed by {committed_by}, B's 201 (replayed: {}) by {b_attempt}",
                created.replayed()
            ));
        }

        // A later retry replays B's 201, byte for byte.
        let later = create(&self.http, &self.b.url, &key, &format!("{key}:later")).await;
        match &later {
            Ok(later) if later.replayed_created() && later.body == created.body => {}
            _ => problem(format!("a later retry answered {}", label(&later))),
        }

        // Where the fault landed.
        let events = events_of(&lines, &a_attempt);
        let logged = |code: &str| events.iter().any(|(event, _)| *event == code);
        let commit_cut = events.iter().any(|(event, line)| {
            *event == "idempotency.commit_failed"
                && line["fields"]["error"]
                    .as_str()
                    .is_some_and(|error| error.contains("committing the request's transaction"))
        });
        let landed = if !logged("idempotency.accepted") {
            Landed::InClaim
        } else if !logged("commands.created") {
            Landed::BeforeWrites
        } else if (committed_by_a && !logged("idempotency.stored"))
            || logged("idempotency.commit_confirmed")
            || logged("idempotency.outcome_unknown")
            || commit_cut
        {
            Landed::InCommit
        } else if committed_by_a {
            Landed::AfterCommit
        } else {
            Landed::BeforeCommit
        };

        // What A answered claims only what happened.
        let a_answer = label(&answered);
        match (&answered, a_answer.as_str()) {
            (Err(_), _) if fault == Fault::Kill => {}
            (Ok(reply), "201") => {
                if !committed_by_a {
                    problem(format!("A answered 201, but {committed_by} committed"));
                }
                if reply.body != created.body {
                    problem("A's 201 and B's differ".to_owned());
                }
            }
            (Ok(_), "503 idempotency.outcome_unknown") => {}
            (Ok(_), "503 idempotency.not_committed") if !committed_by_a => {}
            // The handler's own answer: its write failed, and the layer rolled back.
            (Ok(_), "503 commands.database_unavailable")
                if !committed_by_a && landed == Landed::BeforeWrites => {}
            // The layer's answer when the claim failed: nothing ran.
            (Ok(_), "503 idempotency.store_unavailable")
                if !committed_by_a && landed == Landed::InClaim => {}
            _ => problem(format!(
                "A answered {a_answer} ({landed}, committed by {committed_by})"
            )),
        }

        Some(Trial {
            fault,
            placement,
            landed,
            recovery,
            answered: a_answer,
            committed_by_a,
            waited,
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_on_another_replica_runs_within_a_second_of_the_owners_fault() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let began = Instant::now();
    // B first: it creates the tables, on which the stall goes before A starts.
    let b = start(database.url(), &[]).await.unwrap();
    let mut observer = database.pool(1).await.acquire().await.unwrap().detach();
    sqlx::raw_sql(&commit_stall())
        .execute(&mut observer)
        .await
        .unwrap();
    let proxy = Proxy::start(upstream(database.url())).await;
    let a_url = through(database.url(), proxy.addr);
    let a = start_a(&a_url).await.unwrap();
    let mut bench = Bench {
        http: client(),
        b,
        a: Some(a),
        next_a: None,
        a_url,
        proxy,
        observer,
    };

    let mut queue: Vec<(Fault, Placement)> = MATRIX
        .iter()
        .flat_map(|&cell| std::iter::repeat_n(cell, TRIALS))
        .collect();
    queue.shuffle(&mut rand::rng());
    let mut trials: Vec<Trial> = Vec::new();
    let mut problems = Vec::new();
    let (mut n, mut unseen) = (0, 0);
    while let Some((fault, placement)) = queue.pop() {
        n += 1;
        let failed = problems.len();
        match bench.trial(fault, placement, n, &mut problems).await {
            Some(trial) => trials.push(trial),
            // Failed: the problems say how.
            None if problems.len() > failed => {}
            None => {
                unseen += 1;
                assert!(unseen <= 20, "A's transaction went unseen in 20 trials");
                queue.push((fault, placement));
            }
        }
    }
    let took = began.elapsed();
    drop(bench);

    let mut cells: BTreeMap<(Fault, Placement), Vec<&Trial>> = BTreeMap::new();
    for trial in &trials {
        cells
            .entry((trial.fault, trial.placement))
            .or_default()
            .push(trial);
    }
    println!(
        "{} trials in {:.1} s (A: {HANDLER_DELAY_MS} ms before its writes, {COMMIT_DELAY_MS} ms \
         after them, each COMMIT stalled {COMMIT_STALL_MS} ms; B retried every {} ms); \
         {unseen} trials run again, their window not seen",
        trials.len(),
        took.as_secs_f64(),
        RETRY_PAUSE.as_millis()
    );
    for ((fault, placement), cell) in &cells {
        let mut times: Vec<f64> = cell
            .iter()
            .map(|t| t.recovery.as_secs_f64() * 1000.0)
            .collect();
        times.sort_by(f64::total_cmp);
        let median = if times.len() % 2 == 1 {
            times[times.len() / 2]
        } else {
            (times[times.len() / 2 - 1] + times[times.len() / 2]) / 2.0
        };
        let count = |f: &dyn Fn(&Trial) -> String| {
            let mut counts: BTreeMap<String, usize> = BTreeMap::new();
            for trial in cell {
                *counts.entry(f(trial)).or_default() += 1;
            }
            counts
                .iter()
                .map(|(what, n)| format!("{n} {what}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "{fault}, {placement}: {} trials, recovery min {:.1} ms, median {median:.1} ms, \
             max {:.1} ms",
            cell.len(),
            times[0],
            times[times.len() - 1]
        );
        println!("    landed: {}", count(&|t| t.landed.to_string()));
        println!("    A answered: {}", count(&|t| t.answered.clone()));
        println!(
            "    committed by: {}",
            count(&|t| if t.committed_by_a { "A" } else { "B" }.to_owned())
        );
        println!(
            "    B's 409s before its 201: {}",
            count(&|t| format!("x{}", t.waited.len()))
        );
    }

    assert!(
        problems.is_empty(),
        "{} problems: {problems:#?}",
        problems.len()
    );
    for (&(fault, placement), cell) in &cells {
        assert!(
            cell.len() >= TRIALS,
            "{fault}, {placement}: {} trials",
            cell.len()
        );
        let aimed = match placement {
            Placement::BeforeWrites => Landed::BeforeWrites,
            Placement::BeforeCommit => Landed::BeforeCommit,
            Placement::InCommit => Landed::InCommit,
        };
        let landed = cell.iter().filter(|t| t.landed == aimed).count();
        assert!(
            landed * 2 >= cell.len(),
            "{fault}, {placement}: only {landed} of {} landed {aimed}",
            cell.len()
        );
    }
    assert_eq!(cells.len(), MATRIX.len());
}
