//! The relay: publishes committed messages, backs off through outages, dead-letters
//! what the broker keeps refusing, trims what it published.

use std::{collections::HashMap, future::Future, time::Duration};

use futures_util::FutureExt as _;
use sqlx::{PgConnection, Row as _};
use tokio::time::Instant;
use tracing::Instrument as _;

use super::{
    take::{take, Pending},
    Outbox, OutboxError, Outgoing, Sink, SinkError,
};
use crate::{
    correlation::{Carrier, CorrelationId, MessageCorrelation},
    idempotency::header::IDEMPOTENCY_KEY,
};

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
}

/// Messages a relay round takes by default: enough that a backlog drains in few
/// rounds (each costs a handful of statements), few enough that a round holds its rows
/// and partition keys for milliseconds, and its memory stays small.
pub const DEFAULT_RELAY_BATCH_SIZE: usize = 256;
/// How long an idle relay waits before looking again by default: a committed message
/// waits at most this for an idle relay, and the database sees ten cheap index scans a
/// second per relay.
pub const DEFAULT_RELAY_POLL_INTERVAL: Duration = Duration::from_millis(100);
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

    /// Messages one round takes, publishes and marks in one transaction ([`DEFAULT_RELAY_BATCH_SIZE`], 256): more
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

    /// How long an idle relay waits before looking again ([`DEFAULT_RELAY_POLL_INTERVAL`], 100 ms): the most a committed
    /// message waits for its relay, when the relay has nothing else to do.
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
    /// minute). Dead letters stay until you
    /// requeue or delete them.
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

    /// The relay.
    pub fn build(self) -> Relay<S> {
        #[cfg(feature = "metrics")]
        super::metrics::describe();
        Relay {
            outbox: self.outbox,
            sink: self.sink,
            settings: self.settings,
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
/// (the keys concurrently, each key's messages one after the other, each confirmed
/// before the next), mark what the broker took, commit. A relay that dies mid-round
/// leaves its messages pending: they are published again, with the same idempotency
/// key.
#[derive(Debug)]
pub struct Relay<S> {
    outbox: Outbox,
    sink: S,
    settings: Settings,
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

/// How one message's publication ended.
enum Published<'m> {
    Taken(i64),
    Refused(&'m Pending, SinkError),
    Unavailable(SinkError),
}

impl<S: Sink> Relay<S> {
    /// Runs rounds until `shutdown` completes (a round under way finishes first), and
    /// trims and observes the backlog as configured.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut outage = Duration::ZERO;
        let mut next_trim = Instant::now();
        let mut next_observe = Instant::now();
        loop {
            let now = Instant::now();
            if now >= next_trim {
                next_trim = now + self.settings.trim_interval;
                if let Err(error) = self.trim().await {
                    tracing::warn!(event = "outbox.trim_failed", error = %error, "could not trim the outbox");
                }
            }
            if now >= next_observe {
                next_observe = now + self.settings.observe_interval;
                self.observe().await;
            }
            let wait = match self.round_with_error().await {
                Ok((_, Some(error))) => {
                    if outage.is_zero() {
                        tracing::warn!(event = "outbox.sink_unavailable", error = %error, "the broker is unavailable; backing off");
                    }
                    outage = next_outage_wait(outage, self.settings.max_outage_backoff);
                    outage
                }
                Ok((round, None)) => {
                    if outage > Duration::ZERO {
                        if round.published > 0 {
                            tracing::info!(
                                event = "outbox.sink_recovered",
                                "the broker takes messages again"
                            );
                        }
                        outage = Duration::ZERO;
                    }
                    if round.taken >= self.settings.batch_size {
                        Duration::ZERO
                    } else {
                        self.settings.poll_interval
                    }
                }
                Err(error) => {
                    outage = next_outage_wait(outage, self.settings.max_outage_backoff);
                    tracing::warn!(event = "outbox.round_failed", error = %error, "could not read or mark the outbox; backing off");
                    outage
                }
            };
            if wait.is_zero() {
                if shutdown.as_mut().now_or_never().is_some() {
                    return;
                }
                continue;
            }
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One round: takes, publishes and marks up to a batch of messages, in one
    /// transaction. [`run`](Self::run) calls it in a loop; call it yourself to drive
    /// the relay from a loop of your own.
    pub async fn round(&self) -> Result<Round, OutboxError> {
        self.round_with_error().await.map(|(round, _)| round)
    }

    /// A round, and the first error of a broker that was unavailable.
    async fn round_with_error(&self) -> Result<(Round, Option<SinkError>), OutboxError> {
        let table = &self.outbox.shared.table;
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
        let taken = take(&mut transaction, table, batch).await?;
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

        // One chain per partition key (a message without one is a chain of its own),
        // in the order of its oldest message; a chain stops at its first failure.
        let mut chains: Vec<Vec<&Pending>> = Vec::new();
        let mut chain_of: HashMap<&str, usize> = HashMap::new();
        for message in &taken {
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
        let outcomes = futures_util::future::join_all(
            chains.into_iter().map(|chain| self.publish_chain(chain)),
        )
        .await;

        let mut published = Vec::new();
        let mut refused = Vec::new();
        let mut unavailable = None;
        for outcome in outcomes.into_iter().flatten() {
            match outcome {
                Published::Taken(id) => published.push(id),
                Published::Refused(message, error) => refused.push((message, error)),
                Published::Unavailable(error) => {
                    round.unavailable = true;
                    unavailable.get_or_insert(error);
                }
            }
        }
        round.published = published.len();
        round.rejected = refused.len();
        if !published.is_empty() {
            sqlx::query(&format!(
                "UPDATE {table} SET published_at = now(), attempts = attempts + 1, last_error = NULL \
                 WHERE id = ANY($1)"
            ))
            .bind(&published)
            .execute(&mut *transaction)
            .await
            .map_err(|e| OutboxError::database("could not mark messages published", e))?;
        }
        if !refused.is_empty() {
            round.dead_lettered = self.refused(&mut transaction, refused).await?;
        }
        transaction
            .commit()
            .await
            .map_err(|e| OutboxError::database("could not end a relay round", e))?;
        Ok((round, unavailable))
    }

    /// Publishes one partition key's messages in order, stopping at the first that
    /// fails.
    async fn publish_chain<'m>(&self, chain: Vec<&'m Pending>) -> Vec<Published<'m>> {
        let mut outcomes = Vec::with_capacity(chain.len());
        for message in chain {
            let outcome = self.publish(message).await;
            let stop = !matches!(outcome, Published::Taken(_));
            outcomes.push(outcome);
            if stop {
                break;
            }
        }
        outcomes
    }

    /// Publishes one message in a span that continues its request's trace, under a
    /// correlation ID extended from the request's for this publication.
    async fn publish<'m>(&self, message: &'m Pending) -> Published<'m> {
        let stored = message
            .correlation_id
            .as_deref()
            .and_then(|id| CorrelationId::parse(id).ok());
        let publication = match &stored {
            Some(id) => id.extend_redelivery(),
            None => CorrelationId::new(),
        };
        let span = tracing::info_span!(
            "outbox.publish",
            correlation_id = %publication,
            message_id = message.id,
            destination = message.destination.as_str(),
            trace_id = tracing::field::Empty,
            otel.kind = "producer",
        );
        #[cfg(feature = "opentelemetry")]
        if let Some(trace) = message.traceparent.as_deref().and_then(|traceparent| {
            crate::correlation::TraceContext::parse(traceparent, message.tracestate.as_deref())
        }) {
            trace.continue_in(&span);
        }
        #[cfg(not(feature = "opentelemetry"))]
        let _ = (&message.traceparent, &message.tracestate);
        let id = message.id;
        let destination = message.destination.as_str();
        // The sink finds the publication's ID as `CorrelationId::current()`.
        let current = publication.clone();
        let publishing = async move {
            let mut headers = HeaderList(
                serde_json::from_str::<std::collections::BTreeMap<String, String>>(
                    &message.headers,
                )
                .unwrap_or_default()
                .into_iter()
                .collect(),
            );
            if headers.get(IDEMPOTENCY_KEY.as_str()).is_none() {
                headers.set(IDEMPOTENCY_KEY.as_str(), &message.idempotency_key);
            }
            MessageCorrelation::new().inject(&mut headers, &publication);
            #[cfg(feature = "opentelemetry")]
            if let Some(trace) = crate::correlation::TraceContext::current() {
                trace.inject(&mut headers);
            }
            let outgoing = Outgoing {
                destination,
                partition_key: message.partition_key.as_deref(),
                headers: &headers.0,
                payload: &message.payload,
            };
            let result =
                tokio::time::timeout(self.settings.publish_timeout, self.sink.publish(&outgoing))
                    .await
                    .unwrap_or_else(|_| {
                        Err(SinkError::unavailable(format!(
                            "no acknowledgement within {:?}",
                            self.settings.publish_timeout
                        )))
                    });
            match result {
                Ok(()) => {
                    tracing::debug!(event = "outbox.published", "message published");
                    #[cfg(feature = "metrics")]
                    ::metrics::counter!(super::metrics::PUBLISHED, "destination" => destination.to_owned())
                        .increment(1);
                    Published::Taken(id)
                }
                Err(error) => {
                    #[cfg(feature = "metrics")]
                    ::metrics::counter!(
                        super::metrics::FAILURES,
                        "destination" => destination.to_owned(),
                        "reason" => if error.is_rejected() { "rejected" } else { "unavailable" },
                    )
                    .increment(1);
                    if error.is_rejected() {
                        tracing::warn!(
                            event = "outbox.rejected",
                            attempt = message.attempts + 1,
                            error = %error,
                            "the broker refused the message; it will be tried again"
                        );
                        Published::Refused(message, error)
                    } else {
                        tracing::debug!(event = "outbox.unavailable", error = %error, "the broker is unavailable");
                        Published::Unavailable(error)
                    }
                }
            }
        };
        current.task_local(publishing).instrument(span).await
    }

    /// Counts an attempt for each refused message, schedules its next one or
    /// dead-letters it; returns how many were dead-lettered.
    async fn refused(
        &self,
        connection: &mut PgConnection,
        refused: Vec<(&Pending, SinkError)>,
    ) -> Result<usize, OutboxError> {
        let table = &self.outbox.shared.table;
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
            errors.push(error.to_string());
            delays.push(delay.as_secs_f64());
        }
        let counted = sqlx::query(&format!(
            "UPDATE {table} AS t SET attempts = t.attempts + 1, last_error = r.error, \
               next_attempt_at = now() + make_interval(secs => r.delay), \
               dead_at = CASE WHEN t.attempts + 1 >= $4 THEN now() END \
             FROM unnest($1::int8[], $2::text[], $3::float8[]) AS r(id, error, delay) \
             WHERE t.id = r.id \
             RETURNING t.id, t.destination, t.attempts, t.dead_at IS NOT NULL AS dead"
        ))
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
        let table = &self.outbox.shared.table;
        let mut removed = 0;
        loop {
            let done = sqlx::query(&format!(
                "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} \
                   WHERE published_at < now() - make_interval(secs => $1) \
                   ORDER BY published_at LIMIT 1000 FOR UPDATE SKIP LOCKED)"
            ))
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
                tracing::debug!(event = "outbox.observe_failed", error = %error, "could not measure the backlog");
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

/// Headers as the relay builds them, in order.
struct HeaderList(Vec<(String, String)>);

impl Carrier for HeaderList {
    fn get(&self, name: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, value)| value.as_bytes())
    }

    fn set(&mut self, name: &str, value: &str) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some((_, old)) => *old = value.to_owned(),
            None => self.0.push((name.to_owned(), value.to_owned())),
        }
    }
}
