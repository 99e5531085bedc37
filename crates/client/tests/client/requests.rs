//! What the layer sends and returns, against a scripted `service_fn` client: a
//! non-retryable `4xx` at once, a `POST` without a key retried only when the layer adds
//! one, a streaming body never sent twice, and the parent ID taken from the extension,
//! the header, the task or a new one.

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tower::{Layer, ServiceExt};
use tower_ids::{
    client::{BoxedBody, ReplayBody, RetryError, StopReason},
    correlation::CorrelationId,
};

use super::{fast, mock, outcome, request, respond, sent_headers, status, Answer};

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
