//! Against a real server on 127.0.0.1: the correlation layer, then the idempotency
//! layer on `POST /commands`, scripted to drop connections or answer `409`. Every
//! attempt carries the key and its own correlation ID, the handler runs once, an
//! in-flight duplicate is retried after its `Retry-After` and replayed, and connection
//! errors are retried until the attempts run out.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use axum::{extract::State, response::Response as AxumResponse, routing, Router};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use tower::{Layer, ServiceExt};
use tower_ids::{
    client::{RetryError, StopReason},
    correlation::{CorrelationId, CorrelationLayer},
    idempotency::IdempotencyLayer,
};

use super::{
    fast, header, outcome, post,
    support::{self, client, serve, Logs},
    MS,
};

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
