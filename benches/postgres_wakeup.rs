//! `PostgresStore`'s two modes, by measurement: how soon a duplicate waiting on a request
//! in flight gets its record once the request is stored, and what each mode costs a
//! request at the store.
//!
//! Group `postgres_wakeup` (the issue "waiting duplicates are woken, not polling"): each
//! trial claims a fresh scope, starts a waiter task on `store.wait(&scope, 5 s)`, lets it
//! wait a random 20 to 80 ms (so a polling waiter is at any phase of its backoff, as a
//! real duplicate would be), has the owner make one statement as its handler would (in
//! its transaction, in transactional mode), then stores the outcome. A trial's time runs from just
//! before the owner's completion to the waiter returning `Waited::Completed`; the sleep
//! and the claim are outside it (`iter_custom`), so criterion's figure is the wake
//! latency itself. It includes the owner's own statements (the store's write and, in
//! transactional mode, the commit): the record cannot be seen before they end.
//! - `durable_polling`: `PostgresMode::Durable`; the owner's `complete`. The waiter polls
//!   the row, 10 ms doubling to 200 ms.
//! - `transactional_lock_wait`: `PostgresMode::Transactional`; the owner's
//!   `transaction.settle(scope, Some(..))`, which stores the record and commits. The
//!   waiter waits in `pg_advisory_xact_lock`, granted when the owner's transaction ends,
//!   then reads the record.
//!
//! Criterion reports means, so every trial's times are also kept (all but the first few,
//! which open the pool's connections), and p50, p99 and max per mode are printed at the
//! end with the ratio of the medians (polling over lock wait), for the whole wake-up and
//! split at the moment the owner's completion returned; with them, how busy the
//! machine's CPUs were over each mode's trials (`/proc/stat`), since other processes on
//! the cores show in the tail. A trial whose waiter gets anything but the record fails
//! the bench.
//!
//! Group `postgres_mode_cost`: what each mode costs one request at the store, side by
//! side (`<mode>/<path>`):
//! - `first`: a fresh scope, `begin` (claimed) then `complete` (durable) or `settle`
//!   (transactional, committing). Durable is two statements; transactional reads the
//!   scope, begins a transaction, takes the lock, reads again under it, then stores the
//!   record and commits.
//! - `replay`: `begin` on a scope completed before the row: one statement in either mode
//!   (durable: the claim's upsert, which finds the record; transactional: the read that
//!   counts the request and returns the record).
//!
//! Both groups use one store (a pool of 4 connections, a table in a database this bench
//! creates and drops; the transactional store is `with_mode` of the durable one), 1 KiB
//! record bodies, and a two-worker tokio runtime, the machine's two cores. The server is
//! `TOWER_IDS_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`); with
//! none reachable the bench says `SKIPPED` and measures nothing, unless `CI` is set.
//!
//! Run: `cargo bench --all-features --bench postgres_wakeup` (about 3 minutes)
#![allow(missing_docs)]

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use bytes::Bytes;
use criterion::{Criterion, SamplingMode};
use tower_ids::idempotency::store::{
    Begin, Claim, Fingerprint, IdempotencyStore, Payload, PayloadFormat, PostgresMode,
    PostgresStore, Record, ScopeKey, Transaction, TransactionEnd, Waited,
};

use tower_ids_test_support::postgres as database;

use database::TestDatabase;

/// How long the waiter waits at most: far beyond any wake-up, so a trial that times out
/// is a failure, not a slow sample.
const WAIT_TIMEOUT: Duration = Duration::from_secs(5);

/// The claim's lease in durable mode: longer than any trial, so no lease runs out.
const LEASE: Duration = Duration::from_secs(30);

/// Records outlive the run: none expires while it reads them.
const TTL: Duration = Duration::from_secs(3600);

/// The shortest and longest time the waiter waits before the owner completes.
const PHASE_MS: std::ops::RangeInclusive<u64> = 20..=80;

/// Trials per mode before criterion starts, not kept: they open the pool's connections
/// and prepare the statements, which a running service has long done.
const UNKEPT_TRIALS: usize = 5;

/// The pool's connections: a transactional trial holds two (the owner's transaction and
/// the waiter's), and a waiter may take at most half the pool.
const POOL_CONNECTIONS: u32 = 4;

/// The 99th percentile the issue sets for a woken waiter.
const WAKE_P99_GOAL: Duration = Duration::from_millis(5);

/// A response head: opaque bytes to the store, the size of a small response's.
const HEAD: &[u8] = b"\x02\x0ccontent-type\x10application/json\x08location\x0c/commands/42";

/// The response body, 1 KiB as in the idempotency bench.
static BODY: [u8; 1024] = [b'x'; 1024];

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let Some(database) = runtime.block_on(TestDatabase::create()) else {
        eprintln!(
            "SKIPPED postgres_wakeup: every row of this bench needs PostgreSQL; nothing was measured"
        );
        return;
    };
    let durable = runtime.block_on(async {
        let store = PostgresStore::builder(database.pool(POOL_CONNECTIONS).await)
            .build()
            .expect("PostgresStore");
        store.migrate().await.expect("migrate");
        store
    });
    let transactional = durable.with_mode(PostgresMode::Transactional);

    let mut criterion = Criterion::default().configure_from_args();
    let mut polling = Kept::default();
    let mut lock_wait = Kept::default();
    wake_latency(
        &mut criterion,
        &runtime,
        [
            ("durable_polling", &durable, &mut polling),
            ("transactional_lock_wait", &transactional, &mut lock_wait),
        ],
    );
    cost_per_request(&mut criterion, &runtime, &durable, &transactional);
    criterion.final_summary();
    report(&polling, &lock_wait);

    // The pool's connections go before the database does.
    drop((durable, transactional));
    drop(runtime);
    drop(database);
}

/// One trial's times, both from just before the owner's completion.
#[derive(Clone, Copy)]
struct Trial {
    /// Until the waiter returned with the record.
    woken: Duration,
    /// Until the owner's own completion returned.
    completed: Duration,
}

/// One of a trial's times, read for its percentiles.
type TrialTime = fn(&Trial) -> Duration;

/// The trials of one mode, and how busy the machine was while they ran.
#[derive(Default)]
struct Kept {
    trials: Vec<Trial>,
    machine: Option<Machine>,
}

struct Machine {
    /// The machine's CPU time over the trials, every process's.
    times: CpuTimes,
    /// The load averages at the end, as `/proc/loadavg` gives them.
    load: String,
}

/// The machine's CPU time from `/proc/stat`, in clock ticks: Linux only.
#[derive(Clone, Copy)]
struct CpuTimes {
    busy: u64,
    /// Time the hypervisor gave this VM's CPUs to others.
    steal: u64,
    total: u64,
}

impl CpuTimes {
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let ticks: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .map(|field| field.parse().unwrap_or(0))
            .collect();
        // user nice system idle iowait irq softirq steal; guest time is within user.
        let [user, nice, system, idle, iowait, irq, softirq, steal, ..] = ticks[..] else {
            return None;
        };
        let busy = user + nice + system + irq + softirq;
        Some(Self {
            busy,
            steal,
            total: busy + idle + iowait + steal,
        })
    }

    fn since(&self, earlier: &Self) -> Self {
        Self {
            busy: self.busy - earlier.busy,
            steal: self.steal - earlier.steal,
            total: self.total - earlier.total,
        }
    }
}

fn wake_latency(
    criterion: &mut Criterion,
    runtime: &tokio::runtime::Runtime,
    modes: [(&str, &PostgresStore, &mut Kept); 2],
) {
    let mut group = criterion.benchmark_group("postgres_wakeup");
    // Criterion plans iterations by the wall time of its warm-up, sleeps included, so
    // these are wall-clock budgets: about 600 durable and 850 transactional trials.
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(20)
        .warm_up_time(Duration::from_secs(3))
        .measurement_time(Duration::from_secs(45));
    for (name, store, kept) in modes {
        runtime.block_on(async {
            for _ in 0..UNKEPT_TRIALS {
                on_a_worker(store).await;
            }
        });
        let before = CpuTimes::read();
        let trials = &mut kept.trials;
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let mut woken = Duration::ZERO;
                    for _ in 0..iters {
                        let one = on_a_worker(store).await;
                        woken += one.woken;
                        trials.push(one);
                    }
                    woken
                })
            })
        });
        kept.machine = before.zip(CpuTimes::read()).map(|(before, after)| {
            let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
            Machine {
                times: after.since(&before),
                load: load
                    .split_whitespace()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join(" "),
            }
        });
    }
    group.finish();
}

/// A [`trial`] in a task of its own: the owner runs on a worker of the runtime, as a
/// request's handler does, not on the thread that blocks on the bench.
async fn on_a_worker(store: &PostgresStore) -> Trial {
    let store = store.clone();
    tokio::spawn(async move { trial(&store).await })
        .await
        .expect("the trial's task")
}

/// Claims a fresh scope, has a waiter wait on it for a random 20 to 80 ms, then stores
/// the outcome and times the waiter's return.
async fn trial(store: &PostgresStore) -> Trial {
    let scope = fresh_scope();
    let claimed = store.begin(&scope, claim()).await.expect("begin");
    let waiter = tokio::spawn({
        let store = store.clone();
        async move {
            let settled = store.wait(&scope, WAIT_TIMEOUT).await.expect("wait");
            let returned = Instant::now();
            assert!(
                matches!(settled, Waited::Completed { .. }),
                "the waiter gets the record, not {settled:?}"
            );
            returned
        }
    });
    tokio::time::sleep(Duration::from_millis(rand::random_range(PHASE_MS))).await;
    handler_statement(store, &claimed).await;
    let outcome = record();
    let started = Instant::now();
    store_outcome(store, scope, claimed, outcome).await;
    let completed = started.elapsed();
    let returned = waiter.await.expect("the waiter task");
    Trial {
        woken: returned - started,
        completed,
    }
}

fn cost_per_request(
    criterion: &mut Criterion,
    runtime: &tokio::runtime::Runtime,
    durable: &PostgresStore,
    transactional: &PostgresStore,
) {
    let mut group = criterion.benchmark_group("postgres_mode_cost");
    group
        .sample_size(50)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(8));
    let modes = [("durable", durable), ("transactional", transactional)];
    for (name, store) in modes {
        group.bench_function(format!("{name}/first"), |b| {
            b.to_async(runtime).iter(|| async {
                let scope = fresh_scope();
                let claimed = store.begin(&scope, claim()).await.expect("begin");
                store_outcome(store, scope, claimed, record()).await;
            })
        });
    }
    for (name, store) in modes {
        let scope = fresh_scope();
        runtime.block_on(async {
            let claimed = store.begin(&scope, claim()).await.expect("begin");
            store_outcome(store, scope, claimed, record()).await;
        });
        group.bench_function(format!("{name}/replay"), |b| {
            b.to_async(runtime).iter(|| async {
                match store.begin(&scope, claim()).await.expect("begin") {
                    Begin::Completed { .. } => {}
                    other => panic!("a completed scope replays, not {other:?}"),
                }
            })
        });
    }
    group.finish();
}

/// What a handler does before its request completes: a statement, in the request's
/// transaction when it has one. So the trial's window opens on a connection in use, as
/// a request's completion does, not on one idle since the claim (a round trip after an
/// idle pause is the slow one on this VM: see benches/README.md).
async fn handler_statement(store: &PostgresStore, claimed: &Begin) {
    let statement = sqlx::query("SELECT 1");
    match claimed {
        Begin::ClaimedByTransaction { transaction, .. } => {
            let offer = transaction.offer();
            let transaction = offer
                .get::<Transaction>()
                .expect("the request's transaction");
            let mut connection = transaction.lock().await.expect("open until settled");
            statement.execute(&mut *connection).await
        }
        _ => statement.execute(store.pool()).await,
    }
    .expect("the handler's statement");
}

/// Completes a durable claim or commits a transactional one with `outcome`, failing the
/// bench on anything but a stored record.
async fn store_outcome(
    store: &PostgresStore,
    scope: ScopeKey,
    claimed: Begin,
    outcome: Arc<Record>,
) {
    match claimed {
        Begin::Claimed { lease } => {
            let completion = store
                .complete(&scope, &lease, outcome, TTL)
                .await
                .expect("complete");
            assert!(completion.is_stored(), "stored, not {completion:?}");
        }
        Begin::ClaimedByTransaction { transaction, .. } => {
            let settlement = transaction.settle(scope, Some((outcome, TTL))).await;
            assert!(
                matches!(settlement, TransactionEnd::Committed),
                "committed, not {settlement:?}"
            );
        }
        other => panic!("a fresh scope is claimed, not {other:?}"),
    }
}

/// A scope no trial has used: random, so reruns on one database never meet old rows.
fn fresh_scope() -> ScopeKey {
    ScopeKey::from_bytes(rand::random())
}

/// Every request of the bench asks for the same thing.
fn fingerprint() -> Fingerprint {
    Fingerprint::from_bytes([7; 32])
}

fn claim() -> Claim {
    Claim::new(fingerprint(), LEASE, None)
}

fn record() -> Arc<Record> {
    Arc::new(Record::new(
        fingerprint(),
        SystemTime::now(),
        None,
        None,
        Some(Payload::new(
            PayloadFormat::HTTP,
            201,
            Bytes::from_static(HEAD),
            Bytes::from_static(&BODY),
        )),
    ))
}

/// Prints p50, p99 and max of every kept trial per mode, split at the owner's
/// completion, the ratio of the medians, and how busy the machine was.
fn report(polling: &Kept, lock_wait: &Kept) {
    let modes = [
        ("durable (polling)", polling),
        ("transactional (lock wait)", lock_wait),
    ];
    if modes.iter().all(|(_, kept)| kept.trials.is_empty()) {
        return;
    }
    println!();
    println!("postgres_wakeup, every kept trial; times from just before the owner's completion");
    println!(
        "{:<26} {:<34} {:>7} {:>10} {:>10} {:>10}",
        "mode", "until", "trials", "p50", "p99", "max"
    );
    for (name, kept) in modes {
        if kept.trials.is_empty() {
            continue;
        }
        let parts: [(&str, TrialTime); 3] = [
            ("the waiter's Completed", |trial| trial.woken),
            ("the owner's completion returned", |trial| trial.completed),
            ("the waiter's Completed, after that", |trial| {
                trial.woken.saturating_sub(trial.completed)
            }),
        ];
        for (until, part) in parts {
            let times = sorted(kept.trials.iter().map(part));
            println!(
                "{:<26} {:<34} {:>7} {:>10} {:>10} {:>10}",
                name,
                until,
                times.len(),
                millis(percentile(&times, 0.50)),
                millis(percentile(&times, 0.99)),
                millis(times[times.len() - 1]),
            );
        }
        if let Some(machine) = &kept.machine {
            let share = |ticks: u64| 100.0 * ticks as f64 / machine.times.total.max(1) as f64;
            println!(
                "{:<26} machine over these trials: CPUs {:.0}% busy, {:.1}% stolen; load average {}",
                "",
                share(machine.times.busy),
                share(machine.times.steal),
                machine.load
            );
        }
    }
    if polling.trials.is_empty() || lock_wait.trials.is_empty() {
        return;
    }
    let woken = |kept: &Kept| sorted(kept.trials.iter().map(|trial| trial.woken));
    let (polled, locked) = (woken(polling), woken(lock_wait));
    let ratio = percentile(&polled, 0.50).as_secs_f64() / percentile(&locked, 0.50).as_secs_f64();
    println!("medians, polling / lock wait: {ratio:.1}x");
    let p99 = percentile(&locked, 0.99);
    let over = locked.iter().filter(|&&time| time >= WAKE_P99_GOAL).count();
    let verdict = if p99 < WAKE_P99_GOAL { "met" } else { "MISSED" };
    println!(
        "goal, lock wait p99 < {}: {verdict} ({}; {over} of {} trials at or over it)",
        millis(WAKE_P99_GOAL),
        millis(p99),
        locked.len()
    );
}

fn sorted(durations: impl Iterator<Item = Duration>) -> Vec<Duration> {
    let mut durations: Vec<Duration> = durations.collect();
    durations.sort_unstable();
    durations
}

/// The nearest-rank percentile of sorted, non-empty `durations`.
fn percentile(durations: &[Duration], quantile: f64) -> Duration {
    let rank = (quantile * durations.len() as f64).ceil() as usize;
    durations[rank.clamp(1, durations.len()) - 1]
}

fn millis(duration: Duration) -> String {
    format!("{:.2} ms", duration.as_secs_f64() * 1000.0)
}
