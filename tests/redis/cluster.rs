//! `RedisStore` on a real Redis Cluster made by the test (six `redis-server` processes,
//! three primaries with a replica each): two replicas of a service replay each other's
//! records and run a burst of duplicates once; the store keeps the store contract; and
//! the primary that owns a key's slot is killed (SIGKILL) right after the claim, in the
//! middle of the handler and right after the completion, with replicas' acknowledgement
//! (`WAIT`) off and on, while a client retries on both replicas. Each failover trial
//! prints one line (`cargo test --all-features --test redis cluster -- --nocapture`):
//! executions, what the client saw, and how long after the kill the replay came.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{extract::State, http::HeaderMap, response::Response, routing::post, Router};
use http::StatusCode;
use serde_json::json;
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{store::RedisStore, IdempotencyLayer},
};

use super::{
    cluster_server::RedisCluster,
    contract,
    support::{client, serve, try_send, HttpClient, Reply},
};

/// How many times the handler ran, per key.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<HashMap<String, usize>>>);

impl Ledger {
    fn runs(&self, key: &str) -> usize {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

/// Counts its run, sleeps `x-delay-ms`, answers 201 with the key and the run.
async fn counted(State(ledger): State<Ledger>, headers: HeaderMap) -> Response {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let run = {
        let mut runs = ledger.0.lock().unwrap();
        let runs = runs.entry(key.clone()).or_default();
        *runs += 1;
        *runs
    };
    if let Some(ms) = headers.get("x-delay-ms") {
        let ms = ms.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(
            json!({ "key": key, "run": run }).to_string(),
        ))
        .unwrap()
}

/// A replica of the service: its own `RedisStore` on the cluster, and axum server.
#[derive(Clone)]
struct Node {
    url: String,
    client: HttpClient,
}

impl Node {
    async fn start(store: RedisStore, ledger: &Ledger) -> Self {
        let router = Router::new()
            .route(
                "/commands",
                post(counted).layer(IdempotencyLayer::with_store(store)),
            )
            .with_state(ledger.clone())
            .layer(CorrelationLayer::new());
        Self {
            url: format!("http://{}/commands", serve(router).await),
            client: client(),
        }
    }

    async fn post(&self, key: &str, delay: Option<Duration>) -> Option<Reply> {
        let delay = delay.map(|d| d.as_millis().to_string());
        let mut headers = vec![("idempotency-key", key)];
        if let Some(delay) = &delay {
            headers.push(("x-delay-ms", delay));
        }
        try_send(&self.client, "POST", self.url.clone(), &headers, "{}")
            .await
            .ok()
    }
}

/// A store on `cluster` under `prefix`, waiting for `replicas` acknowledgements.
async fn store(cluster: &RedisCluster, prefix: &str, replicas: u32) -> RedisStore {
    RedisStore::cluster(cluster.urls())
        .prefix(prefix)
        .wait_for_replicas(replicas, Duration::from_secs(1))
        .build()
        .await
        .expect("the cluster is up")
}

fn replayed(reply: &Reply) -> bool {
    reply.status == StatusCode::CREATED && reply.header("idempotent-replayed") == Some("true")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_store_keeps_the_store_contract_on_a_cluster() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let store = store(&cluster, "contract:", 0).await;
    contract::keeps_the_store_contract(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_a_cluster_replay_each_other_and_run_a_burst_once() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let ledger = Ledger::default();
    let a = Node::start(store(&cluster, "two:", 1).await, &ledger).await;
    let b = Node::start(store(&cluster, "two:", 1).await, &ledger).await;

    // Keys land on every primary: each replays across replicas. (A `503` is a claim the
    // replica did not acknowledge in time on a loaded machine: nothing ran; again.)
    let until_answered = |node: Node, key: String| async move {
        for _ in 0..20 {
            match node.post(&key, None).await {
                Some(reply) if reply.status != StatusCode::SERVICE_UNAVAILABLE => return reply,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        panic!("{key}: 503 twenty times");
    };
    for n in 0..12 {
        let key = format!("replay-{n}");
        let first = until_answered(a.clone(), key.clone()).await;
        let again = until_answered(b.clone(), key.clone()).await;
        assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
        assert!(replayed(&again), "{key}: {} {}", again.status, again.text());
        assert_eq!(again.body, first.body);
        assert_eq!(ledger.runs(&key), 1);
    }
    let slots: std::collections::HashSet<u16> = cluster
        .keys("two:*:r")
        .iter()
        .map(|key| cluster.slot_of(key))
        .filter_map(|slot| cluster.primary_of(slot))
        .collect();
    assert!(
        slots.len() >= 2,
        "the records spread over the primaries: {slots:?}"
    );

    // A burst of 20 duplicates over both replicas, for each of 3 keys: one run each.
    for n in 0..3 {
        let key = format!("burst-{n}");
        let sends: Vec<_> = (0..20)
            .map(|i| {
                let node = if i % 2 == 0 { a.clone() } else { b.clone() };
                let key = key.clone();
                tokio::spawn(async move { node.post(&key, Some(Duration::from_millis(200))).await })
            })
            .collect();
        let mut statuses = Vec::new();
        for send in sends {
            statuses.push(send.await.unwrap().map_or(0, |reply| reply.status.as_u16()));
        }
        assert_eq!(ledger.runs(&key), 1, "{key}: {statuses:?}");
        assert!(
            statuses.iter().all(|s| [201, 409, 503].contains(s)),
            "{key}: {statuses:?}"
        );
        assert!(statuses.contains(&201), "{key}: one ran: {statuses:?}");
    }
}

/// When, relative to the first request, the primary of its key's slot is killed.
#[derive(Clone, Copy, Debug)]
enum Moment {
    /// As soon as the claim is in Redis (the handler has just started).
    AfterClaim,
    /// Half-way through the 1 s handler.
    MidHandler,
    /// As soon as the first client has its answer (the record is stored).
    AfterCompletion,
}

/// What one failover trial saw.
struct Seen {
    runs: usize,
    recovered: Duration,
}

/// One trial on a fresh cluster: a 1 s handler on replica A, the primary that owns its
/// key's slot killed at `moment`, a client retrying every 100 ms on B and A until it
/// gets the replay.
async fn failover_trial(moment: Moment, replicas: u32, trial: usize) -> Option<Seen> {
    let mut cluster = RedisCluster::start()?;
    let prefix = format!("failover-{trial}:");
    let ledger = Ledger::default();
    let a = Node::start(store(&cluster, &prefix, replicas).await, &ledger).await;
    let b = Node::start(store(&cluster, &prefix, replicas).await, &ledger).await;
    let key = format!("key-{moment:?}-{replicas}-{trial}");
    // Each replica's first request: connections open, scripts loaded on every node.
    for (node, warm) in [(&a, "warm-a"), (&b, "warm-b")] {
        let deadline = Instant::now() + Duration::from_secs(10);
        while node
            .post(warm, None)
            .await
            .is_none_or(|r| r.status != StatusCode::CREATED)
        {
            assert!(
                Instant::now() < deadline,
                "the cluster never took a first request"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // The first request, sent again while it is refused before its handler starts (a
    // loaded machine can miss the replica's acknowledgement: a `503`, nothing ran).
    let deadline = Instant::now() + Duration::from_secs(20);
    let first = loop {
        let first = tokio::spawn({
            let (a, key) = (a.clone(), key.clone());
            async move { a.post(&key, Some(Duration::from_secs(1))).await }
        });
        while ledger.runs(&key) == 0 && !first.is_finished() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if ledger.runs(&key) > 0 {
            break first;
        }
        let refused = first.await.unwrap();
        assert!(
            refused
                .as_ref()
                .is_none_or(|reply| reply.status == StatusCode::SERVICE_UNAVAILABLE),
            "refused before running with 503 only: {:?}",
            refused.map(|reply| reply.status)
        );
        assert!(Instant::now() < deadline, "the handler never started");
    };
    let claim = cluster
        .keys(&format!("{prefix}*:c"))
        .pop()
        .expect("the claim is in the cluster");
    let slot = cluster.slot_of(&claim);
    let primary = cluster.primary_of(slot).expect("the slot has a primary");
    let mut first = Some(first);
    let answered = match moment {
        Moment::AfterClaim => None,
        Moment::MidHandler => {
            tokio::time::sleep(Duration::from_millis(500)).await;
            None
        }
        Moment::AfterCompletion => Some(first.take().unwrap().await.unwrap()),
    };
    let (cluster, killed) = tokio::task::spawn_blocking(move || {
        cluster.kill(primary);
        (cluster, Instant::now())
    })
    .await
    .unwrap();

    let mut seen = Vec::new();
    let replay = loop {
        let node = if seen.len() % 2 == 0 { &b } else { &a };
        match node.post(&key, None).await {
            Some(reply) if reply.status == StatusCode::CREATED => break reply,
            Some(reply) => seen.push(reply.status.as_u16()),
            None => seen.push(0),
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "no 201 within 30 s of the kill: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let recovered = killed.elapsed();
    let first = match (answered, first) {
        (Some(answered), _) => answered,
        (None, Some(first)) => first.await.unwrap(),
        (None, None) => unreachable!(),
    };
    let promoted = tokio::task::spawn_blocking(move || {
        let promoted = cluster.wait_for_failover(slot, primary);
        (cluster, promoted)
    })
    .await
    .unwrap()
    .1;
    // Whatever was in flight lands before the count is read.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let runs = ledger.runs(&key);
    eprintln!(
        "cluster failover, {moment:?}, wait_for_replicas({replicas}), trial {trial}: primary {primary} killed, {promoted} promoted; executions {runs}; retries saw {seen:?}; first 201 for the retrying client {recovered:?} after the kill ({}); first client {}",
        if replayed(&replay) { "replayed" } else { "executed" },
        first.as_ref().map_or_else(|| "answered later".to_owned(), |r| r.status.to_string()),
    );
    assert!(
        seen.iter().all(|status| [0, 409, 503].contains(status)),
        "before the 201, only 409 or 503: {seen:?}"
    );
    Some(Seen { runs, recovered })
}

async fn failovers(replicas: u32) -> Vec<(Moment, usize)> {
    let mut doubled = Vec::new();
    let mut slowest = Duration::ZERO;
    let mut trials = 0;
    for moment in [
        Moment::AfterClaim,
        Moment::MidHandler,
        Moment::AfterCompletion,
    ] {
        for trial in 0..2 {
            let Some(seen) = failover_trial(moment, replicas, trial).await else {
                return doubled;
            };
            trials += 1;
            slowest = slowest.max(seen.recovered);
            if seen.runs != 1 {
                doubled.push((moment, seen.runs));
            }
        }
    }
    eprintln!(
        "cluster failovers with wait_for_replicas({replicas}): {} of {trials} trials ran the handler more than once; slowest recovery {slowest:?}",
        doubled.len()
    );
    doubled
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_with_replicas_acknowledging_never_runs_a_handler_twice() {
    let doubled = failovers(1).await;
    assert!(doubled.is_empty(), "ran more than once: {doubled:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_without_waiting_for_replicas_recovers() {
    // No assertion on the count: without `WAIT`, a claim or a record the replica had
    // not received is lost with the primary. The line says how often that happened.
    let doubled = failovers(0).await;
    assert!(
        doubled.iter().all(|(_, runs)| *runs <= 2),
        "at most one more run per lost write: {doubled:?}"
    );
}

/// Four clients send new keys (the first request on one replica, its retry on the
/// other) while every slot of one primary moves to another (`MOVED` and `ASK` on the
/// way, followed by the cluster client): every key runs once, and replays after the
/// move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_run_once_while_their_slots_move_to_another_primary() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let ledger = Ledger::default();
    let a = Node::start(store(&cluster, "moving:", 0).await, &ledger).await;
    let b = Node::start(store(&cluster, "moving:", 0).await, &ledger).await;
    let primaries: Vec<u16> = cluster
        .nodes_info()
        .unwrap()
        .into_iter()
        .filter(|node| node.primary && !node.slots.is_empty())
        .map(|node| node.port)
        .collect();
    let (from, to) = (primaries[0], primaries[1]);

    let moving = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let clients: Vec<_> = (0..4)
        .map(|client| {
            let (a, b, moving) = (a.clone(), b.clone(), moving.clone());
            tokio::spawn(async move {
                let mut keys = Vec::new();
                let mut statuses = Vec::new();
                for n in 0.. {
                    if !moving.load(std::sync::atomic::Ordering::Relaxed) && n >= 5 {
                        break;
                    }
                    let key = format!("moving-{client}-{n}");
                    let started = Instant::now();
                    // Until the retry on the other replica replays it.
                    for attempt in 0.. {
                        let node = if attempt % 2 == 0 { &a } else { &b };
                        match node.post(&key, None).await {
                            Some(reply) if replayed(&reply) => break,
                            // The first execution: now its retry, on the other replica.
                            Some(reply) if reply.status == StatusCode::CREATED => {}
                            Some(reply) => statuses.push(reply.status.as_u16()),
                            None => statuses.push(0),
                        }
                        assert!(
                            started.elapsed() < Duration::from_secs(20),
                            "{key} never replayed: {statuses:?}"
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    keys.push(key);
                }
                (keys, statuses)
            })
        })
        .collect();
    let began = Instant::now();
    let cluster = tokio::task::spawn_blocking(move || {
        cluster.move_all_slots(from, to);
        cluster
    })
    .await
    .unwrap();
    let took = began.elapsed();
    moving.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut keys = Vec::new();
    let mut statuses = Vec::new();
    for client in clients {
        let (mine, seen) = client.await.unwrap();
        keys.extend(mine);
        statuses.extend(seen);
    }
    let twice: Vec<_> = keys.iter().filter(|key| ledger.runs(key) != 1).collect();
    eprintln!(
        "cluster reshard: every slot of {from} moved to {to} in {took:?}; {} keys, run more or less than once: {twice:?}; answers other than the replay: {} (503: {}, 409: {})",
        keys.len(),
        statuses.len(),
        statuses.iter().filter(|s| **s == 503).count(),
        statuses.iter().filter(|s| **s == 409).count(),
    );
    assert!(twice.is_empty(), "every key ran once: {twice:?}");
    assert!(
        cluster
            .nodes_info()
            .unwrap()
            .iter()
            .any(|node| node.port == from && node.slots.is_empty()),
        "the slots moved"
    );
    // After the move, every key replays on both replicas from its new primary.
    for key in &keys {
        for node in [&a, &b] {
            let reply = node.post(key, None).await.unwrap();
            assert!(replayed(&reply), "{key}: {} {}", reply.status, reply.text());
        }
    }
}
