//! Faults at the worst moment, with real processes: Redis paused (SIGSTOP, SIGCONT) or
//! killed (SIGKILL) and restarted with its append-only file, around the end of a 1 s
//! handler, under two replicas. In every trial the handler runs exactly once, the first
//! client gets its answer, and a client retrying on both replicas gets the replay
//! within a few seconds of Redis returning.
//!
//! And commands whose caller gave up (timed out, answered 503) but which reach Redis
//! after all, when it resumes or on the reconnected connection: they change nothing,
//! so a key is neither run twice nor left locked.
//!
//! Each trial prints one line (`cargo test --test redis faults -- --nocapture`): the
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
const REPLAY_WITHIN: Duration = Duration::from_secs(3);

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
        layer = layer.policy(Policy::new().lease(lease));
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
    fn length(self) -> Duration {
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

// Commands whose caller gave up. A command that timed out (its request already got a
// 503) stays queued in a paused Redis's socket, or goes out on the reconnected
// connection after a restart, and may reach Redis after all. It must change nothing:
// neither take a key whose worker's claim ran out during the pause, nor lock the key of
// a request that was refused.

/// The lease of the trials whose pause outlasts it.
const SHORT_LEASE: Duration = Duration::from_secs(3);

/// How long the retrying client of these trials waits after each answer.
const RETRY_EVERY: Duration = Duration::from_millis(300);

/// How soon after Redis returns a retry of a refused request must run.
const EXECUTED_WITHIN: Duration = Duration::from_secs(1);

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

fn created(reply: &Reply) -> bool {
    reply.status == StatusCode::CREATED
}

/// The `code` of a problem body.
fn problem_code(reply: &Reply) -> Option<String> {
    let body: serde_json::Value = serde_json::from_slice(&reply.body).ok()?;
    body.get("code")?.as_str().map(str::to_owned)
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

/// A reply as the client sees it: `201 idempotent-replayed: true`, or `409
/// idempotency.in_flight`.
fn describe(reply: &Reply) -> String {
    match (reply.header("idempotent-replayed"), problem_code(reply)) {
        (_, Some(code)) => format!("{} {code}", reply.status.as_u16()),
        (Some(replayed), None) => {
            format!("{} idempotent-replayed: {replayed}", reply.status.as_u16())
        }
        (None, None) => reply.status.as_u16().to_string(),
    }
}

/// One request on each replica: every script is loaded and both connections are open.
pub(super) async fn warm_up(a: &Replica, b: &Replica) {
    for (node, key) in [(a, "warm-a"), (b, "warm-b")] {
        let reply = node.send(key, None).await.unwrap();
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    }
}

/// Where a pause shorter than the lease falls in a handler's run.
#[derive(Clone, Copy, Debug)]
struct Outage {
    lease: Duration,
    handler: Duration,
    /// When the pause begins, after the handler started.
    at: Duration,
    pause: Duration,
}

/// One trial: a handler on A, Redis paused for less than the lease from `at` into the
/// handler. A client retries on B every 300 ms from the start of the pause: B's claims
/// time out (503) but stay queued in Redis, the first ahead of A's attempt to store its
/// outcome; A's own renewal, if one falls in the pause, times out too.
async fn stale_claims_trial(trial: usize, outage: Outage, broken: &mut Broken) {
    let Outage {
        lease,
        handler,
        at,
        pause,
    } = outage;
    let fault = Fault::Pause(pause);
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let ledger = Ledger::default();
    let a = replica(&redis.url(), &ledger, Some(lease)).await;
    let b = replica(&redis.url(), &ledger, Some(lease)).await;
    warm_up(&a, &b).await;
    let key = format!("stale-claims-{trial}");

    let first = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move {
            let sent = Instant::now();
            let reply = a.send(&key, Some(handler)).await;
            (reply, sent.elapsed())
        }
    });
    let handler_started = ledger.started(&key).await;
    tokio::time::sleep_until((handler_started + at).into()).await;
    let (_, back) = fault.begin(redis).await;
    let retries = tokio::spawn({
        let (b, key) = (b.clone(), key.clone());
        let until = Instant::now() + Duration::from_secs(15);
        async move { retry_until(&[b], &key, RETRY_EVERY, until, created).await }
    });
    let (redis, back) = back.await.unwrap();
    let (first, answered) = first.await.unwrap();
    let first = first.expect("the first client gets an answer");
    let (answer, seen) = retries.await.unwrap();
    // Whatever was still in flight lands before the count is read.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let runs = ledger.runs(&key);
    let to_201 = answer
        .as_ref()
        .map(|(_, at)| at.saturating_duration_since(back));
    let answer = answer.map(|(reply, _)| reply);
    let replayed_header = answer
        .as_ref()
        .and_then(|reply| reply.header("idempotent-replayed"));
    let same_body = answer.as_ref().map(|reply| reply.body == first.body);
    eprintln!(
        "stale claims, trial {trial}: {fault:?} at {at:?} into a {handler:?} handler on A, lease {lease:?}, retries on B every {RETRY_EVERY:?}: executions {runs}, first answer {} after {answered:?}, retries saw [{}], first 201 {} after Redis returned (idempotent-replayed {replayed_header:?}, the first answer's body {same_body:?})",
        first.status,
        tally(&seen),
        or_never(to_201),
    );
    let trial = format!("stale claims, trial {trial}, {outage:?}");
    broken.check(&trial, runs == 1, format!("the handler ran {runs} times"));
    broken.check(
        &trial,
        first.status == StatusCode::CREATED && first.header("idempotent-replayed") == Some("false"),
        format!("the first client got {} {}", first.status, first.text()),
    );
    broken.check(
        &trial,
        answered < handler + Duration::from_secs(1),
        format!("the first client waited {answered:?}"),
    );
    broken.check(
        &trial,
        seen.iter().all(|status| [409, 503].contains(status)),
        format!("before the first 201, only 409 or 503: [{}]", tally(&seen)),
    );
    match &answer {
        None => broken.check(&trial, false, "the retrying client never got a 201"),
        Some(reply) => broken.check(
            &trial,
            reply.replayed_created() && reply.body == first.body,
            format!(
                "the retrying client's 201 is not the replay of the first answer: idempotent-replayed {replayed_header:?}, body {}",
                reply.text()
            ),
        ),
    }
    broken.check(
        &trial,
        to_201.is_some_and(|to_201| to_201 <= REPLAY_WITHIN),
        format!("replayed {} after Redis returned", or_never(to_201)),
    );
    drop(redis);
}

/// One trial: `fault` begins before a request arrives on A, which is refused with
/// 503; its claim, timed out, may still reach Redis when it returns (queued in the
/// paused server's socket, or sent on the reconnected connection). A client retries
/// the key alternately on B and A from the refusal on; a retry must run the handler
/// soon after Redis returns, and the retries after it get its replay.
async fn refused_trial(fault: Fault, trial: usize, broken: &mut Broken) {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let ledger = Ledger::default();
    let a = replica(&redis.url(), &ledger, None).await;
    let b = replica(&redis.url(), &ledger, None).await;
    warm_up(&a, &b).await;
    let key = format!("refused-{fault:?}-{trial}");

    let (began, back) = fault.begin(redis).await;
    let sent = Instant::now();
    let refused = a.send(&key, None).await.expect("A answers");
    let refused_after = sent.elapsed();
    let nodes = [b.clone(), a.clone()];
    let retries = tokio::spawn({
        let (nodes, key) = (nodes.clone(), key.clone());
        // Long enough to see the key free, not the whole lease it would be locked for.
        let until = began + fault.length() + Duration::from_secs(3);
        async move {
            tokio::time::sleep(RETRY_EVERY).await;
            retry_until(&nodes, &key, RETRY_EVERY, until, created).await
        }
    });
    let (redis, back) = back.await.unwrap();
    let (executed, seen) = retries.await.unwrap();
    // The 201 came on turn `seen.len()`; the retries go on from the other replica until
    // one replays it. A replica still reconnecting after a restart may answer 503 first.
    let names = ["B", "A"];
    let turn = seen.len();
    let after = match &executed {
        Some(_) => {
            let nodes = [nodes[(turn + 1) % 2].clone(), nodes[turn % 2].clone()];
            tokio::time::sleep(RETRY_EVERY).await;
            let until = back + REPLAY_WITHIN;
            Some(retry_until(&nodes, &key, RETRY_EVERY, until, Reply::replayed_created).await)
        }
        None => None,
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    let runs = ledger.runs(&key);
    let code = problem_code(&refused);
    let to_201 = executed
        .as_ref()
        .map(|(_, at)| at.saturating_duration_since(back));
    let executed = executed.map(|(reply, _)| reply);
    let executed_header = executed
        .as_ref()
        .and_then(|reply| reply.header("idempotent-replayed"));
    let (replay, between) = after.unwrap_or_default();
    let to_replay = replay
        .as_ref()
        .map(|(_, at)| at.saturating_duration_since(back));
    let same_body = replay.as_ref().is_some_and(|(reply, _)| {
        Some(&reply.body) == executed.as_ref().map(|executed| &executed.body)
    });
    let then = match (&executed, &replay) {
        (None, _) => "no 201".to_owned(),
        (Some(executed), replay) => {
            format!(
                "first 201 {} after Redis returned, on {} ({}); then [{}] from {}, and {}",
                or_never(to_201),
                names[turn % 2],
                describe(executed),
                tally(&between),
                names[(turn + 1) % 2],
                match replay {
                    Some((reply, _)) => format!(
                        "on {} {} after Redis returned {} ({})",
                        names[(turn + 1 + between.len()) % 2],
                        or_never(to_replay),
                        describe(reply),
                        if same_body {
                            "the 201's body"
                        } else {
                            "another body"
                        },
                    ),
                    None => format!("no replay within {REPLAY_WITHIN:?}"),
                }
            )
        }
    };
    eprintln!(
        "refused, trial {trial}: {fault:?} from before the request, warm replicas: A refused it with {} {code:?} after {refused_after:?}; retries alternately on B and A every {RETRY_EVERY:?} saw [{}], {then}; executions {runs}",
        refused.status,
        tally(&seen),
    );
    let trial = format!("refused {fault:?}, trial {trial}");
    broken.check(
        &trial,
        refused.status == StatusCode::SERVICE_UNAVAILABLE
            && code.as_deref() == Some("idempotency.store_unavailable"),
        format!(
            "the request during the outage got {} {}",
            refused.status,
            refused.text()
        ),
    );
    broken.check(
        &trial,
        seen.iter().all(|status| [409, 503].contains(status)),
        format!("before the first 201, only 409 or 503: [{}]", tally(&seen)),
    );
    broken.check(
        &trial,
        executed_header == Some("false"),
        format!(
            "a retry ran the handler (201, idempotent-replayed false): got {executed_header:?}"
        ),
    );
    broken.check(
        &trial,
        to_201.is_some_and(|to_201| to_201 <= EXECUTED_WITHIN),
        format!(
            "the first 201 came {} after Redis returned",
            or_never(to_201)
        ),
    );
    if executed.is_some() {
        broken.check(
            &trial,
            replay.is_some() && same_body,
            format!("the retries after the 201 replay it: {then}"),
        );
        broken.check(
            &trial,
            between.iter().all(|status| *status == 503),
            format!(
                "between the 201 and its replay, only 503: [{}]",
                tally(&between)
            ),
        );
    }
    broken.check(&trial, runs == 1, format!("the handler ran {runs} times"));
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_that_timed_out_in_a_paused_redis_never_run_the_handler_twice() {
    let ms = Duration::from_millis;
    // A 3 s lease: renewals every 750 ms, each write of the claim holding it 4.5 s.
    let short = |handler, at, pause| Outage {
        lease: SHORT_LEASE,
        handler: ms(handler),
        at: ms(at),
        pause: ms(pause),
    };
    let trials = [
        // Just after the first renewal; the claim of the old schedule ran out in it.
        short(1000, 900, 2900),
        short(1000, 900, 2900),
        short(1000, 900, 2900),
        // Just before the first renewal, for nearly the whole lease.
        short(2000, 700, 2950),
        short(2000, 700, 2950),
        // The default 10 s lease: a 7 s pause from 3.25 s into a 5 s handler (just
        // before the old schedule's first renewal), and 9.5 s from 2.45 s (just before
        // the new one's).
        Outage {
            lease: Duration::from_secs(10),
            handler: ms(5000),
            at: ms(3250),
            pause: ms(7000),
        },
        Outage {
            lease: Duration::from_secs(10),
            handler: ms(5000),
            at: ms(2450),
            pause: ms(9500),
        },
    ];
    let mut broken = Broken::default();
    for (trial, outage) in trials.into_iter().enumerate() {
        stale_claims_trial(trial, outage, &mut broken).await;
    }
    broken.assert_none();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_while_redis_is_paused_does_not_lock_its_key() {
    let mut broken = Broken::default();
    for trial in 0..3 {
        refused_trial(Fault::Pause(Duration::from_secs(2)), trial, &mut broken).await;
    }
    broken.assert_none();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_while_redis_is_killed_does_not_lock_its_key() {
    let mut broken = Broken::default();
    for trial in 0..3 {
        refused_trial(Fault::Kill(Duration::from_secs(1)), trial, &mut broken).await;
    }
    broken.assert_none();
}

/// A client that hangs up while its request's claim waits in a paused Redis: the claim
/// still lands when Redis resumes (within its deadline), but nothing will run it; the
/// store gives it up by its token, so a retry right after runs instead of getting
/// `409` for a claim's length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_client_hung_up_is_given_up() {
    let mut broken = Broken::default();
    for trial in 0..3 {
        let Some(redis) = RedisServer::start() else {
            return;
        };
        let ledger = Ledger::default();
        let a = replica(&redis.url(), &ledger, None).await;
        warm_up(&a, &a).await;
        let key = format!("hung-up-{trial}");
        redis.pause();
        let hung_up = tokio::time::timeout(Duration::from_millis(100), a.send(&key, None)).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        redis.resume();
        let back = Instant::now();
        let (answer, seen) = retry_until(
            std::slice::from_ref(&a),
            &key,
            Duration::from_millis(100),
            back + Duration::from_secs(20),
            created,
        )
        .await;
        let ran_after = answer.as_ref().map(|(_, at)| at.duration_since(back));
        eprintln!(
            "hung up, trial {trial}: the client gave up ({}), Redis resumed 50 ms later; the retry's first 201 {} after it, after [{}]; executions {}",
            if hung_up.is_err() { "yes" } else { "no: it was answered" },
            or_never(ran_after),
            tally(&seen),
            ledger.runs(&key),
        );
        let trial = format!("hung up, trial {trial}");
        broken.check(
            &trial,
            hung_up.is_err(),
            "the client was answered within 100 ms",
        );
        broken.check(
            &trial,
            ran_after.is_some_and(|after| after < Duration::from_secs(2)),
            format!("the retry ran {} after Redis resumed", or_never(ran_after)),
        );
        broken.check(&trial, ledger.runs(&key) == 1, "one execution");
        drop(redis);
    }
    broken.assert_none();
}
