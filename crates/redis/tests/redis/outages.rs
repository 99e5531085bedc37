//! Redis killed and restarted (with its append-only file) for less than the lease, at
//! every lease from 2 s to 10 s: before the first renewal, across renewals, and at the
//! handler's end, two replicas, a client retrying on both. The claim must outlive the
//! outage as the replicas see it, which ends only once a renewal lands: so the
//! replicas reconnect within a few tens of milliseconds of Redis accepting connections
//! again, and a failed renewal is tried again 50 ms later, not a quarter lease later.
//!
//! Each trial prints one line. CI runs one trial per lease; the whole matrix (4 leases,
//! outages of 0.5, 0.75 and 0.95 of the lease, 3 placements, twice: 72 trials) runs
//! with `TOWER_IDS_FULL_TRIALS=1`:
//!
//! ```sh
//! TOWER_IDS_FULL_TRIALS=1 cargo test --all-features -p tower-ids-redis --test redis outages -- --nocapture --test-threads 1
//! ```

use std::time::{Duration, Instant};

use http::StatusCode;
use tower_ids::idempotency::store::{Claim, Fingerprint, IdempotencyStore, RedisStore, ScopeKey};

use super::{
    faults::{or_never, replica, retry_until, tally, warm_up, Broken, Fault},
    replica::Ledger,
    server::RedisServer,
    support::{full_trials, Reply},
};

/// Where in the handler's run Redis goes down.
#[derive(Clone, Copy, Debug)]
enum Placement {
    /// 50 ms before the first renewal: the claim's own write is the last to land.
    BeforeFirstRenewal,
    /// 100 ms after the first renewal: the outage spans the renewals after it.
    AcrossRenewals,
    /// 50 ms before the handler returns: its outcome is kept and stored once Redis is
    /// back.
    AtHandlerEnd,
}

/// One trial's plan: the handler's length, when the kill comes, how long Redis is down.
#[derive(Clone, Copy, Debug)]
struct Plan {
    lease: Duration,
    handler: Duration,
    at: Duration,
    outage: Duration,
    placement: Placement,
}

impl Plan {
    fn new(lease: Duration, fraction: f64, placement: Placement) -> Self {
        let outage = lease.mul_f64(fraction);
        let ms = Duration::from_millis;
        let (handler, at) = match placement {
            Placement::BeforeFirstRenewal => {
                let at = lease / 4 - ms(50);
                (at + outage + ms(1000), at)
            }
            Placement::AcrossRenewals => {
                let at = lease / 4 + ms(100);
                (at + outage + ms(1000), at)
            }
            Placement::AtHandlerEnd => {
                let handler = lease / 4 + ms(500);
                (handler, handler - ms(50))
            }
        };
        Self {
            lease,
            handler,
            at,
            outage,
            placement,
        }
    }
}

/// Every plan of the matrix, or CI's slice of it: one per lease, at 0.95 of it.
fn plans() -> Vec<Plan> {
    let full = full_trials();
    let leases = [2, 3, 4, 10].map(Duration::from_secs);
    let mut plans = Vec::new();
    for lease in leases {
        if !full {
            let placement = match lease.as_secs() {
                2 => Placement::BeforeFirstRenewal,
                3 => Placement::AcrossRenewals,
                4 => Placement::AtHandlerEnd,
                _ => Placement::BeforeFirstRenewal,
            };
            plans.push(Plan::new(lease, 0.95, placement));
            continue;
        }
        for _ in 0..2 {
            for fraction in [0.5, 0.75, 0.95] {
                for placement in [
                    Placement::BeforeFirstRenewal,
                    Placement::AcrossRenewals,
                    Placement::AtHandlerEnd,
                ] {
                    plans.push(Plan::new(lease, fraction, placement));
                }
            }
        }
    }
    plans
}

/// One trial: the handler on A, Redis killed `at` into it and restarted `outage`
/// later; a client retries on B and A alternately every 200 ms from the kill until
/// one of them replays the first answer.
async fn trial(n: usize, plan: Plan, broken: &mut Broken) {
    let Some(redis) = RedisServer::start_persistent() else {
        return;
    };
    let ledger = Ledger::default();
    let a = replica(&redis.url(), &ledger, Some(plan.lease)).await;
    let b = replica(&redis.url(), &ledger, Some(plan.lease)).await;
    warm_up(&a, &b).await;
    let key = format!("outage-{n}");
    let first = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move {
            let sent = Instant::now();
            let reply = a.send(&key, Some(plan.handler)).await;
            (reply, sent.elapsed())
        }
    });
    let handler_started = ledger.started(&key).await;
    tokio::time::sleep_until((handler_started + plan.at).into()).await;
    let (_, back) = Fault::Kill(plan.outage).begin(redis).await;
    let retries = tokio::spawn({
        let nodes = [b.clone(), a.clone()];
        let key = key.clone();
        let until = Instant::now() + plan.handler + plan.lease * 3 + Duration::from_secs(10);
        async move {
            retry_until(
                &nodes,
                &key,
                Duration::from_millis(200),
                until,
                Reply::replayed_created,
            )
            .await
        }
    });
    let (redis, back) = back.await.unwrap();
    let (first, answered) = first.await.unwrap();
    let first = first.expect("the first client gets an answer");
    let (replay, seen) = retries.await.unwrap();
    // Whatever was still in flight lands before the count is read.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let runs = ledger.runs(&key);
    let to_replay = replay
        .as_ref()
        .map(|(_, at)| at.saturating_duration_since(back));
    eprintln!(
        "outage, trial {n}: lease {:?}, Redis killed {:?} into a {:?} handler ({:?}) for {:?} ({:.2} of the lease): executions {runs}, first answer {} after {answered:?}, retries saw [{}], replay {} after Redis returned",
        plan.lease,
        plan.at,
        plan.handler,
        plan.placement,
        plan.outage,
        plan.outage.as_secs_f64() / plan.lease.as_secs_f64(),
        first.status,
        tally(&seen),
        or_never(to_replay),
    );
    let name = format!("outage, trial {n}, {plan:?}");
    broken.check(&name, runs == 1, format!("the handler ran {runs} times"));
    broken.check(
        &name,
        first.status == StatusCode::CREATED && first.header("idempotent-replayed") == Some("false"),
        format!("the first client got {} {}", first.status, first.text()),
    );
    broken.check(
        &name,
        seen.iter().all(|status| [409, 503].contains(status)),
        format!("before the replay, only 409 or 503: [{}]", tally(&seen)),
    );
    broken.check(
        &name,
        replay
            .as_ref()
            .is_some_and(|(reply, _)| reply.body == first.body),
        "the retries got the first answer's replay",
    );
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_shorter_than_the_lease_runs_the_handler_once_at_every_lease() {
    let mut broken = Broken::default();
    for (n, plan) in plans().into_iter().enumerate() {
        trial(n, plan, &mut broken).await;
    }
    broken.assert_none();
}

/// From Redis accepting connections again after a kill to a store call succeeding,
/// with calls every 50 ms as a failed renewal is retried: the lag the lease's quarter
/// must cover (with the command timeout) is measured here, not assumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_reconnects_within_tens_of_milliseconds_of_redis_returning() {
    let Some(mut redis) = RedisServer::start_persistent() else {
        return;
    };
    let store = RedisStore::builder(redis.url())
        .command_timeout(Duration::from_millis(250))
        .build()
        .await
        .expect("Redis is up");
    let claim = || {
        Claim::new(
            Fingerprint::from_bytes([7; 32]),
            Duration::from_secs(5),
            None,
        )
    };
    let mut lags = Vec::new();
    for (n, down) in [300, 600, 1000, 1500, 2500, 300, 600, 1000, 1500, 2500]
        .into_iter()
        .enumerate()
    {
        store
            .begin(&ScopeKey::from_bytes([n as u8; 32]), claim())
            .await
            .expect("Redis answers before the kill");
        redis = tokio::task::spawn_blocking(move || {
            redis.kill();
            std::thread::sleep(Duration::from_millis(down));
            redis.restart();
            redis
        })
        .await
        .unwrap();
        let back = Instant::now();
        for attempt in 0u8.. {
            let mut scope = [0; 32];
            (scope[0], scope[1]) = (100 + n as u8, attempt);
            if store
                .begin(&ScopeKey::from_bytes(scope), claim())
                .await
                .is_ok()
            {
                break;
            }
            assert!(
                back.elapsed() < Duration::from_secs(10),
                "never reconnected"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        lags.push(back.elapsed());
        eprintln!(
            "reconnect, trial {n}: Redis down {down} ms; a call succeeded {:?} after it accepted connections again",
            back.elapsed()
        );
    }
    lags.sort();
    eprintln!(
        "reconnect lag over {} kills: min {:?}, median {:?}, max {:?}",
        lags.len(),
        lags[0],
        lags[lags.len() / 2],
        lags[lags.len() - 1]
    );
    assert!(
        lags[lags.len() - 1] <= store.recovery_time(),
        "the store promises to be back within {:?}: {lags:?}",
        store.recovery_time()
    );
}
