//! A graceful stop through real processes (issue 34, item 3): a replica that answered
//! while its Redis was paused, and so keeps the outcome to store later, gets SIGTERM
//! before Redis is back. It must wait for the outcome to be stored
//! (`--drain-timeout-ms`) before it exits, or a retry on another replica runs the
//! handler again once the claim runs out.
//!
//! Each trial, as a rolling deploy meets a store hiccup:
//!
//! - a `redis-server --appendonly yes` of its own (free port, temporary directory,
//!   removed at the end) and two `commands` replicas on it, A and B, each with
//!   `--idempotency-lease-ms 4000 --handler-delay-ms 2000`;
//! - a client sends key K to A; Redis is paused (SIGSTOP) a few milliseconds before A's
//!   handler ends (the trials vary by how many; placed by the timestamp of A's
//!   `idempotency.accepted` line, when the handler starts), for 3.6 s: A's completion
//!   fails, A keeps the outcome and answers `201`;
//! - 300 ms after that answer, A gets SIGTERM; from 100 ms after the first send, a
//!   client retries K on B every 100 to 300 ms.
//!
//! Counted and asserted: the handler ran once (the access lines with
//! `idempotency_outcome = "executed"` and the handler's `commands.created` lines of
//! both replicas), A answered `201` after keeping its outcome (its WARN
//! `idempotency.store_failed` in phase `complete`), every answer on B is `409` or `503`
//! until the first replay and every one from it is that replay, byte for byte A's body;
//! A logged `idempotency.drained` and exited 0. And with `--drain-timeout-ms 500`, where
//! the deadline passes before Redis is back: A logs WARN `idempotency.drain_unsettled`
//! (`owed = "outcome_kept"`) in the request's span, with K and A's correlation ID, and
//! exits 0. (What B sees then is printed, not asserted: the key stays claimed until the
//! lease runs out, and B's retry after that runs the handler a second time.)
//!
//! A trial whose pause landed after A's handler had ended (`kill -STOP` late on a busy
//! machine: A stored its outcome at once, and nothing was tested) says so and runs
//! again, up to three times. A trial takes about 8 s. By default a representative slice runs (6 trials and the
//! deadline trial, about a minute); `TOWER_IDS_FULL_TRIALS=1` runs the whole matrix (14
//! and 2). Each trial prints its figures: `cargo test --all-features --test
//! commands_shutdown -- --nocapture`. Without `redis-server` on `PATH` the tests print
//! `SKIPPED` and pass, except in CI (`CI` set). The test builds the `commands` example
//! first (`tests/examples/demo.rs`), so it passes run alone.

#[path = "demo.rs"]
mod demo;
use tower_ids_test_support as support;
use tower_ids_test_support::redis as server;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use demo::Demo;
use http::StatusCode;
use serde_json::Value;
use server::RedisServer;
use support::{client, full_trials, try_send, Reply};

const COMMAND: &str =
    r#"{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}"#;

/// `--idempotency-lease-ms`: a claim holds its key 6 s from its last renewal.
const LEASE_MS: &str = "4000";

/// `--handler-delay-ms`: how long A's handler runs.
const HANDLER_MS: u64 = 2000;

/// How long Redis stays paused: shorter than the lease, so the claim outlives it.
const PAUSE: Duration = Duration::from_millis(3600);

/// From A's `201` to its SIGTERM.
const TERM_AFTER_ANSWER: Duration = Duration::from_millis(300);

/// How many milliseconds before A's handler ends Redis is paused, per trial: the
/// default slice, then the rest of the matrix. `kill -STOP` itself takes a millisecond
/// or two, so the pause lands up to that much later (each trial prints where it landed);
/// nothing under 3 ms, where it could land after the handler's end.
const LEADS_MS: [u64; 6] = [5, 3, 8, 12, 20, 30];
const MORE_LEADS_MS: [u64; 8] = [4, 5, 5, 6, 7, 10, 15, 45];

/// The same for the trials whose drain deadline passes first.
const DEADLINE_LEADS_MS: [u64; 1] = [5];
const MORE_DEADLINE_LEADS_MS: [u64; 1] = [20];

/// The trials share two cores and measure in milliseconds: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What one trial saw, in milliseconds from the first send.
struct Trial {
    lead_ms: u64,
    /// From the pause (once `kill -STOP` returned) to the handler's `commands.created`
    /// line, by the log's clock.
    measured_lead_ms: f64,
    answered_ms: u128,
    term_ms: u128,
    resumed_ms: u128,
    exited_ms: u128,
    exit: std::process::ExitStatus,
    /// A's first answer.
    first: Reply,
    /// B's answers, with when they came.
    retries: Vec<(u128, Reply)>,
    /// Handler runs on A and B.
    executions: usize,
    /// A's log.
    a: Vec<Value>,
    key: String,
}

impl Trial {
    fn events<'a>(&'a self, code: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
        self.a
            .iter()
            .filter(move |line| line["fields"]["event"] == code)
    }

    /// A's first line with `event` = `code`, by its index.
    fn position(&self, code: &str) -> usize {
        self.a
            .iter()
            .position(|line| line["fields"]["event"] == code)
            .unwrap_or_else(|| panic!("A logged no {code}"))
    }

    /// B's answers in runs, `409x7 503x12 201rx3` (`r` for a replay).
    fn retries_summary(&self) -> String {
        let mut runs: Vec<(String, usize)> = Vec::new();
        for (_, reply) in &self.retries {
            let replayed = if reply.replayed() { "r" } else { "" };
            let label = format!("{}{replayed}", reply.status.as_u16());
            match runs.last_mut() {
                Some((last, count)) if *last == label => *count += 1,
                _ => runs.push((label, 1)),
            }
        }
        runs.iter()
            .map(|(label, count)| format!("{label}x{count}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn print(&self, name: &str) {
        let drained = self
            .events("shutdown.drained")
            .chain(self.events("shutdown.drain_incomplete"))
            .next()
            .map_or_else(
                || "no drain line".to_owned(),
                |line| {
                    format!(
                        "drain waited {} ms for {} owed, {} unsettled",
                        line["fields"]["waited_ms"],
                        line["fields"]["pending"],
                        line["fields"]["unsettled"].as_u64().unwrap_or(0)
                    )
                },
            );
        let first_replay = self
            .retries
            .iter()
            .find(|(_, reply)| reply.replayed())
            .map_or("never".to_owned(), |(ms, _)| format!("at {ms} ms"));
        println!(
            "{name}: pause {} ms before the handler's end (measured {:.1} ms); A 201 at {} ms, \
             SIGTERM at {} ms, Redis resumed at {} ms, A exited {} at {} ms ({drained}); \
             B: {} (first replay {first_replay}); executions {}",
            self.lead_ms,
            self.measured_lead_ms,
            self.answered_ms,
            self.term_ms,
            self.resumed_ms,
            self.exit
                .code()
                .map_or("by a signal".to_owned(), |c| c.to_string()),
            self.exited_ms,
            self.retries_summary(),
            self.executions,
        );
    }
}

/// Seconds since midnight (UTC) of a log line's RFC 3339 timestamp.
fn time_of_day(line: &Value) -> f64 {
    let stamp = line["timestamp"]
        .as_str()
        .expect("a timestamp on every line");
    let clock = &stamp[stamp.find('T').expect("RFC 3339") + 1..];
    let mut parts = clock.trim_end_matches('Z').split(':');
    let mut next = || -> f64 { parts.next().unwrap().parse().unwrap() };
    let (hours, minutes, seconds) = (next(), next(), next());
    hours * 3600.0 + minutes * 60.0 + seconds
}

fn wall_time_of_day(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH).unwrap().as_secs_f64() % 86_400.0
}

/// The lines with `event` = `code`.
fn events<'a>(lines: &'a [Value], code: &str) -> Vec<&'a Value> {
    lines
        .iter()
        .filter(|line| line["fields"]["event"] == code)
        .collect()
}

/// Handler runs in one replica's log: (access lines of executed requests, the
/// handler's `commands.created` lines).
fn runs(lines: &[Value]) -> (usize, usize) {
    let executed = events(lines, "http.access")
        .into_iter()
        .filter(|line| line["span"]["idempotency_outcome"] == "executed")
        .count();
    (executed, events(lines, "commands.created").len())
}

async fn create(url: &str, key: &str, attempt: &str) -> Result<Reply, String> {
    try_send(
        &client(),
        "POST",
        format!("{url}/commands"),
        &[
            ("content-type", "application/json"),
            ("x-api-key", "shutdown"),
            ("idempotency-key", key),
            ("attempt-id", attempt),
        ],
        COMMAND,
    )
    .await
    .map_err(|error| error.to_string())
}

/// Retries `key` on `url` from 100 ms after `started`, every 100 to 300 ms, until three
/// replays came, or for 20 s.
async fn retry(url: String, key: String, started: Instant, seed: u64) -> Vec<(u128, Reply)> {
    let mut answers = Vec::new();
    // A small xorshift, different per trial.
    let mut state = 0x9E37_79B9_7F4A_7C15_u64 ^ seed;
    tokio::time::sleep_until((started + Duration::from_millis(100)).into()).await;
    for attempt in 2.. {
        let reply = create(&url, &key, &format!("b{attempt}")).await;
        let at = started.elapsed().as_millis();
        let reply = reply.unwrap_or_else(|e| panic!("B at {at} ms: {e}"));
        answers.push((at, reply));
        let replays = answers.iter().filter(|(_, reply)| reply.replayed()).count();
        if replays >= 3 || at > 20_000 {
            return answers;
        }
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        tokio::time::sleep(Duration::from_millis(100 + state % 201)).await;
    }
    unreachable!()
}

/// One trial on `redis`, Redis paused `lead_ms` before A's handler ends; A with
/// `--drain-timeout-ms drain_timeout_ms` if given, else the default (10 s).
async fn run_trial(
    redis: &RedisServer,
    n: u64,
    lead_ms: u64,
    drain_timeout_ms: Option<&str>,
) -> Trial {
    let url = redis.url();
    let handler_ms = HANDLER_MS.to_string();
    let b_args = [
        "--redis-url",
        url.as_str(),
        "--idempotency-lease-ms",
        LEASE_MS,
        "--handler-delay-ms",
        handler_ms.as_str(),
    ];
    let mut a_args = b_args.to_vec();
    if let Some(timeout) = drain_timeout_ms {
        a_args.extend(["--drain-timeout-ms", timeout]);
    }
    // The handler's own line (`commands.created`) and the layer's steps.
    let env = [(
        "RUST_LOG",
        "info,commands=debug,tower_ids::idempotency=debug",
    )];
    let mut a = Demo::start_with_env(&a_args, &env);
    let mut b = Demo::start_with_env(&b_args, &env);
    let key = format!("shutdown-{n}-{}", uuid::Uuid::now_v7());

    let started = Instant::now();
    let first = {
        let (url, key) = (a.url.clone(), key.clone());
        tokio::spawn(async move { (create(&url, &key, "a1").await, started.elapsed()) })
    };
    let retries = tokio::spawn(retry(b.url.clone(), key.clone(), started, n));

    // The handler starts when the layer has claimed the key (`idempotency.accepted`,
    // a few milliseconds after the send) and sleeps `HANDLER_MS`: the pause is placed
    // by that line's timestamp, on the clock both processes share.
    let accepted = a.events("idempotency.accepted").await;
    let handler_ends = time_of_day(&accepted[0]) + HANDLER_MS as f64 / 1000.0;
    let until_pause = handler_ends - lead_ms as f64 / 1000.0 - wall_time_of_day(SystemTime::now());
    tokio::time::sleep(Duration::from_secs_f64(until_pause.max(0.0))).await;
    redis.pause();
    // SIGSTOP was delivered by now: the pause led the handler's end by at least this.
    let paused = Instant::now();
    let paused_wall = SystemTime::now();

    let (answer, answered) = first.await.unwrap();
    let first = answer.expect("A answers");
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    tokio::time::sleep(TERM_AFTER_ANSWER).await;
    let term = started.elapsed();
    a.terminate();
    assert!(
        paused.elapsed() < PAUSE,
        "A answered {answered:?} after the send: too late for the trial's timeline"
    );
    // A may exit before Redis is back (its drain deadline passed): watch meanwhile.
    let mut exit = a
        .exited_within((paused + PAUSE).saturating_duration_since(Instant::now()))
        .await;
    let mut exited = started.elapsed();
    tokio::time::sleep_until((paused + PAUSE).into()).await;
    redis.resume();
    let resumed = started.elapsed();
    if exit.is_none() {
        exit = a.exited_within(Duration::from_secs(20)).await;
        exited = started.elapsed();
    }
    let exit = exit.expect("A exits within its drain timeout");
    let retries = retries.await.unwrap();
    // Every line of both: A has exited; B owes nothing and stops the same way.
    a.kill();
    b.terminate();
    let b_exit = b.exited_within(Duration::from_secs(20)).await;
    assert!(
        b_exit.is_some_and(|status| status.success()),
        "B stops cleanly: {b_exit:?}"
    );
    b.kill();
    let (a_lines, b_lines) = (a.lines(), b.lines());

    let (a_executed, a_created) = runs(&a_lines);
    let (b_executed, b_created) = runs(&b_lines);
    assert_eq!(
        (a_executed, a_created),
        (1, 1),
        "A ran the handler once, and says so"
    );
    assert_eq!(
        b_executed, b_created,
        "B's access lines and handler lines agree"
    );
    let created = events(&a_lines, "commands.created")[0];
    let measured_lead_ms = (time_of_day(created) - wall_time_of_day(paused_wall)) * 1000.0;
    Trial {
        lead_ms,
        measured_lead_ms,
        answered_ms: answered.as_millis(),
        term_ms: term.as_millis(),
        resumed_ms: resumed.as_millis(),
        exited_ms: exited.as_millis(),
        exit,
        first,
        retries,
        executions: a_executed + b_executed,
        a: a_lines,
        key,
    }
}

impl Trial {
    /// Whether A kept its outcome: its completion failed while Redis was paused.
    fn kept(&self) -> bool {
        self.events("idempotency.store_failed")
            .any(|line| line["fields"]["phase"] == "complete")
    }
}

/// Runs the trial, again (up to three times in all) if the pause landed after A's
/// handler had ended: on a busy machine `kill -STOP` can be tens of milliseconds late,
/// and then A stores its outcome at once and the trial tests nothing. A pause that
/// landed before the end must leave the outcome kept: that is asserted, never retried.
async fn placed_trial(
    name: &str,
    n: u64,
    lead_ms: u64,
    drain_timeout_ms: Option<&str>,
) -> Option<Trial> {
    for attempt in 1..=3 {
        // A Redis of the trial's own: the pause stops nothing else.
        let redis = RedisServer::start_persistent()?;
        let trial = run_trial(&redis, n * 10 + attempt, lead_ms, drain_timeout_ms).await;
        if !trial.kept() && trial.measured_lead_ms <= 0.0 && attempt < 3 {
            println!(
                "{name}: the pause landed {:.1} ms after the handler's end (A answered 201 at {} ms, stored); placing it again",
                -trial.measured_lead_ms,
                trial.answered_ms
            );
            continue;
        }
        trial.print(name);
        assert!(
            trial.kept(),
            "{name}: A's completion failed while Redis was paused, and A kept the outcome"
        );
        return Some(trial);
    }
    unreachable!()
}

/// Asserts what a trial whose drain completed must show.
fn assert_drained(name: &str, trial: &Trial) {
    assert_eq!(trial.executions, 1, "{name}: the handler ran once");
    let first_replay = trial
        .retries
        .iter()
        .position(|(_, reply)| reply.status == StatusCode::CREATED)
        .unwrap_or_else(|| panic!("{name}: B replayed: {}", trial.retries_summary()));
    for (at, reply) in &trial.retries[..first_replay] {
        assert!(
            matches!(
                reply.status,
                StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
            ),
            "{name}: before the replay B answers 409 or 503, at {at} ms: {} {}",
            reply.status,
            reply.text()
        );
    }
    for (at, reply) in &trial.retries[first_replay..] {
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "{name}, at {at} ms: {}",
            reply.text()
        );
        assert!(
            reply.replayed(),
            "{name}: a replay at {at} ms, not a second run"
        );
        assert_eq!(
            reply.body, trial.first.body,
            "{name}: the replay is A's body, byte for byte"
        );
    }
    assert!(trial.exit.success(), "{name}: A exited 0: {}", trial.exit);
    let drained = trial.position("idempotency.drained");
    assert!(
        trial.position("commands.shutting_down") < drained
            && drained < trial.position("commands.stopped"),
        "{name}: A drained between the signal and its stop"
    );
    let summary = &trial.a[trial.position("shutdown.drained")];
    assert!(
        summary["fields"]["pending"].as_u64() >= Some(1),
        "{name}: A still owed the outcome when the drain began: {summary}"
    );
    assert_eq!(trial.events("idempotency.drain_unsettled").count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopped_with_a_kept_outcome_stores_it_before_it_exits() {
    let _serial = SERIAL.lock().await;
    let leads: Vec<u64> = if full_trials() {
        LEADS_MS.iter().chain(&MORE_LEADS_MS).copied().collect()
    } else {
        LEADS_MS.to_vec()
    };
    for (n, lead_ms) in (1..).zip(leads) {
        let name = format!("trial {n}");
        let Some(trial) = placed_trial(&name, n, lead_ms, None).await else {
            return;
        };
        assert_drained(&name, &trial);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_whose_deadline_passes_names_the_key_it_leaves() {
    let _serial = SERIAL.lock().await;
    let leads: Vec<u64> = if full_trials() {
        DEADLINE_LEADS_MS
            .iter()
            .chain(&MORE_DEADLINE_LEADS_MS)
            .copied()
            .collect()
    } else {
        DEADLINE_LEADS_MS.to_vec()
    };
    for (n, lead_ms) in (1..).zip(leads) {
        let name = format!("deadline trial {n}");
        let Some(trial) = placed_trial(&name, 100 + n, lead_ms, Some("500")).await else {
            return;
        };
        assert!(trial.exit.success(), "{name}: A exited 0: {}", trial.exit);
        assert!(
            trial.exited_ms < trial.term_ms + 2000,
            "{name}: A stopped at its 500 ms deadline, not when Redis came back"
        );
        let unsettled: Vec<_> = trial.events("idempotency.drain_unsettled").collect();
        assert_eq!(unsettled.len(), 1, "{name}: {unsettled:?}");
        let warn = unsettled[0];
        assert_eq!(warn["level"], "WARN", "{warn}");
        assert_eq!(warn["fields"]["owed"], "outcome_kept", "{warn}");
        assert_eq!(warn["fields"]["timeout_ms"], 500, "{warn}");
        assert_eq!(
            warn["span"]["idempotency_key"],
            trial.key.as_str(),
            "the request's span, with its key: {warn}"
        );
        assert_eq!(
            warn["span"]["correlation_id"],
            trial.first.header("x-correlation-id").unwrap(),
            "and the correlation ID A answered with: {warn}"
        );
        let summary = &trial.a[trial.position("shutdown.drain_incomplete")];
        assert_eq!(summary["fields"]["unsettled"], 1, "{summary}");
        assert!(trial.position("idempotency.drain_unsettled") < trial.position("commands.stopped"));
    }
}

/// A lease the store cannot keep (4 × 850 ms of recovery with one replica's `WAIT`) is
/// refused before the demo listens: one line on stderr that names the shortest lease
/// that would do, exit code 2, and no panic.
#[tokio::test]
async fn a_lease_the_store_refuses_stops_the_demo_before_it_listens() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let url = redis.url();
    let (status, took, stderr) = tokio::task::spawn_blocking(move || {
        let args = [
            "--addr",
            "127.0.0.1:0",
            "--redis-url",
            &url,
            "--redis-wait-replicas",
            "1",
            "--idempotency-lease-ms",
            "3000",
        ];
        demo::run_to_exit("commands", &args, Duration::from_secs(30))
    })
    .await
    .unwrap();
    println!("exited {status} after {took:?}: {stderr}");
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains("a lease of 3s cannot outlive a store outage")
            && stderr.contains("set a lease of at least 3.4s"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
