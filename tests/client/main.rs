//! The client retry layer: against real axum servers on 127.0.0.1 with the idempotency
//! layer on the other side, and against `service_fn` clients under paused time for
//! everything about timing.
#![allow(missing_docs)]

#[path = "../support/mod.rs"]
mod support;

use std::{
    collections::VecDeque,
    io,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, SystemTime},
};

use axum::{extract::State, response::Response as AxumResponse, routing, Router};
use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use proptest::prelude::*;
use support::{client, serve, Logs};
use tokio::time::Instant;
use tower::{service_fn, util::BoxCloneService, Layer, ServiceExt};
use tower_ids::{
    client::{derive_key, BoxedBody, ReplayBody, RetryError, RetryLayer, RetryOutcome, StopReason},
    correlation::{CorrelationId, CorrelationLayer},
    idempotency::IdempotencyLayer,
};

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
// A real server: CorrelationLayer, then IdempotencyLayer on POST /commands.

#[derive(Clone, Copy, Debug)]
enum Step {
    Status(u16),
    /// Panics: hyper closes the connection, the client sees a transport error.
    Panic,
    /// Answers `201` after a while.
    Slow(u64),
}

#[derive(Clone, Default)]
struct Server {
    url: String,
    script: Arc<Mutex<VecDeque<Step>>>,
    /// Every request that reached the server, replays and 409s included.
    seen: Arc<Mutex<Vec<HeaderMap>>>,
    /// Times the handler started, and times it answered 2xx.
    executions: Arc<AtomicUsize>,
    successes: Arc<AtomicUsize>,
}

impl Server {
    fn seen(&self, name: &str) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|h| header(h, name).unwrap_or("-").to_owned())
            .collect()
    }

    fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }

    fn successes(&self) -> usize {
        self.successes.load(Ordering::SeqCst)
    }
}

async fn handler(State(server): State<Server>, body: Bytes) -> AxumResponse {
    let run = server.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let step = server.script.lock().unwrap().pop_front();
    let status = match step {
        Some(Step::Panic) => panic!("the handler panicked on purpose"),
        Some(Step::Slow(ms)) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            201
        }
        Some(Step::Status(status)) => status,
        None => 201,
    };
    if (200..300).contains(&status) {
        server.successes.fetch_add(1, Ordering::SeqCst);
    }
    AxumResponse::builder()
        .status(status)
        .header("x-run", run)
        .body(axum::body::Body::from(body))
        .unwrap()
}

async fn start(script: impl IntoIterator<Item = Step>) -> Server {
    let mut server = Server {
        script: Arc::new(Mutex::new(script.into_iter().collect())),
        ..Server::default()
    };
    let seen = server.seen.clone();
    let router = Router::new()
        .route(
            "/commands",
            routing::post(handler).layer(IdempotencyLayer::new()),
        )
        .with_state(server.clone())
        .layer(CorrelationLayer::new())
        .layer(tower::util::MapRequestLayer::new(
            move |request: Request<axum::body::Body>| {
                seen.lock().unwrap().push(request.headers().clone());
                request
            },
        ));
    server.url = format!("http://{}/commands", serve(router).await);
    server
}

#[tokio::test]
async fn every_attempt_carries_the_key_and_its_own_correlation_id() {
    let (logs, _guard) = Logs::capture();
    let server = start([Step::Status(503), Step::Status(503)]).await;
    let client = fast().layer(client());

    let parent = CorrelationId::parse("parent").unwrap();
    let response = parent
        .scope(client.oneshot(post(&server.url, r#"{"name":"reboot"}"#)))
        .await
        .unwrap();

    assert_eq!(response.status(), StatusCode::CREATED);
    let keys = server.seen("idempotency-key");
    assert_eq!(keys.len(), 3);
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
    let key = uuid::Uuid::parse_str(&keys[0]).unwrap();
    assert_eq!(key.get_version_num(), 7, "a UUIDv7");
    assert_eq!(
        server.seen("x-correlation-id"),
        ["parent.1", "parent.2", "parent.3"]
    );
    assert_eq!(server.seen("attempt-id"), ["1", "2", "3"]);
    assert_eq!(
        header(response.headers(), "x-correlation-id"),
        Some("parent.3")
    );

    // 503 is not stored: the key is released and the third attempt runs the handler.
    assert_eq!(server.executions(), 3);
    assert_eq!(server.successes(), 1);

    let outcome = outcome(&response);
    assert_eq!(outcome.attempts(), 3);
    assert!(!outcome.replayed());
    assert_eq!(outcome.stop_reason(), StopReason::NotRetryable);
    assert!(!outcome.gave_up());
    assert_eq!(outcome.correlation_id(), "parent.3");
    assert_eq!(outcome.idempotency_key().unwrap().as_str(), keys[0]);

    let events = logs.events("client.attempt");
    assert_eq!(events.len(), 3);
    let field = |i: usize, name: &str| events[i]["fields"][name].clone();
    for (i, (outcome, decision)) in [("503", "retry"), ("503", "retry"), ("201", "done")]
        .into_iter()
        .enumerate()
    {
        assert_eq!(field(i, "attempt"), i as u64 + 1);
        assert_eq!(field(i, "correlation_id"), format!("parent.{}", i + 1));
        assert_eq!(field(i, "idempotency_key"), keys[0].as_str());
        assert_eq!(field(i, "outcome"), outcome);
        assert_eq!(field(i, "decision"), decision);
    }
    assert_eq!(events[0]["level"], "INFO");
    assert_eq!(events[2]["level"], "DEBUG");
    assert!(
        field(0, "delay_ms").as_u64().unwrap() <= 1,
        "first ceiling 1 ms"
    );
    assert!(
        field(1, "delay_ms").as_u64().unwrap() <= 2,
        "second ceiling 2 ms"
    );
    assert!(field(2, "delay_ms").is_null(), "no next attempt");
}

#[tokio::test]
async fn the_handler_runs_once_when_a_connection_drops_and_a_second_call_is_replayed() {
    let server = start([Step::Panic]).await;
    let client = fast().layer(client());

    let response = client
        .clone()
        .oneshot(post(&server.url, r#"{"name":"reboot"}"#))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        outcome(&response).attempts(),
        2,
        "the dropped connection was retried"
    );
    assert_eq!((server.executions(), server.successes()), (2, 1));
    let key = outcome(&response).idempotency_key().unwrap().clone();

    // The caller sends the key again itself: the layer keeps it, the server replays.
    let mut again = post(&server.url, r#"{"name":"reboot"}"#);
    again
        .headers_mut()
        .insert("idempotency-key", key.as_str().parse().unwrap());
    let replay = client.oneshot(again).await.unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert!(outcome(&replay).replayed());
    assert_eq!(outcome(&replay).attempts(), 1);
    assert_eq!(header(replay.headers(), "original-attempt-id"), Some("2"));
    assert_eq!(
        (server.executions(), server.successes()),
        (2, 1),
        "not run again"
    );
    assert_eq!(server.seen("idempotency-key"), [key.as_str(); 3]);
}

#[tokio::test]
async fn an_in_flight_duplicate_is_retried_after_its_retry_after_and_replayed() {
    let server = start([Step::Slow(300)]).await;
    let key = ("idempotency-key", "in-flight-1");
    let body = r#"{"name":"slow"}"#;

    // Someone else (a plain client) starts the action with the same key...
    let first = tokio::spawn({
        let url = server.url.clone();
        async move {
            let json = ("content-type", "application/json");
            support::send(&client(), "POST", url, &[key, json], body).await
        }
    });
    for _ in 0..200 {
        if server.executions() == 1 {
            break;
        }
        tokio::time::sleep(5 * MS).await;
    }
    assert_eq!(server.executions(), 1);

    // ...and our retried call arrives while it runs: 409 + Retry-After: 1, then a replay.
    let mut request = post(&server.url, body);
    request.headers_mut().insert(key.0, key.1.parse().unwrap());
    let started = std::time::Instant::now();
    let response = fast().layer(client()).oneshot(request).await.unwrap();

    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After: 1 honoured"
    );
    assert_eq!(response.status(), StatusCode::CREATED);
    let outcome = outcome(&response);
    assert_eq!(outcome.attempts(), 2);
    assert!(outcome.replayed());
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!((server.executions(), server.successes()), (1, 1));
}

#[tokio::test]
async fn connection_errors_are_retried_until_the_attempts_run_out() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener); // nothing listens: connection refused
    let client = fast().max_attempts(3).layer(client());

    let error = client
        .oneshot(post(&format!("http://{addr}/commands"), "{}"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            RetryError::Transport {
                attempts: 3,
                exhausted: true,
                ..
            }
        ),
        "{error:?}"
    );
    assert!(error.is_exhausted());
    assert_eq!(error.code(), "client.transport");
    assert!(error
        .to_string()
        .starts_with("request failed after 3 attempts"));
    assert!(std::error::Error::source(&error).is_some());
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

#[tokio::test(start_paused = true)]
async fn retry_after_in_seconds_is_honoured() {
    let (inner, log) = mock(|n| match n {
        0 => respond(503, &[("retry-after", "3")]),
        _ => status(200),
    });
    let response = fast()
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let gap = gaps(&log)[0];
    assert!(
        gap >= Duration::from_secs(3) && gap <= Duration::from_secs(3) + 10 * MS,
        "{gap:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_honoured() {
    // An HTTP-date has whole seconds: "now + 5 s" is 4 to 5 s away.
    let (inner, log) = mock(|n| match n {
        0 => {
            let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(5));
            respond(429, &[("retry-after", &date)])
        }
        _ => status(200),
    });
    let response = fast()
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let gap = gaps(&log)[0];
    assert!(
        gap >= Duration::from_secs(4) && gap <= Duration::from_secs(5),
        "{gap:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_deadline_returns_the_last_response_at_once() {
    let (inner, log) = mock(|_| respond(503, &[("retry-after", "60")]));
    let layer = fast().deadline(Duration::from_secs(10));
    let started = Instant::now();
    let response = layer
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "no sleep into the deadline"
    );
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        outcome(&response).stop_reason(),
        StopReason::DeadlineReached
    );
    assert!(outcome(&response).gave_up());
    assert_eq!(log.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn every_attempt_used_returns_the_last_response() {
    let (inner, log) = mock(|_| status(502));
    let response = fast()
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(outcome(&response).attempts(), 5);
    assert_eq!(
        outcome(&response).stop_reason(),
        StopReason::AttemptsExhausted
    );
    assert_eq!(log.lock().unwrap().len(), 5);
}

#[tokio::test(start_paused = true)]
async fn an_attempt_that_hangs_is_abandoned_and_retried() {
    let (inner, log) = mock(|n| if n == 0 { Answer::Hang } else { status(200) });
    let layer = fast().attempt_timeout(Duration::from_secs(2));
    let response = layer
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(outcome(&response).attempts(), 2);
    let gap = gaps(&log)[0];
    assert!(
        gap >= Duration::from_secs(2) && gap <= Duration::from_secs(2) + MS,
        "{gap:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_last_attempt_timing_out_is_an_error() {
    let (inner, _log) = mock(|_| Answer::Hang);
    let layer = fast()
        .max_attempts(2)
        .attempt_timeout(Duration::from_secs(1));
    let error = layer
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            RetryError::TimedOut {
                attempts: 2,
                exhausted: true,
                ..
            }
        ),
        "{error:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_deadline_abandons_the_attempt_in_flight() {
    let (inner, log) = mock(|n| if n == 0 { status(503) } else { Answer::Hang });
    let layer = RetryLayer::new()
        .backoff(Duration::ZERO, Duration::ZERO)
        .attempt_timeout(Duration::from_secs(4))
        .deadline(Duration::from_secs(10));
    let started = Instant::now();
    let error = layer
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap_err();
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(10),
        "at the deadline"
    );
    // 503 at 0 s, timeouts at 4 s and 8 s, the fourth attempt cut at 10 s.
    assert_eq!(log.lock().unwrap().len(), 4);
    match error {
        RetryError::DeadlineExceeded {
            attempts,
            deadline,
            last_status,
            source,
            ..
        } => {
            assert_eq!(attempts, 4);
            assert_eq!(deadline, Duration::from_secs(10));
            assert_eq!(last_status, Some(StatusCode::SERVICE_UNAVAILABLE));
            assert!(source.is_none());
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_failure_with_no_time_left_is_a_deadline_error_with_the_cause() {
    // A zero deadline: the attempt still runs (the client answers at once, and a
    // timeout polls its future before its timer), then no retry can start in time.
    let (inner, _log) = mock(|_| Answer::Fail);
    let layer = fast().deadline(Duration::ZERO);
    let error = layer
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap_err();
    match &error {
        RetryError::DeadlineExceeded {
            attempts: 1,
            last_status: None,
            source: Some(source),
            ..
        } => assert_eq!(source.kind(), io::ErrorKind::ConnectionRefused),
        other => panic!("{other:?}"),
    }
    assert_eq!(error.code(), "client.deadline_exceeded");
    assert!(!error.is_exhausted());
}

#[tokio::test]
async fn a_non_retryable_4xx_is_returned_at_once() {
    for code in [400, 401, 403, 404, 409, 410, 412, 413, 422, 501] {
        let (inner, log) = mock(move |_| status(code));
        let response = fast()
            .layer(inner)
            .oneshot(request(Method::PUT))
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), code);
        assert_eq!(outcome(&response).attempts(), 1, "{code}");
        assert_eq!(outcome(&response).stop_reason(), StopReason::NotRetryable);
        assert_eq!(log.lock().unwrap().len(), 1, "{code}");
    }
    // 409 with Retry-After is the idempotency layer's "in flight": retried.
    let (inner, log) = mock(|n| match n {
        0 => respond(409, &[("retry-after", "0")]),
        _ => status(201),
    });
    fast()
        .layer(inner)
        .oneshot(request(Method::POST))
        .await
        .unwrap();
    assert_eq!(log.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_post_without_a_key_is_retried_only_when_the_layer_adds_one() {
    let always_503 = |_: usize| status(503);
    let layer = fast().max_attempts(3);

    // Keys off, no key: sent once, the 503 returned as it is.
    let (inner, log) = mock(always_503);
    let response = layer
        .clone()
        .add_keys(false)
        .layer(inner)
        .oneshot(request(Method::POST))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        outcome(&response).stop_reason(),
        StopReason::NotSafeToRepeat
    );
    assert!(outcome(&response).idempotency_key().is_none());
    assert_eq!(sent_headers(&log, "idempotency-key"), ["-"]);
    assert_eq!(sent_headers(&log, "attempt-id"), ["1"]);

    // Keys off, the caller's key (X- form): retried, the key untouched.
    let (inner, log) = mock(always_503);
    let mut keyed = request(Method::POST);
    keyed
        .headers_mut()
        .insert("x-idempotency-key", "\"callers-key\"".parse().unwrap());
    let response = layer
        .clone()
        .add_keys(false)
        .layer(inner)
        .oneshot(keyed)
        .await
        .unwrap();
    assert_eq!(outcome(&response).attempts(), 3);
    assert_eq!(
        outcome(&response).idempotency_key().unwrap().as_str(),
        "callers-key"
    );
    assert_eq!(
        sent_headers(&log, "x-idempotency-key"),
        ["\"callers-key\""; 3]
    );
    assert_eq!(
        sent_headers(&log, "idempotency-key"),
        ["-"; 3],
        "none added"
    );

    // Keys on (the default): a key is added and the POST retried.
    for method in [Method::POST, Method::PATCH, Method::PUT, Method::DELETE] {
        let (inner, log) = mock(always_503);
        layer
            .clone()
            .layer(inner)
            .oneshot(request(method.clone()))
            .await
            .unwrap();
        let keys = sent_headers(&log, "idempotency-key");
        assert_eq!(keys.len(), 3, "{method}");
        assert!(log.lock().unwrap().iter().all(|s| s.method == method));
        assert!(
            keys[0] != "-" && keys.iter().all(|k| *k == keys[0]),
            "{method}"
        );
    }

    // GET is retried without a key, and never gets one.
    for add_keys in [true, false] {
        let (inner, log) = mock(always_503);
        layer
            .clone()
            .add_keys(add_keys)
            .layer(inner)
            .oneshot(request(Method::GET))
            .await
            .unwrap();
        assert_eq!(sent_headers(&log, "idempotency-key"), ["-"; 3]);
    }
}

fn streaming(chunks: &'static [&'static str]) -> ReplayBody<BoxedBody> {
    let frames = chunks.iter().map(|c| {
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Frame::data(Bytes::from_static(
            c.as_bytes(),
        )))
    });
    ReplayBody::streaming(BodyExt::boxed(StreamBody::new(futures_util::stream::iter(
        frames,
    ))))
}

fn keyed_upload(body: ReplayBody<BoxedBody>) -> Request<ReplayBody<BoxedBody>> {
    Request::post("http://upstream/uploads")
        .header("idempotency-key", "upload-1")
        .body(body)
        .unwrap()
}

#[tokio::test]
async fn a_streaming_body_is_never_sent_twice() {
    // A 503 after the body streamed: a typed error, not a second send, not the 503.
    let (inner, log) = mock(|_| status(503));
    let error = fast()
        .layer(inner)
        .oneshot(keyed_upload(streaming(&["part-1,", "part-2"])))
        .await
        .unwrap_err();
    match &error {
        RetryError::BodyNotReplayable {
            attempts,
            last_status,
            source,
            ..
        } => {
            assert_eq!(*attempts, 1);
            assert_eq!(*last_status, Some(StatusCode::SERVICE_UNAVAILABLE));
            assert!(source.is_none());
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(error.code(), "client.body_not_replayable");
    assert_eq!(log.lock().unwrap().len(), 1);
    assert_eq!(log.lock().unwrap()[0].body, "part-1,part-2");

    // A connection error after it streamed: the same, with the client's error.
    let (inner, log) = mock(|_| Answer::Fail);
    let error = fast()
        .layer(inner)
        .oneshot(keyed_upload(streaming(&["x"])))
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        RetryError::BodyNotReplayable {
            source: Some(_),
            ..
        }
    ));
    assert_eq!(log.lock().unwrap().len(), 1);

    // A success, or a response that would not be retried anyway, is returned.
    let (inner, _) = mock(|_| status(201));
    let response = fast()
        .layer(inner)
        .oneshot(keyed_upload(streaming(&["x"])))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let (inner, _) = mock(|_| status(503));
    let response = fast()
        .max_attempts(1)
        .layer(inner)
        .oneshot(keyed_upload(streaming(&["x"])))
        .await
        .unwrap();
    assert_eq!(
        outcome(&response).stop_reason(),
        StopReason::AttemptsExhausted
    );

    // A buffered ReplayBody is sent on every attempt, whole.
    let (inner, log) = mock(|n| if n < 2 { status(503) } else { status(201) });
    fast()
        .layer(inner)
        .oneshot(keyed_upload(ReplayBody::buffered("all of it")))
        .await
        .unwrap();
    let bodies: Vec<_> = log.lock().unwrap().iter().map(|s| s.body.clone()).collect();
    assert_eq!(bodies, ["all of it"; 3]);
}

#[tokio::test]
async fn the_parent_id_comes_from_the_extension_the_header_the_task_or_a_new_one() {
    let layer = fast().max_attempts(2);
    let twice = |n: usize| if n == 0 { status(500) } else { status(200) };

    // The caller's header is the parent; attempt headers are overwritten.
    let (inner, log) = mock(twice);
    let mut req = request(Method::GET);
    req.headers_mut()
        .insert("x-correlation-id", "caller-7".parse().unwrap());
    req.headers_mut()
        .insert("attempt-id", "mine".parse().unwrap());
    CorrelationId::parse("task")
        .unwrap()
        .scope(layer.clone().layer(inner).oneshot(req))
        .await
        .unwrap();
    assert_eq!(
        sent_headers(&log, "x-correlation-id"),
        ["caller-7.1", "caller-7.2"]
    );
    assert_eq!(sent_headers(&log, "attempt-id"), ["1", "2"]);

    // The extension comes first.
    let (inner, log) = mock(twice);
    let mut req = request(Method::GET);
    req.extensions_mut()
        .insert(CorrelationId::parse("ext").unwrap());
    req.headers_mut()
        .insert("x-correlation-id", "caller-7".parse().unwrap());
    layer.clone().layer(inner).oneshot(req).await.unwrap();
    assert_eq!(sent_headers(&log, "x-correlation-id"), ["ext.1", "ext.2"]);

    // The task-local.
    let (inner, log) = mock(twice);
    let response = CorrelationId::parse("task")
        .unwrap()
        .scope(layer.clone().layer(inner).oneshot(request(Method::GET)))
        .await
        .unwrap();
    assert_eq!(sent_headers(&log, "x-correlation-id"), ["task.1", "task.2"]);
    assert_eq!(outcome(&response).correlation_id(), "task.2");

    // Nothing: a fresh UUIDv7 parent.
    let (inner, log) = mock(twice);
    layer
        .clone()
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    let ids = sent_headers(&log, "x-correlation-id");
    let parent = ids[0].strip_suffix(".1").unwrap();
    assert_eq!(uuid::Uuid::parse_str(parent).unwrap().get_version_num(), 7);
    assert_eq!(ids[1], format!("{parent}.2"));

    // attempt-id off; another correlation header.
    let (inner, log) = mock(twice);
    layer
        .clone()
        .attempt_ids(false)
        .correlation_header(http::HeaderName::from_static("x-request-id"))
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(sent_headers(&log, "attempt-id"), ["-", "-"]);
    assert_eq!(sent_headers(&log, "x-request-id").len(), 2);
    assert_eq!(sent_headers(&log, "x-correlation-id"), ["-", "-"]);
}

// ---------------------------------------------------------------------------------
// Backoff, through the layer, under paused time.

/// The gaps between the attempts of one request that fails `attempts` times.
fn measured_gaps(base: Duration, cap: Duration, attempts: u32) -> Vec<Duration> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let (inner, log) = mock(|_| status(503));
        let layer = RetryLayer::new()
            .max_attempts(attempts)
            .backoff(base, cap)
            .deadline(Duration::MAX);
        let response = layer
            .layer(inner)
            .oneshot(request(Method::GET))
            .await
            .unwrap();
        assert_eq!(outcome(&response).attempts(), attempts);
        gaps(&log)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_wait_is_within_its_backoff_ceiling(
        base_ms in 0u64..2_000,
        cap_ms in 0u64..10_000,
        attempts in 1u32..8,
    ) {
        let (base, cap) = (Duration::from_millis(base_ms), Duration::from_millis(cap_ms));
        let gaps = measured_gaps(base, cap, attempts);
        prop_assert_eq!(gaps.len() as u32, attempts - 1);
        for (i, gap) in gaps.iter().enumerate() {
            let ceiling = (base * (1 << i)).min(cap);
            prop_assert!(*gap <= ceiling, "retry {}: {:?} > {:?}", i + 1, gap, ceiling);
        }
    }
}

#[test]
fn the_waits_are_jittered_over_the_whole_range() {
    // 300 requests, one retry each, ceiling 1 s: full jitter spreads the waits over
    // [0, 1 s]. Each bound below fails with probability under 10^-13.
    let waits: Vec<Duration> = (0..300)
        .map(|_| measured_gaps(Duration::from_secs(1), Duration::from_secs(1), 2)[0])
        .collect();
    assert!(waits.iter().all(|w| *w <= Duration::from_secs(1)));
    assert!(*waits.iter().min().unwrap() < 100 * MS);
    assert!(*waits.iter().max().unwrap() > 900 * MS);
    let mean = waits.iter().sum::<Duration>() / 300;
    assert!(mean > 350 * MS && mean < 650 * MS, "{mean:?}");
}

// ---------------------------------------------------------------------------------
// Key derivation.

/// Computed once with an independent implementation, Python's hashlib, over the same
/// byte layout:
///
/// ```python
/// D = b"tower-ids.idempotency-key.v1\0"
/// def key(c, e, r):
///     c = c.encode()
///     return hashlib.sha256(D + struct.pack(">Q", len(c)) + c + struct.pack(">Q", 8)
///         + struct.pack(">Q", e) + struct.pack(">Q", len(r)) + r).digest()
/// ```
#[test]
fn derived_keys_match_independent_vectors() {
    let order = br#"{"order":42,"amount_cents":1999}"#;
    let all_bytes: Vec<u8> = (0..=255).collect();
    let vectors: [(&str, u64, &[u8], &str); 4] = [
        (
            "",
            0,
            b"",
            "4512a2ffeac4bf08be71e7fffcb6f540e68683d95d3be4a4af393c06bf7dadff",
        ),
        (
            "charge-card",
            1,
            order,
            "76b2e0a3e90057d55d9959d2b8a9c9e897acb7e9da99da5160a880d104fb4c95",
        ),
        (
            "charge-card",
            2,
            order,
            "b07b2b770609aa747c6c60839ecdf129a585467cd9f253835c0e127a7d25576e",
        ),
        (
            "nightly-report",
            u64::MAX,
            &all_bytes,
            "ee092fe464e4690f0bafd90bb1e8e8e1d95894699605f3ae9d5d1dd93eaf8b48",
        ),
    ];
    for (computation, epoch, bytes, hex) in vectors {
        assert_eq!(
            derive_key(computation, epoch, bytes).to_hex(),
            hex,
            "{computation} {epoch}"
        );
    }
    let key = derive_key("charge-card", 1, order);
    assert_eq!(
        key.to_base64url(),
        "drLgo-kAV9VdmVnSuKnJ6Jest-namdpRYKiA0QT7TJU"
    );
    assert_eq!(key.to_string(), key.to_hex());
}
