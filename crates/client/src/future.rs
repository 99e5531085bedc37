use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use http::Response;

use super::RetryError;

type Inner<T, E> = Pin<Box<dyn Future<Output = Result<Response<T>, RetryError<E>>> + Send>>;

/// Response future of [`Retry`](super::Retry).
///
/// The retry loop holds a timer, the inner client's future and the request across
/// its waits; it is an `async` block behind one box, one allocation per logical
/// request, which is noise next to a network round trip.
pub struct ResponseFuture<T, E> {
    inner: Inner<T, E>,
}

impl<T, E> ResponseFuture<T, E> {
    pub(crate) fn new(inner: Inner<T, E>) -> Self {
        Self { inner }
    }
}

impl<T, E> Future for ResponseFuture<T, E> {
    type Output = Result<Response<T>, RetryError<E>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<T, E> fmt::Debug for ResponseFuture<T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
