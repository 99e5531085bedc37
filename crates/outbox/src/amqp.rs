//! [`AmqpSink`]: the outbox's messages to a RabbitMQ exchange (lapin), with publisher
//! confirms.

use std::{sync::Arc, time::Duration};

use lapin::{
    options::{BasicPublishOptions, ConfirmSelectOptions},
    types::{AMQPValue, FieldTable, LongString, ShortString},
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind,
    PublisherConfirm,
};
use tokio::sync::Mutex;

use super::{Confirm, Outgoing, Sink, SinkError};

/// Publishes each message to one exchange with its destination as the routing key,
/// persistent, `mandatory`, on one channel in confirm mode.
///
/// - Its headers go into the message's header table, its partition key into the
///   `x-partition-key` header.
/// - A key's messages are in flight together: RabbitMQ handles a channel's publications
///   in the order sent, and the relay awaits their confirms in that order.
/// - A key's messages never cross from one channel to the next out of order: once a
///   channel closes (the broker closed the connection, or the channel for one
///   message), the broker may have dropped what was sent on it last, so the sink opens
///   no new channel until every publication of the closed one has settled. A message
///   the relay sends before that is [unavailable](SinkError::unavailable), and it and
///   its key's later messages go again in the next round, after those the closed
///   channel lost.
/// - A message no queue takes (returned as unroutable), or a channel error about the
///   message (a missing exchange, a refused access, too large) is
///   [rejected](SinkError::rejected): the relay tries it again later and dead-letters
///   it after its attempts. A channel the broker closes fails every confirm pending on
///   it, so a message caught by another's channel error is first sent again alone on a
///   new channel, in the order the relay awaits the confirms, and refused only if it
///   fails there too.
/// - A connection or channel that fails otherwise is
///   [unavailable](SinkError::unavailable): the relay backs off without counting an
///   attempt, and the next publication connects again if it must.
/// - A nack (a queue at its `x-max-length` with `x-overflow: reject-publish` refuses
///   so) is [full](SinkError::full): backed off from the same way, and the relay then
///   sends the destination's keys one message at a time, each once the previous is
///   confirmed, so that none is taken before a nacked one of its key. A key's messages
///   already in flight behind the first nack of a full spell may still be taken before
///   it (the [`Relay`](super::Relay) says how often).
///
/// The exchange must exist (declare it, and bind the consumers' queues, at the
/// application's start).
#[derive(Debug)]
pub struct AmqpSink {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    uri: String,
    exchange: String,
    connect_timeout: Duration,
    link: Mutex<Link>,
}

/// The channel publications go on, and the closed ones whose publications have not all
/// settled.
#[derive(Debug, Default)]
struct Link {
    open: Option<Open>,
    retired: Vec<Arc<()>>,
}

#[derive(Debug)]
struct Open {
    connection: Connection,
    channel: Channel,
    /// Held by each publication on `channel` until its confirm settles.
    unsettled: Arc<()>,
}

/// Whether publications still hold `unsettled` (the sink keeps one clone of its own).
fn has_unsettled(unsettled: &Arc<()>) -> bool {
    Arc::strong_count(unsettled) > 1
}

/// One message as it goes on the wire, kept to send it again alone.
struct Publication {
    routing_key: ShortString,
    payload: Vec<u8>,
    properties: BasicProperties,
}

impl AmqpSink {
    /// A sink to `exchange` on the broker at `uri` (`amqp://user:pass@host:port/vhost`);
    /// `""` is the default exchange, where the destination is a queue's name. It
    /// connects at its first publication.
    pub fn new(uri: impl Into<String>, exchange: impl Into<String>) -> Self {
        Self {
            inner: Arc::new(Inner {
                uri: uri.into(),
                exchange: exchange.into(),
                connect_timeout: Duration::from_secs(5),
                link: Mutex::new(Link::default()),
            }),
        }
    }

    /// How long connecting may take before the broker counts as unavailable (5 s).
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        // Only a publication under way shares `inner`, and it borrows the sink.
        Arc::get_mut(&mut self.inner)
            .expect("no publication is under way")
            .connect_timeout = timeout;
        self
    }
}

impl Inner {
    /// The channel for a new publication, and the publication's hold on it; opening one
    /// first if there is none (on the connection, when it is still open: a channel the
    /// broker closed for one message leaves it open), but not while a closed channel
    /// has publications unsettled: the broker may have dropped them, and a key's later
    /// message must not be taken before they are sent again.
    async fn channel(&self) -> Result<(Channel, Arc<()>), SinkError> {
        let mut link = self.link.lock().await;
        link.retired.retain(has_unsettled);
        let closed_unsettled = link.open.as_ref().is_some_and(|open| {
            !open.channel.status().connected() && has_unsettled(&open.unsettled)
        });
        if closed_unsettled || !link.retired.is_empty() {
            return Err(SinkError::unavailable(
                "the channel closed with publications unconfirmed: a new one opens once they \
                 have settled, so that no later message of their keys overtakes them",
            ));
        }
        self.ensure(&mut link).await
    }

    /// The open channel, or a new one, with the lock held; and a hold on it.
    async fn ensure(&self, link: &mut Link) -> Result<(Channel, Arc<()>), SinkError> {
        if let Some(current) = link.open.as_ref() {
            if current.channel.status().connected() {
                return Ok((current.channel.clone(), current.unsettled.clone()));
            }
        }
        let previous = link.open.take();
        let reusable = match previous {
            Some(Open {
                connection,
                unsettled,
                ..
            }) => {
                if has_unsettled(&unsettled) {
                    link.retired.push(unsettled);
                }
                Some(connection).filter(|connection| connection.status().connected())
            }
            None => None,
        };
        let opened = tokio::time::timeout(self.connect_timeout, async {
            let connection = match reusable {
                Some(connection) => connection,
                None => Connection::connect(&self.uri, ConnectionProperties::default()).await?,
            };
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(Open {
                connection,
                channel,
                unsettled: Arc::new(()),
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
        let held = (opened.channel.clone(), opened.unsettled.clone());
        link.open = Some(opened);
        Ok(held)
    }

    /// Sends `publication` on `channel`: what to await for its confirm.
    async fn send(
        &self,
        channel: &Channel,
        publication: &Publication,
    ) -> Result<PublisherConfirm, lapin::Error> {
        channel
            .basic_publish(
                ShortString::from(self.exchange.as_str()),
                publication.routing_key.clone(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &publication.payload,
                publication.properties.clone(),
            )
            .await
    }

    /// Sends `publication` again alone on a new channel (the lock keeps other
    /// publications off it) and waits for its confirm: after the broker closed a channel
    /// for one of the messages on it, not necessarily this one. Refused only if it is
    /// the cause. The relay calls it in the order it awaits a key's confirms, so a
    /// key's messages go again in order.
    async fn alone(&self, publication: &Publication) -> Result<(), SinkError> {
        let mut link = self.link.lock().await;
        let (channel, _held) = self.ensure(&mut link).await?;
        let confirmed = match self.send(&channel, publication).await {
            Ok(confirm) => confirm.await,
            Err(error) => Err(error),
        };
        match confirmed {
            Ok(confirmation) => self.taken(confirmation, publication),
            Err(error) if is_soft(&error) => Err(SinkError::rejected(error)),
            Err(error) => Err(SinkError::unavailable(error)),
        }
    }

    /// What the broker's confirmation says of `publication`.
    fn taken(
        &self,
        confirmation: Confirmation,
        publication: &Publication,
    ) -> Result<(), SinkError> {
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(SinkError::rejected(format!(
                "no queue is bound to routing key {:?} on exchange {:?} (returned unroutable)",
                publication.routing_key.as_str(),
                self.exchange
            ))),
            Confirmation::Nack(_) => Err(SinkError::full(
                "the broker nacked the message (a full queue with reject-publish refuses so)",
            )),
            Confirmation::NotRequested => {
                Err(SinkError::unavailable("the channel is not in confirm mode"))
            }
        }
    }
}

impl Sink for AmqpSink {
    async fn publish(&self, message: &Outgoing<'_>) -> Result<Confirm, SinkError> {
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
        let publication = Publication {
            routing_key: ShortString::from(message.destination()),
            payload: message.payload().to_vec(),
            properties: BasicProperties::default()
                .with_delivery_mode(2)
                .with_headers(headers),
        };
        let inner = self.inner.clone();
        let (channel, unsettled) = inner.channel().await?;
        // Failing here, the channel closed since `channel` looked: its publications
        // unsettled go again first.
        let confirm = inner
            .send(&channel, &publication)
            .await
            .map_err(SinkError::unavailable)?;
        Ok(Confirm::later(async move {
            let _unsettled = unsettled;
            match confirm.await {
                Ok(confirmation) => inner.taken(confirmation, &publication),
                Err(error) if is_soft(&error) => inner.alone(&publication).await,
                Err(error) => Err(SinkError::unavailable(error)),
            }
        }))
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
