//! Where a relay publishes: the [`Sink`] trait, a message as a sink sees it, and how a
//! sink says it failed.

use std::{error::Error, fmt, future::Future};

/// A broker a [`Relay`](super::Relay) publishes to. Implement it for a broker the crate
/// has no sink for.
///
/// `publish` returns once the broker has taken the message for good (a publisher
/// confirm, an acknowledged produce): the relay then marks it published. The relay
/// calls it concurrently for messages of different partition keys, and one at a time,
/// in order, for the messages of one key.
pub trait Sink: Send + Sync + 'static {
    /// Publishes `message`, waiting for the broker's acknowledgement.
    fn publish(&self, message: &Outgoing<'_>)
        -> impl Future<Output = Result<(), SinkError>> + Send;
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
    rejected: bool,
    source: Box<dyn Error + Send + Sync>,
}

impl SinkError {
    /// The broker could not be reached, or did not answer in time: nothing is wrong
    /// with the message. The relay backs off and tries again, without counting an
    /// attempt against the message.
    pub fn unavailable(source: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self {
            rejected: false,
            source: source.into(),
        }
    }

    /// The broker refused this message (no route, too large, a missing topic): the
    /// relay counts an attempt, tries it again later, and dead-letters it after its
    /// last attempt.
    pub fn rejected(source: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self {
            rejected: true,
            source: source.into(),
        }
    }

    /// Whether the broker refused the message itself.
    pub fn is_rejected(&self) -> bool {
        self.rejected
    }
}

impl fmt::Display for SinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rejected {
            write!(f, "the broker refused the message: {}", self.source)
        } else {
            write!(f, "the broker is unavailable: {}", self.source)
        }
    }
}

impl Error for SinkError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.source)
    }
}
