//! The byte budget of request bodies, as a route sees it: held while the work runs,
//! refused with `503` or `413`, and given back on every path.

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use tokio::sync::{mpsc, Notify};
use tower::{service_fn, Service, ServiceExt};

use crate::{
    body::Body,
    idempotency::{Code, IdempotencyLayer},
};

type Frames = mpsc::UnboundedSender<Result<Frame<Bytes>, std::io::Error>>;
type Streamed = StreamBody<
    std::pin::Pin<
        Box<dyn futures_util::Stream<Item = Result<Frame<Bytes>, std::io::Error>> + Send>,
    >,
>;

/// A body whose frames the test sends when it likes; it ends when `Frames` drops.
fn streamed() -> (Frames, Streamed) {
    let (sender, receiver) = mpsc::unbounded_channel();
    let frames = futures_util::stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|frame| (frame, receiver))
    });
    (sender, StreamBody::new(Box::pin(frames)))
}

fn data(len: usize) -> Result<Frame<Bytes>, std::io::Error> {
    Ok(Frame::data(Bytes::from(vec![b'x'; len])))
}

/// A handler that counts its runs and, while `hold` is set, waits for `release`.
#[derive(Clone, Default)]
struct Handler {
    runs: Arc<AtomicUsize>,
    release: Arc<Notify>,
    hold: bool,
}

impl Handler {
    fn holding() -> Self {
        Self {
            hold: true,
            ..Self::default()
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn service<B: Send + 'static>(
        &self,
    ) -> impl Service<
        Request<Body<B>>,
        Response = Response<Full<Bytes>>,
        Error = Infallible,
        Future = impl Send,
    > + Clone
           + Send {
        let handler = self.clone();
        service_fn(move |_request: Request<Body<B>>| {
            let handler = handler.clone();
            async move {
                handler.runs.fetch_add(1, Ordering::SeqCst);
                if handler.hold {
                    handler.release.notified().await;
                }
                let mut response = Response::new(Full::new(Bytes::from_static(b"done")));
                *response.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(response)
            }
        })
    }
}

fn post<B>(key: &str, content_length: Option<usize>, body: B) -> Request<B> {
    let mut request = Request::post("/commands").header("idempotency-key", key);
    if let Some(len) = content_length {
        request = request.header("content-length", len);
    }
    request.body(body).unwrap()
}

/// A body of `len` bytes in one frame, complete.
fn full(len: usize) -> Streamed {
    StreamBody::new(Box::pin(futures_util::stream::iter([data(len)])))
}

async fn until(mut done: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("never happened");
}

async fn answer<B>(response: Response<B>) -> (StatusCode, Option<String>, serde_json::Value)
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let status = response.status();
    let retry_after = response
        .headers()
        .get(http::header::RETRY_AFTER)
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    (status, retry_after, json["code"].clone())
}

#[tokio::test]
async fn a_body_holds_its_bytes_until_the_work_ends() {
    let layer = IdempotencyLayer::new().max_buffered_bytes(1000);
    let budget = layer.settings.budget.clone();
    let handler = Handler::holding();
    let service = tower_layer::Layer::layer(&layer, handler.service());

    let declared = tokio::spawn(service.clone().oneshot(post("a", Some(300), full(300))));
    until(|| handler.runs() == 1).await;
    assert_eq!(
        budget.available(),
        700,
        "the declared length, held by the handler's work"
    );

    // Without a length: chunk by chunk, into a buffer that ends at the body's size.
    let (frames, body) = streamed();
    let streaming = tokio::spawn(service.clone().oneshot(post("b", None, body)));
    frames.send(data(100)).unwrap();
    frames.send(data(150)).unwrap();
    drop(frames);
    until(|| handler.runs() == 2).await;
    assert_eq!(budget.available(), 450);

    handler.release.notify_waiters();
    assert_eq!(
        declared.await.unwrap().unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(
        streaming.await.unwrap().unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(budget.available(), 1000, "all given back");
}

#[tokio::test]
async fn over_the_budget_is_503_with_retry_after_and_the_handler_never_runs() {
    let layer = IdempotencyLayer::new().max_buffered_bytes(1000);
    let budget = layer.settings.budget.clone();
    let handler = Handler::holding();
    let service = tower_layer::Layer::layer(&layer, handler.service());

    let holder = tokio::spawn(service.clone().oneshot(post("a", Some(800), full(800))));
    until(|| handler.runs() == 1).await;

    let declared = service.clone().oneshot(post("b", Some(300), full(300)));
    let (status, retry_after, code) = answer(declared.await.unwrap()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert_eq!(code, Code::Overloaded.as_str());

    // Without a length the budget runs out partway: refused then, all given back.
    let (frames, body) = streamed();
    let streaming = tokio::spawn(service.clone().oneshot(post("c", None, body)));
    for _ in 0..3 {
        frames.send(data(100)).unwrap();
    }
    let (status, _, code) = answer(streaming.await.unwrap().unwrap()).await;
    assert_eq!(
        (status, code.as_str()),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Some(Code::Overloaded.as_str())
        )
    );
    assert_eq!(budget.available(), 200);
    assert_eq!(handler.runs(), 1, "neither refused request ran");

    handler.release.notify_waiters();
    holder.await.unwrap().unwrap();
    assert_eq!(budget.available(), 1000);
    let retry = service.clone().oneshot(post("b", Some(300), full(300)));
    let retry = tokio::spawn(retry);
    until(|| handler.runs() == 2).await;
    handler.release.notify_waiters();
    assert_eq!(retry.await.unwrap().unwrap().status(), StatusCode::CREATED);
    assert_eq!(budget.available(), 1000);
}

#[tokio::test]
async fn a_body_larger_than_the_whole_budget_is_413_not_503() {
    let layer = IdempotencyLayer::new().max_buffered_bytes(1000);
    let handler = Handler::default();
    let service = tower_layer::Layer::layer(&layer, handler.service());

    let declared = service.clone().oneshot(post("a", Some(1001), full(1001)));
    let undeclared = service.clone().oneshot(post("b", None, full(1001)));
    for response in [declared.await.unwrap(), undeclared.await.unwrap()] {
        let (status, retry_after, code) = answer(response).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(retry_after, None, "no retry can fit it");
        assert_eq!(code, Code::BodyTooLarge.as_str());
    }
    assert_eq!(handler.runs(), 0);
    assert_eq!(layer.settings.budget.available(), 1000);
}

#[tokio::test]
async fn a_body_that_fails_or_ends_short_gives_its_bytes_back() {
    let layer = IdempotencyLayer::new().max_buffered_bytes(1000);
    let budget = layer.settings.budget.clone();
    let handler = Handler::default();
    let service = tower_layer::Layer::layer(&layer, handler.service());

    let (frames, body) = streamed();
    let failing = tokio::spawn(service.clone().oneshot(post("a", Some(300), body)));
    frames.send(data(100)).unwrap();
    frames
        .send(Err(std::io::Error::other("connection reset")))
        .unwrap();
    let (status, _, code) = answer(failing.await.unwrap().unwrap()).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::BAD_REQUEST, Some(Code::BodyUnreadable.as_str()))
    );

    // Shorter than its Content-Length: refused, never run with a truncated body.
    let (frames, body) = streamed();
    let short = tokio::spawn(service.clone().oneshot(post("b", Some(300), body)));
    frames.send(data(100)).unwrap();
    drop(frames);
    let (status, _, code) = answer(short.await.unwrap().unwrap()).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::BAD_REQUEST, Some(Code::BodyUnreadable.as_str()))
    );

    assert_eq!(handler.runs(), 0);
    assert_eq!(budget.available(), 1000);
}

#[tokio::test]
async fn a_dropped_response_future_gives_its_bytes_back() {
    let layer = IdempotencyLayer::new().max_buffered_bytes(1000);
    let budget = layer.settings.budget.clone();
    let handler = Handler::holding();
    let service = tower_layer::Layer::layer(&layer, handler.service());

    // Dropped mid-handler: the work goes on in a task of its own, holding the bytes
    // until the handler is done and its outcome stored.
    let mid_handler = service.clone().oneshot(post("a", Some(300), full(300)));
    let dropped = tokio::time::timeout(Duration::from_millis(20), mid_handler).await;
    assert!(dropped.is_err(), "the caller gave up");
    assert_eq!(handler.runs(), 1);
    assert_eq!(budget.available(), 700);
    handler.release.notify_waiters();
    until(|| budget.available() == 1000).await;

    // Dropped mid-read, before its key is claimed: cancelled, the bytes back at once,
    // and the handler never runs.
    let (frames, body) = streamed();
    let mid_read = service.clone().oneshot(post("b", Some(300), body));
    frames.send(data(100)).unwrap();
    let dropped = tokio::time::timeout(Duration::from_millis(20), mid_read).await;
    assert!(dropped.is_err());
    assert_eq!(budget.available(), 1000);
    let _ = frames.send(data(200));
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(handler.runs(), 1, "only the first request ran");

    // Dropped where no runtime can take the rest: dropped with it.
    let (frames, body) = streamed();
    let mut service = service.clone();
    let mut future = service
        .ready()
        .await
        .unwrap()
        .call(post("c", Some(300), body));
    frames.send(data(100)).unwrap();
    assert!(futures_util::poll!(&mut future).is_pending());
    assert_eq!(budget.available(), 700);
    std::thread::spawn(move || drop(future)).join().unwrap();
    assert_eq!(budget.available(), 1000);
    assert_eq!(handler.runs(), 1);
}
