//! How the idempotency layer's replay and memory scale with the records a `MokaStore`
//! holds: 1,000 against 1,000,000 stored keys.
//!
//! Rows (`scale/<row>`, one group so criterion shows them side by side):
//! - `replay/1k_keys`, `replay/1M_keys`: a replay through the real layer on an axum
//!   route (`post(handler).layer(IdempotencyLayer::with_store(store))`), sent with
//!   `oneshot` on a current-thread tokio runtime, the response body collected, from a
//!   store holding 1,000 or 1,000,000 completed records. A replay should cost the same
//!   whatever the store holds (the goal: the two rows at most 1.5x apart).
//! - `first/1k_keys`, `first/1M_keys`: a first execution (a key never stored; the
//!   handler runs and its response is stored) against the same two stores; the same
//!   bar.
//!
//! Each row's store is filled directly through the store API (`begin`, then
//! `complete`, as `tests/memory.rs` does), with the `ScopeKey` and `Fingerprint` the
//! layer computes for the bench's request (no client, POST, `/commands`, no query;
//! `content-type: application/json` and the same JSON body), so every stored key
//! replays. Each record is a 201 with `content-type: application/json` and its own
//! copy of a 1 KiB body, as real responses would be, so the records lie in memory as
//! they would in a server. The byte bound is raised to twice what the records weigh,
//! and the bench asserts that nothing was evicted; moka's pending maintenance is run
//! after the fill, so the timing does not pay for it. How long each fill takes is
//! printed (`scale/fill/...`).
//!
//! Every iteration replays a pseudo-random stored key (an xorshift over the N keys,
//! the key header formatted in the loop, the same work in both rows): one key replayed
//! again and again would stay in the CPU caches, and the 1M row would measure a hot
//! entry rather than a store too large for them. Before a row is measured, its first
//! and last keys are checked to replay (201, `idempotent-replayed: true`, the stored
//! body); after it, the handler's run count is checked to be zero and the store to
//! hold all N records still.
//!
//! Before the timing, the bench measures what a stored record costs beyond its
//! response, at 1,000 and at 1,000,000 records: a counting global allocator
//! (`stats_alloc`) counts the bytes the fill leaves allocated (bytes allocated, less
//! those freed, plus the net change by reallocation; single-threaded, so nothing else
//! is counted), divided by the records, less each response's
//! [`Payload::weight`]. It prints one line per size (`scale/memory/...`) and
//! asserts the figure is within what the store charges per entry,
//! `MOKA_ENTRY_OVERHEAD_BYTES` (832). These are the bytes asked of the allocator: malloc's own
//! per-allocation header and rounding come on top.
//!
//! The counting allocator also serves the timed rows; its counters add the same few
//! atomic operations per allocation to both rows, so compare the rows with each
//! other, and the `idempotency` bench for absolute replay cost.
//!
//! Run: `cargo bench --bench scale`
#![allow(missing_docs)]

use std::{
    alloc::System,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, OnceLock,
    },
    time::{Duration, Instant, SystemTime},
};

use axum::{body::Body, response::Response, routing::post, Router};
use bytes::Bytes;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkGroup, Criterion};
use http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::BodyExt;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tower::ServiceExt;
use tower_ids::idempotency::{
    header::IDEMPOTENT_REPLAYED,
    store::Fingerprint,
    store::ScopeKey,
    store::{Begin, Claim, IdempotencyStore, Payload, Record},
    IdempotencyKey, IdempotencyLayer, MokaStore, DEFAULT_LEASE, DEFAULT_TTL,
};
use tower_ids_moka::MOKA_ENTRY_OVERHEAD_BYTES;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The stored-key counts, with the row labels.
const SIZES: [(&str, u64); 2] = [("1k_keys", 1_000), ("1M_keys", 1_000_000)];
const PATH: &str = "/commands";
const CONTENT_TYPE: &str = "application/json";
const REQUEST_BODY: &str = r#"{"command":"transfer","from":"acc-1","to":"acc-2","amount":100}"#;
const KEY_HEADER: &str = "idempotency-key";
/// The stored response body's length.
const RESPONSE_BYTES: usize = 1024;

type Group<'a> = BenchmarkGroup<'a, criterion::measurement::WallTime>;

/// The key of stored record `n`, as the client sends it.
fn key_text(n: u64) -> String {
    format!("bench-{n:016x}")
}

/// The request that replays record `n`.
fn request(n: u64) -> Request<Body> {
    Request::post(PATH)
        .header(header::CONTENT_TYPE, CONTENT_TYPE)
        .header(
            KEY_HEADER,
            HeaderValue::try_from(key_text(n)).expect("visible ASCII"),
        )
        .body(Body::from(REQUEST_BODY))
        .expect("valid request")
}

/// A 1 KiB JSON body, the response every record holds.
fn response_body() -> Bytes {
    let head = r#"{"status":"created","padding":""#;
    let tail = r#""}"#;
    let padding = "x".repeat(RESPONSE_BYTES - head.len() - tail.len());
    let body = format!("{head}{padding}{tail}");
    assert_eq!(body.len(), RESPONSE_BYTES);
    Bytes::from(body)
}

/// The handler every row serves: `201`, JSON, `body`, counting its runs in `runs`.
fn handler(runs: Arc<AtomicU64>, body: Bytes) -> axum::routing::MethodRouter {
    post(move |_request: Bytes| {
        let runs = runs.clone();
        let body = body.clone();
        async move {
            runs.fetch_add(1, Ordering::Relaxed);
            (
                StatusCode::CREATED,
                [(header::CONTENT_TYPE, CONTENT_TYPE)],
                body,
            )
        }
    })
}

/// The payload the layer keeps of the handler's response to `body`: read back from a
/// store of its own after one request through the layer, so the records the bench
/// fills are the layer's own encoding.
fn template(runtime: &tokio::runtime::Runtime, body: &Bytes) -> Payload {
    let store = MokaStore::new();
    let layer = IdempotencyLayer::with_store(store.clone());
    let runs = Arc::new(AtomicU64::new(0));
    let app = Router::new().route(PATH, handler(runs, body.clone()).layer(layer));
    runtime.block_on(send(&app, request(u64::MAX)));
    let key = IdempotencyKey::parse(key_text(u64::MAX).as_bytes()).expect("valid key");
    let scope = ScopeKey::new("http", &["POST", PATH], None, &key);
    let claim = Claim::new(Fingerprint::from_bytes([0; 32]), DEFAULT_LEASE, None);
    match runtime.block_on(store.begin(&scope, claim)).expect("begin") {
        Begin::Completed { record, .. } => record.payload.clone().expect("a payload"),
        _ => panic!("the template request was stored"),
    }
}

/// The payload the layer keeps of the response every record holds, made once by
/// [`template`] before anything is counted or timed.
static TEMPLATE: OnceLock<Payload> = OnceLock::new();

/// The template's payload with `body`, the record's own copy.
fn stored_response(body: Bytes) -> Payload {
    let template = TEMPLATE.get().expect("the template is made first");
    Payload::new(
        template.format(),
        template.status(),
        Bytes::copy_from_slice(template.head()),
        body,
    )
}

/// A store whose byte bound is what `n` records of `body` weigh, plus room for
/// [`FIRST_ROOM`] more: the `first` rows add a record per iteration, and nothing may be
/// evicted in any row (an eviction would be work the other row does not do).
fn store_for(n: u64, body: &Bytes) -> MokaStore {
    let weight = stored_response(body.clone()).weight();
    let records = usize::try_from(n + FIRST_ROOM).expect("a count of records fits");
    MokaStore::builder()
        .max_bytes(records * (weight + MOKA_ENTRY_OVERHEAD_BYTES))
        .build()
}

/// Records the `first` rows may add: more than criterion's iterations in a row.
const FIRST_ROOM: u64 = 8_000_000;

/// Stores `n` completed records under the scopes and fingerprint the layer computes
/// for [`request`], each with its own copy of `body`, then runs moka's maintenance.
async fn fill(store: &MokaStore, n: u64, body: &[u8]) {
    let method = "POST";
    // Version 1 (SHA-256), as the layer computes it for a scope every caller shares
    // (`NoClient`, below).
    let fingerprint = Fingerprint::collision_resistant(
        method,
        PATH,
        None,
        Some(CONTENT_TYPE.as_bytes()),
        REQUEST_BODY.as_bytes(),
    );
    for i in 0..n {
        let key = IdempotencyKey::parse(key_text(i).as_bytes()).expect("valid key");
        // `NoClient`, and the query left out, as the layer's defaults do.
        let scope = ScopeKey::new("http", &[method, PATH], None, &key);
        let claim = Claim::new(fingerprint, DEFAULT_LEASE, None);
        let Begin::Claimed { lease } = store.begin(&scope, claim).await.expect("begin") else {
            panic!("a fresh key is claimed");
        };
        let record = Record::new(
            fingerprint,
            SystemTime::now(),
            None,
            None,
            Some(stored_response(Bytes::copy_from_slice(body))),
        );
        let stored = store
            .complete(&scope, &lease, Arc::new(record), DEFAULT_TTL)
            .await;
        assert!(
            stored.expect("complete").is_stored(),
            "the lease holder completes"
        );
    }
    store.run_pending_tasks().await;
}

/// Fills a store with `n` records, printing how long it took; asserts none was evicted.
fn filled(runtime: &tokio::runtime::Runtime, label: &str, n: u64, body: &Bytes) -> MokaStore {
    let store = store_for(n, body);
    let start = Instant::now();
    runtime.block_on(fill(&store, n, body));
    eprintln!(
        "scale/fill/{label}: {n} records stored in {:.2?}",
        start.elapsed()
    );
    assert_eq!(store.entry_count(), n, "{label}: nothing evicted");
    store
}

/// Counts the bytes `n` stored records leave allocated, and prints and checks the cost
/// per record beyond its response.
fn memory(runtime: &tokio::runtime::Runtime, n: u64, body: &Bytes) {
    let response_bytes = stored_response(body.clone()).weight();
    let store = store_for(n, body);
    let region = Region::new(GLOBAL);
    runtime.block_on(fill(&store, n, body));
    let change = region.change();
    assert_eq!(store.entry_count(), n, "memory/{n}: nothing evicted");
    let live = change.bytes_allocated as i128 - change.bytes_deallocated as i128
        + change.bytes_reallocated as i128;
    let per_entry = live as f64 / n as f64;
    let overhead = per_entry - response_bytes as f64;
    let allocations = (change.allocations - change.deallocations) as f64 / n as f64;
    println!(
        "scale/memory/{n}: {overhead:.0} B per entry beyond {response_bytes} response bytes \
         ({per_entry:.0} B in all, {allocations:.1} live allocations; charged \
         MOKA_ENTRY_OVERHEAD_BYTES = {MOKA_ENTRY_OVERHEAD_BYTES})"
    );
    assert!(
        overhead <= MOKA_ENTRY_OVERHEAD_BYTES as f64,
        "an entry costs {overhead:.0} B beyond its response at {n} records, more than the \
         {MOKA_ENTRY_OVERHEAD_BYTES} charged"
    );
    drop(store);
}

/// Sends one request and reads the whole response body.
async fn send(app: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    let response: Response = app.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    (parts.status, parts.headers, body)
}

/// Checks a replay: 201, `idempotent-replayed: true`, the stored body.
fn check_replay(
    row: &str,
    (status, headers, body): &(StatusCode, HeaderMap, Bytes),
    stored: &Bytes,
) {
    assert_eq!(*status, StatusCode::CREATED, "{row}: status");
    assert_eq!(
        headers.get(IDEMPOTENT_REPLAYED).map(HeaderValue::as_bytes),
        Some(&b"true"[..]),
        "{row}: a replay"
    );
    assert_eq!(body, stored, "{row}: the stored body");
}

/// The next pseudo-random index below `n` (xorshift64).
fn next_index(state: &mut u64, n: u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state % n
}

fn replay(
    group: &mut Group<'_>,
    runtime: &tokio::runtime::Runtime,
    label: &str,
    n: u64,
    body: &Bytes,
) {
    let row = format!("replay/{label}");
    let store = filled(runtime, label, n, body);

    // The handler answers what every record holds; it must never run.
    let runs = Arc::new(AtomicU64::new(0));
    let layer = IdempotencyLayer::with_store(store.clone());
    let app = Router::new().route(PATH, handler(runs.clone(), body.clone()).layer(layer));

    for n in [0, n - 1] {
        check_replay(&row, &runtime.block_on(send(&app, request(n))), body);
    }
    let app = &app;
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    group.bench_function(&row, |b| {
        b.to_async(runtime).iter(|| {
            let request = request(next_index(&mut state, n));
            async move { black_box(send(app, request).await) }
        })
    });
    assert_eq!(
        runs.load(Ordering::Relaxed),
        0,
        "{row}: the handler never ran"
    );
    runtime.block_on(store.run_pending_tasks());
    assert_eq!(store.entry_count(), n, "{row}: nothing evicted");
}

/// A first execution: a fresh key (never stored) each iteration, against a store that
/// holds `n` records; the handler runs every time and its response is stored.
fn first(
    group: &mut Group<'_>,
    runtime: &tokio::runtime::Runtime,
    label: &str,
    n: u64,
    body: &Bytes,
) {
    let row = format!("first/{label}");
    let store = filled(runtime, label, n, body);
    let runs = Arc::new(AtomicU64::new(0));
    let layer = IdempotencyLayer::with_store(store.clone());
    let app = Router::new().route(PATH, handler(runs.clone(), body.clone()).layer(layer));

    // Keys from `n` on were never stored.
    let next = AtomicU64::new(n);
    let app = &app;
    group.bench_function(&row, |b| {
        b.to_async(runtime).iter(|| {
            let request = request(next.fetch_add(1, Ordering::Relaxed));
            async move { black_box(send(app, request).await) }
        })
    });
    let sent = next.load(Ordering::Relaxed) - n;
    assert_eq!(runs.load(Ordering::Relaxed), sent, "{row}: one run per key");
    runtime.block_on(store.run_pending_tasks());
    assert_eq!(store.entry_count(), n + sent, "{row}: nothing evicted");
}

fn scale(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let body = response_body();
    TEMPLATE.get_or_init(|| template(&runtime, &body));
    // Counted before any timing, on this thread alone.
    for (_, n) in SIZES {
        memory(&runtime, n, &body);
    }
    let mut group = c.benchmark_group("scale");
    group.measurement_time(Duration::from_secs(10));
    for (label, n) in SIZES {
        replay(&mut group, &runtime, label, n, &body);
    }
    for (label, n) in SIZES {
        first(&mut group, &runtime, label, n, &body);
    }
    group.finish();
}

criterion_group!(benches, scale);
criterion_main!(benches);
