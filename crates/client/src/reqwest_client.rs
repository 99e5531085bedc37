//! [`RetryLayer`] as `reqwest-middleware` middleware (features `reqwest` and `client`).

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::Extensions;
use reqwest_middleware::{Error, Middleware, Next, Result};
use tower_service::Service;

use super::{
    service::{run, LogicalRequest},
    ReplayableBody, RetryError, RetryLayer, RetryOutcome,
};
use tower_ids_correlation::CorrelationId;

/// A reqwest body is sent again when it is in memory (bytes, a string, JSON); a
/// streaming body (`Body::wrap_stream`) is sent once.
impl ReplayableBody for reqwest::Body {
    fn try_replay(&self) -> Option<Self> {
        self.as_bytes()
            .map(|bytes| reqwest::Body::from(Bytes::copy_from_slice(bytes)))
    }
}

/// The retry layer on a `reqwest_middleware::ClientWithMiddleware`: the same rules,
/// headers and events as on a tower client (see the [module docs](super)).
///
/// - The parent correlation ID is the call's [`CorrelationId`] extension
///   (`RequestBuilder::with_extension`), else a valid correlation header, else the
///   current ID, else a fresh one.
/// - The response is reqwest's, with the [`RetryOutcome`] in its extensions.
/// - An error of the last attempt is reqwest's own error, as without the layer; the
///   layer's errors ([`RetryError::TimedOut`], [`RetryError::DeadlineExceeded`],
///   [`RetryError::BodyNotReplayable`]) come as `reqwest_middleware::Error::Middleware`,
///   to downcast to `RetryError<reqwest_middleware::Error>`.
/// - Each attempt runs the middleware after this one with a copy of the call's
///   extensions; the request's own timeout (`RequestBuilder::timeout`) applies to each
///   attempt.
///
/// Put it first (outermost), as on a tower client: the middleware after it sees every
/// attempt.
///
/// ```
/// use tower_ids_client::RetryLayer;
///
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(RetryLayer::new())
///     .build();
/// # let _ = client;
/// ```
#[async_trait::async_trait]
impl Middleware for RetryLayer {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> Result<reqwest::Response> {
        let timeout = request.timeout().copied();
        let mut request = http::Request::<reqwest::Body>::try_from(request)?;
        if let Some(id) = extensions.get::<CorrelationId>() {
            request.extensions_mut().insert(id.clone());
        }
        let call = LogicalRequest::new(&self.settings, request);
        let attempts = Attempts {
            next,
            extensions: extensions.clone(),
            timeout,
        };
        match run(attempts, self.settings.clone(), call).await {
            Ok(response) => {
                let (mut parts, Held(mut response)) = response.into_parts();
                if let Some(outcome) = parts.extensions.remove::<RetryOutcome>() {
                    response.extensions_mut().insert(outcome);
                }
                Ok(response)
            }
            Err(RetryError::Transport { source, .. }) => Err(source),
            Err(error) => Err(Error::middleware(error)),
        }
    }
}

/// The rest of the middleware chain as a tower service, one call per attempt.
struct Attempts<'a> {
    next: Next<'a>,
    extensions: Extensions,
    timeout: Option<Duration>,
}

/// reqwest's response, carried through the retry loop in an `http::Response` that has
/// its status and headers.
struct Held(reqwest::Response);

impl<'a> Service<http::Request<reqwest::Body>> for Attempts<'a> {
    type Response = http::Response<Held>;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response>> + Send + 'a>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<reqwest::Body>) -> Self::Future {
        let next = self.next.clone();
        let mut extensions = self.extensions.clone();
        let timeout = self.timeout;
        Box::pin(async move {
            let mut request = reqwest::Request::try_from(request)?;
            *request.timeout_mut() = timeout;
            let response = next.run(request, &mut extensions).await?;
            let mut head = http::Response::new(());
            *head.status_mut() = response.status();
            *head.version_mut() = response.version();
            *head.headers_mut() = response.headers().clone();
            let (parts, ()) = head.into_parts();
            Ok(http::Response::from_parts(parts, Held(response)))
        })
    }
}
