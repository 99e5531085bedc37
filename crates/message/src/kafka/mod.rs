//! [`KafkaConsumer`]: Kafka topics driven through a message handler behind the
//! [`MessageIdempotencyLayer`](super::MessageIdempotencyLayer), as
//! [`AmqpConsumer`](super::amqp::AmqpConsumer) drives a RabbitMQ queue: the consume
//! loop, the offsets, poison messages and the drain are the crate's.
//!
//! ```no_run
//! use rdkafka::ClientConfig;
//! use serde::{Deserialize, Serialize};
//! use tower::{service_fn, ServiceBuilder};
//! use tower_ids_core::IdempotencyKey;
//! use tower_ids_message::{kafka::KafkaConsumer, MessageIdempotencyLayer, MessageKey, Received};
//!
//! #[derive(Deserialize)]
//! struct Payment { account: String, amount: i64 }
//! #[derive(Serialize, Deserialize)]
//! struct Receipt { balance: i64 }
//!
//! # async fn run() -> Result<(), rdkafka::error::KafkaError> {
//! let service = ServiceBuilder::new()
//!     .layer(MessageIdempotencyLayer::new().require_key(true).key(|r: &Received<Payment>| {
//!         Ok(IdempotencyKey::from_carrier(r)?.map(MessageKey::new))
//!     }))
//!     .service(service_fn(|payment: Received<Payment>| async move {
//!         Ok::<_, std::io::Error>(Receipt { balance: payment.into_message().amount })
//!     }));
//! let mut config = ClientConfig::new();
//! config.set("bootstrap.servers", "127.0.0.1:9092").set("group.id", "payments");
//! let stopped = KafkaConsumer::new(config, ["payments"])?
//!     .run(service, async { let _ = tokio::signal::ctrl_c().await; })
//!     .await;
//! assert!(stopped.is_complete(), "left unsettled: {:?}", stopped.left);
//! # Ok(())
//! # }
//! ```

mod topics;

use std::{
    collections::{HashMap, VecDeque},
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use rdkafka::{
    consumer::{Consumer as _, StreamConsumer},
    error::KafkaError,
    message::{Header, Headers as _, Message as _, OwnedHeaders, OwnedMessage},
    producer::{FutureProducer, FutureRecord},
    util::Timeout,
    ClientConfig, TopicPartitionList,
};
use serde::de::DeserializeOwned;
use tokio::{sync::mpsc, task::JoinSet};
use tower_service::Service;

use self::topics::{check_dead_letter_topics, dead_letter_topic};
use super::{
    drive::{
        handle, key_of, settled_line, BoxError, EnvelopeCorrelation, Next, Received,
        ATTEMPTS_HEADER, DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_PAUSE,
        ERROR_HEADER, SOURCE_HEADER,
    },
    Handled,
};
use tower_ids_core::{engine::InHand, Stopped};
use tower_ids_correlation::MessageCorrelation;

/// librdkafka's consumer-only properties, left out of the producer's configuration.
const CONSUMER_ONLY: &[&str] = &[
    "group.id",
    "group.instance.id",
    "group.protocol",
    "group.protocol.type",
    "group.remote.assignor",
    "partition.assignment.strategy",
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "coordinator.query.interval.ms",
    "max.poll.interval.ms",
    "enable.auto.commit",
    "auto.commit.interval.ms",
    "enable.auto.offset.store",
    "auto.offset.reset",
    "queued.min.messages",
    "queued.max.messages.kbytes",
    "fetch.wait.max.ms",
    "fetch.queue.backoff.ms",
    "fetch.message.max.bytes",
    "max.partition.fetch.bytes",
    "fetch.max.bytes",
    "fetch.min.bytes",
    "fetch.error.backoff.ms",
    "isolation.level",
    "enable.partition.eof",
    "check.crcs",
];

/// Partitions handled at once by default: each partition's messages one after the
/// other, in order.
pub const DEFAULT_PARTITIONS_AT_ONCE: usize = 16;

/// Consumes Kafka topics through a message handler: see the [module docs](self).
///
/// The consumer group is the configuration's `group.id`; the driver sets
/// `enable.auto.offset.store=false`: an offset is stored, and committed with the next
/// automatic commit (every second unless `auto.commit.interval.ms` says otherwise),
/// only once its message is settled. Each partition's messages are
/// handled one after the other, in order (so a partition key's messages stay in
/// order), up to [`partitions_at_once`](Self::partitions_at_once) partitions at a time;
/// so the offset committed is always the first message not yet settled.
///
/// | The service answered | The message |
/// |---|---|
/// | `Handled::Ran`, `Handled::Replayed` | settled: its offset stored (after the outcome is durable) |
/// | `Handled::InFlight { retry_after }` | handled again after `retry_after`, in place |
/// | `Handled::Refused(r)`, `r.retryable()` | handled again after the [retry pause](Self::retry_pause), in place: a passing fault, not counted |
/// | `Handled::Refused(r)`, not retryable | dead-lettered, then settled |
/// | the handler failed (`Err`) | produced again at the end of the partition it came from (explicitly: never the partitioner's pick, so a key whose producer partitions otherwise stays on one partition) with its attempt counted (the `x-tower-ids-attempts` header), then settled; dead-lettered at its [last attempt](Self::max_attempts) |
/// | a body that does not decode | dead-lettered, then settled |
///
/// Dead letters go to `{topic}.dead`, with the message's key, headers and body, the reason in the
/// `x-tower-ids-error` header and its source, `topic:partition:offset`, in
/// [`SOURCE_HEADER`] (its attempts so far are in the attempts header); each is logged
/// once at ERROR. At start the consumer says whether each subscribed topic's
/// dead-letter topic exists (INFO `message.dead_letter_topic`, `status=exists`), or
/// WARNs `message.dead_letter_topic_missing`: a dead letter then waits, retried, until
/// it exists (or the broker creates topics on first use). With
/// [`create_dead_letter_topics`](Self::create_dead_letter_topics) it creates a missing
/// one (`status=created`). A partition revoked in a
/// rebalance is abandoned: the message in flight runs to its end, but its offset is
/// not stored (the partition is no longer this consumer's), so its new owner gets it
/// again and the layer replays it; the messages fetched behind it are left to the new
/// owner. A partition whose handler is behind (64 messages
/// fetched ahead of it, a message retried in place while its store is down) is paused
/// until it catches up: the other partitions go on. Connections are librdkafka's to
/// keep. On shutdown the consumer stops fetching, settles the message each partition
/// has in hand within the [drain timeout](Self::drain_timeout) (one retried in place
/// is left), commits, and names at WARN what it left; the messages fetched behind them
/// come again from the committed offsets.
///
/// Every message ends in one line, event `message.settled`, as for RabbitMQ.
#[must_use]
pub struct KafkaConsumer {
    consumer: Arc<StreamConsumer>,
    producer: FutureProducer,
    /// The brokers and security, without the consumer's own settings: for the admin
    /// client that creates dead-letter topics.
    clients: ClientConfig,
    create_dead_letter_topics: bool,
    topics: Vec<String>,
    partitions_at_once: usize,
    max_attempts: u32,
    retry_pause: Duration,
    drain_timeout: Duration,
    correlation_from: EnvelopeCorrelation,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("topics", &self.topics)
            .finish_non_exhaustive()
    }
}

impl KafkaConsumer {
    /// A consumer of `topics` with `config` (`bootstrap.servers`, `group.id`, and any
    /// other librdkafka setting), subscribed to them: it joins its group once
    /// [`run`](Self::run) polls it, so build it where you run it.
    ///
    /// # Errors
    ///
    /// If the consumer or the producer (for copies and dead letters) cannot be created
    /// from the configuration, or the topics cannot be subscribed to (no `group.id`, an
    /// invalid topic name or pattern), as rdkafka's `ClientConfig::create` and
    /// `subscribe` say.
    pub fn new<I: IntoIterator<Item = impl Into<String>>>(
        config: ClientConfig,
        topics: I,
    ) -> Result<Self, KafkaError> {
        let topics: Vec<String> = topics.into_iter().map(Into::into).collect();
        let mut consumer_config = config.clone();
        consumer_config.set("enable.auto.offset.store", "false");
        if consumer_config.get("enable.auto.commit").is_none() {
            consumer_config.set("enable.auto.commit", "true");
        }
        if consumer_config.get("auto.commit.interval.ms").is_none() {
            // What a killed consumer's successor handles again (and replays): a second
            // of settled messages, not librdkafka's default five.
            consumer_config.set("auto.commit.interval.ms", "1000");
        }
        let consumer: Arc<StreamConsumer> = Arc::new(consumer_config.create()?);
        let subscribed: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer.subscribe(&subscribed)?;
        // The same brokers and security for the producer of copies and dead letters,
        // without the consumer's own settings (librdkafka warns of each).
        let mut producer_config = ClientConfig::new();
        for (key, value) in config.config_map() {
            if !CONSUMER_ONLY.contains(&key) {
                producer_config.set(key, value);
            }
        }
        let clients = producer_config.clone();
        producer_config.set("enable.idempotence", "true");
        let producer: FutureProducer = producer_config.create()?;
        Ok(Self {
            consumer,
            producer,
            clients,
            create_dead_letter_topics: false,
            topics,
            partitions_at_once: DEFAULT_PARTITIONS_AT_ONCE,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retry_pause: DEFAULT_RETRY_PAUSE,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            correlation_from: EnvelopeCorrelation::default(),
        })
    }

    /// Partitions handled at once ([`DEFAULT_PARTITIONS_AT_ONCE`]).
    pub fn partitions_at_once(mut self, partitions: usize) -> Self {
        self.partitions_at_once = partitions.max(1);
        self
    }

    /// Deliveries a message's handler may fail before it is dead-lettered
    /// ([`DEFAULT_MAX_ATTEMPTS`]).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Reads the delivery's correlation ID from the decoded message, where a contract
    /// puts it in the message's envelope (a JSON `correlationId`), rather than from the
    /// `x-correlation-id` header: the envelope's ID, when the body decodes into `T` (the
    /// handler's message type) and carries one, wins over the header's; a delivery
    /// without one keeps the header's (or a fresh one). It is validated, extended for
    /// the delivery, and every line of the delivery is under it. An invalid one is
    /// replaced, with WARN `correlation.invalid`.
    pub fn correlation_from<T: 'static>(
        mut self,
        read: impl Fn(&T) -> Option<&str> + Send + Sync + 'static,
    ) -> Self {
        self.correlation_from = EnvelopeCorrelation::new(read);
        self
    }

    /// How long a message refused for a passing reason waits before it is handled
    /// again ([`DEFAULT_RETRY_PAUSE`]).
    pub fn retry_pause(mut self, pause: Duration) -> Self {
        self.retry_pause = pause;
        self
    }

    /// At start, creates each subscribed topic's dead-letter topic (`{topic}.dead`)
    /// that does not exist, with the topic's partitions and replicas (default: only
    /// checks, and WARNs of a missing one). Creating topics needs the `CREATE` ACL on the
    /// cluster or the topic.
    pub fn create_dead_letter_topics(mut self, create: bool) -> Self {
        self.create_dead_letter_topics = create;
        self
    }

    /// How long a stop waits for the messages in flight ([`DEFAULT_DRAIN_TIMEOUT`]).
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// Consumes the topics through `service` until `shutdown` resolves, then drains:
    /// what it returns names the messages it left unsettled (see [`Stopped`]).
    /// Nothing else ends it: broker errors are logged and waited out.
    pub async fn run<T, R, S>(self, service: S, shutdown: impl Future<Output = ()>) -> Stopped
    where
        T: DeserializeOwned + Send + 'static,
        R: Send + 'static,
        S: Service<Received<T>, Response = Handled<R>> + Clone + Send + 'static,
        S::Error: Into<BoxError> + Send,
        S::Future: Send,
    {
        let Self {
            consumer,
            producer,
            clients,
            create_dead_letter_topics,
            topics,
            partitions_at_once,
            max_attempts,
            retry_pause,
            drain_timeout,
            correlation_from,
        } = self;
        let settings = Arc::new(Settings {
            max_attempts,
            retry_pause,
            correlation_from,
            producer,
            consumer: consumer.clone(),
            stopping: AtomicBool::new(false),
            in_hand: InHand::default(),
        });
        check_dead_letter_topics(&consumer, &clients, &topics, create_dead_letter_topics).await;
        tracing::info!(target: "tower_ids::idempotency::message", event = "message.consuming", ?topics, "consuming");

        let mut shutdown = std::pin::pin!(shutdown);
        let mut partitions: HashMap<Slot, Partition> = HashMap::new();
        let mut workers = JoinSet::new();
        let mut reserving: JoinSet<Reserved> = JoinSet::new();
        let slots = Arc::new(tokio::sync::Semaphore::new(partitions_at_once));
        loop {
            tokio::select! {
                biased;
                () = shutdown.as_mut() => break,
                Some(_) = workers.join_next(), if !workers.is_empty() => {}
                Some(Ok(reserved)) = reserving.join_next(), if !reserving.is_empty() => {
                    room_made(&consumer, &mut partitions, &mut reserving, reserved);
                }
                received = consumer.recv() => match received {
                    Ok(message) => {
                        let message = message.detach();
                        let slot = (message.topic().to_owned(), message.partition());
                        let partition = partitions.entry(slot.clone()).or_insert_with(|| {
                            Partition::new(&mut workers, service.clone(), &settings, &slots)
                        });
                        if let Some(reserve) = partition.hand(slot.clone(), message) {
                            // Its worker is behind: the partition waits, the others go on.
                            pause(&consumer, &slot, true);
                            reserving.spawn(reserve);
                        }
                    }
                    Err(error) => {
                        tracing::warn!(target: "tower_ids::idempotency::message", event = "message.broker_unavailable", error = %error, "Kafka consumer error; librdkafka reconnects");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
        stop(
            &consumer,
            &settings,
            partitions,
            workers,
            reserving,
            drain_timeout,
        )
        .await
    }
}

/// A room made in a partition's buffer: the next message held back takes it, or, with
/// none held back, the partition is resumed.
fn room_made(
    consumer: &StreamConsumer,
    partitions: &mut HashMap<Slot, Partition>,
    reserving: &mut JoinSet<Reserved>,
    reserved: Reserved,
) {
    let slot = reserved.0.clone();
    let Some(partition) = partitions.get_mut(&slot) else {
        return;
    };
    if let Some(next) = partition.unheld(reserved) {
        reserving.spawn(next);
    } else {
        pause(consumer, &slot, false);
    }
}

/// A stop, once fetching has ended: each worker settles the message in its hands
/// within `drain_timeout` and stops (those it was handed and had not begun come again
/// from the committed offset), the settled offsets are committed, and the consumer
/// leaves the group. Names what it left.
async fn stop(
    consumer: &StreamConsumer,
    settings: &Settings,
    partitions: HashMap<Slot, Partition>,
    mut workers: JoinSet<()>,
    mut reserving: JoinSet<Reserved>,
    drain_timeout: Duration,
) -> Stopped {
    settings.stopping.store(true, Ordering::Release);
    drop(partitions);
    reserving.abort_all();
    let waiting = workers.len();
    let drained = tokio::time::timeout(drain_timeout, async {
        while workers.join_next().await.is_some() {}
    })
    .await;
    // Read before the workers are aborted: an aborted worker lets go of its name.
    let stopped = settings.in_hand.stopped();
    if drained.is_err() || !stopped.is_complete() {
        tracing::warn!(
            target: "tower_ids::idempotency::message",
            event = "message.drain_unsettled",
            partitions = waiting,
            left = ?stopped.left,
            "stopped with messages unsettled: their offsets are not committed"
        );
        workers.abort_all();
    } else {
        tracing::info!(
            target: "tower_ids::idempotency::message",
            event = "message.drained",
            partitions = waiting,
            "every message in flight settled"
        );
    }
    // The settled offsets, committed before leaving the group.
    if let Err(error) = consumer.commit_consumer_state(rdkafka::consumer::CommitMode::Sync) {
        tracing::debug!(target: "tower_ids::idempotency::message", event = "message.commit_failed", error = %error, "could not commit the settled offsets at stop");
    }
    consumer.unsubscribe();
    stopped
}

struct Settings {
    max_attempts: u32,
    retry_pause: Duration,
    correlation_from: EnvelopeCorrelation,
    producer: FutureProducer,
    consumer: Arc<StreamConsumer>,
    /// Set at a stop: workers take no more messages and stop retrying in place.
    stopping: AtomicBool,
    /// The message each partition's worker is settling, for what a stop leaves.
    in_hand: InHand,
}

/// A partition's topic and number.
type Slot = (String, i32);

/// Messages the recv loop fetched ahead of a partition's worker, at most
/// [`FETCHED_AHEAD`]; past that the partition is paused, so one slow partition never
/// holds the others back.
const FETCHED_AHEAD: usize = 64;

/// A room in a partition's buffer, once its worker has taken a message.
type Reserved = (Slot, Option<mpsc::OwnedPermit<OwnedMessage>>);

/// One partition's worker, and the messages held back while its buffer is full (in
/// order, handed over before any newer one).
struct Partition {
    sender: mpsc::Sender<OwnedMessage>,
    held: VecDeque<OwnedMessage>,
}

impl Partition {
    fn new<T, R, S>(
        workers: &mut JoinSet<()>,
        service: S,
        settings: &Arc<Settings>,
        slots: &Arc<tokio::sync::Semaphore>,
    ) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        R: Send + 'static,
        S: Service<Received<T>, Response = Handled<R>> + Send + 'static,
        S::Error: Into<BoxError> + Send,
        S::Future: Send,
    {
        let (sender, receiver) = mpsc::channel(FETCHED_AHEAD);
        workers.spawn(partition_worker(
            receiver,
            service,
            settings.clone(),
            slots.clone(),
        ));
        Self {
            sender,
            held: VecDeque::new(),
        }
    }

    /// Hands `message` to the worker, or holds it back; a held one gets the future
    /// that waits for room (the caller pauses the partition meanwhile).
    fn hand(
        &mut self,
        slot: Slot,
        message: OwnedMessage,
    ) -> Option<impl Future<Output = Reserved> + Send + 'static> {
        if !self.held.is_empty() {
            self.held.push_back(message);
            return None;
        }
        match self.sender.try_send(message) {
            Ok(()) => None,
            Err(mpsc::error::TrySendError::Full(message)) => {
                self.held.push_back(message);
                Some(reserve(slot, self.sender.clone()))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                tracing::debug!(target: "tower_ids::idempotency::message", event = "message.worker_gone", "a partition's worker ended");
                None
            }
        }
    }

    /// Hands the first held message over in the room `permit` made; the wait for the
    /// next room if more are held (`None`: the partition may fetch again).
    fn unheld(
        &mut self,
        (slot, permit): Reserved,
    ) -> Option<impl Future<Output = Reserved> + Send + 'static> {
        match (permit, self.held.pop_front()) {
            (Some(permit), Some(message)) => {
                permit.send(message);
            }
            // The worker ended: nothing it was handed would run.
            (None, _) => self.held.clear(),
            (Some(_), None) => {}
        }
        (!self.held.is_empty()).then(|| reserve(slot, self.sender.clone()))
    }
}

async fn reserve(slot: Slot, sender: mpsc::Sender<OwnedMessage>) -> Reserved {
    (slot, sender.reserve_owned().await.ok())
}

/// Pauses (or resumes) fetching a partition; one no longer assigned is left alone.
fn pause(consumer: &StreamConsumer, (topic, partition): &Slot, pause: bool) {
    let mut list = TopicPartitionList::new();
    list.add_partition(topic, *partition);
    let paused = if pause {
        consumer.pause(&list)
    } else {
        consumer.resume(&list)
    };
    if let Err(error) = paused {
        tracing::debug!(target: "tower_ids::idempotency::message", event = "message.pause_failed", error = %error, pause, "could not pause or resume a partition");
    }
}

/// One partition's messages, one after the other, each under a slot of the partitions
/// handled at once.
async fn partition_worker<T, R, S>(
    mut receiver: mpsc::Receiver<OwnedMessage>,
    mut service: S,
    settings: Arc<Settings>,
    slots: Arc<tokio::sync::Semaphore>,
) where
    T: DeserializeOwned + 'static,
    S: Service<Received<T>, Response = Handled<R>>,
    S::Error: Into<BoxError>,
{
    while let Some(message) = receiver.recv().await {
        let Ok(_slot) = slots.acquire().await else {
            return;
        };
        if settings.stopping.load(Ordering::Acquire) {
            return;
        }
        if !assigned(&settings.consumer, &message) {
            // Fetched before a rebalance took the partition away: its new owner handles
            // it (from the committed offset), so this consumer leaves it alone.
            continue;
        }
        let held = settings.in_hand.hold(name_of(&message));
        if !settle(&message, &mut service, &settings).await {
            held.leave();
            return;
        }
        // Stored, it is committed with the next commit; for a partition revoked
        // meanwhile the store is refused, and its new owner gets the message again.
        if let Err(error) =
            settings
                .consumer
                .store_offset(message.topic(), message.partition(), message.offset())
        {
            tracing::debug!(target: "tower_ids::idempotency::message", event = "message.offset_not_stored", error = %error, "the partition is no longer this consumer's: its new owner handles the message again");
        }
        drop(held);
    }
}

/// A message's name in its lines and in [`Stopped::left`]: `topic:partition:offset`.
fn name_of(message: &OwnedMessage) -> String {
    format!(
        "{}:{}:{}",
        message.topic(),
        message.partition(),
        message.offset()
    )
}

/// Whether `message`'s partition is still this consumer's.
fn assigned(consumer: &StreamConsumer, message: &OwnedMessage) -> bool {
    match consumer.assignment() {
        Ok(assignment) => assignment
            .find_partition(message.topic(), message.partition())
            .is_some(),
        // Not known: handling it again is safe, skipping it is not.
        Err(_) => true,
    }
}

/// One message: decoded, handled under its correlation ID until it is settled (`true`)
/// or a stop ends its retries in place (`false`).
async fn settle<T, R, S>(message: &OwnedMessage, service: &mut S, settings: &Settings) -> bool
where
    T: DeserializeOwned + 'static,
    S: Service<Received<T>, Response = Handled<R>>,
    S::Error: Into<BoxError>,
{
    let headers: Vec<(String, Vec<u8>)> = message
        .headers()
        .map(|headers| {
            headers
                .iter()
                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                .collect()
        })
        .unwrap_or_default();
    let attempts = headers
        .iter()
        .find(|(n, _)| n == ATTEMPTS_HEADER)
        .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse().ok())
        .unwrap_or(0u32);
    let envelope = Received {
        message: (),
        headers: headers.clone(),
        attempts,
        delivery: name_of(message),
    };
    let correlation = MessageCorrelation::new();
    let payload = message.payload().unwrap_or_default();
    let id = (settings.correlation_from).delivery_id::<T>(&correlation, &envelope, payload);
    let key = key_of(&envelope);
    let settling = async {
        let payload = message.payload().unwrap_or_default();
        loop {
            let (next, reason) = handle(
                service,
                payload,
                &envelope,
                settings.max_attempts,
                settings.retry_pause,
            )
            .await;
            let (outcome, again) = match next {
                Next::Settle(outcome) => (outcome, None),
                // Handled again in place: the partition waits, in order.
                Next::Retry(pause, outcome) => (outcome, Some(pause)),
                Next::Again(attempts) => (
                    produce_again(message, &headers, settings, attempts).await,
                    None,
                ),
                Next::DeadLetter(code, reason) => (
                    dead_letter(message, &headers, settings, code, &reason).await,
                    None,
                ),
            };
            settled_line(outcome, &envelope, &key, &reason);
            let Some(pause) = again else {
                return true;
            };
            if settings.stopping.load(Ordering::Acquire) {
                return false;
            }
            tokio::time::sleep(pause).await;
        }
    };
    correlation.scope(id, &envelope, settling).await
}

/// Produces the message again to its topic and partition, the one it came from (not the
/// one the producer's partitioner would pick for its key: a record from a producer that
/// partitions otherwise would leave its key's partition), with `attempts` counted, and waits for the acknowledgement; `"retried"`, or, if it is not taken,
/// `"requeued"` after the retry pause (the message is then settled only by being handled
/// again: the offset is stored anyway, so the copy must land: it is retried until it
/// does).
async fn produce_again(
    message: &OwnedMessage,
    headers: &[(String, Vec<u8>)],
    settings: &Settings,
    attempts: u32,
) -> &'static str {
    let attempts = attempts.to_string();
    let extra = [(ATTEMPTS_HEADER, attempts.as_bytes())];
    loop {
        let partition = Some(message.partition());
        match produce(
            message.topic(),
            partition,
            message,
            headers,
            &extra,
            settings,
        )
        .await
        {
            Ok(()) => return "retried",
            Err(error) => {
                tracing::warn!(target: "tower_ids::idempotency::message", event = "message.republish_failed", error = %error, "could not produce the message again; trying again");
                tokio::time::sleep(settings.retry_pause).await;
            }
        }
    }
}

/// Produces the message to `{topic}.dead` with `reason`, waiting until it is taken;
/// logs it once at ERROR.
async fn dead_letter(
    message: &OwnedMessage,
    headers: &[(String, Vec<u8>)],
    settings: &Settings,
    code: &str,
    reason: &str,
) -> &'static str {
    let topic = dead_letter_topic(message.topic());
    let source = name_of(message);
    let extra = [
        (ERROR_HEADER, reason.as_bytes()),
        (SOURCE_HEADER, source.as_bytes()),
    ];
    loop {
        match produce(&topic, None, message, headers, &extra, settings).await {
            Ok(()) => {
                tracing::error!(target: "tower_ids::idempotency::message", event = "message.dead_lettered", topic = message.topic(), source = source.as_str(), dead_letter_topic = %topic, code, reason, "a message that cannot be handled went to the dead-letter topic; the messages behind it go on");
                return "dead_lettered";
            }
            Err(error) => {
                tracing::warn!(target: "tower_ids::idempotency::message", event = "message.republish_failed", error = %error, "could not dead-letter the message; trying again");
                tokio::time::sleep(settings.retry_pause).await;
            }
        }
    }
}

/// Produces the message's key and body to `topic` (to `partition`, else the
/// partitioner's pick) with its headers and `extra` ones (replacing those of the same
/// name), and waits for the acknowledgement.
async fn produce(
    topic: &str,
    partition: Option<i32>,
    message: &OwnedMessage,
    headers: &[(String, Vec<u8>)],
    extra: &[(&str, &[u8])],
    settings: &Settings,
) -> Result<(), KafkaError> {
    let mut record_headers = OwnedHeaders::new();
    for (name, value) in headers {
        if extra.iter().any(|(n, _)| n == name) {
            continue;
        }
        record_headers = record_headers.insert(Header {
            key: name,
            value: Some(value.as_slice()),
        });
    }
    for (name, value) in extra {
        record_headers = record_headers.insert(Header {
            key: name,
            value: Some(*value),
        });
    }
    let mut record = FutureRecord::<[u8], [u8]>::to(topic)
        .payload(message.payload().unwrap_or_default())
        .headers(record_headers);
    if let Some(key) = message.key() {
        record = record.key(key);
    }
    if let Some(partition) = partition {
        record = record.partition(partition);
    }
    settings
        .producer
        .send(record, Timeout::After(Duration::from_secs(5)))
        .await
        .map(|_| ())
        .map_err(|(error, _)| error)
}
