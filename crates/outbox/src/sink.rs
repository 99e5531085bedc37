//! Where a relay publishes: the [`Sink`] trait, a message as a sink sees it, the
//! broker's acknowledgement to come, and how a sink says it failed.

use std::{
    error::Error,
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

/// A broker a [`Relay`](super::Relay) publishes to. Implement it for a broker the crate
/// has no sink for.
///
/// `publish` sends a message and returns its [`Confirm`], which resolves once the broker
/// has taken the message for good (a publisher confirm, an acknowledged produce): the
/// relay then marks it published. The relay calls `publish` concurrently for messages
/// of different partition keys; for the messages of one key, one after the other in
/// commit order, each once the previous call has returned, and awaits their confirms
/// in that order. When one fails, the key stops there: that message and the key's
/// later ones are published again in a later round.
///
/// So a sink whose broker keeps the order of what it is sent (one AMQP channel, one
/// Kafka producer's partition) returns [`Confirm::later`] as soon as the message is on
/// its way, and a key's messages are in flight together. A sink that cannot promise
/// that order waits for the acknowledgement in `publish` and returns
/// [`Confirm::taken`]: the key's messages then go one at a time.
pub trait Sink: Send + Sync + 'static {
    /// Sends `message`; its [`Confirm`] tells when the broker has taken it.
    fn publish(
        &self,
        message: &Outgoing<'_>,
    ) -> impl Future<Output = Result<Confirm, SinkError>> + Send;
}

/// The broker's acknowledgement of a message a [`Sink`] sent: awaited by the relay
/// before it marks the message published.
#[must_use = "the message is published only once its Confirm has resolved"]
pub struct Confirm(Option<Acknowledgement>);

type Acknowledgement = Pin<Box<dyn Future<Output = Result<(), SinkError>> + Send>>;

impl Confirm {
    /// The broker has taken the message already: the sink waited for it.
    pub fn taken() -> Self {
        Self(None)
    }

    /// The broker's acknowledgement, still to come: the relay may send the key's next
    /// message before it awaits this one.
    pub fn later(
        acknowledgement: impl Future<Output = Result<(), SinkError>> + Send + 'static,
    ) -> Self {
        Self(Some(Box::pin(acknowledgement)))
    }
}

impl Future for Confirm {
    type Output = Result<(), SinkError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.0.as_mut() {
            None => Poll::Ready(Ok(())),
            Some(acknowledgement) => acknowledgement.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for Confirm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Confirm")
            .field("pending", &self.0.is_some())
            .finish()
    }
}

/// A message as the relay hands it to a [`Sink`]: the enqueued message with the
/// headers the relay adds.
#[derive(Debug)]
pub struct Outgoing<'a> {
    pub(super) destination: &'a str,
    pub(super) partition_key: Option<&'a str>,
    pub(super) headers: &'a [(String, String)],
    pub(super) payload: &'a [u8],
}

impl<'a> Outgoing<'a> {
    /// Where it goes (see [`Message::new`](super::Message::new)).
    pub fn destination(&self) -> &'a str {
        self.destination
    }

    /// Its partition key, if it has one (a Kafka record's key).
    pub fn partition_key(&self) -> Option<&'a str> {
        self.partition_key
    }

    /// Every header: the message's own in name order, then `idempotency-key`,
    /// `x-correlation-id` and the trace context, unless the message set them.
    pub fn headers(&self) -> impl Iterator<Item = (&'a str, &'a str)> {
        self.headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
    }

    /// The body.
    pub fn payload(&self) -> &'a [u8] {
        self.payload
    }
}

/// Why a [`Sink`] did not publish a message.
#[derive(Debug)]
pub struct SinkError {
    kind: Kind,
    source: Box<dyn Error + Send + Sync>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Unavailable,
    Full,
    Rejected,
}

impl SinkError {
    /// The broker could not take the message now: it could not be reached, did not
    /// answer in time, or its client's own queue is full. Nothing is wrong with the
    /// message: the relay backs off and tries again, without counting an attempt
    /// against it.
    pub fn unavailable(source: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self {
            kind: Kind::Unavailable,
            source: source.into(),
        }
    }

    /// The destination has no room for the message now, and may take the key's next
    /// one a moment later (a RabbitMQ queue at its `x-max-length` with `x-overflow:
    /// reject-publish` nacks so). Unavailable, as above; and since a message the
    /// broker took after this one would overtake it, the relay sends the
    /// destination's keys one message at a time for a while (see
    /// [`Relay`](super::Relay)).
    pub fn full(source: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self {
            kind: Kind::Full,
            source: source.into(),
        }
    }

    /// The broker refused this message (no route, too large, a missing topic): the
    /// relay counts an attempt, tries it again later, and dead-letters it after its
    /// last attempt.
    pub fn rejected(source: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self {
            kind: Kind::Rejected,
            source: source.into(),
        }
    }

    /// Whether the broker refused the message itself.
    pub fn is_rejected(&self) -> bool {
        self.kind == Kind::Rejected
    }

    /// Whether the destination had no room for it ([`full`](Self::full)).
    pub fn is_full(&self) -> bool {
        self.kind == Kind::Full
    }
}

// Its cause is its `source()`, not part of its text, so that an error reporter that
// walks the chain prints it once.
impl fmt::Display for SinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.kind {
            Kind::Rejected => "the broker refused the message",
            Kind::Full => "the destination has no room for the message",
            Kind::Unavailable => "the broker is unavailable",
        })
    }
}

impl Error for SinkError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.source)
    }
}
