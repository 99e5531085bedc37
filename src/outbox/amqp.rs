//! [`AmqpSink`]: the outbox's messages to a RabbitMQ exchange (lapin), with publisher
//! confirms.

use std::time::Duration;

use lapin::{
    options::{BasicPublishOptions, ConfirmSelectOptions},
    types::{AMQPValue, FieldTable, LongString, ShortString},
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind,
};
use tokio::sync::Mutex;

use super::{Outgoing, Sink, SinkError};

/// Publishes each message to one exchange with its destination as the routing key,
/// persistent, `mandatory`, and waits for the broker's confirm.
///
/// - Its headers go into the message's header table, its partition key into the
///   `x-partition-key` header.
/// - A message no queue takes (returned as unroutable), a nack, or a channel error
///   about the message (a missing exchange, a refused access) is
///   [rejected](SinkError::rejected): the relay tries it again later and dead-letters
///   it after its attempts. A channel the broker closes fails every confirm pending on
///   it, so a message caught by another's channel error is first sent again alone on a
///   new channel, and refused only if it fails there too.
/// - A connection or channel that fails otherwise is
///   [unavailable](SinkError::unavailable): the next publication connects again.
///
/// The exchange must exist (declare it, and bind the consumers' queues, at the
/// application's start).
#[derive(Debug)]
pub struct AmqpSink {
    uri: String,
    exchange: String,
    connect_timeout: Duration,
    open: Mutex<Option<Open>>,
}

#[derive(Debug)]
struct Open {
    connection: Connection,
    channel: Channel,
}

impl AmqpSink {
    /// A sink to `exchange` on the broker at `uri` (`amqp://user:pass@host:port/vhost`);
    /// `""` is the default exchange, where the destination is a queue's name. It
    /// connects at its first publication.
    pub fn new(uri: impl Into<String>, exchange: impl Into<String>) -> Self {
        Self {
            uri: uri.into(),
            exchange: exchange.into(),
            connect_timeout: Duration::from_secs(5),
            open: Mutex::new(None),
        }
    }

    /// How long connecting may take before the broker counts as unavailable (5 s).
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The channel, opening one first if there is none (on the connection, when it is
    /// still open: a channel the broker closed for one message leaves it open).
    async fn channel(&self) -> Result<Channel, SinkError> {
        let mut open = self.open.lock().await;
        self.ensure(&mut open).await
    }

    /// [`channel`](Self::channel) with the lock held.
    async fn ensure(&self, open: &mut Option<Open>) -> Result<Channel, SinkError> {
        if let Some(current) = open.as_ref() {
            if current.channel.status().connected() {
                return Ok(current.channel.clone());
            }
        }
        let opened = tokio::time::timeout(self.connect_timeout, async {
            let connection = match open.take() {
                Some(Open { connection, .. }) if connection.status().connected() => connection,
                _ => Connection::connect(&self.uri, ConnectionProperties::default()).await?,
            };
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(Open {
                connection,
                channel,
            })
        })
        .await
        .map_err(|_| {
            SinkError::unavailable(format!(
                "no AMQP connection within {:?}",
                self.connect_timeout
            ))
        })?
        .map_err(SinkError::unavailable)?;
        let channel = opened.channel.clone();
        *open = Some(opened);
        Ok(channel)
    }
}

impl AmqpSink {
    /// Publishes `message` on `channel` and waits for its confirm.
    async fn send(
        &self,
        channel: &Channel,
        message: &Outgoing<'_>,
    ) -> Result<Confirmation, lapin::Error> {
        let mut headers = FieldTable::default();
        for (name, value) in message.headers() {
            headers.insert(
                ShortString::from(name),
                AMQPValue::LongString(LongString::from(value)),
            );
        }
        if let Some(key) = message.partition_key() {
            headers.insert(
                ShortString::from("x-partition-key"),
                AMQPValue::LongString(LongString::from(key)),
            );
        }
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        channel
            .basic_publish(
                ShortString::from(self.exchange.as_str()),
                ShortString::from(message.destination()),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                message.payload(),
                properties,
            )
            .await?
            .await
    }
}

impl Sink for AmqpSink {
    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), SinkError> {
        let channel = self.channel().await?;
        let confirmation = match self.send(&channel, message).await {
            Ok(confirmation) => confirmation,
            Err(error) if is_soft(&error) => {
                // The broker closed the channel for one of the messages on it, not
                // necessarily this one: every confirm pending on a closed channel fails
                // with the same error. This one again, alone on a new channel (the lock
                // keeps other publications off it), is refused only if it is the cause.
                let mut open = self.open.lock().await;
                let channel = self.ensure(&mut open).await?;
                self.send(&channel, message).await.map_err(|error| {
                    if is_soft(&error) {
                        SinkError::rejected(error)
                    } else {
                        SinkError::unavailable(error)
                    }
                })?
            }
            Err(error) => return Err(SinkError::unavailable(error)),
        };
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(SinkError::rejected(format!(
                "no queue is bound to routing key {:?} on exchange {:?} (returned unroutable)",
                message.destination(),
                self.exchange
            ))),
            Confirmation::Nack(_) => Err(SinkError::rejected("the broker nacked the message")),
            Confirmation::NotRequested => {
                Err(SinkError::unavailable("the channel is not in confirm mode"))
            }
        }
    }
}

/// Whether the broker closed the channel for a message (a soft error: no such
/// exchange, access refused, a message too large), not the connection.
fn is_soft(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        ErrorKind::ProtocolError(amqp) if matches!(amqp.kind(), lapin::protocol::AMQPErrorKind::Soft(_))
    )
}
