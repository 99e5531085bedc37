//! Per-request cost of the idempotency layer on an axum route, side by side with the
//! bare handler and the `axum-idempotent` crate, at 1 KiB and 64 KiB response bodies.
//!
//! Rows (`idempotency/<row>/<size>`):
//! - `bare`: the handler alone.
//! - `tower_ids/first`: `IdempotencyLayer::new()`, a fresh key every iteration: read and
//!   fingerprint the request, claim the key, run the handler, buffer and store the
//!   response.
//! - `tower_ids/replay`: the same layer, the same key every iteration: a replay.
//! - `floor/replay`: the floor of a replay (`benches/common/floor.rs`): the work no
//!   layer keeping these guarantees can leave out (the key, the scope and fingerprint
//!   digests, the body read, one index lookup, the stored response with the replay's
//!   own headers), hand-written around the same handler. `tower_ids/replay` minus
//!   `bare` over `floor/replay` minus `bare` is how far the layer is from it.
//! - `axum_idempotent/first`, `axum_idempotent/replay`: the same two paths through
//!   `axum-idempotent` 0.6 on `ruts`' moka session store.
//! - `tower_ids_redis/first`, `tower_ids_redis/replay`: the `tower_ids` rows with a
//!   `RedisStore` (defaults, no local cache) on a `redis-server` this bench starts on a
//!   free loopback port and kills at the end; only with `redis-server` on `PATH`
//!   (otherwise a message says the rows were skipped; the `redis` feature is on for
//!   benches through the crate's dev-dependency on itself). That Redis is capped at
//!   512 MiB with LRU eviction, so `first` at 64 KiB cannot fill the machine's memory.
//! - `tower_ids_redis_wait1/first`, `tower_ids_redis_wait1/replay`: the same with
//!   `wait_for_replicas(1, 500 ms)`, against a replica of that server the bench starts
//!   too: a claim and a completion wait for the replica's acknowledgement (`WAIT`).
//!
//! Every row builds the same request in the loop (POST, a small JSON body,
//! `content-type`, `idempotency-key`, a session `cookie`), sends it with `oneshot` on a
//! current-thread tokio runtime and collects the response body. Before a row is
//! measured, one request checks its response (201, the body, replayed or not, the
//! handler's run count); after it, the handler's run count is checked again, so no row
//! can silently measure error responses or a second run.
//!
//! How `axum-idempotent` is configured, and what differs from `tower_ids`:
//! - Direct key mode (`use_idempotency_key_header(Some("idempotency-key"), false)`), TTL
//!   24 h (`expire_after`), the session cookie's `Max-Age` 24 h too (the cache entry
//!   lives for the shorter of the two), default 1 MiB response cap. Its replay marker is
//!   `idempotency-replayed: true` (ours: `idempotent-replayed: true`).
//! - It stores responses in the caller's session, so it needs `CookieManagerLayer` and
//!   `ruts::SessionLayer` around it and a session cookie on every request (a request
//!   without a session is never cached). Keys are therefore scoped per session; ours
//!   are global here (`NoClient`), scoped by method + path + key.
//! - In direct key mode it neither reads nor hashes the request body: the same key with
//!   another body gets the old response. Ours reads the body and fingerprints it
//!   (XXH3-128 of method, path, query, content type, body) and answers 422 on a mismatch.
//! - It has no in-flight claim: two concurrent requests with one key both run. Ours
//!   claims the key in the store before running, and moves the rest of the work to a
//!   task of its own if the client goes away, so a disconnect cannot cancel it.
//! - It serialises status, headers and body into one byte vector, bincode-encodes it
//!   into the session's field map, and on replay decodes and copies it back out. Ours
//!   stores `Bytes` behind an `Arc` and replays without copying the body; a replay is a
//!   store read (the per-key request count is an atomic shared by the entry).
//! - `ruts`' moka store keeps one `HashMap` of fields per session and sweeps it for
//!   expired fields on every write, so its first-execution cost grows with the keys a
//!   session holds. `axum_idempotent/first` therefore starts a fresh session every
//!   [`KEYS_PER_SESSION`] keys (outside the timing) and deletes the old one; ours writes
//!   fresh keys into one store bounded at 64 MiB, which evicts.
//!
//! Run: `cargo bench --all-features --bench idempotency` (or `cargo bench --all-features` for every bench; without the `redis` and `postgres` features it has no store rows)
#![allow(missing_docs)]

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use axum::{body::Body, response::Response, Router};
use bytes::Bytes;
use common::{end_session, key, request, route, start_session, PATH};
use criterion::{black_box, criterion_group, criterion_main, BenchmarkGroup, Criterion};
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::BodyExt;
use ruts::store::moka::MokaStore as SessionMokaStore;
use tower::ServiceExt;
use tower_ids::idempotency::{header::IDEMPOTENT_REPLAYED, IdempotencyLayer};

#[path = "common/idempotent_route.rs"]
mod common;
#[path = "common/floor.rs"]
mod floor;

const SIZES: [(&str, usize); 2] = [("1KiB", 1024), ("64KiB", 64 * 1024)];
/// axum-idempotent's default replay marker.
const THEIR_REPLAYED: &str = "idempotency-replayed";
/// What the rows without sessions send in `cookie`, so every row builds the same request.
const DUMMY_COOKIE: &str = "session=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
/// Keys written into one session before `axum_idempotent/first` moves to a fresh one.
const KEYS_PER_SESSION: u64 = 64;
/// The key every replay iteration sends.
const REPLAY_KEY: u64 = u64::MAX;

type Group<'a> = BenchmarkGroup<'a, criterion::measurement::WallTime>;

/// Sends one request and reads the whole response body.
async fn send(app: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    let response: Response = app.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    (parts.status, parts.headers, body)
}

/// Checks one response: 201, the full body, and the replay marker `marker` as expected
/// (`Some("true")` on a replay; ours says `false` on a first run, theirs sends nothing).
fn check(
    row: &str,
    (status, headers, body): &(StatusCode, HeaderMap, Bytes),
    size: usize,
    marker: (&str, Option<&str>),
) {
    assert_eq!(*status, StatusCode::CREATED, "{row}: status");
    assert_eq!(body.len(), size, "{row}: body length");
    assert!(body.iter().all(|&b| b == b'x'), "{row}: body bytes");
    let (name, expected) = marker;
    let actual = headers.get(name).map(|v| v.to_str().expect("ASCII"));
    assert_eq!(actual, expected, "{row}: {name}");
}

fn bare(c: &mut Group<'_>, runtime: &tokio::runtime::Runtime, label: &str, size: usize) {
    let (handler, runs) = route(size);
    let app = Router::new().route(PATH, handler);
    let cookie = HeaderValue::from_static(DUMMY_COOKIE);
    let row = format!("bare/{label}");

    let response = runtime.block_on(send(&app, request(key(0), &cookie)));
    check(&row, &response, size, (IDEMPOTENT_REPLAYED.as_str(), None));
    assert_eq!(runs.load(Ordering::Relaxed), 1, "{row}: handler runs");

    c.bench_function(&row, |b| {
        b.to_async(runtime)
            .iter(|| async { black_box(send(&app, request(key(REPLAY_KEY), &cookie)).await) })
    });
}

fn tower_ids(c: &mut Group<'_>, runtime: &tokio::runtime::Runtime, label: &str, size: usize) {
    let cookie = HeaderValue::from_static(DUMMY_COOKIE);
    let marker = IDEMPOTENT_REPLAYED;
    let marker = marker.as_str();

    // First execution: a fresh key every iteration; the handler runs every time.
    let (handler, runs) = route(size);
    let app = Router::new().route(PATH, handler.layer(IdempotencyLayer::new()));
    let next = AtomicU64::new(0);
    let row = format!("tower_ids/first/{label}");
    let first = |n| runtime.block_on(send(&app, request(key(n), &cookie)));
    let n = next.fetch_add(1, Ordering::Relaxed);
    check(&row, &first(n), size, (marker, Some("false")));
    check(&row, &first(n), size, (marker, Some("true")));
    assert_eq!(runs.load(Ordering::Relaxed), 1, "{row}: handler runs");
    c.bench_function(&row, |b| {
        b.to_async(runtime).iter(|| async {
            let n = next.fetch_add(1, Ordering::Relaxed);
            black_box(send(&app, request(key(n), &cookie)).await)
        })
    });
    assert_eq!(
        runs.load(Ordering::Relaxed),
        next.load(Ordering::Relaxed),
        "{row}: one run per key"
    );

    // Replay: one warm-up request runs; every iteration replays it.
    let (handler, runs) = route(size);
    let app = Router::new().route(PATH, handler.layer(IdempotencyLayer::new()));
    let row = format!("tower_ids/replay/{label}");
    let once = || runtime.block_on(send(&app, request(key(REPLAY_KEY), &cookie)));
    check(&row, &once(), size, (marker, Some("false")));
    check(&row, &once(), size, (marker, Some("true")));
    c.bench_function(&row, |b| {
        b.to_async(runtime)
            .iter(|| async { black_box(send(&app, request(key(REPLAY_KEY), &cookie)).await) })
    });
    check(&row, &once(), size, (marker, Some("true")));
    assert_eq!(runs.load(Ordering::Relaxed), 1, "{row}: handler runs");
}

/// The floor of a replay (`benches/common/floor.rs`): one warm-up request runs, every
/// iteration replays it.
fn floor(c: &mut Group<'_>, runtime: &tokio::runtime::Runtime, label: &str, size: usize) {
    let cookie = HeaderValue::from_static(DUMMY_COOKIE);
    let (handler, runs) = route(size);
    let app = Router::new().route(PATH, handler.layer(floor::FloorLayer::default()));
    let row = format!("floor/replay/{label}");
    let once = || runtime.block_on(send(&app, request(key(REPLAY_KEY), &cookie)));
    let marker = IDEMPOTENT_REPLAYED;
    let marker = marker.as_str();
    check(&row, &once(), size, (marker, Some("false")));
    check(&row, &once(), size, (marker, Some("true")));
    c.bench_function(&row, |b| {
        b.to_async(runtime)
            .iter(|| async { black_box(send(&app, request(key(REPLAY_KEY), &cookie)).await) })
    });
    assert_eq!(runs.load(Ordering::Relaxed), 1, "{row}: handler runs");
}

/// The app as axum-idempotent's README sets it up, around the handler for `size`.
fn their_app(size: usize) -> (Router, Arc<SessionMokaStore>, Arc<AtomicU64>) {
    let (handler, runs) = route(size);
    let (app, store) = common::their_app(PATH, handler);
    (app, store, runs)
}

fn axum_idempotent(c: &mut Group<'_>, runtime: &tokio::runtime::Runtime, label: &str, size: usize) {
    let marker = THEIR_REPLAYED;

    // First execution: a fresh key every iteration, a fresh session every
    // KEYS_PER_SESSION keys (set up and torn down outside the timing).
    let (app, store, runs) = their_app(size);
    let next = Arc::new(AtomicU64::new(0));
    let row = format!("axum_idempotent/first/{label}");
    let cookie = runtime.block_on(start_session(&app));
    let n = next.fetch_add(1, Ordering::Relaxed);
    let first = || runtime.block_on(send(&app, request(key(n), &cookie)));
    check(&row, &first(), size, (marker, None));
    check(&row, &first(), size, (marker, Some("true")));
    assert_eq!(runs.load(Ordering::Relaxed), 1, "{row}: handler runs");
    runtime.block_on(end_session(&store, &cookie));
    c.bench_function(&row, |b| {
        b.to_async(runtime).iter_custom(|iters| {
            let (app, store, next) = (app.clone(), store.clone(), next.clone());
            async move {
                let mut elapsed = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let batch = left.min(KEYS_PER_SESSION);
                    let cookie = start_session(&app).await;
                    let start = Instant::now();
                    for _ in 0..batch {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        black_box(send(&app, request(key(n), &cookie)).await);
                    }
                    elapsed += start.elapsed();
                    end_session(&store, &cookie).await;
                    left -= batch;
                }
                elapsed
            }
        })
    });
    assert_eq!(
        runs.load(Ordering::Relaxed),
        next.load(Ordering::Relaxed),
        "{row}: one run per key"
    );

    // Replay: one session, one warm-up request runs; every iteration replays it.
    let (app, _store, runs) = their_app(size);
    let row = format!("axum_idempotent/replay/{label}");
    let cookie = runtime.block_on(start_session(&app));
    let once = || runtime.block_on(send(&app, request(key(REPLAY_KEY), &cookie)));
    check(&row, &once(), size, (marker, None));
    check(&row, &once(), size, (marker, Some("true")));
    c.bench_function(&row, |b| {
        b.to_async(runtime)
            .iter(|| async { black_box(send(&app, request(key(REPLAY_KEY), &cookie)).await) })
    });
    check(&row, &once(), size, (marker, Some("true")));
    assert_eq!(runs.load(Ordering::Relaxed), 1, "{row}: handler runs");
}

/// The `first` and `replay` rows of tower-ids over `store`, a store outside the
/// process (Redis, PostgreSQL), named `name`; `store(row)` makes one store per row.
#[cfg(any(feature = "redis", feature = "postgres"))]
fn store_rows<St: tower_ids::idempotency::IdempotencyStore>(
    c: &mut Group<'_>,
    runtime: &tokio::runtime::Runtime,
    label: &str,
    size: usize,
    name: &str,
    store: impl Fn(&str) -> St,
) {
    let cookie = HeaderValue::from_static(DUMMY_COOKIE);
    let marker = tower_ids::idempotency::header::IDEMPOTENT_REPLAYED;
    let marker = marker.as_str();

    // First execution: a fresh key every iteration; the handler runs every time.
    let row = format!("{name}/first/{label}");
    let (handler, runs) = route(size);
    let layer = IdempotencyLayer::with_store(store(&row));
    let app = Router::new().route(PATH, handler.layer(layer));
    let next = AtomicU64::new(0);
    let first = |n| runtime.block_on(send(&app, request(key(n), &cookie)));
    let n = next.fetch_add(1, Ordering::Relaxed);
    check(&row, &first(n), size, (marker, Some("false")));
    check(&row, &first(n), size, (marker, Some("true")));
    assert_eq!(runs.load(Ordering::Relaxed), 1, "{row}: handler runs");
    c.bench_function(&row, |b| {
        b.to_async(runtime).iter(|| async {
            let n = next.fetch_add(1, Ordering::Relaxed);
            black_box(send(&app, request(key(n), &cookie)).await)
        })
    });
    assert_eq!(
        runs.load(Ordering::Relaxed),
        next.load(Ordering::Relaxed),
        "{row}: one run per key"
    );

    // Replay: one warm-up request runs; every iteration replays it from the store.
    let row = format!("{name}/replay/{label}");
    let (handler, runs) = route(size);
    let layer = IdempotencyLayer::with_store(store(&row));
    let app = Router::new().route(PATH, handler.layer(layer));
    let once = || runtime.block_on(send(&app, request(key(REPLAY_KEY), &cookie)));
    check(&row, &once(), size, (marker, Some("false")));
    check(&row, &once(), size, (marker, Some("true")));
    c.bench_function(&row, |b| {
        b.to_async(runtime)
            .iter(|| async { black_box(send(&app, request(key(REPLAY_KEY), &cookie)).await) })
    });
    check(&row, &once(), size, (marker, Some("true")));
    assert_eq!(runs.load(Ordering::Relaxed), 1, "{row}: handler runs");
}

fn idempotency(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    #[cfg(feature = "redis")]
    let redis = redis_rows::RedisServer::start();
    #[cfg(feature = "postgres")]
    let postgres = runtime.block_on(postgres_rows::Database::create());
    let mut group = c.benchmark_group("idempotency");
    for (label, size) in SIZES {
        bare(&mut group, &runtime, label, size);
        floor(&mut group, &runtime, label, size);
        tower_ids(&mut group, &runtime, label, size);
        #[cfg(feature = "redis")]
        if let Some(redis) = &redis {
            redis_rows::tower_ids_redis(&mut group, &runtime, label, size, &redis.url(), 0);
            if redis.has_replica() {
                redis_rows::tower_ids_redis(&mut group, &runtime, label, size, &redis.url(), 1);
            }
        }
        #[cfg(feature = "postgres")]
        if let Some(postgres) = &postgres {
            postgres_rows::tower_ids_postgres(&mut group, &runtime, label, size, postgres);
        }
        axum_idempotent(&mut group, &runtime, label, size);
    }
    group.finish();
}

/// The `tower_ids_redis` rows and the `redis-server` they run against.
#[cfg(feature = "redis")]
mod redis_rows {
    use std::{
        io::{Read, Write},
        net::{TcpListener, TcpStream},
        path::PathBuf,
        process::{Child, Command, Stdio},
        time::{Duration, Instant},
    };

    use tower_ids::idempotency::store::RedisStore;

    use super::Group;

    /// A `redis-server` on a free loopback port, without persistence, and a replica of
    /// it (for the rows that wait for one), both killed on drop.
    pub(super) struct RedisServer {
        port: u16,
        dir: PathBuf,
        child: Child,
        replica: Option<Child>,
    }

    impl RedisServer {
        /// Starts one, or says why not and returns `None`.
        pub(super) fn start() -> Option<Self> {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let dir = std::env::temp_dir().join(format!(
                "tower-ids-bench-redis-{}-{port}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).expect("temp dir");
            let child = Command::new("redis-server")
                .arg("--port")
                .arg(port.to_string())
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru"])
                .arg("--dir")
                .arg(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let child = match child {
                Ok(child) => child,
                Err(error) => {
                    eprintln!("SKIPPED tower_ids_redis rows: cannot start redis-server ({error})");
                    let _ = std::fs::remove_dir_all(&dir);
                    return None;
                }
            };
            let mut server = Self {
                port,
                dir,
                child,
                replica: None,
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            while !server.ping() {
                assert!(
                    Instant::now() < deadline,
                    "redis-server did not answer PING"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            server.replica = server.start_replica();
            Some(server)
        }

        /// A replica of it on another free port, once in sync; `None` (and a message
        /// that the rows waiting for it are skipped) if it cannot be had.
        fn start_replica(&self) -> Option<Child> {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let dir = self.dir.join("replica");
            std::fs::create_dir_all(&dir).expect("temp dir");
            let mut replica = Command::new("redis-server")
                .arg("--port")
                .arg(port.to_string())
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .arg("--replicaof")
                .args(["127.0.0.1", &self.port.to_string()])
                .arg("--dir")
                .arg(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()?;
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let info = Command::new("redis-cli")
                    .args(["-p", &self.port.to_string(), "INFO", "replication"])
                    .output()
                    .ok()
                    .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
                    .unwrap_or_default();
                if info.contains("connected_slaves:1") && info.contains("state=online") {
                    return Some(replica);
                }
                if Instant::now() >= deadline {
                    eprintln!("SKIPPED tower_ids_redis_wait1 rows: the replica never synced");
                    let _ = replica.kill();
                    let _ = replica.wait();
                    return None;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }

        /// Whether a replica is in sync, for the rows that wait for one.
        pub(super) fn has_replica(&self) -> bool {
            self.replica.is_some()
        }

        pub(super) fn url(&self) -> String {
            format!("redis://127.0.0.1:{}", self.port)
        }

        fn ping(&self) -> bool {
            let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
                return false;
            };
            let mut reply = [0; 7];
            stream.write_all(b"PING\r\n").is_ok()
                && stream.read_exact(&mut reply).is_ok()
                && &reply == b"+PONG\r\n"
        }
    }

    impl Drop for RedisServer {
        fn drop(&mut self) {
            if let Some(mut replica) = self.replica.take() {
                let _ = replica.kill();
                let _ = replica.wait();
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// As `tower_ids`, with a `RedisStore` (one per row, on a fresh key prefix) that
    /// waits for `replicas` replicas' acknowledgement of a claim and a completion:
    /// rows `tower_ids_redis` (none) and `tower_ids_redis_wait1` (one, the price of
    /// `WAIT`).
    pub(super) fn tower_ids_redis(
        c: &mut Group<'_>,
        runtime: &tokio::runtime::Runtime,
        label: &str,
        size: usize,
        url: &str,
        replicas: u32,
    ) {
        let name = match replicas {
            0 => "tower_ids_redis".to_owned(),
            n => format!("tower_ids_redis_wait{n}"),
        };
        super::store_rows(c, runtime, label, size, &name, |row| {
            let store = RedisStore::builder(url)
                .prefix(format!("{row}:"))
                .wait_for_replicas(replicas, Duration::from_millis(500))
                .build();
            runtime.block_on(store).expect("Redis store")
        });
    }
}

/// The `tower_ids_postgres` rows, on a database of their own (made as the tests make
/// theirs).
#[cfg(feature = "postgres")]
mod postgres_rows {
    use tower_ids::idempotency::store::PostgresStore;

    pub(super) use super::database::TestDatabase as Database;
    use super::Group;

    /// As `tower_ids`, with a `PostgresStore` (one table per row). A first execution is
    /// two statements (claim, complete), a replay one.
    pub(super) fn tower_ids_postgres(
        c: &mut Group<'_>,
        runtime: &tokio::runtime::Runtime,
        label: &str,
        size: usize,
        database: &Database,
    ) {
        super::store_rows(c, runtime, label, size, "tower_ids_postgres", |row| {
            runtime.block_on(async {
                let table = format!("idem_{}", row.replace(['/', '-'], "_"));
                let store = PostgresStore::builder(database.pool(4).await)
                    .table(table)
                    .build()
                    .expect("PostgresStore");
                store.migrate().await.expect("migrate");
                store
            })
        });
    }
}

#[cfg(feature = "postgres")]
use tower_ids_test_support::postgres as database;

criterion_group!(benches, idempotency);
criterion_main!(benches);
