use std::{
    sync::Arc,
    task::{Context, Poll},
};

use http::{HeaderMap, HeaderName, Request};
use tower_layer::Layer;
use tower_service::Service;

use super::{CorrelationId, DEFAULT_HEADER};

/// Sets the correlation header on outgoing requests of an HTTP client service.
///
/// The ID comes from the request's [`CorrelationId`] extension if it has one, else from
/// the task-local the server layer set ([`CorrelationId::current`]). A header already on
/// the request is never overwritten. With [`extend_per_call`](Self::extend_per_call) each
/// call gets the next child of the ID (`parent.1`, `parent.2`, ...), so the downstream
/// story of every call can be told apart and found by the parent's prefix.
///
/// ```
/// use tower::ServiceBuilder;
/// use tower_ids_correlation::OutboundCorrelationLayer;
/// # let client = tower::service_fn(|_: http::Request<String>| async {
/// #     Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
/// # });
///
/// // `client` is any tower HTTP client, hyper-util's legacy `Client` for one.
/// let client = ServiceBuilder::new()
///     .layer(OutboundCorrelationLayer::new().extend_per_call(true))
///     .service(client);
/// # let _ = client;
/// ```
///
/// # Clone
///
/// Settings are shared behind an `Arc`; the sequence of children belongs to the parent
/// ID, so clones of the client number one parent's calls from one counter.
#[derive(Debug, Clone)]
#[must_use]
pub struct OutboundCorrelationLayer {
    pub(super) settings: Arc<OutboundSettings>,
}

#[derive(Debug, Clone)]
pub(super) struct OutboundSettings {
    pub(super) header: HeaderName,
    extend_per_call: bool,
    generate_if_missing: bool,
    #[cfg(feature = "opentelemetry")]
    trace_context: bool,
    #[cfg(feature = "opentelemetry")]
    baggage: bool,
}

impl OutboundCorrelationLayer {
    /// Sets `x-correlation-id` from the current ID as it is.
    pub fn new() -> Self {
        Self {
            settings: Arc::new(OutboundSettings {
                header: DEFAULT_HEADER,
                extend_per_call: false,
                generate_if_missing: false,
                #[cfg(feature = "opentelemetry")]
                trace_context: true,
                #[cfg(feature = "opentelemetry")]
                baggage: false,
            }),
        }
    }

    /// The header to set. Default `x-correlation-id`.
    pub fn header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.settings).header = name;
        self
    }

    /// Send the next child of the current ID (`id.1`, `id.2`, ...) on each call instead
    /// of the ID itself. Default off.
    pub fn extend_per_call(mut self, extend: bool) -> Self {
        Arc::make_mut(&mut self.settings).extend_per_call = extend;
        self
    }

    /// Send a fresh UUIDv7 when there is no current ID (a background job, say). Default
    /// off: the request goes without the header and the server generates one.
    pub fn generate_if_missing(mut self, generate: bool) -> Self {
        Arc::make_mut(&mut self.settings).generate_if_missing = generate;
        self
    }

    /// Send W3C `traceparent` (and `tracestate`) from the current span's OpenTelemetry
    /// context, unless the request carries a `traceparent` already. Default on; nothing
    /// is sent without an OpenTelemetry context (no `tracing-opentelemetry` layer).
    #[cfg(feature = "opentelemetry")]
    pub fn trace_context(mut self, send: bool) -> Self {
        Arc::make_mut(&mut self.settings).trace_context = send;
        self
    }

    /// Also send the correlation ID as the `correlation_id` member of W3C `baggage`,
    /// added to the members the request has, unless one of them is a `correlation_id`.
    /// Default off. Pair it with [`CorrelationLayer::baggage`](super::CorrelationLayer::baggage)
    /// on the next service, or with any service that reads baggage.
    #[cfg(feature = "opentelemetry")]
    pub fn baggage(mut self, send: bool) -> Self {
        Arc::make_mut(&mut self.settings).baggage = send;
        self
    }

    /// Sets the headers on one outgoing request: the layer's work, shared by its tower
    /// service and its reqwest middleware. `extension` is the request's own
    /// [`CorrelationId`], if it carries one (read only when the header is absent).
    pub(crate) fn apply(&self, headers: &mut HeaderMap, extension: Option<CorrelationId>) {
        let settings = &*self.settings;
        let sent = match headers.get(&settings.header) {
            Some(_value) => {
                #[cfg(feature = "opentelemetry")]
                let sent = _value
                    .to_str()
                    .ok()
                    .and_then(|v| CorrelationId::parse(v).ok());
                #[cfg(not(feature = "opentelemetry"))]
                let sent = None;
                sent
            }
            None => {
                let parent = extension.or_else(CorrelationId::current);
                let id = match parent {
                    Some(parent) if settings.extend_per_call => Some(parent.next_child()),
                    Some(parent) => Some(parent),
                    None if settings.generate_if_missing => Some(CorrelationId::new()),
                    None => None,
                };
                if let Some(id) = &id {
                    headers.insert(settings.header.clone(), id.to_header_value());
                }
                id
            }
        };
        #[cfg(feature = "opentelemetry")]
        {
            if settings.trace_context {
                super::otel::inject_trace_context(headers);
            }
            if let (true, Some(id)) = (settings.baggage, &sent) {
                super::otel::add_to_baggage(headers, id);
            }
        }
        let _ = sent;
    }
}

impl Default for OutboundCorrelationLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for OutboundCorrelationLayer {
    type Service = OutboundCorrelation<S>;

    fn layer(&self, inner: S) -> Self::Service {
        OutboundCorrelation {
            inner,
            layer: self.clone(),
        }
    }
}

/// Client middleware that propagates the correlation ID; made by
/// [`OutboundCorrelationLayer`].
#[derive(Debug, Clone)]
pub struct OutboundCorrelation<S> {
    inner: S,
    layer: OutboundCorrelationLayer,
}

impl<S> OutboundCorrelation<S> {
    /// The layer, to configure and apply with `ServiceBuilder`.
    pub fn layer() -> OutboundCorrelationLayer {
        OutboundCorrelationLayer::new()
    }

    /// The wrapped client.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped client, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the client.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B> Service<Request<B>> for OutboundCorrelation<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let extension = || request.extensions().get::<CorrelationId>().cloned();
        let extension = if request.headers().contains_key(&self.layer.settings.header) {
            None
        } else {
            extension()
        };
        self.layer.apply(request.headers_mut(), extension);
        self.inner.call(request)
    }
}
