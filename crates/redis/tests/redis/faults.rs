//! Faults at the worst moment, with real processes: Redis paused (SIGSTOP, SIGCONT) or
//! killed (SIGKILL) and restarted with its append-only file, around the end of a 1 s
//! handler, under two replicas. In every trial the handler runs exactly once, the first
//! client gets its answer, and a client retrying on both replicas gets the replay
//! within a few seconds of Redis returning.
//!
//! The helpers here (`Fault`, `Broken`, `retry_until`, ...) serve the other trials too:
//! `late_commands.rs`, `outages.rs`, `messages.rs`.
//!
//! Each trial prints one line (`cargo test -p tower-ids-redis --test redis faults -- --nocapture`): the
//! fault, its placement, executions, and how long the replay took.

use std::time::{Duration, Instant};
use tower_ids::idempotency::Policy;

use http::StatusCode;
use tower_ids::idempotency::{store::RedisStore, IdempotencyLayer};

use super::{
    replica::{Ledger, Replica},
    server::RedisServer,
    support::{Logs, Reply},
};

/// How long the handler of every trial runs.
const HANDLER: Duration = Duration::from_secs(1);

/// How soon after Redis returns the retrying client must have its replay.
pub(super) const REPLAY_WITHIN: Duration = Duration::from_secs(3);

/// A replica on the Redis at `redis_url` (a command timeout of 250 ms) whose layer has
/// `lease`, or the default.
pub(super) async fn replica(redis_url: &str, ledger: &Ledger, lease: Option<Duration>) -> Replica {
    let store = RedisStore::builder(redis_url)
        .command_timeout(Duration::from_millis(250))
        .build()
        .await
        .expect("Redis is up");
    let mut layer = IdempotencyLayer::with_store(store);
    if let Some(lease) = lease {
        layer = layer.policy(Policy::new().lease(lease)).unwrap();
    }
    Replica::start(layer, ledger).await
}

/// Sends `key` to each node in turn every 100 ms until one replays it; returns the
/// replay, when it came, and every status seen before it (`0` for a failed connection).
async fn retry_until_replayed(nodes: [Replica; 2], key: String) -> (Reply, Instant, Vec<u16>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let every = Duration::from_millis(100);
    let (replay, seen) = retry_until(&nodes, &key, every, deadline, Reply::replayed_created).await;
    let Some((replay, at)) = replay else {
        panic!("no replay for {key} within 30 s; saw {seen:?}");
    };
    (replay, at, seen)
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Fault {
    /// SIGSTOP, then SIGCONT this much later.
    Pause(Duration),
    /// SIGKILL, then a restart (with the append-only file, if the server keeps one)
    /// this much later.
    Kill(Duration),
}

impl Fault {
    /// Applies the fault on a blocking thread; returns the server and when it was back.
    async fn apply(self, redis: RedisServer) -> (RedisServer, Instant) {
        let (_, back) = self.begin(redis).await;
        back.await.unwrap()
    }

    /// Starts the fault and returns once it is in place: when it started, and the
    /// blocking task that ends it, which returns the server and when it was back.
    pub(super) async fn begin(
        self,
        mut redis: RedisServer,
    ) -> (Instant, tokio::task::JoinHandle<(RedisServer, Instant)>) {
        let (redis, began) = tokio::task::spawn_blocking(move || {
            match self {
                Self::Pause(_) => redis.pause(),
                Self::Kill(_) => redis.kill(),
            }
            (redis, Instant::now())
        })
        .await
        .unwrap();
        let back = tokio::task::spawn_blocking(move || {
            let mut redis = redis;
            std::thread::sleep(self.length().saturating_sub(began.elapsed()));
            match self {
                Self::Pause(_) => redis.resume(),
                Self::Kill(_) => redis.restart(),
            }
            (redis, Instant::now())
        });
        (began, back)
    }

    /// How long Redis is gone.
    pub(super) fn length(self) -> Duration {
        match self {
            Self::Pause(length) | Self::Kill(length) => length,
        }
    }
}

/// One trial: a 1 s handler on replica A, `fault` applied `at` after the handler
/// started, a client retrying on A and B. Asserts every guarantee and says what it saw.
async fn trial(fault: Fault, at: Duration, warm: bool) {
    let Some(redis) = RedisServer::start_persistent() else {
        return;
    };
    let ledger = Ledger::default();
    let a = replica(&redis.url(), &ledger, None).await;
    let b = replica(&redis.url(), &ledger, None).await;
    if warm {
        // Loads every script into Redis, and opens both replicas' connections.
        for (node, key) in [(&a, "warm-a"), (&b, "warm-b")] {
            let reply = node.send(key, None).await.unwrap();
            assert_eq!(reply.status, StatusCode::CREATED);
        }
    }
    let key = format!("trial-{fault:?}-{at:?}-{warm}");

    let first = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move {
            let sent = Instant::now();
            let reply = a.send(&key, Some(HANDLER)).await;
            (reply, sent.elapsed())
        }
    });
    let handler_started = ledger.started(&key).await;
    tokio::time::sleep_until((handler_started + at).into()).await;
    let retries = tokio::spawn(retry_until_replayed([b.clone(), a.clone()], key.clone()));
    let (_redis, back) = fault.apply(redis).await;
    let (first, answered) = first.await.unwrap();
    let first = first.expect("the first client gets an answer");
    let (replay, replayed_at, seen) = retries.await.unwrap();
    // Whatever was still in flight lands before the count is read.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let runs = ledger.runs(&key);
    let to_replay = replayed_at.saturating_duration_since(back);
    eprintln!(
        "fault {fault:?} at {at:?} into the handler, {} Redis: executions {runs}, first answer {} after {answered:?}, replay {to_replay:?} after Redis returned, retries saw {seen:?}",
        if warm { "warm" } else { "fresh" },
        first.status,
    );
    assert_eq!(runs, 1, "the handler ran exactly once");
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert!(
        answered < HANDLER + Duration::from_secs(1),
        "the first client got its answer at once: {answered:?}"
    );
    assert_eq!(replay.body, first.body, "the replay is the first response");
    assert!(
        seen.iter().all(|status| [409, 503].contains(status)),
        "before the replay, only 409 or 503: {seen:?}"
    );
    assert!(
        to_replay <= REPLAY_WITHIN,
        "replayed {to_replay:?} after Redis returned"
    );
}

/// Pauses before, across and after the moment the handler returns.
const PAUSES: [(u64, u64); 5] = [
    // (pause ms, placement ms after the handler started)
    (300, 950),
    (500, 950),
    (1000, 950),
    (2000, 950),
    (1700, 400),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_around_the_end_of_the_handler_fresh() {
    for (pause, at) in PAUSES {
        let fault = Fault::Pause(Duration::from_millis(pause));
        trial(fault, Duration::from_millis(at), false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_around_the_end_of_the_handler_warm() {
    for (pause, at) in PAUSES {
        let fault = Fault::Pause(Duration::from_millis(pause));
        trial(fault, Duration::from_millis(at), true).await;
    }
}

/// Kills before and just after the handler returns, and one mid-handler.
const KILLS: [(u64, u64); 3] = [
    // (down ms, placement ms after the handler started)
    (500, 950),
    (1000, 1020),
    (1500, 400),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_around_the_end_of_the_handler_fresh() {
    for (down, at) in KILLS {
        let fault = Fault::Kill(Duration::from_millis(down));
        trial(fault, Duration::from_millis(at), false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_around_the_end_of_the_handler_warm() {
    for (down, at) in KILLS {
        let fault = Fault::Kill(Duration::from_millis(down));
        trial(fault, Duration::from_millis(at), true).await;
    }
}

/// 20 clients, each sending new keys one after another to either replica and retrying
/// each until it gets a 201; Redis killed at 3 s and restarted at 6 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_load_every_key_runs_once_through_a_redis_kill_and_restart() {
    const WORKERS: usize = 20;
    let Some(redis) = RedisServer::start_persistent() else {
        return;
    };
    let ledger = Ledger::default();
    let nodes = [
        replica(&redis.url(), &ledger, None).await,
        replica(&redis.url(), &ledger, None).await,
    ];
    let begin = Instant::now();
    let stop = begin + Duration::from_secs(9);
    let workers: Vec<_> = (0..WORKERS)
        .map(|worker| {
            let nodes = nodes.clone();
            tokio::spawn(async move {
                // (key, when it was first sent, when its 201 came)
                let mut done = Vec::new();
                for n in 0.. {
                    if Instant::now() >= stop {
                        break;
                    }
                    let key = format!("w{worker}-{n}");
                    let sent = Instant::now();
                    for attempt in 0.. {
                        let node = &nodes[(worker + attempt) % 2];
                        match node.send(&key, Some(Duration::from_millis(300))).await {
                            Ok(reply) if reply.status == StatusCode::CREATED => break,
                            _ => tokio::time::sleep(Duration::from_millis(100)).await,
                        }
                        assert!(
                            sent.elapsed() < Duration::from_secs(30),
                            "{key} never got a 201"
                        );
                    }
                    done.push((key, sent, Instant::now()));
                }
                done
            })
        })
        .collect();
    let (redis, killed, back) = tokio::task::spawn_blocking(move || {
        let mut redis = redis;
        std::thread::sleep(Duration::from_secs(3));
        let killed = Instant::now();
        redis.kill();
        std::thread::sleep(Duration::from_secs(3));
        redis.restart();
        (redis, killed, Instant::now())
    })
    .await
    .unwrap();
    let mut keys = Vec::new();
    for worker in workers {
        keys.extend(worker.await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let in_flight_at_kill = keys
        .iter()
        .filter(|(_, sent, done)| *sent <= killed && *done >= killed)
        .count();
    let twice: Vec<_> = ledger
        .per_key()
        .into_iter()
        .filter(|(_, runs)| *runs != 1)
        .collect();
    let slowest = keys
        .iter()
        .map(|(_, sent, done)| done.duration_since(*sent))
        .max()
        .unwrap();
    eprintln!(
        "load: {} keys from {WORKERS} clients, {in_flight_at_kill} in flight when Redis was killed (down {:?}); keys not run exactly once: {twice:?}; slowest key {slowest:?}",
        keys.len(),
        back.duration_since(killed),
    );
    assert!(
        in_flight_at_kill >= WORKERS / 2,
        "the kill hit keys in flight"
    );
    assert!(twice.is_empty(), "every key ran exactly once: {twice:?}");
    assert_eq!(ledger.per_key().len(), keys.len(), "every key ran");
    // Every key's outcome is in Redis: each replays on both replicas.
    for (key, _, _) in keys
        .iter()
        .filter(|(_, sent, done)| *sent <= killed && *done >= killed)
    {
        for node in &nodes {
            let reply = node.send(key, None).await.unwrap();
            assert!(
                reply.replayed_created(),
                "{key}: {} {}",
                reply.status,
                reply.text()
            );
        }
    }
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_request_on_each_replica_after_a_redis_restart_is_served() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let ledger = Ledger::default();
    let nodes = [
        replica(&redis.url(), &ledger, None).await,
        replica(&redis.url(), &ledger, None).await,
    ];
    for (i, node) in nodes.iter().enumerate() {
        let reply = node.send(&format!("before-{i}"), None).await.unwrap();
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let _redis = tokio::task::spawn_blocking(move || {
        let mut redis = redis;
        redis.restart();
        // Back, and quiet for a while: nothing has told the replicas yet.
        std::thread::sleep(Duration::from_millis(1500));
        redis
    })
    .await
    .unwrap();
    for (i, node) in nodes.iter().enumerate() {
        let reply = node.send(&format!("after-{i}"), None).await.unwrap();
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "replica {i}: {}",
            reply.text()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_running_three_times_the_lease_is_not_run_again() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    // The shortest lease a store with a 250 ms command timeout allows.
    let lease = Duration::from_millis(1400);
    let ledger = Ledger::default();
    let a = replica(&redis.url(), &ledger, Some(lease)).await;
    let b = replica(&redis.url(), &ledger, Some(lease)).await;
    let first = tokio::spawn({
        let a = a.clone();
        async move { a.send("long", Some(lease * 3)).await }
    });
    ledger.started("long").await;
    let (replay, _, seen) = retry_until_replayed([b, a], "long".into()).await;
    let first = first.await.unwrap().unwrap();

    assert_eq!(ledger.runs("long"), 1, "retries never ran it again");
    assert!(seen.len() >= 10, "retried all along: {seen:?}");
    assert!(seen.iter().all(|s| *s == 409), "{seen:?}");
    assert_eq!(replay.body, first.body);
}

/// A Redis without persistence, restarted while the handler runs, loses the claim: the
/// layer cannot promise exactly once then, but it notices, puts the claim back, stores
/// the outcome, and says so in a WARN event.
#[tokio::test(flavor = "current_thread")]
async fn a_redis_that_lost_the_claim_is_noticed_and_logged() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let (logs, _guard) = Logs::capture();
    let ledger = Ledger::default();
    let lease = Duration::from_millis(1400);
    let a = replica(&redis.url(), &ledger, Some(lease)).await;
    let first = tokio::spawn({
        let a = a.clone();
        async move { a.send("lost", Some(Duration::from_millis(2000))).await }
    });
    ledger.started("lost").await;
    let (_redis, _) = Fault::Kill(Duration::from_millis(100)).apply(redis).await;
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(300)).await;

    let restored = logs.events("idempotency.claim_restored");
    assert!(!restored.is_empty(), "{}", logs.raw());
    assert_eq!(restored[0]["level"], "WARN");
    assert_eq!(restored[0]["span"]["idempotency_key"], "lost");
    let replay = a.send("lost", None).await.unwrap();
    assert!(
        replay.replayed_created(),
        "the outcome was stored after all"
    );
    assert_eq!(ledger.runs("lost"), 1);
}

/// The guarantees a trial saw broken, one line each, so that every trial runs and
/// prints its line before the test fails.
#[derive(Default)]
pub(crate) struct Broken(Vec<String>);

impl Broken {
    pub(crate) fn check(&mut self, trial: &str, held: bool, what: impl std::fmt::Display) {
        if !held {
            self.0.push(format!("{trial}: {what}"));
        }
    }

    pub(crate) fn assert_none(self) {
        assert!(self.0.is_empty(), "broken:\n{}", self.0.join("\n"));
    }
}

/// Sends `key` to `nodes` in turn, pausing `every` after each answer, until `done`
/// accepts a reply or `until` has passed; returns that reply and when it came, if one
/// did, and every status seen before it (`0` for a failed connection).
pub(super) async fn retry_until(
    nodes: &[Replica],
    key: &str,
    every: Duration,
    until: Instant,
    done: impl Fn(&Reply) -> bool,
) -> (Option<(Reply, Instant)>, Vec<u16>) {
    let mut seen = Vec::new();
    for turn in 0.. {
        match nodes[turn % nodes.len()].send(key, None).await {
            Ok(reply) if done(&reply) => return (Some((reply, Instant::now())), seen),
            Ok(reply) => seen.push(reply.status.as_u16()),
            Err(_) => seen.push(0),
        }
        if Instant::now() >= until {
            break;
        }
        tokio::time::sleep(every).await;
    }
    (None, seen)
}

/// Statuses in order, repeats counted: `503x4, 409x9, 201`.
pub(super) fn tally(seen: &[u16]) -> String {
    let mut runs: Vec<(u16, usize)> = Vec::new();
    for &status in seen {
        match runs.last_mut() {
            Some((last, n)) if *last == status => *n += 1,
            _ => runs.push((status, 1)),
        }
    }
    let runs: Vec<_> = runs
        .into_iter()
        .map(|(status, n)| match n {
            1 => status.to_string(),
            n => format!("{status}x{n}"),
        })
        .collect();
    runs.join(", ")
}

/// `Some(d)` as `d`, `None` as `never`.
pub(super) fn or_never(duration: Option<Duration>) -> String {
    duration.map_or_else(|| "never".to_owned(), |duration| format!("{duration:?}"))
}

/// One request on each replica: every script is loaded and both connections are open.
pub(super) async fn warm_up(a: &Replica, b: &Replica) {
    for (node, key) in [(a, "warm-a"), (b, "warm-b")] {
        let reply = node.send(key, None).await.unwrap();
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    }
}
