//! The demo in DB mode, crashed on purpose: the `commands` example runs as a child
//! process on a PostgreSQL database of its own while clients create commands; it is
//! killed with SIGKILL at random moments and started again on the same database, and
//! every key is retried until it is answered `201`. Then the database is counted: one
//! command and one outbox message (in the library's `tower_ids_outbox`) per key, none
//! lost that was answered, and a retry of every key replays the answer its client first
//! read. And two replicas on one database: a create on one is replayed by the other,
//! which reads the command too.
//!
//! Each test creates a database of its own on the server at `TOWER_IDS_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/postgres`) and drops it at the end;
//! without a server the tests print `SKIPPED` and pass, except in CI (`CI` set).
//!
//! The tests build the example binary first (`tests/examples/demo.rs`), so `cargo test
//! --test commands_crash` runs alone. The figures (kill points per phase, executions
//! per key) are printed: `cargo test --test commands_crash -- --nocapture`.

use tower_ids_test_support::postgres as database;
#[path = "demo.rs"]
mod demo;
use tower_ids_test_support as support;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    ops::Range,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, RwLock,
    },
    time::{Duration, Instant},
};

use database::TestDatabase;
use demo::Demo;
use http::StatusCode;
use serde_json::{json, Value};
use sqlx::Row;
use support::{client, send, try_send, Reply};

/// Clients creating commands at once, each one key after another.
const CLIENTS: usize = 12;

/// Kill and restart cycles.
const CYCLES: usize = 60;

/// How long each run of the demo lasts before it is killed, drawn uniformly: from
/// before the first create has reached its insert to many creates in.
const RUN_MS: Range<u64> = 50..600;

/// How soon after a kill a `409` may still come. In DB mode a request's own
/// transaction holds its key: a killed request's backend sees its connection close and
/// aborts, and the key is free (tens of milliseconds, as `tests/examples/commands_recovery.rs`
/// measures; no lease to run out). Clients send nothing while the demo restarts, so a
/// `409` is rare, and one a second after a kill would be a key held by a dead request.
const KEY_FREED: Duration = Duration::from_secs(1);

/// `--handler-delay-ms`: each create sleeps this long before its insert.
const HANDLER_DELAY_MS: u64 = 20;

/// `--commit-delay-ms`: each create waits this long between its insert and its answer,
/// after which the layer commits.
const COMMIT_DELAY_MS: u64 = 20;

/// The pause of a client after an answer other than `201`, or a failed connection.
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// The longest one attempt may take; a healthy one takes about 50 ms.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// Starts the demo in DB mode on `database` (off the runtime's threads: it waits for
/// the demo to say where it listens).
async fn start(database: &TestDatabase, extra: &[&str]) -> Demo {
    let mut args: Vec<String> = [
        "--database-url",
        database.url(),
        // A store call slower than this (a busy machine while a restarted demo opens
        // its pool) is answered `503` with nothing run, and the client tries again,
        // rather than waiting out PostgreSQL's default 1 s.
        "--store-timeout-ms",
        "200",
        "--handler-delay-ms",
        &HANDLER_DELAY_MS.to_string(),
        "--commit-delay-ms",
        &COMMIT_DELAY_MS.to_string(),
        // The log is the record of what ran before each kill: no line may die queued.
        "--log-sync",
    ]
    .iter()
    .map(|arg| (*arg).to_owned())
    .collect();
    args.extend(extra.iter().map(|arg| (*arg).to_owned()));
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // The handler's `commands.created` (DEBUG) counts its executions.
        Demo::start_with_env(&args, &[("RUST_LOG", "info,commands=debug")])
    })
    .await
    .unwrap()
}

/// Kills `demo` with SIGKILL and returns its log, every line of it.
async fn kill(mut demo: Demo) -> Vec<Value> {
    tokio::task::spawn_blocking(move || {
        demo.kill();
        demo.lines()
    })
    .await
    .unwrap()
}

/// The correlation ID of the request (or delivery) a log line was logged in.
fn correlation_id(line: &Value) -> Option<&str> {
    line["span"]["correlation_id"].as_str()
}

fn event(line: &Value) -> &str {
    line["fields"]["event"].as_str().unwrap_or_default()
}

/// One `POST /commands` a client sent.
struct Attempt {
    /// The idempotency key, also the command's `device_id`.
    key: String,
    /// `KEY:aN` for the Nth attempt of the key.
    correlation_id: String,
    sent: Instant,
    ended: Instant,
    /// The answer, or why there was none.
    reply: Result<Reply, String>,
}

impl Attempt {
    fn created(&self) -> bool {
        matches!(&self.reply, Ok(reply) if reply.status == StatusCode::CREATED)
    }
}

/// What the clients share with the test: where the demo is (`None` while it is down),
/// and whether to stop after the key at hand.
#[derive(Default)]
struct Clients {
    url: RwLock<Option<String>>,
    stop: AtomicBool,
}

fn create_body(key: &str) -> String {
    json!({"device_id": key, "name": "reboot", "payload": {"key": key}}).to_string()
}

/// One client: keys `cN-0`, `cN-1`, ..., each sent until it is answered `201`, until
/// told to stop. Returns every attempt, in order.
async fn run_client(n: usize, clients: Arc<Clients>) -> Vec<Attempt> {
    let http = client();
    let mut attempts = Vec::new();
    for k in 0.. {
        if clients.stop.load(Ordering::SeqCst) {
            break;
        }
        let key = format!("c{n}-{k}");
        let body = create_body(&key);
        let mut tries = 0;
        loop {
            let Some(url) = clients.url.read().unwrap().clone() else {
                // The demo is down: nothing sent.
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            };
            tries += 1;
            let correlation_id = format!("{key}:a{tries}");
            let headers = [
                ("content-type", "application/json"),
                ("x-api-key", "crash-test"),
                ("idempotency-key", key.as_str()),
                ("x-correlation-id", correlation_id.as_str()),
            ];
            let sent = Instant::now();
            let reply = match tokio::time::timeout(
                ATTEMPT_TIMEOUT,
                try_send(&http, "POST", format!("{url}/commands"), &headers, &body),
            )
            .await
            {
                Ok(Ok(reply)) => Ok(reply),
                Ok(Err(error)) => Err(error.to_string()),
                Err(_) => Err("timed out".to_owned()),
            };
            let attempt = Attempt {
                key: key.clone(),
                correlation_id,
                sent,
                ended: Instant::now(),
                reply,
            };
            let created = attempt.created();
            attempts.push(attempt);
            if created {
                break;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }
    attempts
}

/// Where a kill found one client: the phase of its create in flight, or after the
/// answer to its last one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// A create in flight that had not inserted its command (not yet at the handler,
    /// in `--handler-delay-ms`, or answered `409` in the moment a killed request's
    /// backend still held its key).
    BeforeInsert,
    /// A create that had inserted its command (logged `commands.created`) and whose
    /// transaction had not committed: it leaves nothing.
    InsertedNotCommitted,
    /// A create whose key had committed (by this attempt, or an earlier one whose
    /// answer was lost), with the answer not yet read by the client.
    CommittedNotRead,
    /// No create in flight: the client had read the answer to its last one, and not
    /// sent the next yet.
    AfterAnswer(Read),
}

/// What a client had read when a kill found it between two creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Read {
    /// A `201`: its next key was about to go.
    Created,
    /// A `409` for a key a killed request's backend still held (rare, see
    /// [`KEY_FREED`]): it was pausing before a retry.
    Conflict,
    /// No answer (the demo was killed under it): it was pausing before a retry.
    Nothing,
}

impl Phase {
    fn describe(self) -> &'static str {
        match self {
            Self::BeforeInsert => "before the insert",
            Self::InsertedNotCommitted => "between the insert and the commit",
            Self::CommittedNotRead => "after the commit, before the answer was read",
            Self::AfterAnswer(Read::Created) => "a 201: the next key not sent yet",
            Self::AfterAnswer(Read::Conflict) => "a 409: pausing before a retry",
            Self::AfterAnswer(Read::Nothing) => {
                "no answer (killed under it): pausing before a retry"
            }
        }
    }
}

/// The join of a command (`c`) to its outbox messages (`o`): each message's payload is
/// the `command.created` event, which names its command.
const OUTBOX_JOIN: &str =
    "LEFT JOIN tower_ids_outbox o ON convert_from(o.payload, 'UTF8')::json ->> 'command_id' = c.id::text";

/// A command row, with its outbox rows.
struct CommandRow {
    id: String,
    status: String,
    outbox_rows: i64,
    /// The correlation ID of the attempt that committed it.
    correlation_id: Option<String>,
    sent: bool,
}

async fn commands_by_key(pool: &sqlx::PgPool) -> HashMap<String, Vec<CommandRow>> {
    let rows = sqlx::query(&format!(
        "SELECT c.device_id, c.id::text AS id, c.status, count(o.id) AS outbox_rows, \
                min(o.correlation_id) AS correlation_id, \
                coalesce(bool_and(o.published_at IS NOT NULL), false) AS sent \
         FROM commands c {OUTBOX_JOIN} GROUP BY c.id"
    ))
    .fetch_all(pool)
    .await
    .unwrap();
    let mut by_key: HashMap<String, Vec<CommandRow>> = HashMap::new();
    for row in rows {
        by_key
            .entry(row.get("device_id"))
            .or_default()
            .push(CommandRow {
                id: row.get("id"),
                status: row.get("status"),
                outbox_rows: row.get("outbox_rows"),
                correlation_id: row.get("correlation_id"),
                sent: row.get("sent"),
            });
    }
    by_key
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_random_moments_the_demo_creates_every_command_once() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let began = Instant::now();
    let pool = database.pool(4).await;

    let mut demo = start(&database, &[]).await;
    let clients = Arc::new(Clients::default());
    *clients.url.write().unwrap() = Some(demo.url.clone());
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|n| tokio::spawn(run_client(n, clients.clone())))
        .collect();

    // Kill, restart on a new port, repeat.
    let mut kills = Vec::new();
    let mut logs: Vec<Value> = Vec::new();
    for _ in 0..CYCLES {
        tokio::time::sleep(Duration::from_millis(rand::random_range(RUN_MS))).await;
        kills.push(Instant::now());
        logs.extend(kill(demo).await);
        *clients.url.write().unwrap() = None;
        demo = start(&database, &[]).await;
        *clients.url.write().unwrap() = Some(demo.url.clone());
    }

    // The last run stays up: every client finishes the key at hand.
    clients.stop.store(true, Ordering::SeqCst);
    let mut attempts: Vec<Vec<Attempt>> = Vec::new();
    for task in tasks {
        let finished = tokio::time::timeout(Duration::from_secs(60), task).await;
        attempts.push(finished.expect("every key is answered 201").unwrap());
    }
    let kill_cycles_took = began.elapsed();

    // Every key again, once: the answer its client first read, replayed.
    let http = client();
    let mut first_201: BTreeMap<String, &Attempt> = BTreeMap::new();
    for attempt in attempts.iter().flatten().filter(|a| a.created()) {
        let first = first_201.insert(attempt.key.clone(), attempt);
        assert!(first.is_none(), "a client stops at the first 201 of a key");
    }
    for (key, first) in &first_201 {
        // A 503 says the store did not answer within the demo's 200 ms on a busy
        // machine: nothing ran; ask again.
        let mut retry = None;
        for _ in 0..20 {
            let answer = send(
                &http,
                "POST",
                format!("{}/commands", demo.url),
                &[
                    ("content-type", "application/json"),
                    ("x-api-key", "crash-test"),
                    ("idempotency-key", key),
                    ("x-correlation-id", &format!("{key}:replay")),
                ],
                &create_body(key),
            )
            .await;
            let unavailable = answer.status == StatusCode::SERVICE_UNAVAILABLE;
            retry = Some(answer);
            if !unavailable {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let retry = retry.unwrap();
        let first = first.reply.as_ref().unwrap();
        assert_eq!(retry.status, StatusCode::CREATED, "{key}");
        assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{key}");
        assert_eq!(
            retry.body, first.body,
            "{key}: the same body as the first 201"
        );
    }

    // The relay of the last run sends what is left in the outbox.
    let mut by_key = commands_by_key(&pool).await;
    for _ in 0..100 {
        if by_key.values().flatten().all(|row| row.sent) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        by_key = commands_by_key(&pool).await;
    }
    logs.extend(kill(demo).await);

    // One command per key, one outbox row per command, each the one its client read.
    let keys: HashSet<&String> = attempts.iter().flatten().map(|a| &a.key).collect();
    assert_eq!(keys.len(), first_201.len(), "every key was answered 201");
    let mut duplicates = Vec::new();
    for key in &keys {
        let rows = by_key.get(*key).map_or(&[][..], Vec::as_slice);
        if rows.len() != 1 {
            duplicates.push(format!("{key}: {} commands", rows.len()));
            continue;
        }
        let row = &rows[0];
        assert_eq!(row.outbox_rows, 1, "{key}: one outbox row");
        let answered = first_201[*key].reply.as_ref().unwrap().json();
        assert_eq!(
            answered["id"],
            row.id.as_str(),
            "{key}: the command answered"
        );
        assert!(
            row.sent && row.status == "sent",
            "{key}: published ({})",
            row.status
        );
        let committed_by = row.correlation_id.as_deref().unwrap();
        assert!(
            committed_by.starts_with(&format!("{key}:a")),
            "{key}: committed by one of its own attempts ({committed_by})"
        );
    }
    assert!(
        duplicates.is_empty(),
        "{} of {} keys without exactly one command: {duplicates:?}",
        duplicates.len(),
        keys.len()
    );
    assert_eq!(by_key.len(), keys.len(), "no command for a key nobody sent");

    // What the clients saw: 201, 409 in the moment a killed request's backend still
    // held its key (within KEY_FREED of a kill), or a 503 that says what the store did
    // not do within the demo's 200 ms (a busy machine while a restarted demo opens its
    // pool): never a 503 claiming anything else.
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for attempt in attempts.iter().flatten() {
        let status = match &attempt.reply {
            Ok(reply) if reply.status == StatusCode::SERVICE_UNAVAILABLE => {
                format!("503 {}", reply.json()["code"].as_str().unwrap_or("?"))
            }
            Ok(reply) => reply.status.as_str().to_owned(),
            Err(_) => "no answer".to_owned(),
        };
        *statuses.entry(status).or_default() += 1;
    }
    for attempt in attempts.iter().flatten() {
        if !matches!(&attempt.reply, Ok(reply) if reply.status == StatusCode::CONFLICT) {
            continue;
        }
        let since_kill = kills
            .iter()
            .rev()
            .find(|&&killed| killed <= attempt.sent)
            .map(|&killed| attempt.sent - killed);
        assert!(
            since_kill.is_some_and(|since| since < KEY_FREED),
            "{}: 409 sent {since_kill:?} after the last kill: a key held by a dead request",
            attempt.correlation_id
        );
    }
    for status in statuses.keys() {
        assert!(
            [
                "201",
                "409",
                "503 idempotency.store_unavailable",
                "503 idempotency.not_committed",
                "503 idempotency.outcome_unknown",
                "no answer"
            ]
            .contains(&status.as_str()),
            "unexpected answer {status}: {statuses:?}"
        );
    }

    // Executions: the handler runs that reached the insert, per key.
    let mut executions: HashMap<&str, usize> = HashMap::new();
    let mut inserted: HashSet<&str> = HashSet::new();
    let mut published: HashMap<&str, usize> = HashMap::new();
    for line in &logs {
        match event(line) {
            "commands.created" => {
                *executions
                    .entry(line["fields"]["device_id"].as_str().unwrap())
                    .or_default() += 1;
                inserted.insert(correlation_id(line).unwrap());
            }
            "commands.published" => {
                *published
                    .entry(line["fields"]["command_id"].as_str().unwrap())
                    .or_default() += 1;
            }
            _ => {}
        }
    }
    let mut runs_per_key: BTreeMap<usize, usize> = BTreeMap::new();
    for key in &keys {
        *runs_per_key
            .entry(executions.get(key.as_str()).copied().unwrap_or(0))
            .or_default() += 1;
    }
    assert!(
        !runs_per_key.contains_key(&0),
        "every committed command was inserted by a logged run"
    );
    let published_again = published.values().filter(|&&n| n > 1).count();

    // Where each kill found each client.
    let committed_by: HashMap<&str, &str> = by_key
        .iter()
        .filter_map(|(key, rows)| Some((key.as_str(), rows[0].correlation_id.as_deref()?)))
        .collect();
    let mut phases: BTreeMap<Phase, usize> = BTreeMap::new();
    let mut kills_between_insert_and_commit = 0;
    for &killed in &kills {
        let mut cut_between = false;
        for client in &attempts {
            let phase = phase_at(killed, client, &committed_by, &inserted);
            cut_between |= phase == Phase::InsertedNotCommitted;
            *phases.entry(phase).or_default() += 1;
        }
        kills_between_insert_and_commit += usize::from(cut_between);
    }

    println!(
        "{CYCLES} kills of the demo in {:.1} s ({:.1} s in all), {CLIENTS} clients, \
         {HANDLER_DELAY_MS} ms before and {COMMIT_DELAY_MS} ms after \
         each insert",
        kill_cycles_took.as_secs_f64(),
        began.elapsed().as_secs_f64()
    );
    println!(
        "keys: {} (each one command and one outbox row), attempts: {}, answers: {statuses:?}",
        keys.len(),
        attempts.iter().flatten().count()
    );
    let count = |phase| phases.get(&phase).copied().unwrap_or(0);
    println!("kill points (one per kill and client):");
    for phase in [
        Phase::BeforeInsert,
        Phase::InsertedNotCommitted,
        Phase::CommittedNotRead,
    ] {
        println!("  {:>4}  {}", count(phase), phase.describe());
    }
    let reads = [Read::Created, Read::Conflict, Read::Nothing];
    let after_answer: usize = reads
        .iter()
        .map(|&read| count(Phase::AfterAnswer(read)))
        .sum();
    println!("  {after_answer:>4}  after the answer");
    for read in reads {
        let phase = Phase::AfterAnswer(read);
        println!("  {:>4}    {}", count(phase), phase.describe());
    }
    println!(
        "kills that cut a create between its insert and its commit: \
         {kills_between_insert_and_commit} of {CYCLES}"
    );
    println!("handler runs that reached the insert, per key (runs: keys): {runs_per_key:?}");
    println!(
        "commands published more than once (a kill after the publish, before the command \
         turned sent): {published_again}"
    );

    assert!(
        phases
            .get(&Phase::InsertedNotCommitted)
            .copied()
            .unwrap_or(0)
            > 0,
        "no kill landed between an insert and its commit: the test proved nothing"
    );
}

/// Where the kill at `killed` found `client`, whose attempts are in order.
fn phase_at(
    killed: Instant,
    client: &[Attempt],
    committed_by: &HashMap<&str, &str>,
    inserted: &HashSet<&str>,
) -> Phase {
    let in_flight = client
        .iter()
        .position(|a| a.sent <= killed && killed < a.ended);
    let Some(index) = in_flight else {
        let last = client.iter().rev().find(|a| a.ended <= killed);
        return Phase::AfterAnswer(match last.map(|a| &a.reply) {
            Some(Ok(reply)) if reply.status == StatusCode::CREATED => Read::Created,
            Some(Ok(_)) => Read::Conflict,
            _ => Read::Nothing,
        });
    };
    let attempt = &client[index];
    // The key's commit was by this attempt or one sent before it.
    let committed = committed_by.get(attempt.key.as_str()).is_some_and(|by| {
        client[..=index]
            .iter()
            .any(|earlier| earlier.correlation_id == *by)
    });
    if committed {
        Phase::CommittedNotRead
    } else if inserted.contains(attempt.correlation_id.as_str()) {
        Phase::InsertedNotCommitted
    } else {
        Phase::BeforeInsert
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_database_share_commands_and_answers() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    // Started at once: both create the tables, one after the other.
    let (a, b) = tokio::join!(
        start(&database, &[]),
        start(&database, &["--max-commands", "3"])
    );
    let http = client();
    let create = |url: &str, key: &str, attempt: &str| {
        let url = format!("{url}/commands");
        let key = key.to_owned();
        let attempt = attempt.to_owned();
        let http = &http;
        async move {
            send(
                http,
                "POST",
                url,
                &[
                    ("content-type", "application/json"),
                    ("x-api-key", "replicas"),
                    ("idempotency-key", &key),
                    ("attempt-id", &attempt),
                ],
                &create_body(&key),
            )
            .await
        }
    };

    let first = create(&a.url, "shared-1", "a1").await;
    let replayed = create(&b.url, "shared-1", "a2").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert_eq!(replayed.status, StatusCode::CREATED);
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(replayed.header("original-attempt-id"), Some("a1"));
    assert_eq!(replayed.body, first.body, "B replays A's answer");

    let id = first.json()["id"].as_str().unwrap().to_owned();
    let fetched = send(&http, "GET", format!("{}/commands/{id}", b.url), &[], "").await;
    assert_eq!(fetched.status, StatusCode::OK, "B reads A's command");
    assert_eq!(fetched.json()["id"], id.as_str());
    assert_eq!(fetched.json()["device_id"], "shared-1");

    // B lists the newest --max-commands (3), oldest first, wherever they were created.
    let mut ids = vec![id];
    for n in 2..=5 {
        let replica = if n % 2 == 0 { &a } else { &b };
        let created = create(&replica.url, &format!("shared-{n}"), "a1").await;
        assert_eq!(created.status, StatusCode::CREATED);
        ids.push(created.json()["id"].as_str().unwrap().to_owned());
    }
    let listed = send(&http, "GET", format!("{}/commands", b.url), &[], "").await;
    let listed: Vec<String> = listed
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|command| command["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(listed, ids[2..], "the newest three, oldest first");

    // The two relays share the outbox: each command published exactly once.
    let pool = database.pool(2).await;
    for _ in 0..100 {
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM tower_ids_outbox WHERE published_at IS NULL")
                .fetch_one(&pool)
                .await
                .unwrap();
        if pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let requests: HashMap<String, String> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8')::json ->> 'command_id', correlation_id \
         FROM tower_ids_outbox",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let logs: Vec<Value> = [kill(a).await, kill(b).await].concat();
    let mut published: HashMap<&str, usize> = HashMap::new();
    for line in logs.iter().filter(|l| event(l) == "commands.published") {
        let command_id = line["fields"]["command_id"].as_str().unwrap();
        *published.entry(command_id).or_default() += 1;
        // Under the creating request's correlation ID, extended for the delivery.
        let request = &requests[command_id];
        assert!(
            correlation_id(line)
                .unwrap()
                .starts_with(&format!("{request}.")),
            "{command_id} published under {request}.XYZ"
        );
    }
    for id in &ids {
        assert_eq!(published.get(id.as_str()), Some(&1), "{id} published once");
    }
}

/// The outbox row keeps the creating request's W3C trace context: the command, created
/// with a `traceparent` by a process killed before it published, is published by the
/// next process on the database in the request's trace.
#[cfg(feature = "opentelemetry")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_row_keeps_the_requests_trace_across_a_crash() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let trace_id = "3e1a4f2b6c7d8e9f0a1b2c3d4e5f6a7b";
    // Far longer than the test: nothing is published before the kill.
    let first = start(&database, &["--publish-delay-ms", "600000"]).await;
    let created = send(
        &client(),
        "POST",
        format!("{}/commands", first.url),
        &[
            ("content-type", "application/json"),
            ("x-api-key", "traced"),
            ("idempotency-key", "traced-1"),
            ("traceparent", &format!("00-{trace_id}-a2fb4a1d1a96d312-01")),
        ],
        &create_body("traced-1"),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    let before = kill(first).await;
    assert!(before.iter().all(|l| event(l) != "commands.published"));
    let pool = database.pool(1).await;
    let (traceparent,): (Option<String>,) =
        sqlx::query_as("SELECT traceparent FROM tower_ids_outbox")
            .fetch_one(&pool)
            .await
            .unwrap();
    let traceparent = traceparent.expect("the row keeps the request's traceparent");
    assert!(traceparent.contains(trace_id), "{traceparent}");

    let second = start(&database, &["--publish-delay-ms", "0"]).await;
    let published = &second.events("commands.published").await[0];
    // The library relay's span, which continues the request's trace.
    assert_eq!(published["span"]["name"], "outbox.publish");
    assert_eq!(published["span"]["trace_id"], trace_id, "{published}");
    drop(second);
    pool.close().await;
}

/// `--database-url` to a closed port: the demo exits at once, non-zero, naming the host
/// and port and the cause (`examples/support/database.rs`, shared with `partner`).
#[tokio::test]
async fn an_unreachable_database_fails_the_start_within_seconds_naming_it() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://postgres:secret@127.0.0.1:{port}/commands");
    let (status, took, stderr) = tokio::task::spawn_blocking(move || {
        let args = ["--addr", "127.0.0.1:0", "--database-url", &url];
        demo::run_to_exit("commands", &args, Duration::from_secs(10))
    })
    .await
    .unwrap();
    println!("exited {status} after {took:?}: {stderr}");
    assert!(!status.success());
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(stderr.contains(&format!("127.0.0.1:{port}")), "{stderr}");
    assert!(stderr.contains("Connection refused"), "{stderr}");
    assert!(
        !stderr.contains("secret"),
        "the password stays out: {stderr}"
    );
}
