use std::{
    sync::Arc,
    task::{Context, Poll},
};

use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use tower_service::Service;

use super::{
    future::ResponseFuture,
    layer::{CorrelationLayer, Settings},
    CorrelationId, CorrelationIdError, DefaultMakeSpan, DefaultValidator, MakeCorrelationId,
    MakeSpan, MakeUuidV7, ValidateCorrelationId,
};
use crate::{body::Body, problem::Problem};

/// Middleware that gives every request a correlation ID.
///
/// Made by [`CorrelationLayer`]; see the [module docs](crate).
#[derive(Debug, Clone)]
pub struct Correlation<S, M = MakeUuidV7, V = DefaultValidator, P = DefaultMakeSpan> {
    pub(super) inner: S,
    pub(super) settings: Arc<Settings>,
    pub(super) make_id: M,
    pub(super) validator: V,
    pub(super) make_span: P,
}

impl<S> Correlation<S> {
    /// Wraps `inner` with the default settings.
    pub fn new(inner: S) -> Self {
        use tower_layer::Layer as _;
        CorrelationLayer::new().layer(inner)
    }

    /// The layer, to configure and apply with `ServiceBuilder` or `Router::layer`.
    pub fn layer() -> CorrelationLayer {
        CorrelationLayer::new()
    }
}

impl<S, M, V, P> Correlation<S, M, V, P> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// What the request's headers said.
enum Incoming<'a> {
    Restored {
        id: CorrelationId,
        from_primary: bool,
    },
    Missing,
    Invalid {
        error: CorrelationIdError,
        header: &'a HeaderName,
    },
}

impl<S, M, V, P> Correlation<S, M, V, P>
where
    V: ValidateCorrelationId,
{
    fn read_incoming<'a>(
        settings: &'a Settings,
        validator: &V,
        headers: &HeaderMap,
    ) -> Incoming<'a> {
        let accepted = std::iter::once(&settings.header).chain(&settings.fallbacks);
        for (position, header) in accepted.enumerate() {
            let mut values = headers.get_all(header).iter();
            let Some(value) = values.next() else {
                continue;
            };
            if values.next().is_some() {
                return Incoming::Invalid {
                    error: CorrelationIdError::multiple_values(),
                    header,
                };
            }
            return match CorrelationId::from_header_value(value, settings.max_len, validator) {
                Ok(id) => Incoming::Restored {
                    id,
                    from_primary: position == 0,
                },
                Err(error) => Incoming::Invalid { error, header },
            };
        }
        Incoming::Missing
    }

    /// The ID in the request's W3C baggage, if it holds a valid one.
    #[cfg(feature = "opentelemetry")]
    fn read_baggage<'a>(
        settings: &'a Settings,
        validator: &V,
        headers: &HeaderMap,
    ) -> Incoming<'a> {
        let Some(value) = super::otel::from_baggage(headers) else {
            return Incoming::Missing;
        };
        match CorrelationId::parse_with(&value, settings.max_len, validator) {
            Ok(id) => Incoming::Restored {
                id,
                from_primary: false,
            },
            Err(error) => {
                tracing::warn!(
                    target: "tower_ids::correlation",
                    event = "correlation.invalid",
                    header = "baggage",
                    reason = error.reason(),
                    detail = %error,
                    "invalid correlation id in baggage ignored"
                );
                Incoming::Missing
            }
        }
    }
}

impl<S, M, V, P, ReqBody, ResBody> Service<Request<ReqBody>> for Correlation<S, M, V, P>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    M: MakeCorrelationId<ReqBody>,
    V: ValidateCorrelationId,
    P: MakeSpan<ReqBody>,
{
    type Response = Response<Body<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        let Self {
            inner,
            settings,
            make_id,
            validator,
            make_span,
        } = self;
        let settings = &**settings;
        let incoming = Self::read_incoming(settings, validator, request.headers());
        #[cfg(feature = "opentelemetry")]
        let incoming = match incoming {
            Incoming::Missing if settings.baggage => {
                Self::read_baggage(settings, validator, request.headers())
            }
            incoming => incoming,
        };
        let (id, refused) = match incoming {
            Incoming::Restored { id, from_primary } => {
                if !from_primary {
                    request
                        .headers_mut()
                        .insert(settings.header.clone(), id.to_header_value());
                }
                (id, None)
            }
            Incoming::Missing => {
                let id = generate(make_id, &mut request, settings);
                (id, settings.enforce.then_some(Refused::Missing))
            }
            Incoming::Invalid { error, header } => {
                let id = generate(make_id, &mut request, settings);
                // The refused value never travels further than this layer: a fallback
                // header that held it carries the effective ID too.
                request
                    .headers_mut()
                    .insert(header.clone(), id.to_header_value());
                (id, Some(Refused::Invalid { error, header }))
            }
        };
        request.extensions_mut().insert(id.clone());
        let span = make_span.make_span(&request, &id);
        #[cfg(feature = "opentelemetry")]
        {
            if settings.trace_context {
                super::otel::continue_trace(&span, request.headers());
            }
            super::otel::set_correlation_attribute(&span, &id);
        }

        if let Some(refused) = refused {
            let _entered = span.enter();
            let problem = refused.report(&id, settings);
            if let Some(problem) = problem {
                return ResponseFuture::refused(
                    problem
                        .docs(settings.problem_docs.as_deref())
                        .correlation_id(&id)
                        .into_response(),
                    id,
                    settings.header.clone(),
                );
            }
        }

        let future = {
            let _entered = span.enter();
            id.clone().sync_scope(|| inner.call(request))
        };
        ResponseFuture::called(id.task_local(future), span, settings.header.clone())
    }
}

/// A fresh ID, set on the request in place of whatever the header held.
fn generate<M, B>(make_id: &mut M, request: &mut Request<B>, settings: &Settings) -> CorrelationId
where
    M: MakeCorrelationId<B>,
{
    let id = make_id
        .make_correlation_id(request)
        .with_max_len(settings.max_len);
    request
        .headers_mut()
        .insert(settings.header.clone(), id.to_header_value());
    id
}

enum Refused<'a> {
    Missing,
    Invalid {
        error: CorrelationIdError,
        header: &'a HeaderName,
    },
}

impl Refused<'_> {
    /// Logs the refusal; in `enforce` mode also returns the problem to answer with.
    fn report(self, id: &CorrelationId, settings: &Settings) -> Option<Problem> {
        match self {
            Refused::Missing => {
                tracing::warn!(
                    target: "tower_ids::correlation",
                    event = "correlation.missing",
                    correlation_id = id.as_str(),
                    header = settings.header.as_str(),
                    status = 400,
                    "request refused: no correlation id"
                );
                Some(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "correlation_id.missing",
                    "Missing correlation id",
                    format!("send a correlation id in the {} header", settings.header),
                ))
            }
            Refused::Invalid { error, header } if settings.enforce => {
                tracing::warn!(
                    target: "tower_ids::correlation",
                    event = "correlation.rejected",
                    correlation_id = id.as_str(),
                    header = header.as_str(),
                    reason = error.reason(),
                    detail = %error,
                    status = 400,
                    "request refused: invalid correlation id"
                );
                Some(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "correlation_id.invalid",
                    "Invalid correlation id",
                    format!("{error} (header {header})"),
                ))
            }
            Refused::Invalid { error, header } => {
                tracing::warn!(
                    target: "tower_ids::correlation",
                    event = "correlation.invalid",
                    correlation_id = id.as_str(),
                    header = header.as_str(),
                    reason = error.reason(),
                    detail = %error,
                    "invalid correlation id replaced by a fresh one"
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http::{Request, Response};
    use http_body_util::BodyExt;
    use tower::{service_fn, ServiceExt};

    use super::*;

    async fn seen_by_handler(
        layer: CorrelationLayer,
        request: Request<()>,
    ) -> Response<Body<String>> {
        let service = tower_layer::Layer::layer(
            &layer,
            service_fn(|request: Request<()>| async move {
                let id = request.extensions().get::<CorrelationId>().cloned();
                assert_eq!(id, CorrelationId::current());
                Ok::<_, Infallible>(Response::new(
                    id.map(|id| id.to_string()).unwrap_or_default(),
                ))
            }),
        );
        service.oneshot(request).await.unwrap()
    }

    #[test]
    #[should_panic(expected = "cannot hold a UUID")]
    fn a_bound_below_a_uuid_is_refused() {
        let _ = CorrelationLayer::new().max_len(35);
    }

    #[tokio::test]
    async fn the_handler_and_the_response_carry_the_id() {
        let request = Request::builder()
            .header("x-correlation-id", "abc")
            .body(())
            .unwrap();
        let response = seen_by_handler(CorrelationLayer::new(), request).await;
        assert_eq!(response.headers()["x-correlation-id"], "abc");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "abc");
    }

    #[tokio::test]
    async fn a_custom_header_and_bound() {
        let layer = CorrelationLayer::new()
            .header(HeaderName::from_static("x-trace"))
            .max_len(40);
        let too_long = "a".repeat(41);
        let request = Request::builder()
            .header("x-trace", &too_long)
            .body(())
            .unwrap();
        let response = seen_by_handler(layer.clone(), request).await;
        let generated = response.headers()["x-trace"].to_str().unwrap();
        assert_eq!(generated.len(), 36, "too long for the bound: replaced");

        let fits = "a".repeat(40);
        let request = Request::builder()
            .header("x-trace", &fits)
            .body(())
            .unwrap();
        let response = seen_by_handler(layer, request).await;
        assert_eq!(response.headers()["x-trace"], fits.as_str());
        assert!(!response.headers().contains_key("x-correlation-id"));
    }
}
