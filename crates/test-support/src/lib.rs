//! Helpers shared by the workspace's integration tests: a real server on loopback, a
//! real client, a tracing subscriber that captures JSON log lines, and the servers the
//! tests break on purpose (PostgreSQL, Redis, RabbitMQ, Kafka). Not published; each
//! crate's tests take it as a dev-dependency with the features of the servers they use.
#![allow(missing_docs)]

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod postgres_server;
pub mod proxy;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
pub mod redis;
pub mod redis_cluster;
#[cfg(feature = "replica")]
pub mod replica;

use std::{
    io,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use serde_json::Value;
use tracing_subscriber::fmt::MakeWriter;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Whether the fault tests run their whole trial matrix rather than the slice CI runs:
/// `TOWER_IDS_FULL_TRIALS` set, and neither empty nor `0`. So
/// `TOWER_IDS_FULL_TRIALS=1` runs it, and `TOWER_IDS_FULL_TRIALS=0` (or unset, or
/// empty) runs the slice.
pub fn full_trials() -> bool {
    std::env::var_os("TOWER_IDS_FULL_TRIALS").is_some_and(|v| v != "0" && !v.is_empty())
}

/// Serves `app` on 127.0.0.1 on a free port until the test ends.
pub async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// What the user sees of a response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    /// Every value of header `name`, in order.
    pub fn all(&self, name: &str) -> Vec<String> {
        self.headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    }

    /// `idempotency-expires`, parsed; panics if it is missing or not an HTTP-date.
    pub fn expires(&self) -> std::time::SystemTime {
        let value = self
            .header("idempotency-expires")
            .expect("idempotency-expires");
        httpdate::parse_http_date(value).expect("an HTTP-date")
    }

    /// Whether `at` is within a second of `expected`, either way.
    pub fn within_a_second(at: std::time::SystemTime, expected: std::time::SystemTime) -> bool {
        let apart = at
            .duration_since(expected)
            .or_else(|_| expected.duration_since(at))
            .unwrap();
        apart <= std::time::Duration::from_secs(1)
    }

    /// Whether the answer says it is a replay (`idempotent-replayed: true`).
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Whether the answer is a replayed `201 Created`: what a retry of a command that
    /// was created gets once its outcome is stored.
    pub fn replayed_created(&self) -> bool {
        self.status == StatusCode::CREATED && self.replayed()
    }

    /// The `code` of a problem body (`application/problem+json`), if the body has one.
    pub fn problem_code(&self) -> Option<String> {
        let body: Value = serde_json::from_slice(&self.body).ok()?;
        body.get("code")?.as_str().map(str::to_owned)
    }

    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// Sends `method url` with `headers` and `body`, and reads the whole response.
pub async fn send(
    client: &HttpClient,
    method: &str,
    url: String,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    try_send(client, method, url, headers, body).await.unwrap()
}

/// As [`send`], but a connection that fails or closes early is an `Err`.
pub async fn try_send(
    client: &HttpClient,
    method: &str,
    url: String,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Reply, Box<dyn std::error::Error + Send + Sync>> {
    let mut request = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(Bytes::from(body.to_owned())))?;
    let response = client.request(request).await?;
    let (parts, body) = response.into_parts();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await?.to_bytes(),
    })
}

/// Captured JSON log lines, one object each, with the current span's fields under
/// `span` and every entered span under `spans`.
///
/// One global subscriber writes each event to the buffer of the thread that emitted it.
/// `#[tokio::test]` runs the server, the client and the handler on the test's thread,
/// so a test sees exactly its own events. (Scoped subscribers per test lose events
/// when tests run in parallel: tracing caches callsite interest process-wide.)
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

thread_local! {
    static THREAD_LOGS: std::cell::RefCell<Option<Logs>> = const { std::cell::RefCell::new(None) };
}

/// Stops capturing on this thread when dropped.
pub struct CaptureGuard(());

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        THREAD_LOGS.with(|logs| logs.borrow_mut().take());
    }
}

#[derive(Clone, Copy)]
struct ThreadWriter;

impl io::Write for ThreadWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        THREAD_LOGS.with(|logs| {
            if let Some(logs) = logs.borrow().as_ref() {
                logs.0.lock().unwrap().extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for ThreadWriter {
    type Writer = Self;

    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
}

impl Logs {
    /// Captures every event of this thread (hyper's own below INFO left out) until the
    /// guard drops.
    pub fn capture() -> (Self, CaptureGuard) {
        static INSTALL: std::sync::Once = std::sync::Once::new();
        INSTALL.call_once(|| {
            tracing_subscriber::fmt()
                .json()
                .with_current_span(true)
                .with_span_list(true)
                .with_env_filter("trace,hyper=info,hyper_util=info,h2=info")
                .with_writer(ThreadWriter)
                .try_init()
                .expect("no other subscriber is installed in a test binary that captures logs");
        });
        let logs = Self::default();
        THREAD_LOGS.with(|current| *current.borrow_mut() = Some(logs.clone()));
        (logs, CaptureGuard(()))
    }

    pub fn raw(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    pub fn lines(&self) -> Vec<Value> {
        self.raw()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    /// The lines whose `event` field is `code`.
    pub fn events(&self, code: &str) -> Vec<Value> {
        self.lines()
            .into_iter()
            .filter(|line| line["fields"]["event"] == code)
            .collect()
    }

    /// The lines whose message is `message`.
    pub fn messages(&self, message: &str) -> Vec<Value> {
        self.lines()
            .into_iter()
            .filter(|line| line["fields"]["message"] == message)
            .collect()
    }
}
