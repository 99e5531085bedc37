//! Instructions per request under callgrind: the correlation layer against tower-http's
//! request-ID pair, and the idempotency layer on an axum `Router` against
//! `axum-idempotent`, each beside the bare service, in one run.
//!
//! Seconds on a shared machine move by tens of percent between runs; instruction
//! counts under `valgrind --tool=callgrind` do not (the same binary and inputs give the
//! same count, whatever else the machine is doing). Each case runs in a process of its
//! own, twice: `WARMUP + N` and `WARMUP + 2N` requests; the difference divided by `N` is
//! the cost of one request in the steady state, without start-up, warm-up or exit.
//!
//! Cases (`<group>/<service>/<path>`):
//! - `correlation/{none,fmt}/...`: a `service_fn` handler answering at once, with no
//!   subscriber or a fmt subscriber at INFO writing to `io::sink`; `bare`, `tower_ids`
//!   (`CorrelationLayer::new()`), `tower_http` (`SetRequestIdLayer` with UUIDv4 +
//!   `PropagateRequestIdLayer`); `restore` sends an ID, `generate` does not.
//! - `idempotency/...`: a POST with a 64-byte JSON body through an axum `Router`, the
//!   handler answering `201` with 1 KiB, the response body collected; `bare`, `tower_ids`
//!   (`IdempotencyLayer::new()`, moka) and `axum_idempotent` (0.6 on ruts' moka session
//!   store, as `benches/idempotency.rs` sets it up); `first` sends a fresh key every
//!   request, `replay` one key. `floor/replay` is the floor of a replay
//!   (`benches/common/floor.rs`): the replay is reported against it as well as against
//!   `axum_idempotent`.
//!
//! SHA-256: valgrind does not emulate the SHA extensions (SHA-NI), so under callgrind
//! `sha2` falls back to its portable code, about 3,500 instructions per 64-byte block
//! where the extensions take a few hundred. The idempotency layer hashes its scope
//! with SHA-256 (its fingerprint is XXH3-128). The table therefore gives each
//! case's instructions both in all and without `sha2::sha256::compress256`, which is
//! the part a CPU with SHA extensions does in hardware; the ratio to the peer is taken
//! on the latter.
//!
//! Run: `cargo bench --bench instructions` (needs `valgrind` on `PATH`; about two
//! minutes). `cargo bench --bench instructions -- idempotency` runs the cases whose
//! name contains `idempotency`.
#![allow(missing_docs)]

use std::{convert::Infallible, process::Command, sync::atomic::Ordering};

use axum::{body::Body, Router};
use bytes::Bytes;
use common::{end_session, key, request, route, start_session, PATH};
use futures_util::FutureExt;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_ids::{correlation::CorrelationLayer, idempotency::IdempotencyLayer};

#[path = "common/idempotent_route.rs"]
mod common;
#[path = "common/floor.rs"]
mod floor;

/// Requests before the counted ones: caches, allocator and lazily built state settle.
const WARMUP: u64 = 200;
/// The counted requests: the two runs differ by this many.
const N: u64 = 2_000;
const CASE_VAR: &str = "TOWER_IDS_INSTRUCTIONS_CASE";
const REQUESTS_VAR: &str = "TOWER_IDS_INSTRUCTIONS_REQUESTS";

const CORRELATION_HEADER: &str = "x-correlation-id";
const INCOMING_ID: &str = "0193c4a2-7b1e-7cc0-9a51-3f2d6c1e8b47";
const RESPONSE_BYTES: usize = 1024;
const DUMMY_COOKIE: &str = "session=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
/// As in `benches/idempotency.rs`: axum-idempotent's `first` moves to a fresh session
/// every this many keys, since its store sweeps a session's keys on every write.
const KEYS_PER_SESSION: u64 = 64;

/// Every case, in the order of the table: (name, what it is compared with).
const CASES: &[(&str, &[&str])] = &[
    ("correlation/none/bare/restore", &[]),
    ("correlation/none/tower_http/restore", &[]),
    (
        "correlation/none/tower_ids/restore",
        &["correlation/none/tower_http/restore"],
    ),
    ("correlation/none/bare/generate", &[]),
    ("correlation/none/tower_http/generate", &[]),
    (
        "correlation/none/tower_ids/generate",
        &["correlation/none/tower_http/generate"],
    ),
    ("correlation/fmt/bare/restore", &[]),
    ("correlation/fmt/tower_http/restore", &[]),
    (
        "correlation/fmt/tower_ids/restore",
        &["correlation/fmt/tower_http/restore"],
    ),
    ("correlation/fmt/bare/generate", &[]),
    ("correlation/fmt/tower_http/generate", &[]),
    (
        "correlation/fmt/tower_ids/generate",
        &["correlation/fmt/tower_http/generate"],
    ),
    ("idempotency/bare", &[]),
    ("idempotency/axum_idempotent/replay", &[]),
    ("idempotency/floor/replay", &[]),
    (
        "idempotency/tower_ids/replay",
        &[
            "idempotency/floor/replay",
            "idempotency/axum_idempotent/replay",
        ],
    ),
    ("idempotency/axum_idempotent/first", &[]),
    (
        "idempotency/tower_ids/first",
        &["idempotency/axum_idempotent/first"],
    ),
];

fn main() {
    if let Ok(case) = std::env::var(CASE_VAR) {
        let requests = std::env::var(REQUESTS_VAR)
            .expect("request count")
            .parse()
            .expect("a number");
        run_case(&case, requests);
        return;
    }
    // `cargo bench` passes `--bench`; any other argument filters the cases.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with("--"))
        .collect();
    if Command::new("valgrind").arg("--version").output().is_err() {
        eprintln!("SKIPPED: benches/instructions needs valgrind ('sudo apt-get install valgrind')");
        return;
    }
    let mut measured: Vec<(&str, f64)> = Vec::new();
    println!(
        "{:<40} {:>10} {:>10} {:>10}   compared with (added, without SHA-256)",
        "case", "all", "no SHA", "added"
    );
    for &(case, peers) in CASES {
        if !filter.is_empty() && !filter.iter().any(|f| case.contains(f.as_str())) {
            continue;
        }
        let (total_long, sha_long) = instructions(case, WARMUP + 2 * N);
        let (total_short, sha_short) = instructions(case, WARMUP + N);
        let sha = (sha_long - sha_short) as f64 / N as f64;
        let all = (total_long - total_short) as f64 / N as f64;
        let per_request = all - sha;
        measured.push((case, per_request));
        let bare = bare_of(case).and_then(|bare| lookup(&measured, &bare));
        let added = bare.map(|bare| per_request - bare);
        let versus: Vec<String> = peers
            .iter()
            .filter_map(|peer| {
                let peer_added = lookup(&measured, peer)? - bare?;
                Some(format!(
                    "{peer}: {:.0} added, ratio {:.2}",
                    peer_added,
                    added? / peer_added
                ))
            })
            .collect();
        println!(
            "{case:<40} {all:>10.0} {per_request:>10.0} {:>10}   {}",
            added.map_or_else(|| "-".to_owned(), |added| format!("{added:.0}")),
            versus.join("; ")
        );
    }
}

/// The bare case a case is measured against.
fn bare_of(case: &str) -> Option<String> {
    if let Some(rest) = case.strip_prefix("correlation/") {
        let mut parts = rest.split('/');
        let subscriber = parts.next()?;
        let path = parts.nth(1)?;
        return Some(format!("correlation/{subscriber}/bare/{path}"));
    }
    case.starts_with("idempotency/")
        .then(|| "idempotency/bare".to_owned())
}

fn lookup(measured: &[(&str, f64)], case: &str) -> Option<f64> {
    measured
        .iter()
        .find(|(name, _)| *name == case)
        .map(|&(_, value)| value)
}

/// Runs `case` for `requests` requests under callgrind: the instructions it executed,
/// and those of them in SHA-256's compression function.
fn instructions(case: &str, requests: u64) -> (u64, u64) {
    let exe = std::env::current_exe().expect("own path");
    let profile = std::env::temp_dir().join(format!(
        "tower-ids-instructions-{}-{requests}.out",
        std::process::id()
    ));
    let output = Command::new("valgrind")
        .args(["--tool=callgrind", "--cache-sim=no"])
        .arg(format!("--callgrind-out-file={}", profile.display()))
        .arg(exe)
        .env(CASE_VAR, case)
        .env(REQUESTS_VAR, requests.to_string())
        .output()
        .expect("valgrind runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{case} failed:\n{stderr}");
    let total = stderr
        .lines()
        .find_map(|line| {
            let (_, count) = line.split_once("Collected : ")?;
            count.trim().parse().ok()
        })
        .unwrap_or_else(|| panic!("no instruction count from callgrind:\n{stderr}"));
    let sha = sha_instructions(&profile);
    let _ = std::fs::remove_file(&profile);
    (total, sha)
}

/// The instructions spent in `sha2::sha256::compress256` and what it calls, as
/// `callgrind_annotate --inclusive=yes` reads them from `profile`.
fn sha_instructions(profile: &std::path::Path) -> u64 {
    let output = Command::new("callgrind_annotate")
        .args(["--inclusive=yes", "--threshold=100"])
        .arg(profile)
        .output()
        .expect("callgrind_annotate runs (it comes with valgrind)");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find(|line| line.contains("sha2::sha256::compress256"))
        .and_then(|line| line.split_whitespace().next())
        .map_or(0, |count| count.replace(',', "").parse().expect("a count"))
}

fn run_case(case: &str, requests: u64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let parts: Vec<&str> = case.split('/').collect();
    match parts.as_slice() {
        ["correlation", subscriber, service, path] => {
            let restore = match *path {
                "restore" => true,
                "generate" => false,
                other => panic!("unknown path {other}"),
            };
            let run = || correlation(service, restore, requests);
            match *subscriber {
                "none" => run(),
                "fmt" => {
                    let subscriber = tracing_subscriber::fmt()
                        .with_writer(std::io::sink)
                        .with_max_level(tracing::Level::INFO)
                        .finish();
                    tracing::subscriber::with_default(subscriber, run)
                }
                other => panic!("unknown subscriber {other}"),
            }
        }
        ["idempotency", "bare"] => runtime.block_on(idempotency_bare(requests)),
        ["idempotency", "tower_ids", path] => runtime.block_on(tower_ids(path, requests)),
        ["idempotency", "floor", "replay"] => runtime.block_on(floor_replay(requests)),
        ["idempotency", "axum_idempotent", path] => {
            runtime.block_on(axum_idempotent(path, requests))
        }
        _ => panic!("unknown case {case}"),
    }
}

async fn correlation_handler(_request: Request<()>) -> Result<Response<&'static str>, Infallible> {
    Ok(Response::new("ok"))
}

fn correlation(service: &str, restore: bool, requests: u64) {
    let header = HeaderName::from_static(CORRELATION_HEADER);
    match service {
        "bare" => call_correlation(service_fn(correlation_handler), restore, requests, false),
        "tower_ids" => call_correlation(
            ServiceBuilder::new()
                .layer(CorrelationLayer::new())
                .service_fn(correlation_handler),
            restore,
            requests,
            true,
        ),
        "tower_http" => call_correlation(
            ServiceBuilder::new()
                .layer(SetRequestIdLayer::new(header.clone(), MakeRequestUuid))
                .layer(PropagateRequestIdLayer::new(header))
                .service_fn(correlation_handler),
            restore,
            requests,
            true,
        ),
        other => panic!("unknown service {other}"),
    }
}

/// Sends `requests` requests to `service`; `echoes`: whether its answers carry the ID.
fn call_correlation<S, B>(mut service: S, restore: bool, requests: u64, echoes: bool)
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible>,
{
    for _ in 0..requests {
        let mut builder = Request::builder().uri(PATH);
        if restore {
            builder = builder.header(CORRELATION_HEADER, INCOMING_ID);
        }
        let request = builder.body(()).expect("valid request");
        let response = service
            .call(request)
            .now_or_never()
            .expect("ready at once")
            .expect("infallible");
        assert_eq!(response.headers().contains_key(CORRELATION_HEADER), echoes);
        std::hint::black_box(response);
    }
}

/// Sends one request, reads the whole response body, checks the status.
async fn send(app: &Router, request: Request<Body>) -> Bytes {
    let response = app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::CREATED);
    response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes()
}

async fn idempotency_bare(requests: u64) {
    let (handler, _runs) = route(RESPONSE_BYTES);
    let app = Router::new().route(PATH, handler);
    let cookie = HeaderValue::from_static(DUMMY_COOKIE);
    for n in 0..requests {
        std::hint::black_box(send(&app, request(key(n), &cookie)).await);
    }
}

async fn tower_ids(path: &str, requests: u64) {
    let (handler, runs) = route(RESPONSE_BYTES);
    let app = Router::new().route(PATH, handler.layer(IdempotencyLayer::new()));
    let cookie = HeaderValue::from_static(DUMMY_COOKIE);
    for n in 0..requests {
        let n = if path == "replay" { u64::MAX } else { n };
        std::hint::black_box(send(&app, request(key(n), &cookie)).await);
    }
    let expected = if path == "replay" { 1 } else { requests };
    assert_eq!(runs.load(Ordering::Relaxed), expected, "handler runs");
}

async fn floor_replay(requests: u64) {
    let (handler, runs) = route(RESPONSE_BYTES);
    let app = Router::new().route(PATH, handler.layer(floor::FloorLayer::default()));
    let cookie = HeaderValue::from_static(DUMMY_COOKIE);
    for _ in 0..requests {
        std::hint::black_box(send(&app, request(key(u64::MAX), &cookie)).await);
    }
    assert_eq!(runs.load(Ordering::Relaxed), 1, "handler runs");
}

async fn axum_idempotent(path: &str, requests: u64) {
    let (handler, runs) = route(RESPONSE_BYTES);
    let (app, store) = common::their_app(PATH, handler);
    let mut cookie = start_session(&app).await;
    for n in 0..requests {
        if path == "first" && n > 0 && n % KEYS_PER_SESSION == 0 {
            end_session(&store, &cookie).await;
            cookie = start_session(&app).await;
        }
        let n = if path == "replay" { u64::MAX } else { n };
        std::hint::black_box(send(&app, request(key(n), &cookie)).await);
    }
    let expected = if path == "replay" { 1 } else { requests };
    assert_eq!(runs.load(Ordering::Relaxed), expected, "handler runs");
}
