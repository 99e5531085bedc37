//! The Redis store through real `redis-server` processes and real axum servers on
//! 127.0.0.1: two replicas sharing one Redis, a lease that runs out, Redis killed and
//! restarted under a running layer, and records that expire in Redis.
//!
//! The fault trials (`faults.rs`) pause Redis, kill and restart it around the moment the
//! handler returns, and count executions; `late_commands.rs` checks that commands whose
//! caller gave up change nothing when they reach Redis after all. `cluster.rs` runs the
//! store on a six-node Redis Cluster made by the test and kills the primary of a key's
//! slot.
//!
//! Each test starts its own `redis-server` from `PATH` on a free loopback port in a
//! temporary directory (without persistence unless a test says so) and kills it when
//! the test ends. Without
//! `redis-server` the tests print `SKIPPED` and pass, except in CI (the `CI` variable
//! set), where they must run and fail instead.
#![allow(missing_docs)]

use tower_ids_test_support as support;

use tower_ids_test_support::replica;

mod cluster;
use tower_ids_test_support::redis_cluster as cluster_server;
mod faults;
mod late_commands;
mod messages;
mod outages;
use tower_ids_test_support::redis as server;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant, SystemTime},
};
use tower_ids::idempotency::Policy;

use axum::{extract::State, http::HeaderMap, response::Response, routing::post, Router};
use bytes::Bytes;
use http::StatusCode;
use serde_json::json;
use server::RedisServer;
use support::{client, send, serve, try_send, HttpClient, Reply};
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        store::Fingerprint,
        store::ScopeKey,
        store::{
            Begin, Claim, Completion, IdempotencyStore, Payload, PayloadFormat, Record, RedisStore,
        },
        IdempotencyLayer, InFlight, StoreFailure,
    },
};

/// How many times the handler ran, shared by every replica.
#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>);

impl Runs {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// The handler: counts its run, sleeps `x-delay-ms` if sent, answers 201 with
/// repeated headers and a body naming the run and the replica.
async fn handler(
    State((runs, replica)): State<(Runs, &'static str)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let run = runs.0.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(ms) = headers.get("x-delay-ms") {
        let ms = ms.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let body = json!({
        "run": run,
        "replica": replica,
        "echo": String::from_utf8_lossy(&body),
    })
    .to_string();
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("x-multi", "one")
        .header("x-replica", replica)
        .header("x-multi", "two")
        .header("x-multi", "three")
        .header("x-run", run)
        .body(axum::body::Body::from(body))
        .unwrap()
}

/// A replica: its own `RedisStore` built from `url`, its own axum server.
struct Replica {
    url: String,
    client: HttpClient,
}

impl Replica {
    async fn start(
        redis_url: &str,
        runs: &Runs,
        name: &'static str,
        configure: impl Fn(IdempotencyLayer<RedisStore>) -> IdempotencyLayer<RedisStore>,
    ) -> Self {
        let store = RedisStore::builder(redis_url)
            .command_timeout(Duration::from_millis(250))
            .build()
            .await
            .expect("Redis is up");
        let layer = configure(IdempotencyLayer::with_store(store));
        let router = Router::new()
            .route("/commands", post(handler).layer(layer.clone()))
            .route(
                "/open",
                post(handler).layer(
                    layer
                        .policy(Policy::new().store_failure(StoreFailure::FailOpen))
                        .unwrap(),
                ),
            )
            .with_state((runs.clone(), name))
            .layer(CorrelationLayer::new());
        let addr = serve(router).await;
        Self {
            url: format!("http://{addr}"),
            client: client(),
        }
    }

    async fn post(&self, path: &str, key: &str) -> Reply {
        self.post_with(path, key, &[]).await
    }

    async fn post_with(&self, path: &str, key: &str, extra: &[(&str, &str)]) -> Reply {
        let mut headers = vec![
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ];
        headers.extend_from_slice(extra);
        send(
            &self.client,
            "POST",
            format!("{}{path}", self.url),
            &headers,
            BODY,
        )
        .await
    }
}

const BODY: &str = r#"{"device_id":"d-1","name":"reboot"}"#;

/// Every header but the per-attempt ones, in order, repeats kept.
fn stored_headers(reply: &Reply) -> Vec<(String, String)> {
    const PER_ATTEMPT: [&str; 7] = [
        "x-correlation-id",
        "attempt-id",
        "date",
        "idempotent-replayed",
        "idempotency-first-seen",
        "idempotency-request-count",
        "original-attempt-id",
    ];
    reply
        .headers
        .iter()
        .filter(|(name, _)| !PER_ATTEMPT.contains(&name.as_str()))
        .map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_owned()))
        .collect()
}

#[tokio::test]
async fn a_retry_on_another_replica_replays_the_first_response() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let runs = Runs::default();
    let a = Replica::start(&redis.url(), &runs, "a", |layer| layer).await;
    let b = Replica::start(&redis.url(), &runs, "b", |layer| layer).await;
    let key = "0193c4a2-7b1e-7cc0-9a51-3f2d6c1e8b47";

    let first = a.post_with("/commands", key, &[("attempt-id", "1")]).await;
    let retry = b.post_with("/commands", key, &[("attempt-id", "2")]).await;
    let again = a.post("/commands", key).await;

    assert_eq!(runs.get(), 1, "the handler ran once across both replicas");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert_eq!(first.header("x-replica"), Some("a"));

    assert_eq!(retry.status, first.status);
    assert_eq!(retry.body, first.body, "byte for byte");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.header("x-replica"), Some("a"), "A's response, from B");
    assert_eq!(retry.all("x-multi"), ["one", "two", "three"]);
    assert_eq!(stored_headers(&retry), stored_headers(&first));
    assert_eq!(retry.header("original-attempt-id"), Some("1"));
    assert_eq!(retry.header("attempt-id"), Some("2"));
    assert_eq!(retry.header("idempotency-request-count"), Some("2"));
    let first_seen =
        httpdate::parse_http_date(retry.header("idempotency-first-seen").unwrap()).unwrap();
    let age = SystemTime::now().duration_since(first_seen).unwrap();
    assert!(age < Duration::from_secs(5), "first seen {age:?} ago");

    assert_eq!(again.body, first.body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.header("idempotency-request-count"), Some("3"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_over_both_replicas_run_once() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let runs = Runs::default();
    let wait = |layer: IdempotencyLayer<RedisStore>| {
        layer
            .policy(Policy::new().in_flight(InFlight::Wait {
                timeout: Duration::from_secs(10),
            }))
            .unwrap()
    };
    let replicas = Arc::new([
        Replica::start(&redis.url(), &runs, "a", wait).await,
        Replica::start(&redis.url(), &runs, "b", wait).await,
    ]);
    const KEYS: usize = 20;
    const REQUESTS: usize = 200;

    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let replicas = replicas.clone();
            tokio::spawn(async move {
                let key = format!("burst-{}", i % KEYS);
                let reply = replicas[(i / KEYS) % 2]
                    .post_with("/commands", &key, &[("x-delay-ms", "100")])
                    .await;
                (i % KEYS, reply)
            })
        })
        .collect();
    let mut by_key: Vec<Vec<Reply>> = (0..KEYS).map(|_| Vec::new()).collect();
    for task in tasks {
        let (key, reply) = task.await.unwrap();
        by_key[key].push(reply);
    }

    assert_eq!(runs.get(), KEYS, "one execution per key");
    for (key, replies) in by_key.iter().enumerate() {
        assert_eq!(replies.len(), REQUESTS / KEYS);
        let original: Vec<_> = replies
            .iter()
            .filter(|r| r.header("idempotent-replayed") == Some("false"))
            .collect();
        assert_eq!(original.len(), 1, "key {key}: one original response");
        for reply in replies {
            assert_eq!(reply.status, StatusCode::CREATED, "key {key}: {reply:?}");
            assert_eq!(reply.body, original[0].body, "key {key}: same body");
            assert_eq!(stored_headers(reply), stored_headers(original[0]));
        }
    }
}

/// A payload as a layer would keep it: a format, a status, an opaque head, a body.
fn response(body: &'static str) -> Payload {
    Payload::new(
        PayloadFormat::HTTP,
        201,
        Bytes::from_static(b"x-multi: one, two"),
        Bytes::from_static(body.as_bytes()),
    )
}

#[tokio::test]
async fn a_worker_whose_lease_ran_out_cannot_clobber_the_new_record() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::connect(redis.url()).await.unwrap();
    let scope = ScopeKey::from_bytes([7; 32]);
    let fingerprint = Fingerprint::from_bytes([1; 32]);
    let claim = Claim::new(fingerprint, Duration::from_millis(200), None);
    let record = |body| {
        Record::new(
            fingerprint,
            SystemTime::now(),
            None,
            None,
            Some(response(body)),
        )
    };
    let ttl = Duration::from_secs(60);

    let Begin::Claimed { lease: stale } = store.begin(&scope, claim.clone()).await.unwrap() else {
        panic!("the first begin claims");
    };
    match store.begin(&scope, claim.clone()).await.unwrap() {
        Begin::InFlight { request_count, .. } => assert_eq!(request_count, 2),
        other => panic!("within the lease the scope is in flight: {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let Begin::Claimed { lease: fresh } = store.begin(&scope, claim.clone()).await.unwrap() else {
        panic!("after the lease ran out, a second worker claims");
    };
    assert_ne!(stale.token, fresh.token, "every claim has its own token");
    assert_eq!(
        store
            .complete(&scope, &fresh, Arc::new(record("second")), ttl)
            .await
            .unwrap(),
        Completion::Stored
    );
    assert_eq!(
        store
            .complete(&scope, &stale, Arc::new(record("first")), ttl)
            .await
            .unwrap(),
        Completion::Superseded,
        "the stale worker's complete is refused"
    );
    assert!(
        !store.release(&scope, &stale).await.unwrap(),
        "and so is its release"
    );

    match store.begin(&scope, claim).await.unwrap() {
        Begin::Completed { record, .. } => {
            let stored = record.payload.as_ref().unwrap();
            assert_eq!(stored.body(), "second", "the second worker's record stands");
            assert_eq!(stored.status(), 201);
            assert_eq!(stored.head(), "x-multi: one, two");
        }
        other => panic!("a third begin sees the record: {other:?}"),
    }
}

/// A primary without the replica `wait_for_replicas` asks for (it was promoted, or its
/// replica is resynchronising): each `WAIT` runs out its timeout, and Redis holds every
/// command sent behind it on its connection until then. Eight duplicates of a stored
/// record begun at once each get the record after one wait, not behind the others'
/// (on one shared connection, all but the first reached Redis past their deadline and
/// failed); a claim is refused, not acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_waiting_for_a_missing_replica_do_not_queue_behind_each_other() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let wait = Duration::from_millis(500);
    let plain = RedisStore::connect(redis.url()).await.unwrap();
    let waiting = RedisStore::builder(redis.url())
        .wait_for_replicas(1, wait)
        .build()
        .await
        .unwrap();
    let scope = ScopeKey::from_bytes([9; 32]);
    let fingerprint = Fingerprint::from_bytes([1; 32]);
    let claim = Claim::new(fingerprint, Duration::from_secs(10), None);
    let Begin::Claimed { lease } = plain.begin(&scope, claim.clone()).await.unwrap() else {
        panic!("the first begin claims");
    };
    let record = Record::new(
        fingerprint,
        SystemTime::now(),
        None,
        None,
        Some(response("stored")),
    );
    let ttl = Duration::from_secs(60);
    plain
        .complete(&scope, &lease, Arc::new(record), ttl)
        .await
        .unwrap();

    let started = Instant::now();
    let begins: Vec<_> = (0..8)
        .map(|_| {
            let (waiting, claim) = (waiting.clone(), claim.clone());
            tokio::spawn(async move { waiting.begin(&scope, claim).await })
        })
        .collect();
    for begin in begins {
        match begin.await.unwrap() {
            Ok(Begin::Completed { record, .. }) => {
                assert_eq!(record.payload.as_ref().unwrap().body(), "stored");
            }
            Ok(other) => panic!("a duplicate gets the record: {other:?}"),
            Err(error) => panic!("a duplicate gets the record, not an error: {error}"),
        }
    }
    let took = started.elapsed();
    assert!(
        took < wait * 3,
        "eight replays wait side by side, not in turn: {took:?}"
    );

    let unacknowledged = waiting
        .begin(&ScopeKey::from_bytes([10; 32]), claim)
        .await
        .expect_err("a claim no replica acknowledged is a store failure");
    assert!(
        unacknowledged.to_string().contains("acknowledged by 0"),
        "{unacknowledged}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_within_the_timeout_and_the_layer_recovers() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let runs = Runs::default();
    let replica = Replica::start(&redis.url(), &runs, "a", |layer| layer).await;

    let up = replica.post("/commands", "before").await;
    assert_eq!(up.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 1);

    redis.kill();
    for i in 0..3 {
        let started = Instant::now();
        let closed = replica.post("/commands", &format!("down-{i}")).await;
        let elapsed = started.elapsed();
        assert_eq!(
            closed.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "fail closed"
        );
        assert_eq!(closed.json()["code"], "idempotency.store_unavailable");
        assert!(elapsed < Duration::from_secs(2), "503 after {elapsed:?}");

        let started = Instant::now();
        let open = replica.post("/open", &format!("down-open-{i}")).await;
        let elapsed = started.elapsed();
        assert_eq!(open.status, StatusCode::CREATED, "fail open: it runs");
        assert!(elapsed < Duration::from_secs(2), "ran after {elapsed:?}");
    }
    assert_eq!(runs.get(), 1 + 3, "only the fail-open requests ran");

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    let back = loop {
        let started = Instant::now();
        let reply = try_send(
            &replica.client,
            "POST",
            format!("{}/commands", replica.url),
            &[
                ("idempotency-key", "after"),
                ("content-type", "application/json"),
            ],
            BODY,
        )
        .await
        .expect("the server answers");
        assert!(started.elapsed() < Duration::from_secs(2));
        if reply.status == StatusCode::CREATED || Instant::now() > deadline {
            break reply;
        }
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        back.status,
        StatusCode::CREATED,
        "the layer works again within 5 s of Redis coming back"
    );
    assert_eq!(back.header("idempotent-replayed"), Some("false"));
    let replay = replica.post("/commands", "after").await;
    assert_eq!(
        replay.header("idempotent-replayed"),
        Some("true"),
        "{back:?}\n{replay:?}"
    );
    assert_eq!(replay.body, back.body);
    assert_eq!(runs.get(), 1 + 3 + 1);
}

#[tokio::test]
async fn a_record_expires_in_redis_after_the_ttl() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let runs = Runs::default();
    let replica = Replica::start(&redis.url(), &runs, "a", |layer| {
        layer
            .policy(Policy::new().ttl(Duration::from_secs(1)))
            .unwrap()
    })
    .await;

    let first = replica.post("/commands", "short-lived").await;
    let within = replica.post("/commands", "short-lived").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = replica.post("/commands", "short-lived").await;

    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert_eq!(within.header("idempotent-replayed"), Some("true"));
    assert_eq!(after.status, StatusCode::CREATED);
    assert_eq!(after.header("idempotent-replayed"), Some("false"));
    assert_ne!(after.body, first.body, "it ran again");
    assert_eq!(runs.get(), 2, "an expired record runs again");
}

#[tokio::test]
async fn the_local_cache_replays_and_counts_in_redis() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let cached = RedisStore::builder(redis.url())
        .local_cache(1024 * 1024)
        .build()
        .await
        .unwrap();
    let other_replica = RedisStore::connect(redis.url()).await.unwrap();
    let scope = ScopeKey::from_bytes([9; 32]);
    let fingerprint = Fingerprint::from_bytes([2; 32]);
    let claim = Claim::new(fingerprint, Duration::from_secs(5), None);
    let Begin::Claimed { lease } = cached.begin(&scope, claim.clone()).await.unwrap() else {
        panic!("claimed");
    };
    let record = Record::new(
        fingerprint,
        SystemTime::now(),
        None,
        None,
        Some(response("cached")),
    );
    assert!(cached
        .complete(&scope, &lease, Arc::new(record), Duration::from_secs(60))
        .await
        .unwrap()
        .is_stored());
    // The local insert happens in the background.
    tokio::time::sleep(Duration::from_millis(50)).await;

    let mut counts = Vec::new();
    for store in [&cached, &other_replica, &cached] {
        match store.begin(&scope, claim.clone()).await.unwrap() {
            Begin::Completed {
                record,
                request_count,
            } => {
                assert_eq!(record.payload.as_ref().unwrap().body(), "cached");
                counts.push(request_count);
            }
            other => panic!("a completed record replays: {other:?}"),
        }
    }
    assert_eq!(
        counts,
        [2, 3, 4],
        "every replay is counted in Redis, cached or not"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_store_keeps_the_store_contract() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::connect(redis.url()).await.unwrap();
    tower_ids::idempotency::store::contract::keeps_the_store_contract(Arc::new(store)).await;
}

/// The expiry a stored answer advertises is the record's TTL in Redis, within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expiry_header_is_the_records_ttl_in_redis() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let runs = Runs::default();
    let ttl = Duration::from_secs(7200);
    let replica = Replica::start(&redis.url(), &runs, "a", |layer| {
        layer
            .policy(Policy::new().ttl(ttl))
            .unwrap()
            .expiry_header(true)
    })
    .await;

    let first = replica.post("/commands", "expiring").await;
    let replay = replica.post("/commands", "expiring").await;

    let mut connection = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let records: Vec<String> = redis::cmd("KEYS")
        .arg("tower-ids:idem:*:r")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    let left_ms: u64 = redis::cmd("PTTL")
        .arg(&records[0])
        .query_async(&mut connection)
        .await
        .unwrap();
    let in_redis = SystemTime::now() + Duration::from_millis(left_ms);
    assert!(
        Reply::within_a_second(first.expires(), in_redis),
        "advertised {:?}, Redis {:?}",
        first.expires(),
        in_redis
    );
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.expires(), first.expires());
}
