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
//! set). It builds both examples first (`tests/examples/demo.rs`), so `cargo test --test
//! outbox_proof` runs alone. The two proofs take turns rather than share the machine.
//!
//! The files follow a message's way: `requests` (the requests to `serve`), `processes`
//! (one relay or consumer process and its log), `chaos` (the relays and consumers killed
//! and restarted, the broker disturbed), `amqp` and `kafka` (each broker's set-up and
//! fault), `verify` (the databases and the logs checked, the figures printed). `serve`
//! has the server's own trials: a half-sent request answered within the body timeout,
//! and a stop with such a client connected.

use tower_ids_test_support::postgres as database;
#[path = "../demo.rs"]
mod demo;
use tower_ids_test_support as support;
use tower_ids_test_support::kafka as kafka_broker;
use tower_ids_test_support::rabbitmq;

mod amqp;
mod chaos;
mod kafka;
mod processes;
mod requests;
mod serve;
mod verify;

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use chaos::Fleet;
use database::TestDatabase;
use processes::Progress;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_rabbitmq_every_payment_lands_once_in_order_through_kills_and_closed_connections() {
    let Some((trial, cleanup)) = amqp::trial().await else {
        return;
    };
    run(trial).await;
    drop(cleanup);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_kafka_every_payment_lands_once_in_order_through_kills_and_a_paused_broker() {
    let Some((trial, broker)) = kafka::trial().await else {
        return;
    };
    run(trial).await;
    drop(broker);
}

/// One broker's run.
pub(crate) struct Trial {
    broker: &'static str,
    /// `examples/outbox` arguments that pick the broker and its destinations.
    outbox: Vec<String>,
    fleet: Fleet,
    sender: TestDatabase,
    consumer: TestDatabase,
}

/// Runs one trial: builds the examples, starts `serve` and the fleet with its chaos,
/// sends the requests, waits until the consumer has every payment and the outbox
/// nothing pending, stops everything, then checks the databases and the logs.
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
        tokio::task::spawn_blocking(move || chaos::chaos(fleet, progress, ready_tx, stop))
    };
    tokio::task::spawn_blocking(move || ready_rx.recv_timeout(Duration::from_secs(60)))
        .await
        .unwrap()
        .expect("the relays and consumers start");

    let sending = Instant::now();
    let sent = requests::send_requests(&server.url).await;
    let sending = sending.elapsed();
    assert_eq!(sent.payments.len(), MESSAGES);

    // Until the consumer has every payment, and the outbox nothing pending.
    let sender = trial.sender.pool(2).await;
    let consumer = trial.consumer.pool(2).await;
    loop {
        let have = verify::applied(&consumer).await;
        let rows = verify::outbox_rows(&sender).await;
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

    let seq_of = verify::sender_side(&sender, &sent).await;
    verify::consumer_side(&consumer, &sent, &seq_of).await;
    sender.close().await;
    consumer.close().await;
    let logs = verify::logs(&chaos);
    verify::report(
        trial.broker,
        &sent,
        &chaos,
        logs,
        verify::Times {
            began,
            build,
            sending,
            done,
        },
    );
}
