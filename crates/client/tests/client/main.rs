//! The client retry layer: against real axum servers on 127.0.0.1 with the idempotency
//! layer on the other side, and against `service_fn` clients under paused time for
//! everything about timing.
#![allow(missing_docs)]

use tower_ids_test_support as support;

mod derive_key;
mod real_server;
mod requests;
mod timing;

use std::{
    io,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{service_fn, util::BoxCloneService};
use tower_ids::client::{RetryLayer, RetryOutcome};

const MS: Duration = Duration::from_millis(1);

/// Fast retries for tests against real sockets.
fn fast() -> RetryLayer {
    RetryLayer::new().backoff(MS, 10 * MS)
}

fn outcome<B>(response: &Response<B>) -> &RetryOutcome {
    response.extensions().get::<RetryOutcome>().unwrap()
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).map(|v| v.to_str().unwrap())
}

fn post(uri: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post(uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

// ---------------------------------------------------------------------------------
// A `service_fn` client: scripted answers, every request recorded with its time.

enum Answer {
    Respond(Response<String>),
    /// The client fails (connection refused).
    Fail,
    /// Never answers.
    Hang,
}

fn status(code: u16) -> Answer {
    respond(code, &[])
}

fn respond(code: u16, headers: &[(&str, &str)]) -> Answer {
    let mut response = Response::builder().status(code);
    for (name, value) in headers {
        response = response.header(*name, *value);
    }
    Answer::Respond(response.body(String::new()).unwrap())
}

#[derive(Debug)]
struct Sent {
    at: Instant,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
}

type Log = Arc<Mutex<Vec<Sent>>>;

/// A client that answers call `n` (0-based) with `script(n)`.
fn mock<B>(
    script: impl Fn(usize) -> Answer + Send + Sync + 'static,
) -> (
    BoxCloneService<Request<B>, Response<String>, io::Error>,
    Log,
)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: std::fmt::Debug,
{
    let log = Log::default();
    let script = Arc::new(script);
    let sent = log.clone();
    let service = service_fn(move |request: Request<B>| {
        let (script, sent) = (script.clone(), sent.clone());
        async move {
            let at = Instant::now();
            let (parts, body) = request.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            let n = {
                let mut sent = sent.lock().unwrap();
                sent.push(Sent {
                    at,
                    method: parts.method,
                    headers: parts.headers,
                    body,
                });
                sent.len() - 1
            };
            match script(n) {
                Answer::Respond(response) => Ok(response),
                Answer::Fail => Err(io::Error::from(io::ErrorKind::ConnectionRefused)),
                Answer::Hang => std::future::pending().await,
            }
        }
    });
    (BoxCloneService::new(service), log)
}

fn sent_headers(log: &Log, name: &str) -> Vec<String> {
    log.lock()
        .unwrap()
        .iter()
        .map(|s| header(&s.headers, name).unwrap_or("-").to_owned())
        .collect()
}

fn gaps(log: &Log) -> Vec<Duration> {
    let sent = log.lock().unwrap();
    sent.windows(2).map(|w| w[1].at - w[0].at).collect()
}

fn request(method: Method) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri("http://upstream/x")
        .body(Full::new(Bytes::from_static(b"payload")))
        .unwrap()
}
