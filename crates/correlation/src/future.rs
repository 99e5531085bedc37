use std::{
    future::Future,
    pin::Pin,
    task::{ready, Context, Poll},
};

use http::{HeaderName, Response};
use pin_project_lite::pin_project;
use tokio::task::futures::TaskLocalFuture;
use tracing::Span;

use super::CorrelationId;
use crate::body::Body;

pin_project! {
    /// Response future of [`Correlation`](super::Correlation).
    pub struct ResponseFuture<F, B> {
        #[pin]
        kind: Kind<F, B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B> {
        Called {
            #[pin]
            future: TaskLocalFuture<CorrelationId, F>,
            span: Span,
            header: HeaderName,
        },
        Refused {
            response: Option<Response<Body<B>>>,
        },
    }
}

impl<F, B> ResponseFuture<F, B> {
    pub(super) fn called(
        future: TaskLocalFuture<CorrelationId, F>,
        span: Span,
        header: HeaderName,
    ) -> Self {
        Self {
            kind: Kind::Called {
                future,
                span,
                header,
            },
        }
    }

    pub(super) fn refused(
        mut response: Response<Body<B>>,
        id: CorrelationId,
        header: HeaderName,
    ) -> Self {
        echo(&mut response, &id, header);
        Self {
            kind: Kind::Refused {
                response: Some(response),
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<Body<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Called {
                mut future,
                span,
                header,
            } => {
                let _entered = span.enter();
                let mut response = ready!(future.as_mut().poll(cx))?.map(Body::inner);
                // The ID the task-local held: taken back rather than kept in a clone of
                // its own, which would cost two atomic operations per request.
                if let Some(id) = future.take_value() {
                    echo(&mut response, &id, header.clone());
                }
                Poll::Ready(Ok(response))
            }
            KindProj::Refused { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
        }
    }
}

/// Sets the ID on the response unless the handler set the header itself.
///
/// The header is the response's only carrier of the ID: a response extension as well
/// would cost three allocations per request for what the header already says.
fn echo<B>(response: &mut Response<B>, id: &CorrelationId, header: HeaderName) {
    if let http::header::Entry::Vacant(entry) = response.headers_mut().entry(header) {
        entry.insert(id.to_header_value());
    }
}

impl<F, B> std::fmt::Debug for ResponseFuture<F, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
