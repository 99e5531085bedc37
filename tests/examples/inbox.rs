//! The transactional inbox (`examples/inbox`) crashed on purpose, over RabbitMQ and over
//! Kafka: 1,000 payments with distinct keys (and some published twice, as a retrying
//! sender would) go to two consumer processes; one of them is killed with SIGKILL at a
//! random moment and started again, over and over, until every message was
//! acknowledged. Then the database is counted: each payment's row exactly once, and the
//! balances add up to the 1,000 amounts, none lost and none doubled. The logs say how
//! many kills landed between a commit and its acknowledgement (there must be some, or
//! the test proved nothing) and each of those messages must have come again and been
//! replayed, not applied again.
//!
//! Every fifth stop is a SIGTERM instead, mid-stream: the consumer must acknowledge
//! every commit it made, log `message.drained` and exit 0.
//!
//! Each kill picks its victim at random, once the consumer restarted last has received
//! a message (on Kafka, once the group has rebalanced), after a random pause (none
//! while the kills lag behind the progress, so that a fast run still gets its kills).
//! Every other kill then waits for the victim to log a commit (`inbox.handled`) and
//! lands at a random moment within the first half of its `--ack-delay-ms`. What a kill
//! hit is read from the victim's log, not assumed: a delivery it logged as committed
//! but never began to acknowledge (`inbox.acking`) was cut between the two.
//!
//! Each test owns its database (on `TOWER_IDS_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/postgres`), its queue on RabbitMQ (`AMQP_URL`) or
//! its Tansu broker (`TANSU_BIN`), and removes them. Without a server the test prints
//! `SKIPPED` and passes, except under CI (`CI` set). It builds the example first
//! (`tests/examples/demo.rs`), so `cargo test --test inbox` runs alone; the figures are
//! printed with `cargo test --all-features --test inbox -- --nocapture`.

use tower_ids_test_support::postgres as database;
#[path = "demo.rs"]
mod demo;
use tower_ids_test_support::kafka;
use tower_ids_test_support::rabbitmq;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io::{BufRead, BufReader},
    ops::Range,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use database::TestDatabase;
use futures_util::future::BoxFuture;
use serde_json::{json, Value};

/// Payments, each with a key of its own.
const PAYMENTS: usize = 1000;

/// Of those, every `DUPLICATE_EVERY`th is published a second time, a few messages later.
const DUPLICATE_EVERY: usize = 20;

/// Accounts the payments are spread over.
const ACCOUNTS: usize = 20;

/// Fewer kills than this and the test failed to test: the consumers were too fast.
const MIN_KILLS: usize = 15;

/// Kills a trial aims at: while the kills lag behind this many spread evenly over the
/// messages acknowledged, each comes as early as its pacing allows.
const TARGET_KILLS: usize = 24;

/// Every this many stops of a consumer, the stop is a SIGTERM, mid-stream: the
/// consumer must settle what it holds and exit 0.
const GRACEFUL_EVERY: usize = 5;

/// The longest a trial may run, kills and all, before it fails.
const TRIAL_LIMIT: Duration = Duration::from_secs(150);

/// How a trial drives the consumers on one broker.
struct Pacing {
    /// `--handler-delay-ms`: in the open transaction, before the writes.
    handler_delay_ms: u64,
    /// `--ack-delay-ms`: between the commit and the acknowledgement, the window.
    ack_delay_ms: u64,
    /// How long after the restarted consumer received its first message the next kill
    /// comes, drawn uniformly.
    kill_after_ms: Range<u64>,
}

/// The payments (key, account, amount), and the messages in the order they are
/// published: each payment once, and every `DUPLICATE_EVERY`th again one to eight
/// messages later.
fn payments() -> (Vec<Value>, Vec<Value>) {
    let batch = uuid::Uuid::now_v7();
    let payments: Vec<Value> = (0..PAYMENTS)
        .map(|n| {
            json!({
                "idempotency_key": format!("pay-{batch}-{n}"),
                "account": format!("acct-{}", n % ACCOUNTS),
                "amount": rand::random_range(1..=100_000_i64),
            })
        })
        .collect();
    let mut order: Vec<(f64, &Value)> = payments
        .iter()
        .enumerate()
        .map(|(n, payment)| (n as f64, payment))
        .collect();
    for (n, payment) in payments.iter().enumerate().step_by(DUPLICATE_EVERY) {
        let later = rand::random_range(1..=8) as f64 + 0.5;
        order.push((n as f64 + later, payment));
    }
    order.sort_by(|a, b| a.0.total_cmp(&b.0));
    let sent = order.into_iter().map(|(_, p)| p.clone()).collect();
    (payments, sent)
}

/// What a test published.
struct Published {
    payments: Vec<Value>,
    /// Every message's delivery ID (the AMQP `message_id`, or the Kafka
    /// `topic:partition:offset`), in the order they were published.
    deliveries: Vec<String>,
    /// The delivery IDs of the second copies.
    second_copies: HashSet<String>,
}

impl Published {
    /// `sent` (the messages, in order) went out as `deliveries`.
    fn new(payments: Vec<Value>, sent: &[Value], deliveries: Vec<String>) -> Self {
        let mut keys = HashSet::new();
        let second_copies = sent
            .iter()
            .zip(&deliveries)
            .filter(|(payment, _)| !keys.insert(payment["idempotency_key"].as_str()))
            .map(|(_, delivery)| delivery.clone())
            .collect();
        Self {
            payments,
            deliveries,
            second_copies,
        }
    }
}

// ----------------------------------------------------------------------------------
// The consumer processes
// ----------------------------------------------------------------------------------

/// What the log of one consumer process has said so far.
#[derive(Default)]
struct Seen {
    lines: Vec<Value>,
    received: usize,
    /// Deliveries committed (`inbox.handled`) and not yet being acknowledged.
    pending: HashSet<String>,
}

/// One run of `inbox consume`, its JSON log read line by line.
struct Consumer {
    name: String,
    child: Child,
    seen: Arc<Mutex<Seen>>,
    reader: Option<JoinHandle<()>>,
}

/// A finished run of a consumer: its whole log, and whether it was killed.
struct Run {
    name: String,
    killed: bool,
    lines: Vec<Value>,
}

fn event(line: &Value) -> &str {
    line["fields"]["event"].as_str().unwrap_or_default()
}

fn delivery(line: &Value) -> Option<&str> {
    line["fields"]["delivery"].as_str()
}

impl Consumer {
    /// Starts `inbox ARGS consume ...` as `name` and waits until it consumes. Every
    /// delivery it begins to acknowledge goes into `acked`, shared by all runs.
    fn start(name: String, args: &[String], acked: Arc<Mutex<HashSet<String>>>) -> Self {
        let mut child = Command::new(demo::example_path("inbox"))
            .args(["--log-format", "json"])
            .args(args)
            .args(["--instance", &name])
            // `inbox.acking` is DEBUG.
            .env("RUST_LOG", "info,lapin=warn,inbox=debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the inbox example runs");
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let seen = Arc::new(Mutex::new(Seen::default()));
        let sink = seen.clone();
        let reader = std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                let value: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|_| panic!("not one JSON object per line: {line}"));
                let mut seen = sink.lock().unwrap();
                let id = delivery(&value).map(str::to_owned);
                match (event(&value), id) {
                    ("inbox.received", _) => seen.received += 1,
                    ("inbox.handled", Some(id)) => {
                        seen.pending.insert(id);
                    }
                    ("inbox.acking", Some(id)) => {
                        seen.pending.remove(&id);
                        acked.lock().unwrap().insert(id);
                    }
                    _ => {}
                }
                seen.lines.push(value);
            }
        });
        let consumer = Self {
            name,
            child,
            seen,
            reader: Some(reader),
        };
        let ready = consumer.wait(Duration::from_secs(30), |seen| {
            seen.lines
                .iter()
                .any(|line| event(line) == "message.consuming")
        });
        assert!(ready, "{} logged no message.consuming", consumer.name);
        consumer
    }

    /// Waits up to `limit` for `until` to hold of the log; whether it did.
    fn wait(&self, limit: Duration, until: impl Fn(&Seen) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if until(&self.seen.lock().unwrap()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    /// SIGKILL: no ack, no goodbye. Returns its whole log.
    fn kill(mut self) -> Run {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.finish(true)
    }

    /// SIGTERM, as a service manager stops it: it finishes what it holds and exits 0.
    fn terminate(mut self) -> Run {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill(1) runs");
        assert!(status.success(), "kill -TERM failed");
        let deadline = Instant::now() + Duration::from_secs(30);
        let exit = loop {
            if let Some(exit) = self.child.try_wait().unwrap() {
                break exit;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not stop within 30 s of SIGTERM",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(exit.success(), "{} stopped with {exit}", self.name);
        self.finish(false)
    }

    fn finish(&mut self, killed: bool) -> Run {
        if let Some(reader) = self.reader.take() {
            reader.join().expect("the log is one JSON object per line");
        }
        Run {
            name: self.name.clone(),
            killed,
            lines: std::mem::take(&mut self.seen.lock().unwrap().lines),
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ----------------------------------------------------------------------------------
// The trial
// ----------------------------------------------------------------------------------

/// How many messages the broker still holds unacknowledged, with no consumer running.
type Left = Box<dyn Fn() -> BoxFuture<'static, usize> + Send + Sync>;

/// What a trial did.
struct Trial {
    runs: Vec<Run>,
    kills: usize,
    /// Consumers stopped mid-stream with SIGTERM (and started again).
    terminations: usize,
    took: Duration,
    /// Runs of a lone consumer after the kills, for messages whose acknowledgement a
    /// kill lost after it was sent.
    sweeps: usize,
}

/// Two consumers on `args`, one killed and restarted at a time, until every
/// publication has been acknowledged (or its acknowledgement sent); then both stopped
/// with SIGTERM, and what the broker still holds (`left`) swept up by a lone consumer.
async fn trial(
    args: Vec<String>,
    publications: &[String],
    pacing: &'static Pacing,
    left: Left,
) -> Trial {
    let began = Instant::now();
    let expected: HashSet<String> = publications.iter().cloned().collect();
    let args = Arc::new(args);
    let (mut runs, kills, terminations) = {
        let args = args.clone();
        tokio::task::spawn_blocking(move || kill_loop(&args, &expected, pacing))
            .await
            .unwrap()
    };
    let mut sweeps = 0;
    loop {
        let remaining = left().await;
        if remaining == 0 {
            break;
        }
        assert!(
            sweeps < 3,
            "{remaining} messages still unacknowledged after {sweeps} sweeps"
        );
        sweeps += 1;
        let args = args.clone();
        let run = tokio::task::spawn_blocking(move || {
            let acked = Arc::new(Mutex::new(HashSet::new()));
            let consumer = Consumer::start(format!("sweep-{sweeps}"), &args, acked.clone());
            // Until it has acknowledged as many (some may be acknowledged again).
            let deadline = Instant::now() + Duration::from_secs(20);
            while acked.lock().unwrap().len() < remaining && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            consumer.terminate()
        })
        .await
        .unwrap();
        runs.push(run);
    }
    Trial {
        runs,
        kills,
        terminations,
        took: began.elapsed(),
        sweeps,
    }
}

/// The kills, and every `GRACEFUL_EVERY`th stop a SIGTERM instead: returns every run,
/// how many were killed and how many terminated mid-stream.
fn kill_loop(
    args: &[String],
    expected: &HashSet<String>,
    pacing: &Pacing,
) -> (Vec<Run>, usize, usize) {
    let began = Instant::now();
    let acked = Arc::new(Mutex::new(HashSet::new()));
    let done = || expected.is_subset(&acked.lock().unwrap());
    let start = |slot: usize, generation: usize| {
        let name = format!("{}-{generation}", ["a", "b"][slot]);
        Consumer::start(name, args, acked.clone())
    };
    let mut live = [Some(start(0, 0)), Some(start(1, 0))];
    let mut generations = [0, 0];
    let mut runs = Vec::new();
    let mut kills = 0;
    let mut terminations = 0;
    let mut restarted = 0;
    while !done() {
        assert!(
            began.elapsed() < TRIAL_LIMIT,
            "{} of {} messages acknowledged after {TRIAL_LIMIT:?}, {kills} kills",
            acked.lock().unwrap().len(),
            expected.len()
        );
        // Once the restarted consumer has work (on Kafka, once the group rebalanced).
        let consumer = live[restarted].as_ref().unwrap();
        consumer.wait(Duration::from_secs(10), |seen| seen.received > 0 || done());
        let progress = acked.lock().unwrap().len() as f64 / expected.len() as f64;
        let behind = (kills as f64) < TARGET_KILLS as f64 * progress;
        let after = if behind {
            pacing.kill_after_ms.start
        } else {
            rand::random_range(pacing.kill_after_ms.clone())
        };
        std::thread::sleep(Duration::from_millis(after));
        if done() {
            break;
        }
        let victim = rand::random_range(0..2);
        let consumer = live[victim].take().unwrap();
        if kills % 2 == 1 {
            // Aimed: at a commit whose acknowledgement is due.
            let committed = consumer.wait(Duration::from_secs(3), |seen| {
                !seen.pending.is_empty() || done()
            });
            if committed {
                std::thread::sleep(Duration::from_millis(rand::random_range(
                    0..pacing.ack_delay_ms / 2,
                )));
            }
        }
        if (kills + terminations) % GRACEFUL_EVERY == GRACEFUL_EVERY - 1 {
            runs.push(consumer.terminate());
            terminations += 1;
        } else {
            runs.push(consumer.kill());
            kills += 1;
        }
        generations[victim] += 1;
        live[victim] = Some(start(victim, generations[victim]));
        restarted = victim;
    }
    for consumer in live.into_iter().flatten() {
        runs.push(consumer.terminate());
    }
    (runs, kills, terminations)
}

/// Starts, kills and counts; asserts the database and the logs; prints the figures.
async fn run_trial(
    broker: &str,
    started: Instant,
    database: &TestDatabase,
    args: Vec<String>,
    published: Published,
    pacing: &'static Pacing,
    left: Left,
) {
    let building = Instant::now();
    tokio::task::spawn_blocking(|| demo::example_path("inbox"))
        .await
        .unwrap();
    let build = building.elapsed();
    let trial = trial(args, &published.deliveries, pacing, left).await;
    let payments = &published.payments;
    let pool = database.pool(2).await;

    // The database: each payment once, every balance its payments' sum.
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, count(*) FROM payments GROUP BY key")
            .fetch_all(&pool)
            .await
            .unwrap();
    let rows: HashMap<String, i64> = rows.into_iter().collect();
    let keys: HashSet<&str> = payments
        .iter()
        .map(|p| p["idempotency_key"].as_str().unwrap())
        .collect();
    let doubled: Vec<_> = rows.iter().filter(|(_, n)| **n > 1).collect();
    let lost: Vec<_> = keys.iter().filter(|k| !rows.contains_key(**k)).collect();
    assert!(doubled.is_empty(), "payments applied twice: {doubled:?}");
    assert!(lost.is_empty(), "payments lost: {lost:?}");
    assert_eq!(rows.len(), PAYMENTS, "no payment the test did not send");
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    for payment in payments {
        *expected
            .entry(payment["account"].as_str().unwrap().to_owned())
            .or_default() += payment["amount"].as_i64().unwrap();
    }
    let balances: BTreeMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT account, balance FROM accounts")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(balances, expected, "every balance is its payments' sum");
    let total: i64 = expected.values().sum();
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tower_ids_idempotency WHERE completed")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        records, PAYMENTS as i64,
        "one idempotency record per payment"
    );
    pool.close().await;

    // The logs: what each kill cut, and what came again.
    let lines = || trial.runs.iter().flat_map(|run| run.lines.iter());
    let of = |code: &'static str| lines().filter(move |line| event(line) == code);
    let mut handled_keys: HashMap<&str, usize> = HashMap::new();
    for line in of("inbox.handled") {
        *handled_keys
            .entry(line["fields"]["key"].as_str().unwrap())
            .or_default() += 1;
    }
    let twice: Vec<_> = handled_keys.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "keys committed twice, by the logs: {twice:?}"
    );
    let committed: HashSet<&str> = of("inbox.handled").filter_map(delivery).collect();
    let replayed: Vec<&str> = of("inbox.replayed").filter_map(delivery).collect();
    let replayed_set: HashSet<&str> = replayed.iter().copied().collect();
    let mut cutting_kills = 0;
    let mut cut: Vec<(&str, &str)> = Vec::new();
    for run in trial.runs.iter().filter(|run| run.killed) {
        let handled: HashSet<&str> = run
            .lines
            .iter()
            .filter(|line| event(line) == "inbox.handled")
            .filter_map(delivery)
            .collect();
        let acking: HashSet<&str> = run
            .lines
            .iter()
            .filter(|line| event(line) == "inbox.acking")
            .filter_map(delivery)
            .collect();
        let pending: Vec<&str> = handled.difference(&acking).copied().collect();
        cutting_kills += usize::from(!pending.is_empty());
        cut.extend(pending.into_iter().map(|d| (run.name.as_str(), d)));
    }
    // A SIGTERM, mid-stream or at the end: every commit acknowledged, the drain whole.
    for run in trial.runs.iter().filter(|run| !run.killed) {
        let of_run = |code: &'static str| {
            run.lines
                .iter()
                .filter(move |line| event(line) == code)
                .filter_map(delivery)
                .collect::<HashSet<&str>>()
        };
        let unacked: Vec<&str> = of_run("inbox.handled")
            .difference(&of_run("inbox.acking"))
            .copied()
            .collect();
        assert!(
            unacked.is_empty(),
            "{} stopped by SIGTERM with commits not acknowledged: {unacked:?}",
            run.name
        );
        assert!(
            run.lines
                .iter()
                .any(|line| event(line) == "message.drained"),
            "{} stopped by SIGTERM without draining",
            run.name
        );
    }
    let not_replayed: Vec<_> = cut
        .iter()
        .filter(|(_, d)| !replayed_set.contains(d))
        .collect();
    assert!(
        not_replayed.is_empty(),
        "cut between commit and ack, yet never replayed: {not_replayed:?}"
    );
    let redeliveries_replayed = replayed.iter().filter(|d| committed.contains(*d)).count();
    let copies_replayed = replayed
        .iter()
        .filter(|d| published.second_copies.contains(**d))
        .count();
    let settled = |outcome: &str| {
        of("message.settled")
            .filter(|line| line["fields"]["outcome"] == outcome)
            .count()
    };
    assert_eq!(settled("dead_lettered"), 0, "no payment refused for good");

    eprintln!(
        "inbox over {broker}: {} messages ({PAYMENTS} payments, {} sent twice), total {total} \
         over {ACCOUNTS} accounts; {} kills (SIGKILL) and {} SIGTERMs mid-stream, each \
         restarted, in {:.1} s, {} sweeps; \
         test runtime {:.1} s (of which building the example {:.1} s)",
        published.deliveries.len(),
        published.second_copies.len(),
        trial.kills,
        trial.terminations,
        trial.took.as_secs_f64(),
        trial.sweeps,
        started.elapsed().as_secs_f64(),
        build.as_secs_f64(),
    );
    eprintln!(
        "  commits logged {}; replays {}: redeliveries of a logged commit {redeliveries_replayed}, \
         second copies {copies_replayed}, others (a commit its process died before logging) {}; \
         requeued {}, handler failures {}",
        committed.len(),
        replayed.len(),
        replayed.len() - redeliveries_replayed - copies_replayed,
        settled("requeued") + settled("in_flight"),
        settled("retried"),
    );
    eprintln!(
        "  kills between a commit and its ack: {cutting_kills} of {} (commits cut from their \
         ack: {}, every one replayed on redelivery)",
        trial.kills,
        cut.len()
    );
    eprintln!("  payments rows {PAYMENTS}, each key once; balances sum {total}, as sent");
    assert!(
        trial.kills >= MIN_KILLS,
        "only {} kills before every message was handled: the consumers were too fast to test",
        trial.kills
    );
    assert!(
        cutting_kills > 0,
        "no kill landed between a commit and its ack: the test proved nothing"
    );
}

// ----------------------------------------------------------------------------------
// RabbitMQ
// ----------------------------------------------------------------------------------

/// RabbitMQ: a prefetch of two per consumer; a killed consumer's connection drops and
/// its unacknowledged messages are delivered again at once.
static AMQP_PACING: Pacing = Pacing {
    handler_delay_ms: 20,
    ack_delay_ms: 40,
    kill_after_ms: 100..700,
};

/// Deletes the test's queues when dropped (from a thread of its own: the test's
/// runtime may be gone).
struct Queue(String);

impl Drop for Queue {
    fn drop(&mut self) {
        let name = self.0.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                if let Some(connection) = rabbitmq::connect().await {
                    if let Ok(channel) = connection.create_channel().await {
                        // With the dead-letter queue the driver declares beside it.
                        for queue in [name.clone(), format!("{name}.dead")] {
                            let _ = channel
                                .queue_delete(queue.as_str().into(), Default::default())
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
async fn over_rabbitmq_consumers_killed_at_random_apply_each_payment_once() {
    use lapin::{
        options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions},
        types::FieldTable,
        BasicProperties,
    };

    let started = Instant::now();
    let Some(connection) = rabbitmq::connect().await else {
        return;
    };
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let queue = Queue(format!(
        "tower-ids.test.inbox.{}.{}",
        std::process::id(),
        uuid::Uuid::now_v7()
    ));
    let channel = connection.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.0.as_str().into(), durable, FieldTable::default())
        .await
        .unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let (payments, sent) = payments();
    let mut deliveries = Vec::new();
    let mut confirms = Vec::new();
    for payment in &sent {
        let id = uuid::Uuid::now_v7().to_string();
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.0.as_str().into(),
                BasicPublishOptions::default(),
                payment.to_string().as_bytes(),
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(id.as_str().into()),
            )
            .await
            .unwrap();
        confirms.push(confirm);
        deliveries.push(id);
    }
    for confirm in confirms {
        confirm.await.unwrap();
    }
    let published = Published::new(payments, &sent, deliveries);

    let args: Vec<String> = [
        "--broker",
        "amqp",
        "--amqp-url",
        &rabbitmq::url(),
        "--queue",
        &queue.0,
        "--prefetch",
        "2",
        "consume",
        "--database-url",
        database.url(),
        "--in-flight-retry-ms",
        "100",
        "--handler-delay-ms",
        &AMQP_PACING.handler_delay_ms.to_string(),
        "--ack-delay-ms",
        &AMQP_PACING.ack_delay_ms.to_string(),
    ]
    .map(str::to_owned)
    .into();
    // With no consumer, every message the broker still has is ready.
    let left: Left = {
        let channel = channel.clone();
        let name = queue.0.clone();
        Box::new(move || {
            let channel = channel.clone();
            let name = name.clone();
            Box::pin(async move {
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                };
                let declared = channel
                    .queue_declare(name.as_str().into(), passive, FieldTable::default())
                    .await
                    .unwrap();
                declared.message_count() as usize
            })
        })
    };
    run_trial(
        "RabbitMQ",
        started,
        &database,
        args,
        published,
        &AMQP_PACING,
        left,
    )
    .await;
    let _ = connection.close(200, "done".into()).await;
    drop(queue);
}

// ----------------------------------------------------------------------------------
// Kafka
// ----------------------------------------------------------------------------------

/// Kafka: one record at a time per consumer, 4 partitions; a killed consumer's
/// partitions go to the others once its session times out (1 s), and the restarted one
/// joins in another rebalance.
static KAFKA_PACING: Pacing = Pacing {
    handler_delay_ms: 30,
    ack_delay_ms: 35,
    kill_after_ms: 200..1500,
};

const PARTITIONS: i32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_kafka_consumers_killed_at_random_apply_each_payment_once() {
    use rdkafka::{
        admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
        consumer::{BaseConsumer, Consumer as _},
        producer::{FutureProducer, FutureRecord},
        ClientConfig, Offset, TopicPartitionList,
    };

    let started = Instant::now();
    let Some(broker) = kafka::Broker::start() else {
        return;
    };
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let topic = format!("inbox-{}", uuid::Uuid::now_v7());
    let group = format!("inbox-{}", uuid::Uuid::now_v7());
    let config = || {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &broker.addr);
        config
    };
    let admin: AdminClient<_> = config().create().unwrap();
    let new = NewTopic::new(&topic, PARTITIONS, TopicReplication::Fixed(1));
    for created in admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .unwrap()
    {
        created.unwrap();
    }
    let producer: FutureProducer = config().set("enable.idempotence", "true").create().unwrap();
    let (payments, sent) = payments();
    let bodies: Vec<String> = sent.iter().map(Value::to_string).collect();
    let deliveries: Vec<_> = sent
        .iter()
        .zip(&bodies)
        .map(|(payment, body)| {
            let record = FutureRecord::to(&topic)
                .key(payment["account"].as_str().unwrap())
                .payload(body);
            producer.send(record, Duration::from_secs(10))
        })
        .collect();
    let deliveries: Vec<String> = futures_util::future::join_all(deliveries)
        .await
        .into_iter()
        .map(|delivered| {
            let delivered = delivered.map_err(|(error, _)| error).unwrap();
            format!("{topic}:{}:{}", delivered.partition, delivered.offset)
        })
        .collect();

    let args: Vec<String> = [
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
        "consume",
        "--database-url",
        database.url(),
        "--in-flight-retry-ms",
        "100",
        "--handler-delay-ms",
        &KAFKA_PACING.handler_delay_ms.to_string(),
        "--ack-delay-ms",
        &KAFKA_PACING.ack_delay_ms.to_string(),
    ]
    .map(str::to_owned)
    .into();
    // Past the group's committed offset, up to the end of each partition (as the
    // producer was told it).
    let mut ends = [0_i64; PARTITIONS as usize];
    for delivery in &deliveries {
        let (partition, offset) = delivery[topic.len() + 1..].split_once(':').unwrap();
        let end = &mut ends[partition.parse::<usize>().unwrap()];
        *end = (*end).max(offset.parse::<i64>().unwrap() + 1);
    }
    let left: Left = {
        let (addr, topic, group) = (broker.addr.clone(), topic.clone(), group.clone());
        Box::new(move || {
            let (addr, topic, group) = (addr.clone(), topic.clone(), group.clone());
            Box::pin(async move {
                tokio::task::spawn_blocking(move || {
                    let reader: BaseConsumer = ClientConfig::new()
                        .set("bootstrap.servers", &addr)
                        .set("group.id", &group)
                        .create()
                        .unwrap();
                    let mut partitions = TopicPartitionList::new();
                    for partition in 0..PARTITIONS {
                        partitions.add_partition(&topic, partition);
                    }
                    let committed = reader
                        .committed_offsets(partitions, Duration::from_secs(10))
                        .unwrap();
                    (0..PARTITIONS)
                        .zip(ends)
                        .map(|(partition, end)| {
                            let at = match committed
                                .find_partition(&topic, partition)
                                .map(|p| p.offset())
                            {
                                Some(Offset::Offset(at)) => at,
                                _ => 0,
                            };
                            assert!(at <= end, "partition {partition} committed past its end");
                            usize::try_from(end - at).unwrap()
                        })
                        .sum()
                })
                .await
                .unwrap()
            })
        })
    };
    let published = Published::new(payments, &sent, deliveries);
    run_trial(
        "Kafka",
        started,
        &database,
        args,
        published,
        &KAFKA_PACING,
        left,
    )
    .await;
    drop(broker);
}
