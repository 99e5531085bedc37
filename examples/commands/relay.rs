//! DB mode's publisher: the library's outbox relay ([`Relay`]), one per replica, and
//! the demo's [`Sink`] behind it, [`CommandSink`].
//!
//! The relay takes the committed messages of `tower_ids_outbox` (replicas share them:
//! each device's messages are taken by one relay at a time, in commit order), publishes
//! each under its own extension of the request's correlation ID in a span
//! (`outbox.publish`) that continues the request's trace, and marks it published once
//! the sink returns. It adds the headers the AMQP event carries: `x-correlation-id`,
//! `idempotency-key` (the message's own, stored with it, the same on every
//! publication) and, with `--features opentelemetry`, `traceparent`/`tracestate`. A
//! relay that dies before marking leaves its messages pending, and they are published
//! again: at least once, as from any outbox.
//!
//! [`CommandSink`] is what makes a message a sent command: it waits until
//! `--publish-delay-ms` after the command was created, then, in a transaction of its
//! own with the command's row locked, publishes a `queued` command (by log and, with
//! `--amqp-url`, to the broker), turns it `sent` and commits; a command cancelled (or
//! already sent) meanwhile is skipped, and the message counts as done.

use std::{sync::Arc, time::Duration};

use lapin::types::FieldTable;
use serde::Deserialize;
use sqlx::PgPool;
use tokio::{
    sync::{watch, Semaphore},
    task::JoinHandle,
};
use tower_ids::{
    correlation::Carrier as _,
    outbox::{Confirm, Outgoing, Relay, Sink, SinkError},
};

use crate::{broker::Broker, postgres::Database};

/// How long an idle relay waits before looking at the outbox again (the library's
/// default): a command is published within `--publish-delay-ms` plus this, and an idle
/// replica asks the database ten times a second (an index scan of the pending rows,
/// none).
const OUTBOX_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Messages one round takes, publishes and marks: enough to drain a burst quickly, few
/// enough that a round holds its rows and devices for milliseconds (plus what is left
/// of their `--publish-delay-ms`).
const OUTBOX_BATCH: usize = 100;

/// Commands the sink publishes at once, each in a transaction of its own on a pool
/// connection: the relay publishes the devices of a round concurrently, and without a
/// bound a round of 100 would take every connection the requests need. (The broker
/// confirms one event at a time anyway: [`Broker`] has one channel.)
pub(crate) const PUBLISH_CONNECTIONS: usize = 4;

/// How long one publication may take beyond its `--publish-delay-ms` before the relay
/// gives up on it and tries again later: a pool connection (1 s at most), a turn
/// behind the other publications at the broker, and the broker's confirm (5 s at most
/// each).
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(15);

/// The longest wait between tries while the broker or the database fails: a broker
/// back is used again within 5 s, and a broker that stays down is asked every 5 s.
const MAX_OUTAGE_BACKOFF: Duration = Duration::from_secs(5);

/// Starts this replica's relay over `database`'s outbox, publishing through a
/// [`CommandSink`]; `true` sent on the returned sender stops it once its round is done
/// (a command still in its `--publish-delay-ms` stays pending for the next start, or
/// another replica).
pub(crate) fn spawn(
    database: &Database,
    broker: Option<Arc<Broker>>,
    delay: Duration,
) -> (watch::Sender<bool>, JoinHandle<()>) {
    let (stop, stopping) = watch::channel(false);
    let sink = CommandSink {
        pool: database.pool().clone(),
        broker,
        delay,
        stopping: stopping.clone(),
        connections: Semaphore::new(PUBLISH_CONNECTIONS),
    };
    let relay: Relay<CommandSink> = database
        .outbox()
        .relay(sink)
        .poll_interval(OUTBOX_POLL_INTERVAL)
        .batch_size(OUTBOX_BATCH)
        .publish_timeout(delay + PUBLISH_TIMEOUT)
        .max_outage_backoff(MAX_OUTAGE_BACKOFF)
        .build();
    let task = tokio::spawn(async move {
        relay.run(stopped(stopping)).await;
    });
    (stop, task)
}

/// Resolves once `true` is sent, or the sender is gone.
async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// The demo's [`Sink`]: a message is a command to send. See the [module](self).
pub(crate) struct CommandSink {
    pool: PgPool,
    /// `None`: publish by log only (no `--amqp-url`, or the broker was unreachable at
    /// start).
    broker: Option<Arc<Broker>>,
    /// `--publish-delay-ms`.
    delay: Duration,
    stopping: watch::Receiver<bool>,
    /// [`PUBLISH_CONNECTIONS`] permits.
    connections: Semaphore,
}

/// What the sink reads of a message's payload (the event the broker gets).
#[derive(Deserialize)]
struct Created {
    command_id: String,
    device_id: String,
}

impl Sink for CommandSink {
    // Waits for the broker in `publish`: a command's event is published one at a time.
    async fn publish(&self, message: &Outgoing<'_>) -> Result<Confirm, SinkError> {
        self.deliver(message).await.map(|()| Confirm::taken())
    }
}

impl CommandSink {
    async fn deliver(&self, message: &Outgoing<'_>) -> Result<(), SinkError> {
        // Enqueued by `Database::create`: not expected to fail.
        let event: Created = serde_json::from_slice(message.payload())
            .map_err(|error| SinkError::rejected(format!("not a command event: {error}")))?;
        let command_id = event.command_id.as_str();
        loop {
            let turn = self
                .connections
                .acquire()
                .await
                .expect("the semaphore is never closed");
            let mut transaction = self.pool.begin().await.map_err(failed)?;
            // Locked until the commit: a cancel arriving now waits, then is refused
            // (409); one that locked it first makes this wait, then see it cancelled.
            let row: Option<(String, f64)> = sqlx::query_as(
                "SELECT status, \
                        extract(epoch FROM created_at + make_interval(secs => $2) - now())::float8 \
                 FROM commands WHERE id = $1::uuid FOR UPDATE",
            )
            .bind(command_id)
            .bind(self.delay.as_secs_f64())
            .fetch_optional(&mut *transaction)
            .await
            .map_err(failed)?;
            let Some((status, wait)) = row else {
                skipped(command_id, "missing");
                return Ok(());
            };
            match status.as_str() {
                "queued" if wait > 0.0 => {
                    // Not due yet: wait out `--publish-delay-ms` with nothing locked.
                    drop(transaction);
                    drop(turn);
                    self.wait(Duration::from_secs_f64(wait)).await?;
                    continue;
                }
                "queued" => {}
                "cancelled" => {
                    skipped(command_id, "cancelled");
                    return Ok(());
                }
                _ => {
                    skipped(command_id, "already_sent");
                    return Ok(());
                }
            }
            // To the broker before the command turns `sent`: a crash in between
            // publishes it again (at least once).
            if let Some(broker) = &self.broker {
                let mut headers = FieldTable::default();
                for (name, value) in message.headers() {
                    headers.set(name, value);
                }
                if let Err(error) = broker
                    .publish_body(message.destination(), message.payload(), headers)
                    .await
                {
                    tracing::warn!(
                        event = "commands.amqp_publish_failed",
                        command_id,
                        error = %error,
                        "could not publish the event to the AMQP broker; the message stays pending"
                    );
                    return Err(SinkError::unavailable(error));
                }
            }
            sqlx::query("UPDATE commands SET status = 'sent' WHERE id = $1::uuid")
                .bind(command_id)
                .execute(&mut *transaction)
                .await
                .map_err(failed)?;
            transaction.commit().await.map_err(failed)?;
            tracing::info!(
                event = "commands.published",
                command_id,
                device_id = event.device_id.as_str(),
                amqp = self.broker.is_some(),
                "command published"
            );
            return Ok(());
        }
    }
}

impl CommandSink {
    /// Waits `wait`, unless the service stops first: then the message stays pending
    /// (the relay's round ends, and the relay with it).
    async fn wait(&self, wait: Duration) -> Result<(), SinkError> {
        tokio::select! {
            () = tokio::time::sleep(wait) => Ok(()),
            () = stopped(self.stopping.clone()) => Err(SinkError::unavailable(
                "stopping before the command's --publish-delay-ms passed; it stays pending",
            )),
        }
    }
}

/// A database call of the sink failed: the message stays pending and is tried again.
fn failed(error: sqlx::Error) -> SinkError {
    tracing::warn!(
        event = "commands.publish_failed",
        error = %error,
        "could not read or mark the command; its message stays pending, trying again"
    );
    SinkError::unavailable(error)
}

fn skipped(command_id: &str, reason: &'static str) {
    tracing::info!(
        event = "commands.publish_skipped",
        command_id,
        reason,
        "command not queued any more: not publishing"
    );
}
