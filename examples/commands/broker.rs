//! `--amqp-url`: each published event also goes to a RabbitMQ topic exchange, with the
//! delivery's correlation ID and an idempotency key in its headers (in memory the
//! creating request's, [`Broker::publish`]; in DB mode the outbox message's own, with
//! the headers the library's relay adds, [`Broker::publish_body`]).
//!
//! Publishing is "if available": a broker that cannot be reached at start leaves the
//! service publishing by log only ([`Broker::connect`] answers `None`); a publish that
//! fails later is reported to the caller, which leaves the message pending (DB mode) or
//! logs it (in memory), and the next publish opens a new connection.
//!
//! Not `mandatory`: an event no queue is bound for is dropped by the exchange and counts
//! as published, so the demo with `--amqp-url` and no consumer still turns its commands
//! `sent`. (The library's `AmqpSink` publishes `mandatory`, and refuses such a message.)

use std::time::Duration;

use lapin::{
    options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions},
    types::FieldTable,
    BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind,
};
use serde::Serialize;
use serde_json::value::RawValue;
use tokio::sync::Mutex;
use tower_ids::{correlation::MessageCorrelation, idempotency::IdempotencyKey};

/// How long connecting (with declaring the exchange) or one publish with its confirm
/// may take: a broker that is stopped (not closed) would otherwise hold the publisher,
/// and in DB mode its batch's row locks, for as long as TCP keeps trying.
const AMQP_TIMEOUT: Duration = Duration::from_secs(5);

/// The event published for a command, as its JSON body.
#[derive(Debug, Serialize)]
pub(crate) struct Event<'a> {
    /// The routing key too: `command.created`.
    #[serde(rename = "type")]
    pub(crate) event: &'a str,
    pub(crate) command_id: &'a str,
    pub(crate) device_id: &'a str,
    pub(crate) name: &'a str,
    pub(crate) payload: &'a RawValue,
}

/// The exchange the events go to, and the channel to it, opened again after a failure.
pub(crate) struct Broker {
    url: String,
    exchange: String,
    /// `None` after a failed publish: the next one connects again.
    open: Mutex<Option<Open>>,
}

/// A connection and its channel, in confirm mode. The connection is kept so it stays
/// open as long as the channel is used.
struct Open {
    _connection: Connection,
    channel: Channel,
}

type AmqpError = Box<dyn std::error::Error + Send + Sync>;

impl Broker {
    /// Connects to `url` and declares `exchange` (topic, durable); `None`, with a WARN,
    /// when that fails: the service then publishes by log only.
    pub(crate) async fn connect(url: &str, exchange: &str) -> Option<Self> {
        match open(url, exchange).await {
            Ok(open) => {
                tracing::info!(
                    event = "commands.amqp_connected",
                    exchange,
                    "publishing events to the AMQP exchange"
                );
                Some(Self {
                    url: url.to_owned(),
                    exchange: exchange.to_owned(),
                    open: Mutex::new(Some(open)),
                })
            }
            Err(error) => {
                tracing::warn!(
                    event = "commands.amqp_unavailable",
                    exchange,
                    error = %error,
                    "AMQP broker unreachable at start: publishing by log only"
                );
                None
            }
        }
    }

    /// Publishes `event` (routed by its type), as [`publish_body`](Self::publish_body).
    /// The headers carry the current correlation ID (this delivery's) and
    /// `idempotency_key` when there is one.
    pub(crate) async fn publish(
        &self,
        event: &Event<'_>,
        idempotency_key: Option<&IdempotencyKey>,
    ) -> Result<(), AmqpError> {
        let body = serde_json::to_vec(event)?;
        let mut headers = FieldTable::default();
        MessageCorrelation::new().inject_current(&mut headers);
        if let Some(key) = idempotency_key {
            key.inject(&mut headers);
        }
        self.publish_body(event.event, &body, headers).await
    }

    /// Publishes the JSON `body` under `routing_key` with `headers`, persistent, and
    /// waits for the broker's confirm.
    pub(crate) async fn publish_body(
        &self,
        routing_key: &str,
        body: &[u8],
        headers: FieldTable,
    ) -> Result<(), AmqpError> {
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_headers(headers);

        let mut open = self.open.lock().await;
        let published = tokio::time::timeout(AMQP_TIMEOUT, async {
            if open.is_none() {
                *open = Some(self::open(&self.url, &self.exchange).await?);
            }
            let Some(Open { channel, .. }) = open.as_ref() else {
                unreachable!("opened just above");
            };
            let confirmation = channel
                .basic_publish(
                    self.exchange.as_str().into(),
                    routing_key.into(),
                    BasicPublishOptions::default(),
                    body,
                    properties,
                )
                .await?
                .await?;
            if confirmation.is_nack() {
                return Err::<(), AmqpError>("the broker refused the message (nack)".into());
            }
            Ok(())
        })
        .await
        .unwrap_or_else(|_| Err(format!("no confirm within {AMQP_TIMEOUT:?}").into()));
        if published.is_err() {
            // The channel may be closed or stuck: the next publish opens another.
            *open = None;
        }
        published
    }
}

/// A connection to `url` with a channel in confirm mode, `exchange` declared on it.
async fn open(url: &str, exchange: &str) -> Result<Open, AmqpError> {
    tokio::time::timeout(AMQP_TIMEOUT, async {
        let connection = Connection::connect(url, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel
            .exchange_declare(
                exchange.into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Open {
            _connection: connection,
            channel,
        })
    })
    .await
    .unwrap_or_else(|_| Err(format!("no connection within {AMQP_TIMEOUT:?}").into()))
}
