//! [`OutboundCorrelationLayer`] as `reqwest-middleware` middleware (feature `reqwest`).

use http::Extensions;
use reqwest_middleware::{Middleware, Next, Result};

use super::{CorrelationId, OutboundCorrelationLayer};

/// The layer's work on every request a `reqwest_middleware::ClientWithMiddleware`
/// sends: the correlation header from the call's [`CorrelationId`] extension
/// (`RequestBuilder::with_extension`) or the current ID, the next child of it with
/// [`extend_per_call`](OutboundCorrelationLayer::extend_per_call); `traceparent` and,
/// if asked, `baggage` with the `opentelemetry` feature. A header the request has is
/// never overwritten.
///
/// ```
/// use tower_ids_correlation::OutboundCorrelationLayer;
///
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(OutboundCorrelationLayer::new().extend_per_call(true))
///     .build();
/// # let _ = client;
/// ```
#[async_trait::async_trait]
impl Middleware for OutboundCorrelationLayer {
    async fn handle(
        &self,
        mut request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> Result<reqwest::Response> {
        let extension = if request.headers().contains_key(&self.settings.header) {
            None
        } else {
            extensions.get::<CorrelationId>().cloned()
        };
        self.apply(request.headers_mut(), extension);
        next.run(request, extensions).await
    }
}
