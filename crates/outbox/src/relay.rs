//! The relay: publishes committed messages, backs off through outages, dead-letters
//! what the broker keeps refusing, trims what it published.

use std::{
    collections::{HashMap, HashSet},
    future::Future,
    sync::Mutex,
    time::Duration,
};

use futures_util::FutureExt as _;
use sqlx::{
    postgres::{PgListener, PgPoolOptions},
    PgConnection, Row as _,
};
use tokio::time::Instant;

use super::{
    publish::{Publication, Published},
    take::{take, Pending},
    Outbox, OutboxError, Sink, SinkError,
};
use tower_ids_core::{engine::InHand, store::Chain, Stopped};

/// Settings of a [`Relay`], with their defaults.
#[derive(Debug, Clone)]
struct Settings {
    batch_size: usize,
    poll_interval: Duration,
    max_attempts: u32,
    retry_backoff: Duration,
    max_retry_backoff: Duration,
    max_outage_backoff: Duration,
    publish_timeout: Duration,
    retention: Duration,
    trim_interval: Duration,
    observe_interval: Duration,
    drain_timeout: Duration,
}

/// Messages a relay round takes by default: chosen from `benches/outbox.rs`, where 1,024
/// drained a backlog faster than 256 on every broker and shape (the round's statements
/// and its wait for its last confirm spread over four times the messages), while a
/// round still holds its rows and partition keys for milliseconds. A round keeps its
/// batch in memory: at most this many messages (their payloads and headers) per relay.
pub const DEFAULT_RELAY_BATCH_SIZE: usize = 1024;
/// How often an idle relay looks anyway by default: only a fallback, since a commit
/// wakes it at once. It bounds the wait of a message whose notification was missed (a
/// relay that died in its round, the listening connection lost), and costs an idle
/// relay four cheap statements every 5 s.
pub const DEFAULT_RELAY_POLL_INTERVAL: Duration = Duration::from_secs(5);
/// Publications a refused message gets by default before it is dead-lettered: with
/// [`DEFAULT_RETRY_BACKOFF`] doubling, about 8.5 minutes of a broker refusing it, time
/// for an operator to fix a missing queue or topic before anything is given up.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;
/// The wait after a refusal by default, doubled per attempt: a message the broker
/// refused is not hammered, and one refused by a passing condition goes soon.
pub const DEFAULT_RETRY_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait between attempts of a refused message by default.
pub const DEFAULT_MAX_RETRY_BACKOFF: Duration = Duration::from_secs(300);
/// The longest wait between rounds while the broker is unavailable by default: an
/// outage costs the broker one try per relay every 30 s at worst, and a broker that
/// comes back is used within that.
pub const DEFAULT_MAX_OUTAGE_BACKOFF: Duration = Duration::from_secs(30);
/// How long one publication may take by default before the broker counts as
/// unavailable: longer than a healthy broker's slowest confirm, short enough that a
/// stalled broker does not hold a round's rows for long.
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// How long published messages stay by default: a week of history to look into when
/// a consumer reports a gap, bounded so the table does not grow without end.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// How often a relay trims by default: published rows go within a minute of their
/// retention, in batches of 1,000.
pub const DEFAULT_TRIM_INTERVAL: Duration = Duration::from_secs(60);
/// How often a relay measures the backlog for its gauges by default: a count over the
/// pending rows' index, cheap at this rate, fresh enough for an alert.
pub const DEFAULT_OBSERVE_INTERVAL: Duration = Duration::from_secs(10);

/// How long a destination that had no room ([`SinkError::full`]) gets its keys one
/// message at a time after its last refusal: a queue that fills once usually fills again
/// while its consumers catch up, and a spell of backpressure costs one pipeline's
/// worth of order at its start, not one per refusal.
const FULL_SPELL: Duration = Duration::from_secs(30);

/// How long a stop waits for the round under way by default: as long as the consumer
/// drivers wait for their deliveries, and within Kubernetes' default grace period of
/// 30 s. A healthy round takes milliseconds; one that takes longer is waiting on a
/// broker or a database that has stopped answering.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for Settings {
    fn default() -> Self {
        Self {
            batch_size: DEFAULT_RELAY_BATCH_SIZE,
            poll_interval: DEFAULT_RELAY_POLL_INTERVAL,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retry_backoff: DEFAULT_RETRY_BACKOFF,
            max_retry_backoff: DEFAULT_MAX_RETRY_BACKOFF,
            max_outage_backoff: DEFAULT_MAX_OUTAGE_BACKOFF,
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
            retention: DEFAULT_RETENTION,
            trim_interval: DEFAULT_TRIM_INTERVAL,
            observe_interval: DEFAULT_OBSERVE_INTERVAL,
            drain_timeout: DRAIN_TIMEOUT,
        }
    }
}

/// Builds a [`Relay`]: [`Outbox::relay`] with a sink, the settings, then
/// [`build`](Self::build).
#[derive(Debug)]
#[must_use]
pub struct RelayBuilder<S> {
    outbox: Outbox,
    sink: S,
    settings: Settings,
}

impl<S: Sink> RelayBuilder<S> {
    pub(super) fn new(outbox: Outbox, sink: S) -> Self {
        Self {
            outbox,
            sink,
            settings: Settings::default(),
        }
    }

    /// Messages one round takes, publishes and marks in one transaction ([`DEFAULT_RELAY_BATCH_SIZE`], 1,024): more
    /// publish faster, and hold their rows and partition keys longer.
    ///
    /// # Panics
    ///
    /// If `size` is 0.
    pub fn batch_size(mut self, size: usize) -> Self {
        assert!(
            size > 0,
            "tower-ids: an outbox batch takes at least one message"
        );
        self.settings.batch_size = size;
        self
    }

    /// How often an idle relay looks anyway ([`DEFAULT_RELAY_POLL_INTERVAL`], 5 s): a
    /// commit wakes it at once, so this only bounds the wait of a message whose
    /// notification was missed.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// Publications a message gets before it is dead-lettered, when the broker keeps
    /// refusing it ([`DEFAULT_MAX_ATTEMPTS`], 10). Outages do not count.
    ///
    /// # Panics
    ///
    /// If `attempts` is 0.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        assert!(
            attempts > 0,
            "tower-ids: a message gets at least one attempt"
        );
        self.settings.max_attempts = attempts;
        self
    }

    /// After the broker refused a message, how long before it is tried again: `backoff`
    /// ([`DEFAULT_RETRY_BACKOFF`], 1 s), doubled per attempt up to `max` ([`DEFAULT_MAX_RETRY_BACKOFF`], 5 min). Later messages of its partition
    /// key wait for it.
    pub fn retry_backoff(mut self, backoff: Duration, max: Duration) -> Self {
        self.settings.retry_backoff = backoff;
        self.settings.max_retry_backoff = max.max(backoff);
        self
    }

    /// The longest wait between tries while the broker is unavailable ([`DEFAULT_MAX_OUTAGE_BACKOFF`], 30 s): the relay
    /// tries again after 100 ms, then doubles the wait up to this.
    pub fn max_outage_backoff(mut self, max: Duration) -> Self {
        self.settings.max_outage_backoff = max;
        self
    }

    /// How long one publication may take before the broker counts as unavailable
    /// ([`DEFAULT_PUBLISH_TIMEOUT`], 10 s).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.settings.publish_timeout = timeout;
        self
    }

    /// How long published messages stay in the table before the relay removes them
    /// ([`DEFAULT_RETENTION`], 7 days), and how often it looks ([`DEFAULT_TRIM_INTERVAL`], a
    /// minute). Dead letters stay until you requeue or delete them.
    ///
    /// A retention of zero deletes each message in the round that publishes it, instead
    /// of marking it and trimming it later: the cheapest round (a delete writes no new
    /// row version and no index entry; the figures are in `benches/README.md`), at the
    /// price of no history to look into when a consumer reports a gap.
    pub fn retention(mut self, retention: Duration, every: Duration) -> Self {
        self.settings.retention = retention;
        self.settings.trim_interval = every;
        self
    }

    /// How often the relay measures the backlog for its gauges ([`DEFAULT_OBSERVE_INTERVAL`], 10 s; with the
    /// `metrics` feature).
    pub fn observe_interval(mut self, interval: Duration) -> Self {
        self.settings.observe_interval = interval;
        self
    }

    /// How long a stop waits for the round under way (10 s): past it, the round is
    /// dropped (its transaction rolls back, so its messages stay pending, and the next
    /// round of any relay publishes them again with their keys) and named in what
    /// [`Relay::run`] returns.
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.settings.drain_timeout = timeout;
        self
    }

    /// The relay.
    pub fn build(self) -> Relay<S> {
        #[cfg(feature = "metrics")]
        super::metrics::describe();
        Relay {
            outbox: self.outbox,
            sink: self.sink,
            settings: self.settings,
            full: Mutex::default(),
        }
    }
}

/// Publishes an [`Outbox`]'s committed messages to a [`Sink`], and marks them
/// published. Run one per replica: relays share the work, and each partition key is
/// published by one relay at a time, in commit order.
///
/// Each round, in one transaction: take up to a batch of pending messages (the oldest
/// first) whose partition keys no other relay holds (a transaction-scoped advisory
/// lock per key; messages without a key with `FOR UPDATE SKIP LOCKED`), publish them
/// (the keys concurrently; each key's messages sent in order and their confirms awaited
/// in that order, the first failure stopping the key), mark what the broker took,
/// commit. A relay that dies mid-round
/// leaves its messages pending: they are published again, with the same idempotency
/// key.
///
/// A destination that has no room for a message ([`SinkError::full`]: a RabbitMQ queue
/// at its `x-max-length` with `reject-publish`) may take the key's next one a moment
/// later, which would then overtake it. So once one has refused so, the relay sends its
/// keys one message at a time, each once the previous is confirmed, until 30 s have
/// passed without such a refusal (INFO `outbox.destination_full` when the spell
/// starts). What was already in flight behind the first refusal of a spell may still
/// be taken before it: `crates/outbox/tests/outbox/amqp.rs` measures it.
#[derive(Debug)]
pub struct Relay<S> {
    outbox: Outbox,
    sink: S,
    settings: Settings,
    /// The destinations in a full spell, and when it ends.
    full: Mutex<HashMap<String, Instant>>,
}

/// What one round of a [`Relay`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Round {
    /// Messages it took.
    pub taken: usize,
    /// Messages the broker took.
    pub published: usize,
    /// Messages the broker refused (an attempt counted), dead letters included.
    pub rejected: usize,
    /// Of those, messages dead-lettered.
    pub dead_lettered: usize,
    /// Whether the broker was unavailable for some message.
    pub unavailable: bool,
}

impl<S: Sink> Relay<S> {
    /// Runs rounds until `shutdown` completes (a round under way finishes first, within
    /// the drain timeout); beside
    /// them, trims and observes the backlog as configured.
    ///
    /// Between rounds an idle relay waits for a message to be committed: every
    /// [`enqueue`](Outbox::enqueue) notifies the table's channel at its commit
    /// (`LISTEN`/`NOTIFY`, on one connection of the relay's own), so it publishes
    /// within milliseconds and does nothing meanwhile. It also wakes when a message's
    /// backoff ends, and polls every [`poll_interval`](RelayBuilder::poll_interval) in
    /// case a notification was missed (the listening connection lost, a relay that died
    /// with messages in its round).
    ///
    /// A stop (`shutdown` resolving) lets the round under way finish within the
    /// [drain timeout](RelayBuilder::drain_timeout), and returns what it left: nothing,
    /// or the messages of a round that did not finish in time, by `outbox:{id}` (see
    /// [`Stopped`]). Nothing else ends a run: an unavailable broker or database is
    /// logged and waited out.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Stopped {
        let mut shutdown = std::pin::pin!(shutdown);
        // The gauges from the start: one count, before the first round moves them.
        self.observe().await;
        tokio::select! {
            biased;
            stopped = self.publish_until(shutdown.as_mut()) => stopped,
            never = self.maintain() => match never {},
        }
    }

    /// Rounds until `shutdown`, waiting between them as [`run`](Self::run) says.
    async fn publish_until(
        &self,
        mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Stopped {
        let mut wakeup = Wakeup::new(&self.outbox);
        wakeup.listen().await;
        let mut outage = Outage::default();
        loop {
            let in_hand = InHand::default();
            let round = self.round_with_error(&in_hand);
            let mut round = std::pin::pin!(round);
            // A stop during a round waits for it up to the drain timeout, and ends the
            // run once the round is accounted for as any other.
            let (finished, stopping) = tokio::select! {
                biased;
                finished = round.as_mut() => (finished, false),
                () = shutdown.as_mut() => {
                    match tokio::time::timeout(self.settings.drain_timeout, round.as_mut()).await {
                        Ok(finished) => (finished, true),
                        Err(_) => return self.left_behind(&in_hand),
                    }
                }
            };
            let wait = outage.after(finished, &self.settings);
            if stopping {
                return Stopped::default();
            }
            if matches!(wait, Wait::Not) {
                if shutdown.as_mut().now_or_never().is_some() {
                    return Stopped::default();
                }
                continue;
            }
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return Stopped::default(),
                () = self.wait(wait, &mut wakeup) => {}
            }
        }
    }

    /// Waits as a round asked: its backoff, or while idle until a message is committed
    /// or due, polling at least every `poll_interval`.
    async fn wait(&self, wait: Wait, wakeup: &mut Wakeup<'_>) {
        match wait {
            Wait::Not => {}
            Wait::For(wait) => tokio::time::sleep(wait).await,
            Wait::Idle => {
                let until_due = self.next_due().await;
                let at_most = until_due.map_or(self.settings.poll_interval, |due| {
                    due.min(self.settings.poll_interval)
                });
                wakeup.wait(at_most).await;
            }
        }
    }

    /// A stop whose round did not finish within the drain timeout: the round is dropped
    /// (its transaction rolls back) and its messages named.
    fn left_behind(&self, in_hand: &InHand) -> Stopped {
        let stopped = in_hand.stopped();
        tracing::warn!(
            target: "tower_ids::outbox",
            event = "outbox.drain_unsettled",
            left = ?stopped.left,
            "stopped in the middle of a round: its messages stay pending and are published again"
        );
        stopped
    }

    /// Trims and observes the backlog, each at its interval, off the publishing path.
    async fn maintain(&self) -> std::convert::Infallible {
        let mut next_trim = Instant::now();
        let mut next_observe = Instant::now() + self.settings.observe_interval;
        loop {
            let now = Instant::now();
            if now >= next_trim {
                next_trim = now + self.settings.trim_interval;
                if let Err(error) = self.trim().await {
                    tracing::warn!(target: "tower_ids::outbox", event = "outbox.trim_failed", error = %Chain(&error), "could not trim the outbox");
                }
            }
            if now >= next_observe {
                next_observe = now + self.settings.observe_interval;
                self.observe().await;
            }
            tokio::time::sleep_until(next_trim.min(next_observe)).await;
        }
    }

    /// How long until the next message waiting out a backoff is due, if one is.
    async fn next_due(&self) -> Option<Duration> {
        let seconds: Option<f64> = sqlx::query_scalar(&self.outbox.shared.sql.next_due)
            .fetch_one(&self.outbox.shared.pool)
            .await
            .ok()
            .flatten();
        seconds.map(|s| Duration::from_secs_f64(s.max(0.0)))
    }

    /// One round: takes, publishes and marks up to a batch of messages, in one
    /// transaction. [`run`](Self::run) calls it in a loop; call it yourself to drive
    /// the relay from a loop of your own.
    pub async fn round(&self) -> Result<Round, OutboxError> {
        (self.round_with_error(&InHand::default()).await).map(|(round, _)| round)
    }

    /// A round, and the first error of a broker that was unavailable; the messages it
    /// took are held in `in_hand` while it runs.
    async fn round_with_error(
        &self,
        in_hand: &InHand,
    ) -> Result<(Round, Option<SinkError>), OutboxError> {
        let sql = &self.outbox.shared.sql;
        let batch = self.settings.batch_size;
        let mut transaction = self
            .outbox
            .shared
            .pool
            // The keys' rows are read after their locks are granted, in a statement of
            // its own: READ COMMITTED (whatever the database's default), so that
            // statement sees what the key's previous holder marked.
            .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
            .map_err(|e| OutboxError::database("could not begin a relay round", e))?;
        let taken = take(&mut transaction, sql, batch).await?;
        // Held to the round's end: what a stop names if the round cannot finish.
        let _held: Vec<_> = (taken.iter())
            .map(|message| in_hand.hold(format!("outbox:{}", message.id)))
            .collect();
        let mut round = Round {
            taken: taken.len(),
            ..Round::default()
        };
        if taken.is_empty() {
            transaction
                .commit()
                .await
                .map_err(|e| OutboxError::database("could not end a relay round", e))?;
            return Ok((round, None));
        }

        let outcomes = self.publish_chains(chains_by_key(&taken)).await;
        let answers = self.answers(outcomes);
        round.published = answers.published.len();
        round.rejected = answers.refused.len();
        round.unavailable = answers.unavailable.is_some();
        self.mark_published(&mut transaction, &answers.published)
            .await?;
        if !answers.refused.is_empty() {
            round.dead_lettered = self.refused(&mut transaction, answers.refused).await?;
        }
        transaction
            .commit()
            .await
            .map_err(|e| OutboxError::database("could not end a relay round", e))?;
        Ok((round, answers.unavailable))
    }

    /// Publishes every chain at once, each a key's messages in order; a chain with a
    /// message for a destination in a full spell goes one message at a time.
    async fn publish_chains<'m>(&self, chains: Vec<Vec<&'m Pending>>) -> Vec<Vec<Published<'m>>> {
        let full = self.in_full_spell();
        futures_util::future::join_all(chains.into_iter().map(|chain| {
            let one_at_a_time = (chain.iter()).any(|message| full.contains(&message.destination));
            self.publish_chain(chain, one_at_a_time)
        }))
        .await
    }

    /// What the broker answered, sorted; a destination without room starts or extends
    /// its full spell.
    fn answers<'m>(&self, outcomes: Vec<Vec<Published<'m>>>) -> Answers<'m> {
        let mut answers = Answers {
            published: Vec::new(),
            refused: Vec::new(),
            unavailable: None,
        };
        for outcome in outcomes.into_iter().flatten() {
            match outcome {
                Published::Taken(id) => answers.published.push(id),
                Published::Refused(message, error) => answers.refused.push((message, error)),
                Published::Unavailable(message, error) => {
                    if error.is_full() {
                        self.full_spell(&message.destination);
                    }
                    answers.unavailable.get_or_insert(error);
                }
            }
        }
        answers
    }

    /// Marks the messages the broker took as published, or deletes them at once when
    /// nothing is retained.
    async fn mark_published(
        &self,
        connection: &mut PgConnection,
        published: &[i64],
    ) -> Result<(), OutboxError> {
        if published.is_empty() {
            return Ok(());
        }
        let sql = &self.outbox.shared.sql;
        let mark = if self.settings.retention.is_zero() {
            &sql.forget
        } else {
            &sql.mark
        };
        sqlx::query(mark)
            .bind(published)
            .execute(&mut *connection)
            .await
            .map_err(|e| OutboxError::database("could not mark messages published", e))?;
        Ok(())
    }

    /// The destinations whose full spell has not ended.
    fn in_full_spell(&self) -> HashSet<String> {
        let mut full = self
            .full
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        full.retain(|_, until| *until > now);
        full.keys().cloned().collect()
    }

    /// Starts or extends `destination`'s full spell.
    fn full_spell(&self, destination: &str) {
        let mut full = self
            .full
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let until = Instant::now() + FULL_SPELL;
        if full.insert(destination.to_owned(), until).is_none() {
            tracing::info!(
                target: "tower_ids::outbox",
                event = "outbox.destination_full",
                destination,
                "the destination has no room: its keys go one message at a time, so that none overtakes a refused one"
            );
        }
    }

    /// Publishes one partition key's messages: sends them in order, then awaits their
    /// confirms in order, stopping at the first that fails (the key's later messages,
    /// sent or not, stay pending and go again in a later round). `one_at_a_time`, each
    /// is sent once the previous is confirmed.
    async fn publish_chain<'m>(
        &self,
        chain: Vec<&'m Pending>,
        one_at_a_time: bool,
    ) -> Vec<Published<'m>> {
        if one_at_a_time {
            return self.publish_one_at_a_time(chain).await;
        }
        let mut outcomes = Vec::with_capacity(chain.len());
        let mut sent = Vec::with_capacity(chain.len());
        let mut unsent = None;
        for message in chain {
            let publication = Publication::of(message);
            match publication
                .send(&self.sink, self.settings.publish_timeout)
                .await
            {
                Ok(confirm) => sent.push((publication, confirm)),
                Err(error) => {
                    unsent = Some((publication, error));
                    break;
                }
            }
        }
        for (publication, confirm) in sent {
            let outcome = publication
                .confirmed(confirm, self.settings.publish_timeout)
                .await;
            let stop = !matches!(outcome, Published::Taken(_));
            outcomes.push(outcome);
            if stop {
                return outcomes;
            }
        }
        if let Some((publication, error)) = unsent {
            outcomes.push(publication.failed(error));
        }
        outcomes
    }

    /// Publishes one partition key's messages, each once the previous is confirmed,
    /// stopping at the first that fails.
    async fn publish_one_at_a_time<'m>(&self, chain: Vec<&'m Pending>) -> Vec<Published<'m>> {
        let mut outcomes = Vec::with_capacity(chain.len());
        let timeout = self.settings.publish_timeout;
        for message in chain {
            let publication = Publication::of(message);
            let outcome = match publication.send(&self.sink, timeout).await {
                Ok(confirm) => publication.confirmed(confirm, timeout).await,
                Err(error) => publication.failed(error),
            };
            let stop = !matches!(outcome, Published::Taken(_));
            outcomes.push(outcome);
            if stop {
                break;
            }
        }
        outcomes
    }

    /// Counts an attempt for each refused message, schedules its next one or
    /// dead-letters it; returns how many were dead-lettered.
    async fn refused(
        &self,
        connection: &mut PgConnection,
        refused: Vec<(&Pending, SinkError)>,
    ) -> Result<usize, OutboxError> {
        let mut ids = Vec::with_capacity(refused.len());
        let mut errors = Vec::with_capacity(refused.len());
        let mut delays = Vec::with_capacity(refused.len());
        for (message, error) in refused {
            let attempts = u32::try_from(message.attempts).unwrap_or(0);
            let delay = self
                .settings
                .retry_backoff
                .saturating_mul(1 << attempts.min(16))
                .min(self.settings.max_retry_backoff);
            ids.push(message.id);
            errors.push(Chain(&error).to_string());
            delays.push(delay.as_secs_f64());
        }
        let counted = sqlx::query(&self.outbox.shared.sql.refused)
            .bind(&ids)
            .bind(&errors)
            .bind(&delays)
            .bind(i32::try_from(self.settings.max_attempts).unwrap_or(i32::MAX))
            .fetch_all(&mut *connection)
            .await
            .map_err(|e| OutboxError::database("could not count failed attempts", e))?;
        let mut dead = 0;
        for row in counted.iter().filter(|row| row.get::<bool, _>("dead")) {
            dead += 1;
            let id: i64 = row.get("id");
            let destination: String = row.get("destination");
            let attempts: i32 = row.get("attempts");
            tracing::error!(
                target: "tower_ids::outbox",
                event = "outbox.dead_lettered",
                message_id = id,
                destination = destination.as_str(),
                attempts,
                "the broker refused the message on its last attempt; it is a dead letter now"
            );
            #[cfg(feature = "metrics")]
            ::metrics::counter!(super::metrics::DEAD_LETTERED, "destination" => destination)
                .increment(1);
        }
        Ok(dead)
    }

    /// Removes published messages older than the retention, a batch at a time; returns
    /// how many.
    pub async fn trim(&self) -> Result<u64, OutboxError> {
        let mut removed = 0;
        if self.settings.retention.is_zero() {
            // Deleted as they were published: nothing to trim.
            return Ok(0);
        }
        loop {
            let done = sqlx::query(&self.outbox.shared.sql.trim)
                .bind(self.settings.retention.as_secs_f64())
                .execute(&self.outbox.shared.pool)
                .await
                .map_err(|e| OutboxError::database("could not trim the outbox", e))?
                .rows_affected();
            removed += done;
            if done < 1000 {
                return Ok(removed);
            }
        }
    }

    /// Sets the backlog gauges (with the `metrics` feature).
    async fn observe(&self) {
        #[cfg(feature = "metrics")]
        match self.outbox.backlog().await {
            Ok((count, oldest)) => {
                ::metrics::gauge!(super::metrics::BACKLOG).set(count as f64);
                ::metrics::gauge!(super::metrics::OLDEST_PENDING_AGE)
                    .set(oldest.map_or(0.0, |age| age.as_secs_f64()));
            }
            Err(error) => {
                tracing::debug!(target: "tower_ids::outbox", event = "outbox.observe_failed", error = %Chain(&error), "could not measure the backlog");
            }
        }
    }
}

/// The wait after another failed round: 100 ms, then doubled, up to `max`.
fn next_outage_wait(previous: Duration, max: Duration) -> Duration {
    if previous.is_zero() {
        Duration::from_millis(100).min(max)
    } else {
        previous.saturating_mul(2).min(max)
    }
}

/// One chain per partition key (a message without one is a chain of its own), in the
/// order of its oldest message; a chain stops at its first failure.
fn chains_by_key(taken: &[Pending]) -> Vec<Vec<&Pending>> {
    let mut chains: Vec<Vec<&Pending>> = Vec::new();
    let mut chain_of: HashMap<&str, usize> = HashMap::new();
    for message in taken {
        match message.partition_key.as_deref() {
            Some(key) => match chain_of.get(key) {
                Some(&chain) => chains[chain].push(message),
                None => {
                    chain_of.insert(key, chains.len());
                    chains.push(vec![message]);
                }
            },
            None => chains.push(vec![message]),
        }
    }
    chains
}

/// What the broker answered in a round.
struct Answers<'m> {
    /// The IDs of the messages it took.
    published: Vec<i64>,
    /// The messages it refused for themselves, with why.
    refused: Vec<(&'m Pending, SinkError)>,
    /// The first error of a broker that was unavailable, if it was.
    unavailable: Option<SinkError>,
}

/// What the relay knows of an outage across rounds.
#[derive(Default)]
struct Outage {
    /// The wait after the last failed round; zero when none failed since the broker
    /// last answered.
    backoff: Duration,
    /// Whether the WARN of an outage went out and its `sink_recovered` is owed: a
    /// round's backoff alone (a key that found the broker gone in a round that
    /// otherwise went through) is not an outage to announce or end.
    announced: bool,
}

impl Outage {
    /// What a round says of the broker (announcing an outage's start and end), and the
    /// wait it asks for.
    fn after(
        &mut self,
        finished: Result<(Round, Option<SinkError>), OutboxError>,
        settings: &Settings,
    ) -> Wait {
        let (round, error) = match finished {
            Ok(finished) => finished,
            Err(error) => {
                self.backoff = next_outage_wait(self.backoff, settings.max_outage_backoff);
                tracing::warn!(target: "tower_ids::outbox", event = "outbox.round_failed", error = %Chain(&error), "could not read or mark the outbox; backing off");
                return Wait::For(self.backoff);
            }
        };
        // The broker answered a message (took it, or refused it for itself): an outage
        // is over, even if a later key of the same round found it gone again (that key
        // backs off, unannounced). A round that sent nothing says nothing of the broker.
        let answered = round.published > 0 || round.rejected > 0;
        if answered {
            if self.announced {
                tracing::info!(
                    target: "tower_ids::outbox",
                    event = "outbox.sink_recovered",
                    "the broker takes messages again"
                );
            }
            self.announced = false;
            self.backoff = Duration::ZERO;
        }
        match error {
            Some(error) => {
                if !self.announced && !answered {
                    tracing::warn!(target: "tower_ids::outbox", event = "outbox.sink_unavailable", error = %Chain(&error), "the broker is unavailable; backing off");
                    self.announced = true;
                }
                self.backoff = next_outage_wait(self.backoff, settings.max_outage_backoff);
                Wait::For(self.backoff)
            }
            // A full batch, or a refusal whose backoff may be over already: the next
            // round at once (an idle wait would miss a zero backoff).
            None if round.taken >= settings.batch_size || round.rejected > 0 => Wait::Not,
            None => Wait::Idle,
        }
    }
}

/// What a relay does after a round.
#[derive(Clone, Copy)]
enum Wait {
    /// A full batch: the next round at once.
    Not,
    /// A backoff after a failure.
    For(Duration),
    /// Until a message is committed or due.
    Idle,
}

/// What wakes an idle relay: a notification on its table's channel, from a connection
/// of its own (outside the pool's count).
struct Wakeup<'a> {
    outbox: &'a Outbox,
    listener: Option<PgListener>,
}

/// How long connecting the listening connection may take before the relay polls.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(5);

impl<'a> Wakeup<'a> {
    fn new(outbox: &'a Outbox) -> Self {
        Self {
            outbox,
            listener: None,
        }
    }

    /// Listens on the table's channel, unless it does already; if the database cannot
    /// be reached, the relay polls until it can.
    async fn listen(&mut self) {
        if self.listener.is_some() {
            return;
        }
        let shared = &self.outbox.shared;
        let listening = tokio::time::timeout(LISTEN_TIMEOUT, async {
            // A pool of its own, of one connection: a listener made from the relay's
            // pool would hold one of its connections for good.
            let own = PgPoolOptions::new()
                .max_connections(1)
                .connect_lazy_with((*shared.pool.connect_options()).clone());
            let mut listener = PgListener::connect_with(&own).await?;
            listener.listen(&shared.table).await?;
            Ok::<_, sqlx::Error>(listener)
        })
        .await;
        match listening {
            Ok(Ok(listener)) => self.listener = Some(listener),
            Ok(Err(error)) => {
                tracing::debug!(target: "tower_ids::outbox", event = "outbox.listen_failed", error = %Chain(&error), "could not listen for commits; polling");
            }
            Err(_) => {
                tracing::debug!(
                    target: "tower_ids::outbox",
                    event = "outbox.listen_failed",
                    "could not listen for commits in time; polling"
                );
            }
        }
    }

    /// Waits for a commit's notification, or `at_most`.
    async fn wait(&mut self, at_most: Duration) {
        self.listen().await;
        let Some(listener) = self.listener.as_mut() else {
            tokio::time::sleep(at_most).await;
            return;
        };
        match tokio::time::timeout(at_most, listener.try_recv()).await {
            // Every notification so far wakes one round.
            Ok(Ok(Some(_))) => while listener.next_buffered().is_some() {},
            // The connection was lost (notifications meanwhile with it): a round now;
            // the listener connects again at its next wait.
            Ok(Ok(None)) => {}
            Ok(Err(error)) => {
                tracing::debug!(target: "tower_ids::outbox", event = "outbox.listen_failed", error = %Chain(&error), "lost the connection that listens for commits; polling");
                self.listener = None;
            }
            Err(_) => {}
        }
    }
}
