//! The body tower-ids services hand on, in requests and responses.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// Request or response body of the tower-ids services.
    ///
    /// Either the wrapped body, passed through untouched; complete bytes a layer holds
    /// (a problem response, a replayed response, a request body it read to fingerprint);
    /// or bytes a layer read first followed by the rest of the wrapped body (a response
    /// too large to keep, streamed on).
    pub struct Body<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Complete { data: Option<Bytes> },
        Prefixed { prefix: Option<Bytes>, #[pin] rest: B },
        Trailed { data: Option<Bytes>, trailers: Option<Box<HeaderMap>> },
    }
}

impl<B> Body<B> {
    /// The wrapped body, untouched.
    pub fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    /// A complete body.
    pub fn complete(data: Bytes) -> Self {
        Self {
            kind: Kind::Complete {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// The bytes of a complete body.
    #[doc(hidden)]
    pub fn complete_bytes(&self) -> Option<Bytes> {
        match &self.kind {
            Kind::Complete { data } => Some(data.clone().unwrap_or_default()),
            _ => None,
        }
    }

    /// A complete body followed by `trailers` (a gRPC response's status).
    #[doc(hidden)]
    pub fn with_trailers(data: Bytes, trailers: Option<Box<HeaderMap>>) -> Self {
        match trailers {
            trailers @ Some(_) => Self {
                kind: Kind::Trailed {
                    data: (!data.is_empty()).then_some(data),
                    trailers,
                },
            },
            _ => Self::complete(data),
        }
    }

    /// `prefix`, then the rest of `rest`.
    #[doc(hidden)]
    pub fn prefixed(prefix: Bytes, rest: B) -> Self {
        Self {
            kind: Kind::Prefixed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
            },
        }
    }
}

impl<B> http_body::Body for Body<B>
where
    B: http_body::Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Complete { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Prefixed { prefix, rest } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(Frame::data(prefix)))),
                None => rest.poll_frame(cx),
            },
            KindProj::Trailed { data, trailers } => Poll::Ready(match data.take() {
                Some(data) => Some(Ok(Frame::data(data))),
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Complete { data } => data.is_none(),
            Kind::Prefixed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
            Kind::Trailed { data, trailers } => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Complete { data } | Kind::Trailed { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Prefixed { prefix, rest } => {
                let extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + extra);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
        }
    }
}

impl<B> std::fmt::Debug for Body<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Inner { .. } => "Inner",
            Kind::Complete { .. } => "Complete",
            Kind::Prefixed { .. } => "Prefixed",
            Kind::Trailed { .. } => "Trailed",
        };
        f.debug_struct("Body").field("kind", &kind).finish()
    }
}
