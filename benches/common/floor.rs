//! The floor of a replay: the work no idempotency layer can leave out when it answers
//! a duplicate and keeps this crate's guarantees, and nothing else. `benches/` reports
//! the layer's replay against it (replay-added / floor-added).
//!
//! Per request: read and validate the key from its header; derive the scope (SHA-256 of
//! client, method, path and key, as the layer does, so a key is never shared across
//! scopes); read the whole body and fingerprint it (as the layer does for a scope with
//! no client, SHA-256 of method, path, query, content type and body, so a key reused
//! with another request is caught); one
//! lookup in an in-memory index (one lock, one hash map); compare the fingerprints; and
//! build the stored response (status, its headers, its body shared, not copied) with
//! the headers every replay must carry (`idempotent-replayed: true`, the key echoed).
//! The routes of the benches identify no client, so neither does the floor.
//!
//! Left out, as work a layer may choose not to do: claiming the key (a replay finds a
//! record), metrics, events, limits on the body, the replay's informational headers
//! (first seen, request count, original attempt), and the task that keeps a claimed
//! request running when its caller goes away.

use std::{
    collections::HashMap,
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use axum::{body::Body, response::Response};
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::BodyExt;
use tower::{Layer, Service, ServiceExt};
use tower_ids::idempotency::{
    header::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED},
    store::{Fingerprint, ScopeKey},
    IdempotencyKey,
};

/// A stored response, as the floor keeps it.
struct Stored {
    fingerprint: Fingerprint,
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

/// The floor as a route layer: the first request with a key runs the handler and its
/// response is stored; every later one is answered from the index.
#[derive(Clone, Default)]
pub(crate) struct FloorLayer {
    index: Arc<Mutex<HashMap<[u8; 32], Arc<Stored>>>>,
}

impl<S> Layer<S> for FloorLayer {
    type Service = Floor<S>;

    fn layer(&self, inner: S) -> Floor<S> {
        Floor {
            inner,
            index: self.index.clone(),
        }
    }
}

#[derive(Clone)]
pub(crate) struct Floor<S> {
    inner: S,
    index: Arc<Mutex<HashMap<[u8; 32], Arc<Stored>>>>,
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

impl<S> Service<Request<Body>> for Floor<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> BoxFuture {
        let inner = self.inner.clone();
        let index = self.index.clone();
        Box::pin(async move {
            let key = IdempotencyKey::from_headers(request.headers(), &[IDEMPOTENCY_KEY])
                .ok()
                .flatten()
                .expect("the benches send a valid key");
            let (parts, body) = request.into_parts();
            let query = parts.uri.query();
            let (method, path) = (parts.method.as_str(), parts.uri.path());
            let scope = match query {
                Some(query) => ScopeKey::new("http", &[method, path, query], None, &key),
                None => ScopeKey::new("http", &[method, path], None, &key),
            };
            let body = body.collect().await.expect("a body").to_bytes();
            let content_type = parts
                .headers
                .get(header::CONTENT_TYPE)
                .map(HeaderValue::as_bytes);
            let fingerprint = Fingerprint::collision_resistant(
                parts.method.as_str(),
                parts.uri.path(),
                query,
                content_type,
                &body,
            );
            let found = index.lock().unwrap().get(scope.as_bytes()).cloned();
            if let Some(stored) = found {
                assert!(stored.fingerprint == fingerprint, "the same request");
                let mut response = Response::new(Body::from(stored.body.clone()));
                *response.status_mut() = stored.status;
                let headers = response.headers_mut();
                headers.reserve(stored.headers.len() + 2);
                for (name, value) in &stored.headers {
                    headers.append(name.clone(), value.clone());
                }
                headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
                headers.insert(IDEMPOTENCY_KEY, key.to_header_value());
                return Ok(response);
            }
            let request = Request::from_parts(parts, Body::from(body));
            let response = inner.oneshot(request).await?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.expect("a body").to_bytes();
            let stored = Stored {
                fingerprint,
                status: parts.status,
                headers: parts.headers.clone(),
                body: body.clone(),
            };
            index
                .lock()
                .unwrap()
                .insert(*scope.as_bytes(), Arc::new(stored));
            let mut response = Response::from_parts(parts, Body::from(body));
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("false"));
            Ok(response)
        })
    }
}
