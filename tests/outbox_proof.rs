//! The outbox proved through real processes, requests → outbox → relay → broker →
//! inbox, once over RabbitMQ and once over Kafka: `examples/outbox serve` takes 1,000
//! requests of 10 payments over 50 accounts (16 at once, each sent again with its key
//! afterwards, which must replay the `201` and add nothing), so 10,000 messages are
//! enqueued in the requests' transactions; two `examples/outbox relay` processes publish
//! them; `examples/inbox consume` processes apply them to a database of their own. While
//! that runs, relays and consumers are killed with SIGKILL at random moments and started
//! again (several times each), and the broker is disturbed once. Then the consumer's
//! database must have every payment exactly once (no row missing, none doubled), every
//! balance must equal the sum sent to its account, and each account's payments must
//! have been applied in the order the sender committed them: their sequence numbers
//! (taken in the sender's transaction under a row lock, `sent_payments.seq`) strictly
//! increase in the consumer's apply order (`payments.id`).
//!
//! - **RabbitMQ**: a vhost of the run's own (`rabbitmqctl add_vhost`, deleted after), 4
//!   queues; an account's messages go to one queue (`examples/outbox`'s `queue_of`),
//!   each queue has one consumer with a prefetch of 1, so a queue's order is its apply
//!   order. Halfway, every connection of the vhost is closed by the broker
//!   (`rabbitmqctl close_all_connections -p VHOST`): the relays' sinks reconnect, the
//!   consumers exit and are started again.
//! - **Kafka**: a Tansu broker of the test's own, a topic of 4 partitions created up
//!   front, 2 consumers in one group. Halfway the broker is **paused** (SIGSTOP, 5 s,
//!   SIGCONT) rather than restarted: the Tansu build the tests use keeps everything in
//!   memory, so a restart would lose the topic, its records and the group's offsets,
//!   and the test would measure that loss, not the outbox. A pause stalls every
//!   produce, fetch, commit and heartbeat at once, which is the outage the relays and
//!   consumers must ride out.
//!
//! Kills come at random points of the progress (the relays' publications and the
//! consumers' commits, read from their logs), spread over 5% to 90% of the run, so that
//! some land while requests are still being sent. A relay is killed just after it logs a
//! publication, while the round that published it (which marks its messages published
//! when it commits) is still open, so that what the broker took is published again: the
//! test fails if no message was. A process that exits by itself (a consumer whose
//! connection was closed) is started again too. The figures (messages,
//! kills, the fault, republications by relays and replays by the inbox, wall time) are
//! printed with `cargo test --all-features --test outbox_proof -- --nocapture`.
//!
//! Each test owns two databases (on `TOWER_IDS_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/postgres`), its vhost or broker, and removes
//! them. Without a server the test prints `SKIPPED` and passes, except under CI (`CI`
//! set). It builds both examples first (`tests/support/demo.rs`), so `cargo test --test
//! outbox_proof` runs alone. The two tests take turns rather than share the machine.

#[path = "postgres/database.rs"]
mod database;
#[path = "support/demo.rs"]
mod demo;
#[path = "support/kafka.rs"]
mod kafka;
#[path = "support/rabbitmq.rs"]
mod rabbitmq;
#[path = "support/mod.rs"]
mod support;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io::{BufRead, BufReader},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use database::TestDatabase;
use http::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

/// Requests sent to `serve`.
const REQUESTS: usize = 1_000;

/// Payments per request: each one message.
const PER_REQUEST: usize = 10;

/// Messages the requests enqueue.
const MESSAGES: usize = REQUESTS * PER_REQUEST;

/// Accounts the payments are spread over (the partition keys).
const ACCOUNTS: usize = 50;

/// Requests in flight at once.
const CONCURRENCY: usize = 16;

/// Relay processes.
const RELAYS: usize = 2;

/// SIGKILLs of a relay, and of a consumer, per run.
const KILLS: usize = 5;

/// RabbitMQ queues, one consumer each.
const QUEUES: usize = 4;

/// Kafka partitions, and the consumers of the group.
const PARTITIONS: i32 = 4;
const KAFKA_CONSUMERS: usize = 2;

/// How long the Kafka broker stays paused.
const PAUSE: Duration = Duration::from_secs(5);

/// From the first request to the consumer's database having every payment, at most.
const LIMIT: Duration = Duration::from_secs(150);

/// Tries of one request before the test gives up on it.
const ATTEMPTS: usize = 20;

/// The two tests take turns: each runs a dozen processes and 40 database connections on
/// a machine of two cores, and alone each stays within its [`LIMIT`].
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ----------------------------------------------------------------------------------
// The processes
// ----------------------------------------------------------------------------------

/// What the test keeps of a log line.
#[derive(Debug, Clone)]
struct Event {
    code: String,
    level: String,
    delivery: Option<String>,
    key: Option<String>,
    /// `outbox.published`: the outbox row, from its `outbox.publish` span.
    message_id: Option<i64>,
    /// `inbox.received` over AMQP: whether the broker had delivered it before.
    redelivered: Option<bool>,
}

/// Events the test reads; other lines are kept only when they warn.
const KEPT: &[&str] = &[
    "outbox.published",
    "inbox.received",
    "inbox.handled",
    "inbox.replayed",
    "inbox.ready",
    "relay.ready",
];

fn parse(line: &str) -> Option<Event> {
    let value: Value = match serde_json::from_str(line) {
        Ok(value) => value,
        Err(_) => {
            return Some(Event {
                code: "(not JSON)".to_owned(),
                level: "WARN".to_owned(),
                delivery: None,
                key: Some(line.to_owned()),
                message_id: None,
                redelivered: None,
            })
        }
    };
    let fields = &value["fields"];
    let level = value["level"].as_str().unwrap_or_default();
    let code = match fields["event"].as_str() {
        Some(code) => code.to_owned(),
        // A library's line: its target and the start of its message.
        None => format!(
            "{}: {:.60}",
            value["target"].as_str().unwrap_or_default(),
            fields["message"].as_str().unwrap_or_default()
        ),
    };
    if !KEPT.contains(&code.as_str()) && !matches!(level, "WARN" | "ERROR") {
        return None;
    }
    Some(Event {
        code,
        level: level.to_owned(),
        delivery: fields["delivery"].as_str().map(str::to_owned),
        key: fields["key"].as_str().map(str::to_owned),
        message_id: value["span"]["message_id"].as_i64(),
        redelivered: fields["redelivered"].as_bool(),
    })
}

/// Progress, counted from every process's log as it is read.
#[derive(Default)]
struct Progress {
    /// `outbox.published` lines of the relays.
    published: AtomicUsize,
    /// `inbox.handled` lines of the consumers.
    handled: AtomicUsize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Relay,
    Consumer,
}

/// One run of a relay or a consumer, its JSON log read line by line.
struct Process {
    name: String,
    child: Child,
    events: Arc<Mutex<Vec<Event>>>,
    /// Its `outbox.published` lines so far.
    published: Arc<AtomicUsize>,
    reader: Option<JoinHandle<()>>,
}

/// A finished run: its role and its events.
struct Run {
    role: Role,
    events: Vec<Event>,
}

impl Process {
    /// Starts the example `example` with `args` as `name`, and waits until it logs that
    /// it is ready; a start whose process exits first (a connection closed under it) is
    /// tried again, up to five times.
    fn start(
        example: &str,
        role: Role,
        name: String,
        args: &[String],
        progress: Arc<Progress>,
    ) -> Self {
        let mut tries = 0;
        loop {
            match Self::try_start(example, role, name.clone(), args, progress.clone()) {
                Ok(process) => return process,
                Err(why) if tries < 5 => {
                    tries += 1;
                    eprintln!("{why}; starting it again");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(why) => panic!("{why}, five times"),
            }
        }
    }

    fn try_start(
        example: &str,
        role: Role,
        name: String,
        args: &[String],
        progress: Arc<Progress>,
    ) -> Result<Self, String> {
        let ready = match role {
            Role::Relay => "relay.ready",
            Role::Consumer => "inbox.ready",
        };
        let mut child = Command::new(demo::example_path(example))
            .args(args)
            .env(
                "RUST_LOG",
                // `outbox.published` is DEBUG.
                "info,lapin=warn,rdkafka=warn,tower_ids::outbox=debug",
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("the {example} example runs: {e}"));
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let events = Arc::new(Mutex::new(Vec::new()));
        let published = Arc::new(AtomicUsize::new(0));
        let (sink, counted) = (events.clone(), published.clone());
        let reader = std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                let Some(event) = parse(&line) else { continue };
                match event.code.as_str() {
                    "outbox.published" => {
                        progress.published.fetch_add(1, Ordering::Relaxed);
                        counted.fetch_add(1, Ordering::Relaxed);
                    }
                    "inbox.handled" => {
                        progress.handled.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
                sink.lock().unwrap().push(event);
            }
        });
        let mut process = Self {
            name,
            child,
            events,
            published,
            reader: Some(reader),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !process
            .events
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.code == ready)
        {
            if let Some(status) = process.child.try_wait().unwrap() {
                return Err(format!(
                    "{} exited with {status} before {ready}",
                    process.name
                ));
            }
            assert!(
                Instant::now() < deadline,
                "{} logged no {ready} within 30 s",
                process.name
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(process)
    }

    /// Whether it exited by itself.
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// SIGKILL, aimed at a relay's round: as soon as it logs its next publication
    /// (within 3 s), while the round that published it has not committed, so that
    /// what it published is published again.
    fn kill_mid_round(self) -> Run {
        let before = self.published.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(3);
        while self.published.load(Ordering::Relaxed) == before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        self.kill(Role::Relay)
    }

    /// SIGKILL: no goodbye.
    fn kill(mut self, role: Role) -> Run {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.finish(role)
    }

    /// SIGTERM, as a service manager stops it: it finishes what it holds and exits 0.
    fn terminate(mut self, role: Role) -> Run {
        signal(self.child.id(), "-TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not stop within 30 s of SIGTERM",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(status.success(), "{} stopped with {status}", self.name);
        self.finish(role)
    }

    fn finish(&mut self, role: Role) -> Run {
        if let Some(reader) = self.reader.take() {
            reader.join().expect("the log reader ends with the process");
        }
        Run {
            role,
            events: std::mem::take(&mut *self.events.lock().unwrap()),
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kill SIGNAL pid`.
fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill(1) runs");
    assert!(status.success(), "kill {signal} {pid} failed");
}

// ----------------------------------------------------------------------------------
// The relays and consumers, killed and restarted
// ----------------------------------------------------------------------------------

/// The disturbance of the broker, once, halfway.
#[derive(Clone)]
enum Fault {
    /// `rabbitmqctl close_all_connections`, in the vhost if there is one.
    CloseConnections { vhost: Option<String> },
    /// SIGSTOP, [`PAUSE`], SIGCONT.
    Pause { pid: u32 },
    /// No way to disturb this broker here (said loudly).
    None,
}

/// How the relays and the consumers are started.
struct Fleet {
    /// `examples/outbox relay` arguments, without `--instance`.
    relay: Vec<String>,
    /// `examples/inbox consume` arguments of each consumer, without `--instance`.
    consumers: Vec<Vec<String>>,
    fault: Fault,
}

/// What the chaos did.
#[derive(Default)]
struct Chaos {
    runs: Vec<Run>,
    relay_kills: usize,
    consumer_kills: usize,
    /// Processes that exited by themselves and were started again: (role, status).
    exits: Vec<(Role, String)>,
    /// What the fault did, in words, and at which handled count.
    fault: Option<String>,
}

/// `count` thresholds, one drawn uniformly in each of `count` equal slices of 5% to
/// 90% of `total`: random, and spread over the run.
fn thresholds(count: usize, total: usize) -> Vec<usize> {
    let (from, to) = (total / 20, total * 9 / 10);
    let width = (to - from) / count;
    (0..count)
        .map(|n| from + n * width + rand::random_range(0..width))
        .collect()
}

/// Starts the relays and the consumers, tells `ready`, then kills and restarts them at
/// the planned points and restarts any that exits, until `stop`; then stops them all
/// with SIGTERM.
fn chaos(
    fleet: Fleet,
    progress: Arc<Progress>,
    ready: std::sync::mpsc::Sender<()>,
    stop: Arc<AtomicBool>,
) -> Chaos {
    let mut report = Chaos::default();
    let start = |role: Role, slot: usize, generation: usize| {
        let (example, base, prefix) = match role {
            Role::Relay => ("outbox", &fleet.relay, "relay"),
            Role::Consumer => ("inbox", &fleet.consumers[slot], "consumer"),
        };
        let name = format!("{prefix}-{slot}-{generation}");
        let mut args = base.clone();
        args.extend(["--instance".to_owned(), name.clone()]);
        Process::start(example, role, name, &args, progress.clone())
    };
    let mut relays: Vec<(Option<Process>, usize)> = (0..RELAYS)
        .map(|slot| (Some(start(Role::Relay, slot, 0)), 0))
        .collect();
    let mut consumers: Vec<(Option<Process>, usize)> = (0..fleet.consumers.len())
        .map(|slot| (Some(start(Role::Consumer, slot, 0)), 0))
        .collect();
    ready.send(()).unwrap();

    let mut relay_points = thresholds(KILLS, MESSAGES).into_iter().peekable();
    let mut consumer_points = thresholds(KILLS, MESSAGES).into_iter().peekable();
    let fault_at = MESSAGES * 2 / 5 + rand::random_range(0..MESSAGES / 5);
    let mut fault: Option<JoinHandle<String>> = None;
    let faulting = Arc::new(AtomicBool::new(false));

    while !stop.load(Ordering::Relaxed) {
        // Whoever exited by itself starts again.
        for (role, slots) in [(Role::Relay, &mut relays), (Role::Consumer, &mut consumers)] {
            for (slot, (process, generation)) in slots.iter_mut().enumerate() {
                let status = process.as_mut().unwrap().exited();
                if let Some(status) = status {
                    let run = process.take().unwrap().finish(role);
                    report.runs.push(run);
                    report.exits.push((role, status.to_string()));
                    *generation += 1;
                    *process = Some(start(role, slot, *generation));
                }
            }
        }
        let published = progress.published.load(Ordering::Relaxed);
        let handled = progress.handled.load(Ordering::Relaxed);
        // Kills wait while the broker is disturbed (each fault on its own), and for a
        // victim that exited by itself to be started again.
        if !faulting.load(Ordering::Relaxed) {
            if relay_points.peek().is_some_and(|point| published >= *point) {
                let slot = rand::random_range(0..relays.len());
                let (process, generation) = &mut relays[slot];
                if process.as_mut().unwrap().exited().is_none() {
                    relay_points.next();
                    report.runs.push(process.take().unwrap().kill_mid_round());
                    report.relay_kills += 1;
                    *generation += 1;
                    *process = Some(start(Role::Relay, slot, *generation));
                }
            }
            if consumer_points
                .peek()
                .is_some_and(|point| handled >= *point)
            {
                let slot = rand::random_range(0..consumers.len());
                let (process, generation) = &mut consumers[slot];
                if process.as_mut().unwrap().exited().is_none() {
                    consumer_points.next();
                    report
                        .runs
                        .push(process.take().unwrap().kill(Role::Consumer));
                    report.consumer_kills += 1;
                    *generation += 1;
                    *process = Some(start(Role::Consumer, slot, *generation));
                }
            }
        }
        if fault.is_none() && handled >= fault_at {
            let kind = fleet.fault.clone();
            let faulting = faulting.clone();
            faulting.store(true, Ordering::Relaxed);
            fault = Some(std::thread::spawn(move || {
                let what = disturb(&kind);
                // A second for the processes it brought down to exit and start again.
                std::thread::sleep(Duration::from_secs(1));
                faulting.store(false, Ordering::Relaxed);
                format!("{what}, at {handled} payments applied")
            }));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if let Some(fault) = fault {
        report.fault = Some(fault.join().expect("the fault thread"));
    }
    assert!(
        relay_points.peek().is_none() && consumer_points.peek().is_none(),
        "the run ended before its kills: {} relay and {} consumer kills of {KILLS} each",
        report.relay_kills,
        report.consumer_kills
    );
    for (role, slots) in [(Role::Relay, relays), (Role::Consumer, consumers)] {
        for (process, _) in slots {
            report.runs.push(process.unwrap().terminate(role));
        }
    }
    report
}

/// Disturbs the broker once; says what it did.
fn disturb(fault: &Fault) -> String {
    match fault {
        Fault::CloseConnections { vhost } => {
            let mut args = vec!["close_all_connections"];
            if let Some(vhost) = vhost {
                args.extend(["-p", vhost.as_str()]);
            }
            args.push("tower-ids outbox proof: connections closed on purpose");
            let output = rabbitmqctl(&args).expect("rabbitmqctl close_all_connections");
            // "Closed 6 connections"
            let closed = output
                .lines()
                .find_map(|line| line.strip_prefix("Closed "))
                .and_then(|rest| rest.split_whitespace().next())
                .unwrap_or("?")
                .to_owned();
            format!("RabbitMQ closed {closed} connections of the run (rabbitmqctl close_all_connections)")
        }
        Fault::Pause { pid } => {
            signal(*pid, "-STOP");
            std::thread::sleep(PAUSE);
            signal(*pid, "-CONT");
            format!("broker paused {} s (SIGSTOP, SIGCONT)", PAUSE.as_secs())
        }
        Fault::None => "no fault (this broker cannot be disturbed here)".to_owned(),
    }
}

/// `rabbitmqctl ARGS`: its stdout, or why it failed.
fn rabbitmqctl(args: &[&str]) -> Result<String, String> {
    let output = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .map_err(|e| format!("rabbitmqctl: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "rabbitmqctl {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

// ----------------------------------------------------------------------------------
// The requests
// ----------------------------------------------------------------------------------

/// What the requests sent.
#[derive(Default)]
struct Sent {
    /// Every payment's key, with its account and amount.
    payments: HashMap<String, (String, i64)>,
    /// Retries that replayed the `201`.
    replayed: usize,
    /// Answers other than `201` (tried again), by status; connection errors as `0`.
    refused: BTreeMap<u16, usize>,
}

/// Sends [`REQUESTS`] requests, [`CONCURRENCY`] at once; each until it is answered
/// `201`, then once more with its key, which must replay the same `201`.
async fn send_requests(url: &str) -> Sent {
    let client = support::client();
    let next = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(Mutex::new(Sent::default()));
    let run = uuid::Uuid::now_v7();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (client, next, sent) = (client.clone(), next.clone(), sent.clone());
            let url = format!("{url}/payments");
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= REQUESTS {
                        return;
                    }
                    let payments: Vec<(String, i64)> = (0..PER_REQUEST)
                        .map(|_| {
                            (
                                format!("acct-{}", rand::random_range(0..ACCOUNTS)),
                                rand::random_range(1..=100_000_i64),
                            )
                        })
                        .collect();
                    let body = json!({
                        "payments": payments
                            .iter()
                            .map(|(account, amount)| json!({"account": account, "amount": amount}))
                            .collect::<Vec<_>>(),
                    })
                    .to_string();
                    let key = format!("req-{run}-{n}");
                    let headers = [
                        ("idempotency-key", key.as_str()),
                        ("content-type", "application/json"),
                    ];
                    let mut created = None;
                    for _ in 0..ATTEMPTS {
                        match support::try_send(&client, "POST", url.clone(), &headers, &body).await
                        {
                            Ok(reply) if reply.status == StatusCode::CREATED => {
                                created = Some(reply);
                                break;
                            }
                            Ok(reply) => {
                                *sent
                                    .lock()
                                    .unwrap()
                                    .refused
                                    .entry(reply.status.as_u16())
                                    .or_default() += 1;
                            }
                            Err(_) => {
                                *sent.lock().unwrap().refused.entry(0).or_default() += 1;
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    let created = created
                        .unwrap_or_else(|| panic!("request {n}: no 201 in {ATTEMPTS} tries"));
                    let again = support::send(&client, "POST", url.clone(), &headers, &body).await;
                    assert!(
                        again.replayed_created() && again.body == created.body,
                        "request {n}: its retry replays the same 201: {again:?}"
                    );
                    let keys = created.json()["keys"].clone();
                    let keys: Vec<String> = serde_json::from_value(keys).unwrap();
                    assert_eq!(keys.len(), PER_REQUEST);
                    let mut sent = sent.lock().unwrap();
                    sent.replayed += 1;
                    for (key, payment) in keys.into_iter().zip(payments) {
                        assert!(sent.payments.insert(key, payment).is_none(), "a key twice");
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    Arc::try_unwrap(sent)
        .ok()
        .expect("the workers are done")
        .into_inner()
        .unwrap()
}

// ----------------------------------------------------------------------------------
// The trial
// ----------------------------------------------------------------------------------

/// One broker's run.
struct Trial {
    broker: &'static str,
    /// `examples/outbox` arguments that pick the broker and its destinations.
    outbox: Vec<String>,
    fleet: Fleet,
    sender: TestDatabase,
    consumer: TestDatabase,
}

/// Rows of `payments` in the consumer's database, 0 before the table exists.
async fn applied(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT key) FROM payments")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

/// The outbox's rows: (pending, published, dead).
async fn outbox_rows(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL), \
                count(*) FILTER (WHERE published_at IS NOT NULL), \
                count(*) FILTER (WHERE dead_at IS NOT NULL) FROM tower_ids_outbox",
    )
    .fetch_one(pool)
    .await
    .unwrap_or((-1, -1, -1))
}

async fn run(trial: Trial) {
    let _turn = ONE_AT_A_TIME.lock().await;
    let began = Instant::now();
    let building = Instant::now();
    tokio::task::spawn_blocking(|| {
        demo::example_path("outbox");
        demo::example_path("inbox");
    })
    .await
    .unwrap();
    let build = building.elapsed();
    let started = Instant::now();

    // The sender: `serve`, which creates its tables and the outbox's.
    let mut serve_args = trial.outbox.clone();
    serve_args.extend(
        [
            "--database-url",
            trial.sender.url(),
            "serve",
            "--connections",
            "24",
        ]
        .map(str::to_owned),
    );
    let server = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = serve_args.iter().map(String::as_str).collect();
        demo::Demo::example("outbox", &args, &[("RUST_LOG", "warn,outbox=info")])
    })
    .await
    .unwrap();

    // The relays and consumers, and their chaos, on a thread of their own.
    let progress = Arc::new(Progress::default());
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let chaos_thread = {
        let (progress, stop) = (progress.clone(), stop.clone());
        let fleet = trial.fleet;
        tokio::task::spawn_blocking(move || chaos(fleet, progress, ready_tx, stop))
    };
    tokio::task::spawn_blocking(move || ready_rx.recv_timeout(Duration::from_secs(60)))
        .await
        .unwrap()
        .expect("the relays and consumers start");

    let sending = Instant::now();
    let sent = send_requests(&server.url).await;
    let sending = sending.elapsed();
    assert_eq!(sent.payments.len(), MESSAGES);

    // Until the consumer has every payment, and the outbox nothing pending.
    let sender = trial.sender.pool(2).await;
    let consumer = trial.consumer.pool(2).await;
    loop {
        let have = applied(&consumer).await;
        let rows = outbox_rows(&sender).await;
        if have == MESSAGES as i64 && rows.0 == 0 {
            break;
        }
        if chaos_thread.is_finished() {
            chaos_thread.await.unwrap();
            unreachable!("the chaos ends only when told");
        }
        assert!(
            started.elapsed() < LIMIT,
            "{have} of {MESSAGES} payments applied after {LIMIT:?}; outbox (pending, published, \
             dead) {rows:?}; {} publications, {} commits logged",
            progress.published.load(Ordering::Relaxed),
            progress.handled.load(Ordering::Relaxed),
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let done = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let chaos = chaos_thread.await.unwrap();
    server.terminate();
    let mut server = server;
    let exit = server.exited_within(Duration::from_secs(30)).await;
    assert!(
        exit.is_some_and(|status| status.success()),
        "serve stops on SIGTERM: {exit:?}"
    );

    // The sender's side: every payment sent once, every message published, none dead.
    let recorded: Vec<(String, String, i64, i64)> =
        sqlx::query_as("SELECT key, account, amount, seq FROM sent_payments")
            .fetch_all(&sender)
            .await
            .unwrap();
    assert_eq!(
        recorded.len(),
        MESSAGES,
        "one sent_payments row per payment"
    );
    let mut seq_of: HashMap<&str, i64> = HashMap::new();
    for (key, account, amount, seq) in &recorded {
        assert_eq!(
            sent.payments.get(key),
            Some(&(account.clone(), *amount)),
            "sent_payments holds what the 201s said"
        );
        seq_of.insert(key, *seq);
    }
    assert_eq!(
        outbox_rows(&sender).await,
        (0, MESSAGES as i64, 0),
        "one message per payment, each published, none dead"
    );

    // The consumer's side: each payment once, the balances, the order per account.
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, count(*) FROM payments GROUP BY key")
            .fetch_all(&consumer)
            .await
            .unwrap();
    let rows: HashMap<String, i64> = rows.into_iter().collect();
    let doubled: Vec<_> = rows.iter().filter(|(_, n)| **n > 1).collect();
    let lost: Vec<_> = sent
        .payments
        .keys()
        .filter(|key| !rows.contains_key(*key))
        .collect();
    let unknown: Vec<_> = rows
        .keys()
        .filter(|key| !sent.payments.contains_key(*key))
        .collect();
    assert!(doubled.is_empty(), "payments applied twice: {doubled:?}");
    assert!(lost.is_empty(), "payments lost: {} {lost:?}", lost.len());
    assert!(unknown.is_empty(), "payments nobody sent: {unknown:?}");
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    for (account, amount) in sent.payments.values() {
        *expected.entry(account.clone()).or_default() += amount;
    }
    let balances: BTreeMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT account, balance FROM accounts")
            .fetch_all(&consumer)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(
        balances, expected,
        "every balance is the sum sent to its account"
    );
    let order: Vec<(String, String)> =
        sqlx::query_as("SELECT key, account FROM payments ORDER BY id")
            .fetch_all(&consumer)
            .await
            .unwrap();
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut out_of_order = Vec::new();
    for (key, account) in &order {
        let seq = seq_of[key.as_str()];
        if let Some(previous) = last.insert(account, seq) {
            if seq <= previous {
                out_of_order.push(format!("{account}: {seq} after {previous}"));
            }
        }
    }
    assert!(
        out_of_order.is_empty(),
        "payments applied out of their account's commit order ({}): {:?}",
        out_of_order.len(),
        &out_of_order[..out_of_order.len().min(20)]
    );
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tower_ids_idempotency WHERE completed")
            .fetch_one(&consumer)
            .await
            .unwrap();
    assert_eq!(records, MESSAGES as i64, "one inbox record per payment");
    sender.close().await;
    consumer.close().await;

    // The logs: publications, deliveries, replays.
    let events = |role: Role| {
        chaos
            .runs
            .iter()
            .filter(move |run| run.role == role)
            .flat_map(|run| run.events.iter())
    };
    let mut publications: HashMap<i64, usize> = HashMap::new();
    for event in events(Role::Relay).filter(|e| e.code == "outbox.published") {
        *publications
            .entry(
                event
                    .message_id
                    .expect("outbox.published in its outbox.publish span"),
            )
            .or_default() += 1;
    }
    let republished: usize = publications.values().map(|n| n - 1).sum();
    let mut handled: HashMap<&str, usize> = HashMap::new();
    for event in events(Role::Consumer).filter(|e| e.code == "inbox.handled") {
        *handled.entry(event.key.as_deref().unwrap()).or_default() += 1;
    }
    let twice: Vec<_> = handled.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "keys committed twice, by the logs: {twice:?}"
    );
    // A replay is of a copy the relay published again, or of a delivery the broker
    // made again (the consumer killed or cut off before its ack): on Kafka a record
    // (partition:offset) received before; on RabbitMQ a delivery flagged redelivered.
    let (mut replays, mut redeliveries) = (0, 0);
    let mut seen: HashSet<&str> = HashSet::new();
    for run in chaos.runs.iter().filter(|run| run.role == Role::Consumer) {
        let mut redelivered: HashMap<&str, bool> = HashMap::new();
        for event in &run.events {
            let delivery = event.delivery.as_deref().unwrap_or_default();
            match event.code.as_str() {
                "inbox.received" => {
                    let again = match event.redelivered {
                        Some(flag) => flag,
                        None => !seen.insert(delivery),
                    };
                    redelivered.insert(delivery, again);
                }
                "inbox.replayed" => {
                    replays += 1;
                    redeliveries += usize::from(redelivered.get(delivery) == Some(&true));
                }
                _ => {}
            }
        }
    }
    let warnings: BTreeMap<&str, usize> = chaos
        .runs
        .iter()
        .flat_map(|run| run.events.iter())
        .filter(|e| matches!(e.level.as_str(), "WARN" | "ERROR"))
        .fold(BTreeMap::new(), |mut counts, e| {
            *counts.entry(e.code.as_str()).or_default() += 1;
            counts
        });

    eprintln!(
        "outbox proof over {}: {MESSAGES} messages from {REQUESTS} requests of {PER_REQUEST} \
         payments over {ACCOUNTS} accounts ({CONCURRENCY} at once) in {:.1} s; each request \
         sent again with its key: {} replayed 201s, nothing added; answers other than 201, \
         tried again: {:?}",
        trial.broker,
        sending.as_secs_f64(),
        sent.replayed,
        sent.refused,
    );
    eprintln!(
        "  SIGKILLs (each restarted): {} relays, {} consumers; {}; exits restarted: {:?}",
        chaos.relay_kills,
        chaos.consumer_kills,
        chaos.fault.as_deref().unwrap_or("no fault"),
        chaos.exits,
    );
    eprintln!(
        "  republished by the relays (their logs: publications less messages): {republished}; \
         replays by the inbox: {replays} ({} of a copy published again, {redeliveries} of a \
         delivery the broker made again)",
        replays - redeliveries,
    );
    eprintln!("  warnings logged: {warnings:?}");
    eprintln!(
        "  each of the {MESSAGES} payments applied once, balances as sent, each account in \
         commit order; wall time {:.1} s (requests to the last payment applied {:.1} s, \
         building the examples {:.1} s)",
        began.elapsed().as_secs_f64(),
        done.as_secs_f64(),
        build.as_secs_f64(),
    );
    assert!(
        chaos.relay_kills >= KILLS && chaos.consumer_kills >= KILLS,
        "every planned kill happened"
    );
    assert!(
        republished > 0,
        "no relay kill landed inside a round: nothing was published again, so the inbox \
         absorbed no republication"
    );
}

// ----------------------------------------------------------------------------------
// RabbitMQ
// ----------------------------------------------------------------------------------

/// A vhost of the run's own, deleted on drop.
struct Vhost(String);

impl Vhost {
    /// Creates one with `user` allowed everything, or says why it could not.
    fn create(user: &str) -> Result<Self, String> {
        let name = format!("tower-ids-outbox-proof-{}", uuid::Uuid::now_v7());
        rabbitmqctl(&["add_vhost", &name])?;
        let vhost = Self(name);
        rabbitmqctl(&["set_permissions", "-p", &vhost.0, user, ".*", ".*", ".*"])?;
        Ok(vhost)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        if let Err(error) = rabbitmqctl(&["delete_vhost", &self.0]) {
            eprintln!("could not delete the vhost {}: {error}", self.0);
        }
    }
}

/// Deletes the run's queues on drop, when it has no vhost of its own.
struct Queues(Vec<String>);

impl Drop for Queues {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let names = std::mem::take(&mut self.0);
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                if let Some(connection) = rabbitmq::connect().await {
                    if let Ok(channel) = connection.create_channel().await {
                        for name in names {
                            let _ = channel
                                .queue_delete(name.as_str().into(), Default::default())
                                .await;
                        }
                    }
                    let _ = connection.close(200, "done".into()).await;
                }
            });
        })
        .join();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_rabbitmq_every_payment_lands_once_in_order_through_kills_and_closed_connections() {
    let Some(connection) = rabbitmq::connect().await else {
        return;
    };
    let _ = connection.close(200, "found".into()).await;
    let (Some(sender), Some(consumer)) =
        (TestDatabase::create().await, TestDatabase::create().await)
    else {
        return;
    };
    let base = rabbitmq::url();
    let user = base
        .split_once("://")
        .and_then(|(_, rest)| rest.split([':', '@']).next())
        .unwrap_or("guest")
        .to_owned();
    // A vhost of the run's own; else unique queues in the URL's vhost.
    let (vhost, url, fault) = match Vhost::create(&user) {
        Ok(vhost) => {
            let (server, _) = base.rsplit_once('/').unwrap();
            let url = format!("{server}/{}", vhost.0);
            let fault = Fault::CloseConnections {
                vhost: Some(vhost.0.clone()),
            };
            (Some(vhost), url, fault)
        }
        Err(why) => {
            let fault = if rabbitmqctl(&["status"]).is_ok() {
                Fault::CloseConnections { vhost: None }
            } else {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "no rabbitmqctl ({why}), and CI is set: the connections must be closed"
                );
                eprintln!("SKIPPED (in part): no rabbitmqctl ({why}); the run's connections will not be closed");
                Fault::None
            };
            (None, base.clone(), fault)
        }
    };
    let prefix = format!("outbox-proof.{}", uuid::Uuid::now_v7());
    let queues: Vec<String> = (0..QUEUES).map(|n| format!("{prefix}.{n}")).collect();
    let _queues = Queues(if vhost.is_some() {
        Vec::new()
    } else {
        queues.clone()
    });
    let outbox: Vec<String> = [
        "--broker",
        "amqp",
        "--amqp-url",
        &url,
        "--queue-prefix",
        &prefix,
        "--queues",
        &QUEUES.to_string(),
    ]
    .map(str::to_owned)
    .into();
    let mut relay = outbox.clone();
    relay.extend(
        [
            "--log-format",
            "json",
            "--database-url",
            sender.url(),
            "relay",
        ]
        .map(str::to_owned),
    );
    let consumers = queues
        .iter()
        .map(|queue| {
            [
                "--broker",
                "amqp",
                "--amqp-url",
                &url,
                "--queue",
                queue,
                "--prefetch",
                "1",
                "--log-format",
                "json",
                "consume",
                "--database-url",
                consumer.url(),
                "--in-flight-retry-ms",
                "100",
            ]
            .map(str::to_owned)
            .into()
        })
        .collect();
    run(Trial {
        broker: "RabbitMQ",
        outbox,
        fleet: Fleet {
            relay,
            consumers,
            fault,
        },
        sender,
        consumer,
    })
    .await;
    drop(vhost);
}

// ----------------------------------------------------------------------------------
// Kafka
// ----------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_kafka_every_payment_lands_once_in_order_through_kills_and_a_paused_broker() {
    use rdkafka::{
        admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
        ClientConfig,
    };

    let Some(broker) = kafka::Broker::start() else {
        return;
    };
    let (Some(sender), Some(consumer)) =
        (TestDatabase::create().await, TestDatabase::create().await)
    else {
        return;
    };
    let topic = format!("outbox-proof-{}", uuid::Uuid::now_v7());
    let group = format!("outbox-proof-{}", uuid::Uuid::now_v7());
    let admin: AdminClient<_> = ClientConfig::new()
        .set("bootstrap.servers", &broker.addr)
        .create()
        .unwrap();
    let new = NewTopic::new(&topic, PARTITIONS, TopicReplication::Fixed(1));
    for created in admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .unwrap()
    {
        created.unwrap();
    }
    drop(admin);
    let outbox: Vec<String> = [
        "--broker",
        "kafka",
        "--kafka-brokers",
        &broker.addr,
        "--topic",
        &topic,
        "--partitions",
        &PARTITIONS.to_string(),
    ]
    .map(str::to_owned)
    .into();
    let mut relay = outbox.clone();
    relay.extend(
        [
            "--log-format",
            "json",
            "--database-url",
            sender.url(),
            "relay",
        ]
        .map(str::to_owned),
    );
    let consumers = (0..KAFKA_CONSUMERS)
        .map(|_| {
            [
                "--broker",
                "kafka",
                "--kafka-brokers",
                &broker.addr,
                "--topic",
                &topic,
                "--group",
                &group,
                "--session-timeout-ms",
                "1000",
                "--log-format",
                "json",
                "consume",
                "--database-url",
                consumer.url(),
                "--in-flight-retry-ms",
                "100",
            ]
            .map(str::to_owned)
            .into()
        })
        .collect();
    run(Trial {
        broker: "Kafka",
        outbox,
        fleet: Fleet {
            relay,
            consumers,
            fault: Fault::Pause { pid: broker.pid() },
        },
        sender,
        consumer,
    })
    .await;
    drop(broker);
}
