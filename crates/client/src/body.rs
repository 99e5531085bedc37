use std::{
    fmt,
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{combinators::BoxBody, Empty, Full};
use pin_project_lite::pin_project;

/// A request body the retry layer can send again, or knows it cannot.
///
/// [`try_replay`](Self::try_replay) returns a copy to send on one attempt while the
/// original is kept for the next; `None` means the body can be sent once only (it
/// streams), and the layer sends the original on the first attempt and refuses to
/// retry with [`RetryError::BodyNotReplayable`](super::RetryError::BodyNotReplayable).
///
/// Implemented for `http_body_util::Full` and `Empty`, `String`, and [`ReplayBody`].
/// Implement it for your own body type when a copy is cheap and complete.
pub trait ReplayableBody: Sized {
    /// A copy holding the whole body, or `None` when this body can be sent only once.
    fn try_replay(&self) -> Option<Self>;
}

impl<D: Buf + Clone> ReplayableBody for Full<D> {
    fn try_replay(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl<D> ReplayableBody for Empty<D> {
    fn try_replay(&self) -> Option<Self> {
        Some(Self::new())
    }
}

impl ReplayableBody for String {
    fn try_replay(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl<B> ReplayableBody for ReplayBody<B> {
    fn try_replay(&self) -> Option<Self> {
        match &self.kind {
            Kind::Buffered { data } => Some(Self {
                kind: Kind::Buffered { data: data.clone() },
            }),
            Kind::Streaming { .. } => None,
        }
    }
}

/// The default streaming body of [`ReplayBody`]: any body of `Bytes` behind a box.
pub type BoxedBody = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

pin_project! {
    /// A request body that is either buffered bytes, sent on every attempt, or a
    /// streaming body, sent on the first attempt only.
    ///
    /// Use it as the hyper-util client's body type when some requests stream (an upload
    /// read from disk) and others are small and retryable:
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_ids_client::{ReplayBody, ReplayableBody};
    ///
    /// let small: ReplayBody = ReplayBody::buffered(r#"{"name":"reboot"}"#);
    /// assert!(small.try_replay().is_some());
    ///
    /// let stream = http_body_util::StreamBody::new(futures_util::stream::iter(
    ///     [Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from("chunk")))],
    /// ));
    /// let upload = ReplayBody::streaming(stream);
    /// assert!(upload.try_replay().is_none(), "sent once, never twice");
    /// ```
    ///
    /// A retry that would need a streaming body again fails with
    /// [`RetryError::BodyNotReplayable`](super::RetryError::BodyNotReplayable).
    pub struct ReplayBody<B = BoxedBody> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Buffered { data: Option<Bytes> },
        Streaming { #[pin] body: B },
    }
}

impl<B> ReplayBody<B> {
    /// Bytes held in memory: sent on every attempt (a cheap reference-counted copy).
    pub fn buffered(data: impl Into<Bytes>) -> Self {
        let data: Bytes = data.into();
        Self {
            kind: Kind::Buffered {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// No body; replayable.
    pub fn empty() -> Self {
        Self {
            kind: Kind::Buffered { data: None },
        }
    }

    /// A streaming body: sent once, never retried.
    pub fn streaming(body: B) -> Self {
        Self {
            kind: Kind::Streaming { body },
        }
    }

    /// `true` for buffered bytes (replayable), `false` for a streaming body.
    pub fn is_buffered(&self) -> bool {
        matches!(self.kind, Kind::Buffered { .. })
    }
}

impl<B> Default for ReplayBody<B> {
    fn default() -> Self {
        Self::empty()
    }
}

impl<B> From<Bytes> for ReplayBody<B> {
    fn from(data: Bytes) -> Self {
        Self::buffered(data)
    }
}

impl<B> From<String> for ReplayBody<B> {
    fn from(data: String) -> Self {
        Self::buffered(data)
    }
}

impl<B> From<Vec<u8>> for ReplayBody<B> {
    fn from(data: Vec<u8>) -> Self {
        Self::buffered(data)
    }
}

impl<B> From<&'static str> for ReplayBody<B> {
    fn from(data: &'static str) -> Self {
        Self::buffered(data)
    }
}

impl<B> fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Buffered { data } => f
                .debug_struct("ReplayBody::Buffered")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
            Kind::Streaming { .. } => f.debug_struct("ReplayBody::Streaming").finish(),
        }
    }
}

impl<B> Body for ReplayBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Buffered { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Streaming { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Buffered { data } => data.is_none(),
            Kind::Streaming { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Streaming { body } => body.size_hint(),
        }
    }
}
