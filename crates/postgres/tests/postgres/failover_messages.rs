//! The outbox's relay and the transactional inbox through a primary's failover (the one
//! `failover.rs` stages: a primary streaming to a standby through a link the test can
//! cut, an endpoint every pool connects through; the link cut, the primary SIGKILLed,
//! the standby promoted, the endpoint moved), with RabbitMQ on a vhost of the test's own.
//!
//! **Outbox**: transactions stream in through the endpoint, each enqueuing one message
//! with a key of its own (every other one with a partition key), while a [`Relay`] on a
//! pool of its own through the endpoint publishes them to a queue; the primary fails
//! over midway, the stream goes on, then the relay drains. Synchronous replication:
//! every message whose COMMIT returned `Ok` was published at least once, nothing was
//! published that is not in the new primary's outbox table. Either replication: the
//! relay came back by itself (the new primary's backlog drains, nothing dead-lettered).
//! Messages published twice are printed: at least once is the promise, the consumer's
//! inbox absorbs them by their `idempotency-key`.
//!
//! **Inbox**: messages stream into a queue; a lapin consumer loop of the test's own runs
//! each delivery through a [`MessageIdempotencyLayer`] over a transactional
//! [`PostgresStore`] (its pool through the endpoint), whose handler inserts a row in the
//! delivery's transaction, and acks only on `Ran` or `Replayed` (nack and requeue
//! otherwise). One message's COMMIT sleeps in a deferred trigger; the link is cut and the
//! primary killed while it does (the other deliveries' COMMITs then wait for the standby).
//! Synchronous replication: after draining, each message's row is on the new primary
//! exactly once, and no message was acked whose row is missing. Either replication:
//! every message is acked in the end.
//!
//! Asynchronous replication runs too, printed, not asserted (what the primary committed
//! after the cut is lost). Every trial prints one line:
//!
//! ```text
//! cargo test --all-features -p tower-ids-postgres --test postgres failover_messages -- --nocapture
//! ```
//!
//! runs one synchronous and one asynchronous trial per side (about 25 s each);
//! `TOWER_IDS_FULL_TRIALS=1` adds later kills and runs each trial twice. Without the
//! PostgreSQL server binaries or RabbitMQ the tests print `SKIPPED` (and fail under CI).

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use futures_util::StreamExt as _;
use lapin::{
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
        BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
    },
    types::{AMQPValue, FieldTable},
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use sqlx::{postgres::PgPoolOptions, PgPool};
use tokio::{
    sync::Semaphore,
    task::{block_in_place, JoinHandle},
};
use tower::{service_fn, ServiceBuilder, ServiceExt as _};
use tower_ids::{
    idempotency::{
        message::{Handled, MessageIdempotencyLayer, MessageKey},
        store::{PostgresMode, PostgresStore, Transaction},
        IdempotencyKey, InFlight, Policy,
    },
    outbox::{amqp::AmqpSink, Message, Outbox, Relay},
};

use super::{
    failover::{promote, waiting_on, Replication, Streaming, SERIAL},
    faults::{self, COMMIT_FAULTS},
    proxy::Proxy,
    rabbitmq,
    replica::Ledger,
    support::full_trials,
};

/// The stream before the failover, and after the endpoint's move.
const BEFORE: Duration = Duration::from_millis(1500);
const AFTER: Duration = Duration::from_millis(1500);

/// A new transaction (outbox) or message (inbox) this often, at most this many
/// transactions in flight.
const EVERY: Duration = Duration::from_millis(10);
const IN_FLIGHT: usize = 8;

/// How long after the endpoint's move everything must have drained.
const DRAIN: Duration = Duration::from_secs(30);

/// Deliveries the inbox consumer handles at once (the channel's prefetch).
const PREFETCH: u16 = 8;

/// How long a delivery that was not handled waits before its nack (requeue): the
/// store's outage is not hammered.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// How long before the kill the link is cut, in the inbox trials.
const CUT_LEAD: Duration = Duration::from_millis(200);

/// A vhost of the test's own (`rabbitmqctl add_vhost`), deleted on drop; without
/// `rabbitmqctl`, the URL's own vhost, where the queue's name is unique and the queue
/// goes once its consumer does (auto-delete).
struct Vhost {
    url: String,
    name: Option<String>,
}

impl Vhost {
    /// `None` (said loudly; under CI a failure) when no RabbitMQ answers.
    async fn create() -> Option<Self> {
        let connection = rabbitmq::connect().await?;
        let _ = connection.close(200, "found".into()).await;
        let base = rabbitmq::url();
        let user = base
            .split_once("://")
            .and_then(|(_, rest)| rest.split([':', '@']).next())
            .unwrap_or("guest")
            .to_owned();
        let name = format!("tower-ids-failover-{}", uuid::Uuid::now_v7());
        if rabbitmq::rabbitmqctl(&["add_vhost", &name]).is_err() {
            return Some(Self {
                url: base,
                name: None,
            });
        }
        let (server, _) = base.rsplit_once('/').unwrap();
        let vhost = Self {
            url: format!("{server}/{name}"),
            name: Some(name.clone()),
        };
        rabbitmq::rabbitmqctl(&["set_permissions", "-p", &name, &user, ".*", ".*", ".*"])
            .expect("the vhost's permissions");
        Some(vhost)
    }

    fn describe(&self) -> &'static str {
        if self.name.is_some() {
            "own vhost"
        } else {
            "no rabbitmqctl: a queue of its own in the URL's vhost"
        }
    }

    /// A connection to the vhost, and a channel on it.
    async fn channel(&self) -> (Connection, Channel) {
        let connection = Connection::connect(&self.url, ConnectionProperties::default())
            .await
            .expect("RabbitMQ answered a moment ago");
        let channel = connection.create_channel().await.unwrap();
        (connection, channel)
    }

    /// A channel on the vhost and a fresh queue there.
    async fn queue(&self, what: &str) -> (Connection, Channel, String) {
        let (connection, channel) = self.channel().await;
        let name = format!("failover-{what}-{}", uuid::Uuid::now_v7().simple());
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    auto_delete: self.name.is_none(),
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        (connection, channel, name)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        if let Some(name) = &self.name {
            if let Err(error) = rabbitmq::rabbitmqctl(&["delete_vhost", name]) {
                eprintln!("could not delete the vhost {name}: {error}");
            }
        }
    }
}

/// The broker, then a primary streaming to a standby, a pool straight to the standby,
/// and the endpoint on the primary. `None` (said) without RabbitMQ or PostgreSQL.
struct Stage {
    vhost: Vhost,
    primary: super::server::PostgresServer,
    standby: super::server::PostgresServer,
    link: Proxy,
    endpoint: Proxy,
    primary_pool: PgPool,
    standby_pool: PgPool,
}

impl Stage {
    async fn start(replication: Replication) -> Option<Self> {
        let vhost = Vhost::create().await?;
        let Streaming {
            primary,
            standby,
            link,
            primary_pool,
        } = Streaming::start(replication).await?;
        let standby_pool = faults::pool(&standby.url()).await;
        let endpoint = Proxy::start(primary.port()).await;
        Some(Self {
            vhost,
            primary,
            standby,
            link,
            endpoint,
            primary_pool,
            standby_pool,
        })
    }

    /// A pool of `connections` through the endpoint.
    async fn pool(&self, connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(1))
            .connect(&format!(
                "postgres://postgres@127.0.0.1:{}/postgres",
                self.endpoint.port()
            ))
            .await
            .expect("the endpoint leads to the primary")
    }

    /// Kills the primary (SIGKILL), promotes the standby and moves the endpoint to it;
    /// returns when the primary was killed and when the endpoint moved.
    async fn fail_over(&mut self) -> (Instant, Instant) {
        block_in_place(|| self.primary.kill());
        let killed = Instant::now();
        promote(&self.standby, &self.standby_pool).await;
        self.endpoint.move_to(self.standby.port());
        (killed, Instant::now())
    }
}

/// Runs each trial in a task of its own, one at a time (and none beside the other
/// failover trials), so every trial prints its line; the failures are told at the end.
/// A trial that returns `None` found no server: the rest are skipped.
async fn trials<P, F>(plans: Vec<P>, label: fn(&P) -> String, trial: fn(P) -> F)
where
    P: Copy + Send + 'static,
    F: Future<Output = Option<()>> + Send + 'static,
{
    let _serial = SERIAL.lock().await;
    let mut failed = Vec::new();
    for plan in plans {
        match tokio::spawn(trial(plan)).await {
            Ok(Some(())) => {}
            Ok(None) => return,
            Err(error) => {
                let panic = error.into_panic();
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                failed.push(format!("{}: {why}", label(&plan)));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} trials failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// The trials: each of `moments` with synchronous replication (asserted) and the first
/// with asynchronous (printed), once; with `TOWER_IDS_FULL_TRIALS=1`, `more` too, each
/// twice.
fn plans<M: Copy>(moments: &[M], more: &[M]) -> Vec<(Replication, M, usize)> {
    let (synchronous, repeats) = if full_trials() {
        ([moments, more].concat(), 2)
    } else {
        (moments.to_vec(), 1)
    };
    (1..=repeats)
        .flat_map(|trial| {
            let synchronous = synchronous.clone();
            synchronous
                .into_iter()
                .map(move |moment| (Replication::Synchronous, moment, trial))
                .chain([(Replication::Asynchronous, moments[0], trial)])
        })
        .collect()
}

// ---------------------------------------------------------------------------------
// The outbox relay.

/// Where an enqueuing transaction failed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Failed {
    /// Before its COMMIT (`BEGIN` or the enqueue): nothing of it stands.
    BeforeCommit,
    /// Its COMMIT failed: in doubt.
    Commit,
}

/// One enqueuing transaction: its message's key, when it ended, how.
struct Enqueued {
    key: String,
    at: Instant,
    outcome: Result<(), Failed>,
}

/// Transactions through the endpoint, one every [`EVERY`] with at most [`IN_FLIGHT`]
/// at once, each enqueuing one message to `queue`, until stopped.
struct Writers {
    stop: Arc<AtomicBool>,
    task: JoinHandle<Vec<Enqueued>>,
}

impl Writers {
    fn start(outbox: Outbox, queue: String, label: String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let in_flight = Arc::new(Semaphore::new(IN_FLIGHT));
                let mut transactions = Vec::new();
                let mut every = tokio::time::interval(EVERY);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                while !stop.load(Ordering::Relaxed) {
                    every.tick().await;
                    let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                        continue;
                    };
                    let n = transactions.len();
                    let key = format!("{label}-{n}");
                    let mut message = Message::new(queue.clone(), format!("message {n}"))
                        .idempotency_key(IdempotencyKey::new(&key).unwrap());
                    if n % 2 == 1 {
                        message = message.partition_key(format!("p{}", n % 3));
                    }
                    let outbox = outbox.clone();
                    transactions.push(tokio::spawn(async move {
                        let outcome = enqueue(&outbox, message).await;
                        drop(permit);
                        Enqueued {
                            key,
                            at: Instant::now(),
                            outcome,
                        }
                    }));
                }
                let mut enqueued = Vec::new();
                for transaction in transactions {
                    enqueued.push(transaction.await.unwrap());
                }
                enqueued
            }
        });
        Self { stop, task }
    }

    async fn stop(self) -> Vec<Enqueued> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

/// One transaction that enqueues `message` and commits.
async fn enqueue(outbox: &Outbox, message: Message) -> Result<(), Failed> {
    let mut transaction = outbox
        .pool()
        .begin()
        .await
        .map_err(|_| Failed::BeforeCommit)?;
    outbox
        .enqueue(&mut transaction, message)
        .await
        .map_err(|_| Failed::BeforeCommit)?;
    transaction.commit().await.map_err(|_| Failed::Commit)
}

/// Reads `queue` (auto-acked) until aborted: each delivery's `idempotency-key`, and
/// when it came.
fn read(
    channel: Channel,
    queue: String,
    received: Arc<Mutex<Vec<(String, Instant)>>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut deliveries = channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        while let Some(Ok(delivery)) = deliveries.next().await {
            let key = delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|headers| {
                    headers
                        .inner()
                        .iter()
                        .find(|(name, _)| name.as_str() == "idempotency-key")
                        .and_then(|(_, value)| match value {
                            AMQPValue::LongString(key) => Some(key.to_string()),
                            _ => None,
                        })
                })
                .unwrap_or_default();
            received.lock().unwrap().push((key, Instant::now()));
        }
    })
}

/// The keys of the messages in the outbox table at `pool`, and how many are pending.
async fn outbox_rows(pool: &PgPool) -> (HashSet<String>, i64) {
    let rows: Vec<(String, bool)> = sqlx::query_as(
        "SELECT idempotency_key, published_at IS NULL AND dead_at IS NULL FROM tower_ids_outbox",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let pending = rows.iter().filter(|(_, pending)| *pending).count();
    (
        rows.into_iter().map(|(key, _)| key).collect(),
        i64::try_from(pending).unwrap(),
    )
}

#[derive(Clone, Copy, Debug)]
struct OutboxPlan {
    replication: Replication,
    /// From the link's cut to the kill: the COMMITs (synchronous) and the relay's
    /// round wait for the standby meanwhile.
    cut_before_kill: Duration,
    trial: usize,
}

impl OutboxPlan {
    fn label(&self) -> String {
        format!(
            "outbox-{:?}-{:?}-{}",
            self.replication, self.cut_before_kill, self.trial
        )
    }
}

async fn outbox_trial(plan: OutboxPlan) -> Option<()> {
    let mut stage = Stage::start(plan.replication).await?;
    let synchronous = plan.replication == Replication::Synchronous;
    Outbox::new(stage.primary_pool.clone())
        .migrate()
        .await
        .unwrap();
    let (connection, channel, queue) = stage.vhost.queue("outbox").await;
    let received = Arc::new(Mutex::new(Vec::new()));
    let reading = read(channel, queue.clone(), received.clone());

    let relay: Relay<AmqpSink> = Outbox::new(stage.pool(2).await)
        .relay(AmqpSink::new(stage.vhost.url.clone(), ""))
        .build();
    let (stop_relay, stopped) = tokio::sync::oneshot::channel::<()>();
    let relaying = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await;
    });
    let writers = Writers::start(
        Outbox::new(stage.pool(IN_FLIGHT as u32).await),
        queue,
        plan.label(),
    );

    tokio::time::sleep(BEFORE).await;
    stage.link.cut();
    let cut = Instant::now();
    tokio::time::sleep(plan.cut_before_kill).await;
    let (killed, moved) = stage.fail_over().await;
    tokio::time::sleep(AFTER).await;
    let enqueued = writers.stop().await;
    let stopped_at = Instant::now();

    // The drain: nothing pending on the new primary, and every message there received.
    let new_primary = Outbox::new(stage.standby_pool.clone());
    let drained = loop {
        let (table, pending) = outbox_rows(&stage.standby_pool).await;
        let got: HashSet<String> = received
            .lock()
            .unwrap()
            .iter()
            .map(|(key, _)| key.clone())
            .collect();
        if pending == 0 && table.is_subset(&got) {
            break Some(stopped_at.elapsed());
        }
        if moved.elapsed() > DRAIN {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = stop_relay.send(());
    let relay_stopped = tokio::time::timeout(Duration::from_secs(15), relaying)
        .await
        .is_ok();
    reading.abort();
    let _ = connection.close(200, "done".into()).await;

    // The reckoning.
    let (table, pending) = outbox_rows(&stage.standby_pool).await;
    let dead = new_primary.dead_letters(1000).await.unwrap().len();
    let received = received.lock().unwrap().clone();
    let mut deliveries: HashMap<&str, usize> = HashMap::new();
    for (key, _) in &received {
        *deliveries.entry(key.as_str()).or_default() += 1;
    }
    let committed: Vec<&Enqueued> = enqueued.iter().filter(|e| e.outcome.is_ok()).collect();
    let committed_after_move = committed.iter().filter(|e| e.at > moved).count();
    let committed_before_cut = committed.iter().filter(|e| e.at < cut).count();
    let before_commit = enqueued
        .iter()
        .filter(|e| e.outcome == Err(Failed::BeforeCommit))
        .count();
    let in_doubt: Vec<&Enqueued> = enqueued
        .iter()
        .filter(|e| e.outcome == Err(Failed::Commit))
        .collect();
    let in_doubt_stood = in_doubt.iter().filter(|e| table.contains(&e.key)).count();
    let not_published: Vec<&str> = committed
        .iter()
        .filter(|e| !deliveries.contains_key(e.key.as_str()))
        .map(|e| e.key.as_str())
        .collect();
    let committed_lost = committed.iter().filter(|e| !table.contains(&e.key)).count();
    let phantoms: Vec<&str> = deliveries
        .keys()
        .copied()
        .filter(|key| !table.contains(*key))
        .collect();
    let doubled = deliveries.values().filter(|n| **n > 1).count();
    let extra: usize = deliveries.values().map(|n| n - 1).sum();
    let back_after = received
        .iter()
        .find(|(_, at)| *at > moved)
        .map(|(_, at)| *at - moved);
    let mut sample = not_published.clone();
    sample.truncate(5);
    let mut phantom_sample = phantoms.clone();
    phantom_sample.truncate(5);
    eprintln!(
        "outbox relay through a failover, {:?} replication, link cut {:?} before the kill, trial {} ({}): \
         promoted and endpoint moved {:?} after the kill; {} transactions: {} committed ({committed_before_cut} before the cut, \
         {committed_after_move} after the move), {before_commit} failed before COMMIT, {} COMMITs failed ({in_doubt_stood} of them \
         on the new primary); new primary's outbox {} rows, {pending} pending, {dead} dead; published {} messages in {} deliveries, \
         {doubled} more than once ({extra} extra); committed, not on the new primary {committed_lost}; committed, never published {} {sample:?}; \
         published, not on the new primary {} {phantom_sample:?}; relay's first publication {back_after:?} after the move; \
         drained {drained:?} after the last enqueue; relay stopped: {relay_stopped}",
        plan.replication,
        plan.cut_before_kill,
        plan.trial,
        stage.vhost.describe(),
        moved - killed,
        enqueued.len(),
        committed.len(),
        in_doubt.len(),
        table.len(),
        deliveries.len(),
        received.len(),
        not_published.len(),
        phantoms.len(),
    );

    // Either replication: the relay came back by itself, and the writers did.
    assert!(
        committed_before_cut > 0 && committed_after_move > 0,
        "the stream committed before the cut ({committed_before_cut}) and after the move ({committed_after_move})"
    );
    assert!(
        drained.is_some(),
        "the relay did not drain the new primary's outbox within {DRAIN:?} of the endpoint's move: {pending} pending"
    );
    assert_eq!(dead, 0, "nothing dead-lettered");
    assert!(relay_stopped, "the relay stops when asked");
    if synchronous {
        assert!(
            not_published.is_empty(),
            "{} messages whose COMMIT returned Ok were never published: {sample:?}",
            not_published.len()
        );
        assert!(
            phantoms.is_empty(),
            "{} messages were published that are not in the new primary's outbox: {phantom_sample:?}",
            phantoms.len()
        );
    }
    Some(())
}

/// Synchronous replication: every committed message is published at least once, and
/// none that the new primary does not have; asynchronous, printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_relay_publishes_every_committed_message_through_a_failover() {
    let plans = plans(
        &[Duration::from_millis(300)],
        // The relay's round and the COMMITs wait for the standby longer.
        &[Duration::from_millis(1500)],
    )
    .into_iter()
    .map(|(replication, cut_before_kill, trial)| OutboxPlan {
        replication,
        cut_before_kill,
        trial,
    })
    .collect();
    trials(plans, OutboxPlan::label, outbox_trial).await;
}

// ---------------------------------------------------------------------------------
// The transactional inbox.

/// What became of one delivery.
struct Handling {
    key: String,
    what: String,
    acked: bool,
    at: Instant,
}

/// Publishes `{label}-{n}` to `queue` every [`EVERY`] (confirmed), and `slowed` as the
/// `slowed_at`th, until stopped; returns every key published.
struct Publisher {
    stop: Arc<AtomicBool>,
    task: JoinHandle<Vec<String>>,
}

impl Publisher {
    fn start(channel: Channel, queue: String, label: String, slowed: String) -> Self {
        const SLOWED_AT: usize = 100;
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .unwrap();
                let mut published = Vec::new();
                let mut every = tokio::time::interval(EVERY);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                while !stop.load(Ordering::Relaxed) {
                    every.tick().await;
                    let key = if published.len() == SLOWED_AT {
                        slowed.clone()
                    } else {
                        format!("{label}-{}", published.len())
                    };
                    channel
                        .basic_publish(
                            "".into(),
                            queue.as_str().into(),
                            BasicPublishOptions::default(),
                            key.as_bytes(),
                            BasicProperties::default().with_delivery_mode(2),
                        )
                        .await
                        .unwrap()
                        .await
                        .unwrap();
                    published.push(key);
                }
                published
            }
        });
        Self { stop, task }
    }

    async fn stop(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

#[derive(Clone, Copy, Debug)]
struct InboxPlan {
    replication: Replication,
    /// How long the slowed message's COMMIT sleeps in the trigger.
    commit_sleep: Duration,
    /// From that COMMIT seen in the trigger's sleep to the kill (the link cut
    /// [`CUT_LEAD`] before).
    kill_after: Duration,
    trial: usize,
}

impl InboxPlan {
    fn label(&self) -> String {
        format!(
            "inbox-{:?}-{:?}-{:?}-{}",
            self.replication, self.commit_sleep, self.kill_after, self.trial
        )
    }
}

async fn inbox_trial(plan: InboxPlan) -> Option<()> {
    let mut stage = Stage::start(plan.replication).await?;
    let synchronous = plan.replication == Replication::Synchronous;
    faults::prepare(&stage.primary_pool).await;
    sqlx::raw_sql(COMMIT_FAULTS)
        .execute(&stage.primary_pool)
        .await
        .unwrap();
    let label = plan.label();
    let slowed = format!("{label}-slowed");
    sqlx::query("INSERT INTO commit_faults (key, sleep, fail) VALUES ($1, $2, false)")
        .bind(&slowed)
        .bind(plan.commit_sleep.as_secs_f64())
        .execute(&stage.primary_pool)
        .await
        .unwrap();

    // The inbox: the layer over a transactional store through the endpoint; the handler
    // inserts the message's row (its run: 1 for the first) in the delivery's
    // transaction, and tells the slowed message's backend.
    let store = PostgresStore::builder(stage.pool(u32::from(PREFETCH) + 2).await)
        .mode(PostgresMode::Transactional)
        .build()
        .unwrap();
    let ledger = Ledger::default();
    let slowed_backend: Arc<Mutex<Option<i32>>> = Arc::default();
    let inbox = ServiceBuilder::new()
        .layer(
            MessageIdempotencyLayer::with_store(store)
                .key(|key: &String| Ok(Some(MessageKey::new(IdempotencyKey::new(key)?))))
                .require_key(true)
                .policy(Policy::new().in_flight(InFlight::Reject {
                    retry_after: RETRY_PAUSE,
                })).unwrap(),
        )
        .service(service_fn({
            let (ledger, slowed_backend, slowed) =
                (ledger.clone(), slowed_backend.clone(), slowed.clone());
            move |key: String| {
                let (ledger, slowed_backend, slowed) =
                    (ledger.clone(), slowed_backend.clone(), slowed.clone());
                async move {
                    let run = i64::try_from(ledger.count(&key)).unwrap();
                    let transaction =
                        Transaction::current().ok_or_else(|| "no transaction".to_owned())?;
                    let mut connection = transaction
                        .lock()
                        .await
                        .map_err(|_| "transaction over".to_owned())?;
                    let backend: i32 = sqlx::query_scalar(
                        "INSERT INTO commands (key, run) VALUES ($1, $2) RETURNING pg_backend_pid()",
                    )
                    .bind(&key)
                    .bind(run)
                    .fetch_one(&mut *connection)
                    .await
                    .map_err(|e| format!("insert failed: {e}"))?;
                    if key == slowed && run == 1 {
                        *slowed_backend.lock().unwrap() = Some(backend);
                    }
                    Ok::<_, String>(run)
                }
            }
        }));

    // The consumer loop: each delivery in a task of its own, acked on `Ran` or
    // `Replayed` only, else nacked (requeued) after a pause.
    let (connection, channel, queue) = stage.vhost.queue("inbox").await;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .unwrap();
    let handled: Arc<Mutex<Vec<Handling>>> = Arc::default();
    let consuming = tokio::spawn({
        let (channel, queue, handled) = (channel.clone(), queue.clone(), handled.clone());
        async move {
            let mut deliveries = channel
                .basic_consume(
                    queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            while let Some(Ok(delivery)) = deliveries.next().await {
                let (inbox, handled) = (inbox.clone(), handled.clone());
                tokio::spawn(async move {
                    let key = String::from_utf8_lossy(&delivery.data).into_owned();
                    let (what, ack) = match inbox.oneshot(key.clone()).await {
                        Ok(Handled::Ran(_)) => ("ran".to_owned(), true),
                        Ok(Handled::Replayed { .. }) => ("replayed".to_owned(), true),
                        Ok(Handled::InFlight { .. }) => ("in flight".to_owned(), false),
                        Ok(Handled::Refused(refusal)) => (refusal.code().to_string(), false),
                        Err(error) => (format!("handler failed: {error}"), false),
                        Ok(_) => ("other".to_owned(), false),
                    };
                    let acked = if ack {
                        delivery.ack(BasicAckOptions::default()).await.is_ok()
                    } else {
                        tokio::time::sleep(RETRY_PAUSE).await;
                        let _ = delivery
                            .nack(BasicNackOptions {
                                requeue: true,
                                ..BasicNackOptions::default()
                            })
                            .await;
                        false
                    };
                    handled.lock().unwrap().push(Handling {
                        key,
                        what,
                        acked,
                        at: Instant::now(),
                    });
                });
            }
        }
    });
    let (publishing, publisher) = stage.vhost.channel().await;
    let publisher = Publisher::start(publisher, queue, label, slowed.clone());

    // The slowed message's COMMIT in the trigger's sleep; the link cut, the kill.
    let deadline = Instant::now() + Duration::from_secs(10);
    let backend = loop {
        if let Some(backend) = *slowed_backend.lock().unwrap() {
            break backend;
        }
        assert!(Instant::now() < deadline, "the slowed message never ran");
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = waiting_on(&stage.primary_pool, backend).await;
        if now == "PgSleep" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slowed COMMIT never slept in the trigger: its backend is {now}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let committing = Instant::now();
    tokio::time::sleep(plan.kill_after.saturating_sub(CUT_LEAD)).await;
    stage.link.cut();
    tokio::time::sleep(plan.kill_after.saturating_sub(committing.elapsed())).await;
    let at_kill = waiting_on(&stage.primary_pool, backend).await;
    let kill_into_commit = committing.elapsed();
    let (killed, moved) = stage.fail_over().await;
    tokio::time::sleep(AFTER).await;
    let published = publisher.stop().await;
    let _ = publishing.close(200, "done".into()).await;

    // The drain: every message acked.
    let drained = loop {
        let acked: HashSet<String> = handled
            .lock()
            .unwrap()
            .iter()
            .filter(|h| h.acked)
            .map(|h| h.key.clone())
            .collect();
        if published.iter().all(|key| acked.contains(key)) {
            break Some(moved.elapsed());
        }
        if moved.elapsed() > DRAIN {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    consuming.abort();
    let _ = connection.close(200, "done".into()).await;

    // The reckoning, on the new primary.
    let rows: HashMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT key, count(*) FROM commands GROUP BY key")
            .fetch_all(&stage.standby_pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let handled = std::mem::take(&mut *handled.lock().unwrap());
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut acks: HashMap<&str, usize> = HashMap::new();
    for handling in &handled {
        *outcomes.entry(handling.what.as_str()).or_default() += 1;
        if handling.acked {
            *acks.entry(handling.key.as_str()).or_default() += 1;
        }
    }
    let missing: Vec<&str> = published
        .iter()
        .filter(|key| !rows.contains_key(*key))
        .map(String::as_str)
        .collect();
    let doubled: Vec<(&str, i64)> = rows
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(key, n)| (key.as_str(), *n))
        .collect();
    let acked_without_row: Vec<&str> = acks
        .keys()
        .copied()
        .filter(|key| !rows.contains_key(*key))
        .collect();
    let acked_twice = acks.values().filter(|n| **n > 1).count();
    let runs = ledger.per_key();
    let ran_again = runs.values().filter(|n| **n > 1).count();
    let slowed_seen: Vec<&str> = handled
        .iter()
        .filter(|h| h.key == slowed)
        .map(|h| h.what.as_str())
        .collect();
    let first_ran_after_move = handled
        .iter()
        .filter(|h| h.what == "ran" && h.at > moved)
        .map(|h| h.at - moved)
        .min();
    let not_retryable: Vec<&str> = outcomes
        .keys()
        .copied()
        .filter(|what| {
            ![
                "ran",
                "replayed",
                "in flight",
                "idempotency.store_unavailable",
                "idempotency.pool_exhausted",
                "idempotency.original_failed",
                "idempotency.not_committed",
                "idempotency.outcome_unknown",
            ]
            .contains(what)
                && !what.starts_with("handler failed")
        })
        .collect();
    eprintln!(
        "inbox through a failover, {:?} replication, slowed COMMIT {:?} killed {kill_into_commit:?} into it (its backend then: {at_kill}), \
         trial {} ({}): promoted and endpoint moved {:?} after the kill; {} messages published; {} deliveries handled: {outcomes:?}; \
         the slowed message: {slowed_seen:?}, handler runs {}, rows {}; handler runs {} for {} messages ({ran_again} ran more than once); \
         acked {} ({acked_twice} more than once); on the new primary: {} missing {:?}, {} doubled {:?}, acked without a row {} {:?}; \
         first run after the move {first_ran_after_move:?} after it; drained {drained:?} after the move",
        plan.replication,
        plan.commit_sleep,
        plan.trial,
        stage.vhost.describe(),
        moved - killed,
        published.len(),
        handled.len(),
        runs.get(&slowed).copied().unwrap_or(0),
        rows.get(&slowed).copied().unwrap_or(0),
        runs.values().sum::<usize>(),
        runs.len(),
        acks.len(),
        missing.len(),
        missing.iter().take(5).collect::<Vec<_>>(),
        doubled.len(),
        doubled.iter().take(5).collect::<Vec<_>>(),
        acked_without_row.len(),
        acked_without_row.iter().take(5).collect::<Vec<_>>(),
    );

    // Either replication: the consumer came back by itself and acked every message.
    assert!(
        drained.is_some(),
        "not every message was acked within {DRAIN:?} of the endpoint's move: {} of {}",
        acks.len(),
        published.len()
    );
    assert!(
        not_retryable.is_empty(),
        "refused for good, or answered what the consumer does not know: {not_retryable:?}"
    );
    assert_eq!(acked_twice, 0, "each message acked once");
    if synchronous {
        assert!(
            acked_without_row.is_empty(),
            "acked, yet no row on the new primary: {acked_without_row:?}"
        );
        assert!(missing.is_empty(), "messages with no row: {missing:?}");
        assert!(doubled.is_empty(), "messages with two rows: {doubled:?}");
    }
    Some(())
}

/// Synchronous replication: after a failover mid-stream, with a COMMIT in flight, each
/// message's row is on the new primary once, and none was acked without it;
/// asynchronous, printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transactional_inbox_applies_each_message_once_through_a_failover() {
    let plans = plans(
        // Killed before the store's 1 s timeout: the COMMIT's answer is lost with the
        // connection.
        &[(Duration::from_millis(1500), Duration::from_millis(500))],
        // Killed after it: the store is already asking what became of the commit.
        &[(Duration::from_secs(3), Duration::from_millis(1500))],
    )
    .into_iter()
    .map(
        |(replication, (commit_sleep, kill_after), trial)| InboxPlan {
            replication,
            commit_sleep,
            kill_after,
            trial,
        },
    )
    .collect();
    trials(plans, InboxPlan::label, inbox_trial).await;
}
