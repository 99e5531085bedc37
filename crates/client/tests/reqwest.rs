//! The outbound correlation layer and the client retry layer as reqwest middleware
//! (feature `reqwest`), against a real axum server on 127.0.0.1 with the server layers.
#![allow(missing_docs)]

use tower_ids_test_support as support;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{extract::State, routing::post, Router};
use http::{HeaderMap, StatusCode};
use reqwest_middleware::ClientBuilder;
use support::serve;
use tower_ids::{
    client::{RetryError, RetryLayer, RetryOutcome},
    correlation::{CorrelationId, CorrelationLayer, OutboundCorrelationLayer},
    idempotency::IdempotencyLayer,
};

type Seen = Arc<Mutex<Vec<HeaderMap>>>;

/// `POST /commands` behind both server layers: answers `503` to its first run, `201`
/// after; `POST /echo` has no idempotency layer. Both remember the request headers.
async fn server() -> (String, Seen) {
    let seen = Seen::default();
    let commands = |State(seen): State<Seen>, headers: HeaderMap| async move {
        let mut seen = seen.lock().unwrap();
        seen.push(headers);
        if seen.len() == 1 {
            (StatusCode::SERVICE_UNAVAILABLE, "not yet")
        } else {
            (StatusCode::CREATED, "created")
        }
    };
    let echo = |State(seen): State<Seen>, headers: HeaderMap| async move {
        seen.lock().unwrap().push(headers);
        "ok"
    };
    let app = Router::new()
        .route("/commands", post(commands).layer(IdempotencyLayer::new()))
        .route("/echo", post(echo))
        .with_state(seen.clone())
        .layer(CorrelationLayer::new());
    (format!("http://{}", serve(app).await), seen)
}

fn header(headers: &HeaderMap, name: &str) -> String {
    headers[name].to_str().unwrap().to_owned()
}

#[tokio::test]
async fn the_retry_layer_sends_one_key_and_a_new_attempt_each_time() {
    let (url, seen) = server().await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryLayer::new().backoff(Duration::from_millis(1), Duration::from_millis(10)))
        .build();

    let response = client
        .post(format!("{url}/commands"))
        .body(r#"{"name":"reboot"}"#)
        .with_extension(CorrelationId::parse("order-7").unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.url().path(), "/commands", "reqwest's own response");
    let outcome = response.extensions().get::<RetryOutcome>().unwrap().clone();
    assert_eq!(outcome.attempts(), 2);
    assert!(!outcome.replayed());
    assert_eq!(response.headers()["x-correlation-id"], "order-7.2");
    assert_eq!(response.text().await.unwrap(), "created");

    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    let key = header(&seen[0], "idempotency-key");
    assert_eq!(uuid::Uuid::parse_str(&key).unwrap().get_version_num(), 7);
    assert_eq!(
        header(&seen[1], "idempotency-key"),
        key,
        "one key for every attempt"
    );
    assert_eq!(header(&seen[0], "attempt-id"), "1");
    assert_eq!(header(&seen[1], "attempt-id"), "2");
    assert_eq!(header(&seen[0], "x-correlation-id"), "order-7.1");
    assert_eq!(header(&seen[1], "x-correlation-id"), "order-7.2");
    assert_eq!(
        outcome.idempotency_key().map(|k| k.as_str()),
        Some(key.as_str())
    );
}

#[tokio::test]
async fn a_duplicate_call_with_the_callers_key_is_a_replay() {
    let (url, seen) = server().await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryLayer::new().backoff(Duration::from_millis(1), Duration::from_millis(10)))
        .build();
    let call = || {
        client
            .post(format!("{url}/commands"))
            .header("idempotency-key", "caller-key-1")
            .body("{}")
            .send()
    };
    assert_eq!(call().await.unwrap().status(), StatusCode::CREATED);
    let again = call().await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(again.extensions().get::<RetryOutcome>().unwrap().replayed());
    assert_eq!(again.headers()["idempotency-key"], "caller-key-1");
    assert_eq!(
        seen.lock().unwrap().len(),
        2,
        "the 503 and the 201; the replay ran nothing"
    );
}

#[tokio::test]
async fn errors_are_reqwests_own_or_the_layers() {
    // A port nothing listens on: every attempt is refused; the error is reqwest's.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/commands", closed.local_addr().unwrap());
    drop(closed);
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryLayer::new()
                .max_attempts(3)
                .backoff(Duration::from_millis(1), Duration::from_millis(5)),
        )
        .build();
    let error = client.post(&url).body("{}").send().await.unwrap_err();
    assert!(
        matches!(error, reqwest_middleware::Error::Reqwest(ref e) if e.is_connect()),
        "{error:?}"
    );

    // A streaming body cannot be sent twice: the layer's own error, to downcast.
    let (url, _seen) = server().await;
    let stream = futures_util::stream::iter([Ok::<_, std::io::Error>(http_body::Frame::data(
        bytes::Bytes::from("{}"),
    ))]);
    let error = client
        .post(format!("{url}/commands"))
        .body(reqwest::Body::wrap(http_body_util::StreamBody::new(stream)))
        .send()
        .await
        .unwrap_err();
    let reqwest_middleware::Error::Middleware(error) = error else {
        panic!("not the layer's error: {error:?}");
    };
    let error = error
        .downcast_ref::<RetryError<reqwest_middleware::Error>>()
        .unwrap();
    assert!(
        matches!(error, RetryError::BodyNotReplayable { .. }),
        "{error}"
    );
}

#[tokio::test]
async fn the_outbound_layer_sets_the_correlation_id_per_call() {
    let (url, seen) = server().await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(OutboundCorrelationLayer::new().extend_per_call(true))
        .build();
    let parent = CorrelationId::parse("handler-1").unwrap();
    parent
        .clone()
        .scope(async {
            client.post(format!("{url}/echo")).send().await.unwrap();
            client.post(format!("{url}/echo")).send().await.unwrap();
        })
        .await;
    // The call's own ID, from an extension, and a header the caller set, untouched.
    client
        .post(format!("{url}/echo"))
        .with_extension(CorrelationId::parse("job-9").unwrap())
        .send()
        .await
        .unwrap();
    client
        .post(format!("{url}/echo"))
        .header("x-correlation-id", "caller-set")
        .send()
        .await
        .unwrap();
    let seen = seen.lock().unwrap();
    let ids: Vec<_> = seen.iter().map(|h| header(h, "x-correlation-id")).collect();
    assert_eq!(ids, ["handler-1.1", "handler-1.2", "job-9.1", "caller-set"]);
}
