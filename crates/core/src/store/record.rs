//! What a store keeps for a request that ran: its [`Record`] and the transport's
//! answer in it, a [`Payload`].

use std::{
    any::Any,
    sync::{Arc, OnceLock},
    time::SystemTime,
};

use bytes::Bytes;

use super::{AttemptId, Fingerprint};

/// The outcome of an executed request, as stored.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Record {
    /// The fingerprint of the request that ran.
    pub fingerprint: Fingerprint,
    /// When it arrived.
    pub first_seen: SystemTime,
    /// Its attempt ID, if it sent one.
    pub original_attempt: Option<AttemptId>,
    /// The control epoch it ran in, when the layer binds keys to one.
    pub epoch: Option<u64>,
    /// What duplicates get back; `None` when it was too large to keep (the request ran,
    /// and duplicates are told so rather than run it again).
    pub payload: Option<Payload>,
    /// When the store lets it go: set by the layer as it completes the request (then
    /// plus the TTL, the expiry it gives the store), and kept with the record. `None`
    /// for a record built without it.
    pub expires_at: Option<SystemTime>,
}

impl Record {
    /// A record, as a store that keeps records its own way reads one back.
    pub fn new(
        fingerprint: Fingerprint,
        first_seen: SystemTime,
        original_attempt: Option<AttemptId>,
        epoch: Option<u64>,
        payload: Option<Payload>,
    ) -> Self {
        Self {
            fingerprint,
            first_seen,
            original_attempt,
            epoch,
            payload,
            expires_at: None,
        }
    }

    /// Bytes the record holds for its outcome ([`Payload::weight`]).
    pub fn weight(&self) -> usize {
        self.payload.as_ref().map_or(0, Payload::weight)
    }
}

/// What a record hands back to duplicates: the transport's answer as its layer
/// encoded it, opaque to the store. The store keeps its [`format`](Self::format) tag,
/// its [`status`](Self::status), its head and its body, and gives them back as they
/// were.
#[derive(Clone)]
pub struct Payload {
    format: PayloadFormat,
    status: u16,
    /// Encoded when a store first asks for it, if the payload was made from its decoded
    /// form: a store in this process never asks.
    head: OnceLock<Bytes>,
    body: Bytes,
    decoded: Option<Decoded>,
}

/// What the layer that made a payload reads it as, kept beside it (and weighed with it)
/// so that a replay from a store in this process decodes nothing.
#[derive(Clone)]
struct Decoded {
    value: Arc<dyn Any + Send + Sync>,
    bytes: usize,
    encode_head: fn(&(dyn Any + Send + Sync)) -> Bytes,
}

/// Which layer encoded a [`Payload`]: a layer replays only its own format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadFormat(u8);

impl PayloadFormat {
    /// An HTTP response: the head holds its status and headers, the body its body.
    pub const HTTP: Self = Self(1);
    /// A gRPC call's response: its metadata, messages and trailers, in the body.
    pub const GRPC: Self = Self(2);
    /// A message handler's outcome: its JSON, in the body.
    pub const MESSAGE: Self = Self(3);

    /// The format tagged `tag`, as a store reads it back.
    pub const fn from_tag(tag: u8) -> Self {
        Self(tag)
    }

    /// The tag a store keeps.
    pub const fn tag(self) -> u8 {
        self.0
    }
}

impl Payload {
    /// A payload of `format`: its `status` as the transport numbers it (the HTTP
    /// status, the gRPC code, `0` for a message outcome), for operators and logs; its
    /// `head` and `body`, opaque.
    pub fn new(format: PayloadFormat, status: u16, head: Bytes, body: Bytes) -> Self {
        Self {
            format,
            status,
            head: OnceLock::from(head),
            body,
            decoded: None,
        }
    }

    /// A payload of `format` made from `value`, what its layer reads it as, which
    /// weighs `bytes` beside `body`; its head is `encode_head(value)`, encoded only when
    /// a store asks for it.
    #[doc(hidden)]
    pub fn from_decoded<T: Any + Send + Sync>(
        format: PayloadFormat,
        status: u16,
        body: Bytes,
        value: T,
        bytes: usize,
        encode_head: fn(&(dyn Any + Send + Sync)) -> Bytes,
    ) -> Self {
        Self {
            format,
            status,
            head: OnceLock::new(),
            body,
            decoded: Some(Decoded {
                value: Arc::new(value),
                bytes,
                encode_head,
            }),
        }
    }

    /// Which layer encoded it.
    pub fn format(&self) -> PayloadFormat {
        self.format
    }

    /// The answer's status as its transport numbers it.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// What the layer keeps besides the body (an HTTP response's status and headers).
    pub fn head(&self) -> &Bytes {
        self.head.get_or_init(|| match &self.decoded {
            Some(decoded) => (decoded.encode_head)(&*decoded.value),
            None => Bytes::new(),
        })
    }

    /// The answer's body (an HTTP response's body, a message outcome's JSON).
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// Bytes held: the head, the body, and what the layer that made it keeps of it
    /// decoded.
    pub fn weight(&self) -> usize {
        self.head.get().map_or(0, Bytes::len)
            + self.body.len()
            + self.decoded.as_ref().map_or(0, |decoded| decoded.bytes)
    }

    /// What the layer that made this payload reads it as, if it is kept with it (in a
    /// store in this process) and is a `T`.
    #[doc(hidden)]
    pub fn decoded<T: Any>(&self) -> Option<&T> {
        self.decoded.as_ref()?.value.downcast_ref()
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Payload")
            .field("format", &self.format)
            .field("status", &self.status)
            .field("head_bytes", &self.head.get().map(Bytes::len))
            .field("body_bytes", &self.body.len())
            .finish()
    }
}
