//! 3,000 requests with 1 MiB bodies in flight at once through a real axum server on
//! loopback, against a 64 MiB byte budget: at most 64 are admitted, the rest are
//! refused `503` with `Retry-After`, and the process's peak of allocated bytes, counted
//! by a global allocator, stays within the budget plus a stated margin for the 6,000
//! connections (both ends are in this process). Then every refused request is retried
//! and runs.
//!
//! Its own test binary: the allocator counts every thread of the process. It opens
//! about 6,000 sockets at once (`ulimit -n` must allow that) and takes 5 to 20 s on 2
//! cores, most of it the retries, each a 1 MiB body read and hashed.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use axum::{extract::State, routing::post, Router};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use peak_alloc::PeakAlloc;
use tokio::{net::TcpStream, sync::watch};
use tower_ids::idempotency::IdempotencyLayer;

#[global_allocator]
static ALLOCATOR: PeakAlloc = PeakAlloc;

const REQUESTS: usize = 3_000;
const BODY_BYTES: usize = 1024 * 1024;
const BUDGET: usize = 64 * BODY_BYTES;
/// What may be allocated beyond the budget, none of it request bodies the layer holds
/// (figures from debug builds, as `cargo test` makes them):
/// - 40 KiB per request, for its connection's two ends and its tasks, both ends being
///   in this process: hyper starts a server connection with an 8 KiB read buffer
///   (grown when a refused body is drained) and an 8 KiB buffer for the headers it
///   writes, and the client here with 2 KiB and 8 KiB. Measured: 22 KiB per request
///   when all 3,000 are refused before a byte of their body is read.
/// - 480 KiB more per admitted request: its state through hyper, axum, this layer and
///   the handler while held (58 KiB, measured with 3,000 empty bodies held), and
///   hyper's read buffer, which grows while a body streams in, up to 8 KiB + 400 KiB.
const MARGIN: usize = REQUESTS * 40 * 1024 + (BUDGET / BODY_BYTES) * 480 * 1024;

/// Requests the handler holds, and whether it may let them go.
#[derive(Clone)]
struct Gate {
    entered: Arc<AtomicUsize>,
    released: watch::Receiver<bool>,
}

async fn hold(State(gate): State<Gate>, body: Bytes) -> (StatusCode, String) {
    gate.entered.fetch_add(1, Ordering::SeqCst);
    let mut released = gate.released.clone();
    let _ = released.wait_for(|released| *released).await;
    (StatusCode::CREATED, body.len().to_string())
}

/// Serves on 127.0.0.1 with a listen backlog for thousands of connections at once.
async fn serve(app: Router) -> SocketAddr {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(4096).unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

enum Outcome {
    Status(StatusCode, Option<String>),
    Failed(String),
}

/// One request on a connection of its own, through hyper's HTTP/1 client.
async fn send(addr: SocketAddr, key: String, body: Bytes) -> Outcome {
    let attempt = async {
        let stream = TcpStream::connect(addr).await?;
        // The answers are a few hundred bytes: a small read buffer keeps the client's
        // share of the count small.
        let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
            .read_buf_exact_size(Some(2048))
            .handshake(TokioIo::new(stream))
            .await?;
        tokio::spawn(connection);
        let request = Request::post(format!("http://{addr}/commands"))
            .header("idempotency-key", key)
            .header("content-type", "application/octet-stream")
            .body(Full::new(body))?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(http::header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_owned());
        response.into_body().collect().await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Outcome::Status(status, retry_after))
    };
    attempt
        .await
        .unwrap_or_else(|error| Outcome::Failed(error.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_thousand_1_mib_requests_in_flight_stay_within_the_budget() {
    let started = Instant::now();
    let (release, released) = watch::channel(false);
    let gate = Gate {
        entered: Arc::default(),
        released,
    };
    let layer = IdempotencyLayer::new().max_buffered_bytes(BUDGET);
    let app = Router::new()
        .route("/commands", post(hold).layer(layer))
        .with_state(gate.clone());
    let addr = serve(app).await;
    // One body, shared by every request: the client's copies would swamp the count.
    let body = Bytes::from(vec![b'x'; BODY_BYTES]);

    let baseline = ALLOCATOR.current_usage();
    ALLOCATOR.reset_peak_usage();
    let refused = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let (body, refused) = (body.clone(), refused.clone());
            tokio::spawn(async move {
                let outcome = send(addr, format!("key-{i}"), body).await;
                if matches!(outcome, Outcome::Status(StatusCode::SERVICE_UNAVAILABLE, _)) {
                    refused.fetch_add(1, Ordering::SeqCst);
                }
                (i, outcome)
            })
        })
        .collect();

    // Every request is either held by the handler or answered.
    let deadline = Instant::now() + Duration::from_secs(20);
    while gate.entered.load(Ordering::SeqCst) + refused.load(Ordering::SeqCst) < REQUESTS {
        assert!(
            Instant::now() < deadline,
            "stuck: {} held, {} refused",
            gate.entered.load(Ordering::SeqCst),
            refused.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let admitted = gate.entered.load(Ordering::SeqCst);
    let peak = ALLOCATOR.peak_usage().saturating_sub(baseline);
    let in_flight = Instant::now();
    println!(
        "budget: {REQUESTS} requests of {BODY_BYTES} bytes, budget {BUDGET}: {admitted} admitted, \
         {} refused; peak allocated {peak} bytes above the baseline ({:.1} MiB; budget {} MiB, \
         margin {:.1} MiB), reached in {:.1?}",
        REQUESTS - admitted,
        peak as f64 / 1048576.0,
        BUDGET / BODY_BYTES,
        MARGIN as f64 / 1048576.0,
        in_flight - started,
    );
    assert!(
        admitted <= BUDGET / BODY_BYTES,
        "{admitted} admitted, more than fit"
    );
    assert!(admitted > 0, "the budget admitted nothing");
    assert!(
        peak <= BUDGET + MARGIN,
        "peak {peak} bytes above the baseline, over the budget {BUDGET} plus the margin {MARGIN}"
    );

    release.send(true).unwrap();
    let mut to_retry = Vec::new();
    let mut created = 0;
    for task in tasks {
        let (i, outcome) = task.await.unwrap();
        match outcome {
            Outcome::Status(StatusCode::CREATED, _) => created += 1,
            Outcome::Status(StatusCode::SERVICE_UNAVAILABLE, retry_after) => {
                assert_eq!(retry_after.as_deref(), Some("1"), "request {i}");
                to_retry.push(i);
            }
            Outcome::Status(status, _) => panic!("request {i}: {status}"),
            Outcome::Failed(error) => panic!("request {i} failed: {error}"),
        }
    }
    assert_eq!(created, admitted, "every admitted request answered 201");

    // The refused retried, fewer at once than the budget holds: each one runs.
    let retried = futures_util::future::join_all((0..16).map(|lane| {
        let keys: Vec<_> = to_retry.iter().copied().skip(lane).step_by(16).collect();
        let body = body.clone();
        tokio::spawn(async move {
            let mut created = 0;
            for i in keys {
                match send(addr, format!("key-{i}"), body.clone()).await {
                    Outcome::Status(StatusCode::CREATED, _) => created += 1,
                    Outcome::Status(status, _) => panic!("retry of request {i}: {status}"),
                    Outcome::Failed(error) => panic!("retry of request {i} failed: {error}"),
                }
            }
            created
        })
    }))
    .await;
    let retried: usize = retried.into_iter().map(Result::unwrap).sum();
    assert_eq!(retried, to_retry.len());
    assert_eq!(
        gate.entered.load(Ordering::SeqCst),
        REQUESTS,
        "each ran once"
    );
    println!(
        "budget: {retried} refused requests retried, all 201; {:.1?} in all",
        started.elapsed()
    );
}
