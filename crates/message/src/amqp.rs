//! [`AmqpConsumer`]: a RabbitMQ queue driven through a message handler behind the
//! [`MessageIdempotencyLayer`](super::MessageIdempotencyLayer), as `axum::serve` drives
//! an HTTP router: the consume loop, the acknowledgements, poison messages, reconnects
//! and the drain are the crate's; the handler and the wiring are yours.
//!
//! ```no_run
//! use serde::{Deserialize, Serialize};
//! use tower::{service_fn, ServiceBuilder};
//! use tower_ids_core::IdempotencyKey;
//! use tower_ids_message::{amqp::AmqpConsumer, MessageIdempotencyLayer, MessageKey, Received};
//!
//! #[derive(Deserialize)]
//! struct Payment { account: String, amount: i64 }
//! #[derive(Serialize, Deserialize)]
//! struct Receipt { balance: i64 }
//!
//! # async fn run() {
//! let handler = service_fn(|payment: Received<Payment>| async move {
//!     let payment = payment.into_message();
//!     Ok::<_, std::io::Error>(Receipt { balance: payment.amount })
//! });
//! let service = ServiceBuilder::new()
//!     .layer(MessageIdempotencyLayer::new().require_key(true).key(|r: &Received<Payment>| {
//!         Ok(IdempotencyKey::from_carrier(r)?.map(MessageKey::new))
//!     }))
//!     .service(handler);
//! AmqpConsumer::new("amqp://guest:guest@127.0.0.1:5672/%2f", "payments")
//!     .run(service, async { let _ = tokio::signal::ctrl_c().await; })
//!     .await;
//! # }
//! ```

use std::{collections::HashMap, future::Future, time::Duration};

use futures_util::StreamExt as _;
use lapin::{
    message::Delivery,
    options::{
        BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
        BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
    },
    types::{AMQPValue, FieldTable, LongString, ShortString},
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties,
};
use serde::de::DeserializeOwned;
use tokio::{sync::oneshot, task::JoinSet};
use tower_service::Service;

use super::{
    drive::{
        handle, key_of, settled_line, BoxError, EnvelopeCorrelation, Next, Received,
        ATTEMPTS_HEADER, DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_PAUSE,
        ERROR_HEADER, SOURCE_HEADER,
    },
    Handled,
};
use tower_ids_core::{engine::InHand, Stopped};
use tower_ids_correlation::{Carrier, MessageCorrelation};

/// Deliveries handled at once by default (the channel's prefetch).
pub const DEFAULT_PREFETCH: u16 = 16;
/// How long a stop waits for RabbitMQ to confirm the consumer's cancel and the
/// connection's close: a broker that does not answer must not hold the stop (an
/// unanswered close still gives the deliveries back once the socket goes).
const BROKER_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest wait between connection attempts while RabbitMQ cannot be reached.
const MAX_RECONNECT_BACKOFF: Duration = Duration::from_secs(5);
/// Consumes a RabbitMQ queue through a message handler: see the
/// [module docs](self).
///
/// Each delivery's body is decoded from JSON into the handler's message type, handed
/// to the service as a [`Received`] (with the message's headers, so the layer reads its
/// key and the correlation ID from them), and settled by what the service answers:
///
/// | The service answered | The delivery |
/// |---|---|
/// | `Handled::Ran`, `Handled::Replayed` | acknowledged: after the outcome is stored (over a transactional store, after its commit) |
/// | `Handled::InFlight { retry_after }` | back to the queue after `retry_after` (nack, requeue) |
/// | `Handled::Refused(r)`, `r.retryable()` (the store unavailable, a commit not known, the handler's transaction broke under it, the handler failed on the database's passing fault: see [`transient_if`](super::MessageIdempotencyLayer::transient_if)) | back to the queue after the [retry pause](Self::retry_pause): a passing fault, not counted |
/// | `Handled::Refused(r)`, not retryable (a key missing or invalid, another payload under the key) | dead-lettered at once |
/// | the handler failed (`Err`) | published again at the back of the queue with its attempt counted ([`ATTEMPTS_HEADER`]), then acknowledged; dead-lettered at its [last attempt](Self::max_attempts) |
/// | a body that does not decode | dead-lettered at once |
///
/// A dead letter is published, confirmed, to the [dead-letter queue](Self::dead_letter_queue)
/// (declared durable) with the message's headers and body, its reason in
/// [`ERROR_HEADER`] and the queue it came from in [`SOURCE_HEADER`] (its attempts so far
/// are in [`ATTEMPTS_HEADER`]), then the delivery is acknowledged; it is logged once at
/// ERROR.
/// So a poison message never blocks the messages behind it, and its attempts are
/// counted in the message itself, across redeliveries and restarts.
///
/// A lost connection or channel is reconnected with backoff (100 ms doubling to 5 s):
/// the deliveries not yet acknowledged come back from the broker, and the layer replays
/// those that ran. On shutdown the consumer stops taking deliveries, finishes and
/// settles those in flight within the [drain timeout](Self::drain_timeout), and names,
/// at WARN, those it left (they go back to the queue with the connection).
///
/// Every delivery ends in one line, event `message.settled`, with its `outcome`
/// (`handled`, `replayed`, `in_flight`, `retried`, `requeued`, `dead_lettered`), the
/// `correlation_id` and the idempotency `key`, inside the delivery's correlation span.
#[derive(Debug, Clone)]
#[must_use]
pub struct AmqpConsumer {
    uri: String,
    queue: String,
    dead_letter_queue: String,
    declare_queue: bool,
    correlation_from: EnvelopeCorrelation,
    prefetch: u16,
    ordered_by: Option<String>,
    max_attempts: u32,
    retry_pause: Duration,
    drain_timeout: Duration,
}

impl AmqpConsumer {
    /// A consumer of `queue` on the broker at `uri` (`amqp://user:pass@host:port/vhost`).
    /// The queue is declared durable at start if it does not exist (see
    /// [`declare_queue`](Self::declare_queue)); its dead letters go to `{queue}.dead`
    /// unless set.
    pub fn new(uri: impl Into<String>, queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            uri: uri.into(),
            dead_letter_queue: format!("{queue}.dead"),
            declare_queue: true,
            correlation_from: EnvelopeCorrelation::default(),
            queue,
            prefetch: DEFAULT_PREFETCH,
            ordered_by: None,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retry_pause: DEFAULT_RETRY_PAUSE,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
        }
    }

    /// Deliveries handled at once ([`DEFAULT_PREFETCH`]): the channel's prefetch.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// Keeps the order of the messages that share this header's value (the outbox's
    /// `x-partition-key`, say): each is handled only once the one delivered before it
    /// has settled, while messages of other values (or without the header) go on
    /// beside them, up to the prefetch. Unset by default: every delivery at once.
    ///
    /// The order is the queue's, kept until a message is retried: one published again
    /// for another attempt goes to the back of the queue.
    pub fn ordered_by(mut self, header: impl Into<String>) -> Self {
        self.ordered_by = Some(header.into());
        self
    }

    /// Deliveries a message's handler may fail before it is dead-lettered
    /// ([`DEFAULT_MAX_ATTEMPTS`]).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Whether the consumer declares its queue, durable and without arguments, when it
    /// does not exist (on by default), so that a consumer started before its first
    /// publisher consumes at once. A queue that exists is left as it is, whatever its
    /// arguments (`x-max-length`, a quorum queue): the check is passive. Off, a missing
    /// queue is an error the consumer logs and retries (`message.broker_unavailable`),
    /// for a queue that only the topology's owner declares.
    pub fn declare_queue(mut self, declare: bool) -> Self {
        self.declare_queue = declare;
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

    /// Where dead letters go (`{queue}.dead` by default), declared durable at start.
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter_queue = queue.into();
        self
    }

    /// How long a delivery refused for a passing reason waits before it goes back to
    /// the queue ([`DEFAULT_RETRY_PAUSE`]).
    pub fn retry_pause(mut self, pause: Duration) -> Self {
        self.retry_pause = pause;
        self
    }

    /// How long a stop waits for the deliveries in flight ([`DEFAULT_DRAIN_TIMEOUT`]).
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// Consumes the queue through `service` until `shutdown` resolves, then drains:
    /// what it returns names the deliveries it left unsettled (see [`Stopped`]).
    /// Nothing else ends it: a broker that cannot be reached is retried with backoff.
    pub async fn run<T, R, S>(self, service: S, shutdown: impl Future<Output = ()>) -> Stopped
    where
        T: DeserializeOwned + Send + 'static,
        R: Send + 'static,
        S: Service<Received<T>, Response = Handled<R>> + Clone + Send + 'static,
        S::Error: Into<BoxError> + Send,
        S::Future: Send,
    {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut in_flight = JoinSet::new();
        let in_hand = InHand::default();
        let mut chains = HashMap::new();
        let mut backoff = Duration::ZERO;
        let mut session = None;
        'connect: loop {
            let Some(opened) = self.connect(&mut backoff, shutdown.as_mut()).await else {
                break 'connect;
            };
            let (connection, consuming, publisher, mut deliveries) = opened;
            tracing::info!(target: "tower_ids::idempotency::message", event = "message.consuming", queue = %self.queue, prefetch = self.prefetch, "consuming");
            loop {
                tokio::select! {
                    biased;
                    () = shutdown.as_mut() => {
                        let cancel = consuming
                            .basic_cancel(deliveries.tag(), BasicCancelOptions::default());
                        let _ = tokio::time::timeout(BROKER_ANSWER_TIMEOUT, cancel).await;
                        session = Some(connection);
                        break 'connect;
                    }
                    Some(_) = in_flight.join_next(), if !in_flight.is_empty() => {}
                    delivery = deliveries.next() => match delivery {
                        Some(Ok(delivery)) => {
                            let after = self.predecessor(&delivery, &mut chains);
                            // In hand from now until settled, waiting for its
                            // predecessor included: unacknowledged either way.
                            let held = in_hand.hold(name_of(&delivery));
                            let settle = self.clone().settle(delivery, service.clone(), publisher.clone());
                            let in_turn = after.in_turn(settle);
                            in_flight.spawn(async move {
                                let _held = held;
                                in_turn.await;
                            });
                        }
                        ended => {
                            let error = match ended {
                                Some(Err(error)) => error.to_string(),
                                _ => "the consumer was cancelled".to_owned(),
                            };
                            tracing::warn!(target: "tower_ids::idempotency::message", event = "message.connection_lost", queue = %self.queue, error, "lost the consumer; reconnecting (unacknowledged deliveries come back)");
                            backoff = Duration::from_millis(100);
                            continue 'connect;
                        }
                    }
                }
            }
        }
        let stopped = self.drain(&mut in_flight, &in_hand).await;
        if let Some(connection) = session {
            // Deliveries prefetched and never started go back to the queue now.
            let close = connection.close(200, "stopped".into());
            let _ = tokio::time::timeout(BROKER_ANSWER_TIMEOUT, close).await;
        }
        stopped
    }

    /// A connection and its channels ([`open`](Self::open)), after waiting out
    /// `backoff` if it is not zero, and again with a longer one (100 ms doubling to
    /// 5 s) while RabbitMQ cannot be reached; `None` once `shutdown` resolves. A failed
    /// first attempt is logged at WARN (a lost connection already was, as
    /// `message.connection_lost`), and a connection made after a wait at INFO.
    async fn connect(
        &self,
        backoff: &mut Duration,
        mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Option<Opened> {
        loop {
            if !backoff.is_zero() {
                tokio::select! {
                    () = shutdown.as_mut() => return None,
                    () = tokio::time::sleep(*backoff) => {}
                }
            }
            let opened = tokio::select! {
                () = shutdown.as_mut() => return None,
                opened = self.open() => opened,
            };
            match opened {
                Ok(opened) => {
                    if !backoff.is_zero() {
                        tracing::info!(target: "tower_ids::idempotency::message", event = "message.broker_recovered", queue = %self.queue, "consuming again");
                    }
                    return Some(opened);
                }
                Err(error) => {
                    if backoff.is_zero() {
                        tracing::warn!(target: "tower_ids::idempotency::message", event = "message.broker_unavailable", queue = %self.queue, error = %error, "cannot consume from RabbitMQ; trying again");
                    }
                    *backoff =
                        (*backoff * 2).clamp(Duration::from_millis(100), MAX_RECONNECT_BACKOFF);
                }
            }
        }
    }

    /// With [`ordered_by`](Self::ordered_by), the delivery's place in its value's
    /// chain: the settling of the one delivered before it (if not settled yet), and
    /// the signal of its own. Settled links are pruned as the chains grow past the
    /// prefetch, so they stay as many as the deliveries in hand.
    fn predecessor(&self, delivery: &Delivery, chains: &mut Chains) -> Waiting {
        let value = self.ordered_by.as_deref().and_then(|header| {
            let headers = delivery.properties.headers().as_ref()?;
            Some(Carrier::get(headers, header)?.to_vec())
        });
        let Some(value) = value else {
            return Waiting {
                before: None,
                done: None,
            };
        };
        if chains.len() > 2 * usize::from(self.prefetch) {
            chains.retain(|_, settled| {
                matches!(settled.try_recv(), Err(oneshot::error::TryRecvError::Empty))
            });
        }
        let (done, settled) = oneshot::channel();
        let before = chains.insert(value, settled);
        Waiting {
            before,
            done: Some(done),
        }
    }

    /// Waits for the deliveries in flight, up to the drain timeout; names those it left.
    async fn drain(&self, in_flight: &mut JoinSet<()>, in_hand: &InHand) -> Stopped {
        let waiting = in_flight.len();
        let drained = tokio::time::timeout(self.drain_timeout, async {
            while in_flight.join_next().await.is_some() {}
        })
        .await;
        // Read before the tasks are aborted: an aborted task lets go of its name.
        let stopped = in_hand.stopped();
        if drained.is_err() {
            tracing::warn!(target: "tower_ids::idempotency::message", event = "message.drain_unsettled", queue = %self.queue, in_flight = waiting, left = ?stopped.left, "stopped with deliveries unsettled: they go back to the queue");
            in_flight.abort_all();
        } else {
            tracing::info!(target: "tower_ids::idempotency::message", event = "message.drained", queue = %self.queue, settled = waiting, "every delivery in flight settled");
        }
        stopped
    }

    /// A connection, its consuming channel, its publishing channel in confirm mode (for
    /// copies and dead letters), and the queue's deliveries at the prefetch.
    async fn open(&self) -> Result<Opened, lapin::Error> {
        let connection = Connection::connect(&self.uri, ConnectionProperties::default()).await?;
        let publisher = connection.create_channel().await?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        publisher
            .queue_declare(
                self.dead_letter_queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        if self.declare_queue {
            self.declare_if_missing(&connection, &publisher).await?;
        }
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        let deliveries = channel
            .basic_consume(
                self.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(), // manual acknowledgements
                FieldTable::default(),
            )
            .await?;
        Ok((connection, channel, publisher, deliveries))
    }

    /// Declares the queue durable if a passive check finds it missing. The check runs on
    /// a channel of its own, which the broker closes when the queue is missing.
    async fn declare_if_missing(
        &self,
        connection: &Connection,
        publisher: &Channel,
    ) -> Result<(), lapin::Error> {
        let probe = connection.create_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let found =
            (probe.queue_declare(self.queue.as_str().into(), passive, FieldTable::default())).await;
        if found.is_ok() {
            let _ = probe.close(200, "".into()).await;
            return Ok(());
        }
        publisher
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        tracing::info!(target: "tower_ids::idempotency::message", event = "message.queue_declared", queue = %self.queue, "the queue did not exist: declared it, durable");
        Ok(())
    }

    /// One delivery: decoded, handled under its correlation ID, settled.
    async fn settle<T, R, S>(self, delivery: Delivery, mut service: S, publisher: Channel)
    where
        T: DeserializeOwned + 'static,
        S: Service<Received<T>, Response = Handled<R>>,
        S::Error: Into<BoxError>,
    {
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let attempts = attempts_of(&headers);
        let correlation = MessageCorrelation::new();
        let id = (self.correlation_from).delivery_id::<T>(&correlation, &headers, &delivery.data);
        let key = key_of(&headers);
        let envelope = Received {
            message: (),
            headers: text_headers(&headers),
            attempts,
            delivery: name_of(&delivery),
        };
        let settling = async move {
            let (next, reason) = handle(
                &mut service,
                &delivery.data,
                &envelope,
                self.max_attempts,
                self.retry_pause,
            )
            .await;
            let outcome = match next {
                Next::Settle(outcome) => ack(&delivery, outcome).await,
                Next::Retry(after, outcome) => requeue(&delivery, after, outcome).await,
                Next::Again(attempts) => self.again(&delivery, &publisher, attempts).await,
                Next::DeadLetter(code, reason) => {
                    self.dead_letter(&delivery, &publisher, code, &reason).await
                }
            };
            settled_line(outcome, &envelope, &key, &reason);
        };
        correlation.scope(id, &headers, settling).await;
    }

    /// Publishes the message again at the back of the queue with `attempts` counted,
    /// then acknowledges the delivery; if the copy is not confirmed, the delivery goes
    /// back to the queue instead.
    async fn again(&self, delivery: &Delivery, publisher: &Channel, attempts: u32) -> &'static str {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers.insert(
            ATTEMPTS_HEADER.into(),
            AMQPValue::LongLongInt(i64::from(attempts)),
        );
        match publish(publisher, &self.queue, delivery, headers).await {
            Ok(()) => ack(delivery, "retried").await,
            Err(error) => {
                tracing::warn!(target: "tower_ids::idempotency::message", event = "message.republish_failed", error = %error, "could not publish the message again; it goes back to the queue");
                requeue(delivery, self.retry_pause, "requeued").await
            }
        }
    }

    /// Publishes the delivery to the dead-letter queue with `reason`, then acknowledges
    /// it; logs it once at ERROR. If the dead letter is not confirmed, the delivery goes
    /// back to the queue instead.
    async fn dead_letter(
        &self,
        delivery: &Delivery,
        publisher: &Channel,
        code: &str,
        reason: &str,
    ) -> &'static str {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers.insert(
            ERROR_HEADER.into(),
            AMQPValue::LongString(LongString::from(reason)),
        );
        headers.insert(
            SOURCE_HEADER.into(),
            AMQPValue::LongString(LongString::from(self.queue.as_str())),
        );
        match publish(publisher, &self.dead_letter_queue, delivery, headers).await {
            Ok(()) => {
                tracing::error!(target: "tower_ids::idempotency::message", event = "message.dead_lettered", queue = %self.queue, dead_letter_queue = %self.dead_letter_queue, code, reason, "a message that cannot be handled went to the dead-letter queue; the messages behind it go on");
                ack(delivery, "dead_lettered").await
            }
            Err(error) => {
                tracing::warn!(target: "tower_ids::idempotency::message", event = "message.republish_failed", error = %error, "could not dead-letter the message; it goes back to the queue");
                requeue(delivery, self.retry_pause, "requeued").await
            }
        }
    }
}

/// A connection, its consuming channel, its publishing channel, and the deliveries.
type Opened = (Connection, Channel, Channel, lapin::Consumer);

/// For each header value, the signal that its latest delivery has settled.
type Chains = HashMap<Vec<u8>, oneshot::Receiver<()>>;

/// A delivery's link in its chain (none without `ordered_by` or the header): what it
/// waits for, and what it signals.
struct Waiting {
    before: Option<oneshot::Receiver<()>>,
    done: Option<oneshot::Sender<()>>,
}

impl Waiting {
    /// Runs `settle` once the delivery before it has settled (or its task is gone),
    /// then signals the delivery after it.
    async fn in_turn(self, settle: impl Future<Output = ()>) {
        let Self { before, done } = self;
        if let Some(before) = before {
            // Ended either way: settled, or its task gone.
            let _ = before.await;
        }
        settle.await;
        if let Some(done) = done {
            let _ = done.send(());
        }
    }
}

async fn ack(delivery: &Delivery, outcome: &'static str) -> &'static str {
    if let Err(error) = delivery.ack(BasicAckOptions::default()).await {
        // The channel is gone: the broker delivers it again, and the layer replays it.
        tracing::debug!(target: "tower_ids::idempotency::message", event = "message.ack_failed", error = %error, "could not acknowledge; the broker delivers it again");
    }
    outcome
}

async fn requeue(delivery: &Delivery, after: Duration, outcome: &'static str) -> &'static str {
    tokio::time::sleep(after).await;
    let _ = delivery
        .nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        })
        .await;
    outcome
}

/// Publishes the delivery's body and properties, with `headers`, to `queue` on the
/// default exchange, persistent, and waits for the broker's confirm.
async fn publish(
    publisher: &Channel,
    queue: &str,
    delivery: &Delivery,
    headers: FieldTable,
) -> Result<(), String> {
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    let properties = match delivery.properties.content_type() {
        Some(content_type) => properties.with_content_type(content_type.clone()),
        None => properties,
    };
    let properties = match delivery.properties.message_id() {
        Some(id) => properties.with_message_id(id.clone()),
        None => properties,
    };
    let confirm = publisher
        .basic_publish(
            ShortString::from(""),
            ShortString::from(queue),
            BasicPublishOptions::default(),
            &delivery.data,
            properties,
        )
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    match confirm {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        Confirmation::Ack(Some(_)) => Err(format!("no queue {queue:?}")),
        Confirmation::Nack(_) => Err("the broker nacked it".to_owned()),
    }
}

/// The failed deliveries a message's headers count ([`ATTEMPTS_HEADER`]), whatever
/// integer type a broker or a publisher gave it.
fn attempts_of(headers: &FieldTable) -> u32 {
    let count = match headers.inner().get(ATTEMPTS_HEADER) {
        Some(AMQPValue::ShortShortUInt(n)) => i64::from(*n),
        Some(AMQPValue::ShortUInt(n)) => i64::from(*n),
        Some(AMQPValue::LongUInt(n)) => i64::from(*n),
        Some(AMQPValue::ShortShortInt(n)) => i64::from(*n),
        Some(AMQPValue::ShortInt(n)) => i64::from(*n),
        Some(AMQPValue::LongInt(n)) => i64::from(*n),
        Some(AMQPValue::LongLongInt(n)) => *n,
        _ => 0,
    };
    u32::try_from(count.max(0)).unwrap_or(u32::MAX)
}

/// The headers whose values are text (AMQP long strings), as a driver hands them over.
fn text_headers(headers: &FieldTable) -> Vec<(String, Vec<u8>)> {
    headers
        .inner()
        .iter()
        .filter_map(|(name, value)| match value {
            AMQPValue::LongString(text) => Some((name.to_string(), text.as_bytes().to_vec())),
            _ => None,
        })
        .collect()
}

/// A delivery's name in its lines and in [`Stopped::left`]: its message ID, or its
/// delivery tag where it has none.
fn name_of(delivery: &Delivery) -> String {
    match delivery.properties.message_id() {
        Some(id) => id.to_string(),
        None => format!("tag-{}", delivery.delivery_tag),
    }
}
