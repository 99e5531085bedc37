//! The message layer (`MessageIdempotencyLayer`) through a real `redis-server` shared by
//! two consumers, A and B, each with its own `RedisStore` (command timeout 250 ms), and
//! Redis paused (SIGSTOP, SIGCONT) at the moments that matter. Deliveries are plain
//! calls of the consumers' services (no broker): a redelivery is the same message
//! again, on either consumer. In every trial the handler runs exactly once, and what
//! each consumer is told (`Handled`) is what it needs to ack, requeue or publish.
//!
//! Each trial prints one line (`cargo test -p tower-ids-redis --test redis messages -- --nocapture`): the
//! fault, its placement, what every delivery got, and executions.

use std::{
    convert::Infallible,
    time::{Duration, Instant},
};
use tower_ids::idempotency::Policy;

use serde::{Deserialize, Serialize};
use tower::{service_fn, util::BoxCloneSyncService, Layer, ServiceExt};
use tower_ids::idempotency::{
    extract::KeyRejection,
    message::{Handled, MessageIdempotency, MessageIdempotencyLayer, MessageKey},
    store::RedisStore,
    IdempotencyKey,
};

use super::{faults::Broken, replica::Ledger, server::RedisServer};

/// The message: its key, its data (the fingerprint), and how long handling it takes.
#[derive(Clone, Debug)]
struct Delivery {
    key: String,
    data: &'static str,
    handle_for: Duration,
}

impl Delivery {
    fn new(key: impl Into<String>, handle_for: Duration) -> Self {
        Self {
            key: key.into(),
            data: r#"{"device_id":"d-1","name":"reboot"}"#,
            handle_for,
        }
    }
}

/// What the handler publishes: the key, which consumer ran it, and which run it was.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct Outcome {
    key: String,
    consumer: String,
    run: usize,
}

type KeyOf = fn(&Delivery) -> Result<Option<MessageKey>, KeyRejection>;

fn key_of(delivery: &Delivery) -> Result<Option<MessageKey>, KeyRejection> {
    let key = IdempotencyKey::new(&delivery.key)?;
    Ok(Some(
        MessageKey::new(key)
            .scope("devices")
            .scope("reboot")
            .fingerprint(delivery.data),
    ))
}

type Handler = BoxCloneSyncService<Delivery, Outcome, Infallible>;

/// A consumer: its own `RedisStore` and layer over a counting handler.
#[derive(Clone)]
struct Consumer {
    service: MessageIdempotency<Handler, Outcome, RedisStore, KeyOf>,
}

impl Consumer {
    async fn start(
        redis_url: &str,
        ledger: &Ledger,
        name: &'static str,
        lease: Option<Duration>,
    ) -> Self {
        let store = RedisStore::builder(redis_url)
            .command_timeout(Duration::from_millis(250))
            .build()
            .await
            .expect("Redis is up");
        let mut layer = MessageIdempotencyLayer::with_store(store).key(key_of as KeyOf);
        if let Some(lease) = lease {
            layer = layer.policy(Policy::new().lease(lease)).unwrap();
        }
        let ledger = ledger.clone();
        let handler = service_fn(move |delivery: Delivery| {
            let ledger = ledger.clone();
            async move {
                let run = ledger.count(&delivery.key);
                tokio::time::sleep(delivery.handle_for).await;
                Ok::<_, Infallible>(Outcome {
                    key: delivery.key,
                    consumer: name.to_owned(),
                    run,
                })
            }
        });
        Self {
            service: layer.layer(BoxCloneSyncService::new(handler)),
        }
    }

    async fn deliver(&self, delivery: Delivery) -> Handled<Outcome> {
        match self.service.clone().oneshot(delivery).await {
            Ok(handled) => handled,
            Err(never) => match never {},
        }
    }
}

/// One delivery on each consumer: every script is loaded and both connections are
/// open.
async fn warm_up(a: &Consumer, b: &Consumer) {
    for (consumer, key) in [(a, "warm-a"), (b, "warm-b")] {
        let handled = consumer.deliver(Delivery::new(key, Duration::ZERO)).await;
        assert!(matches!(handled, Handled::Ran(_)), "{handled:?}");
    }
}

/// Pauses Redis on a blocking thread and returns once it is paused: when it was, and
/// the blocking task that resumes it `length` later and returns the server and when
/// it was back.
async fn pause(
    redis: RedisServer,
    length: Duration,
) -> (Instant, tokio::task::JoinHandle<(RedisServer, Instant)>) {
    let (redis, began) = tokio::task::spawn_blocking(move || {
        redis.pause();
        (redis, Instant::now())
    })
    .await
    .unwrap();
    let back = tokio::task::spawn_blocking(move || {
        std::thread::sleep(length.saturating_sub(began.elapsed()));
        redis.resume();
        (redis, Instant::now())
    });
    (began, back)
}

/// A delivery's answer as a consumer reads it.
fn describe(handled: &Handled<Outcome>) -> String {
    match handled {
        Handled::Ran(outcome) => format!("Ran(run {} on {})", outcome.run, outcome.consumer),
        Handled::Replayed { outcome, replay } => format!(
            "Replayed(run {} on {}, delivery {})",
            outcome.run,
            outcome.consumer,
            replay.request_count()
        ),
        Handled::InFlight { .. } => "InFlight".to_owned(),
        Handled::Refused(refusal) => format!(
            "Refused({}, {})",
            refusal.code(),
            if refusal.retryable() {
                "requeue"
            } else {
                "reject"
            }
        ),
        other => format!("{other:?}"),
    }
}

/// What a delivery may get while the one that runs is not done, or Redis is out: a
/// requeue, never a rejection.
fn requeued(handled: &Handled<Outcome>) -> bool {
    match handled {
        Handled::InFlight { .. } => true,
        Handled::Refused(refusal) => {
            refusal.code().as_str() == "idempotency.store_unavailable" && refusal.retryable()
        }
        _ => false,
    }
}

/// Answers in order, repeats counted: `Refused(idempotency.store_unavailable,
/// requeue)x4, InFlightx9`.
fn tally(seen: &[Handled<Outcome>]) -> String {
    let mut runs: Vec<(String, usize)> = Vec::new();
    for answer in seen.iter().map(describe) {
        match runs.last_mut() {
            Some((last, n)) if *last == answer => *n += 1,
            _ => runs.push((answer, 1)),
        }
    }
    let runs: Vec<_> = runs
        .into_iter()
        .map(|(answer, n)| match n {
            1 => answer,
            n => format!("{answer}x{n}"),
        })
        .collect();
    runs.join(", ")
}

/// Delivers `delivery` to `consumers` in turn, pausing `every` after each answer, until
/// one has an outcome (`Ran` or `Replayed`) or `until` has passed; returns that answer,
/// when it came and on which turn, if one did, and every answer before it.
async fn redeliver_until_outcome(
    consumers: Vec<Consumer>,
    delivery: Delivery,
    every: Duration,
    until: Instant,
) -> (
    Option<(Handled<Outcome>, Instant, usize)>,
    Vec<Handled<Outcome>>,
) {
    let mut seen = Vec::new();
    for turn in 0.. {
        let handled = consumers[turn % consumers.len()]
            .deliver(delivery.clone())
            .await;
        if handled.outcome().is_some() {
            return (Some((handled, Instant::now(), turn)), seen);
        }
        seen.push(handled);
        if Instant::now() >= until {
            break;
        }
        tokio::time::sleep(every).await;
    }
    (None, seen)
}

/// How long a consumer waits after each answer before the redelivery.
const REDELIVER_EVERY: Duration = Duration::from_millis(300);

/// How soon a delivery to a paused Redis must be refused: the 250 ms command timeout,
/// and slack for a loaded machine.
const REFUSED_WITHIN: Duration = Duration::from_millis(750);

/// How soon after Redis returns a redelivery of a refused message must run.
const RAN_WITHIN: Duration = Duration::from_secs(1);

/// How soon after Redis returns a redelivery must get the stored outcome.
const REPLAY_WITHIN: Duration = Duration::from_secs(3);

/// (M1) Redis paused before a delivery reaches A, for `outage`: A refuses it as
/// `idempotency.store_unavailable` (requeue) within the command timeout; its claim,
/// timed out, reaches Redis when it returns and must take nothing. Redeliveries
/// alternately on B and A every 300 ms must run the handler within 1 s of Redis's
/// return, and the next one replay the same outcome.
async fn refused_trial(trial: usize, outage: Duration, broken: &mut Broken) {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let ledger = Ledger::default();
    let a = Consumer::start(&redis.url(), &ledger, "A", None).await;
    let b = Consumer::start(&redis.url(), &ledger, "B", None).await;
    warm_up(&a, &b).await;
    let key = format!("refused-{trial}");
    let delivery = Delivery::new(&key, Duration::ZERO);

    let (began, back) = pause(redis, outage).await;
    let sent = Instant::now();
    let refused = a.deliver(delivery.clone()).await;
    let refused_after = sent.elapsed();
    let consumers = vec![b.clone(), a.clone()];
    let redeliveries = tokio::spawn({
        let (consumers, delivery) = (consumers.clone(), delivery.clone());
        // Long enough to see the key free, not the whole claim it would be locked for.
        let until = began + outage + Duration::from_secs(3);
        async move {
            tokio::time::sleep(REDELIVER_EVERY).await;
            redeliver_until_outcome(consumers, delivery, REDELIVER_EVERY, until).await
        }
    });
    let (redis, back) = back.await.unwrap();
    let (ran, seen) = redeliveries.await.unwrap();
    let on = |turn: usize| ["B", "A"][turn % 2];
    let next = match &ran {
        Some((_, _, turn)) => {
            tokio::time::sleep(REDELIVER_EVERY).await;
            Some((turn + 1, consumers[(turn + 1) % 2].deliver(delivery).await))
        }
        None => None,
    };
    // Whatever was still in flight lands before the count is read.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let runs = ledger.runs(&key);
    let to_ran = ran
        .as_ref()
        .map(|(_, at, _)| at.saturating_duration_since(back));
    let then = match (&ran, &next) {
        (Some((ran, _, turn)), Some((next_turn, next))) => format!(
            "first outcome {to_ran:?} after Redis returned, on {}: {}; next redelivery on {}: {}",
            on(*turn),
            describe(ran),
            on(*next_turn),
            describe(next),
        ),
        _ => "no outcome".to_owned(),
    };
    eprintln!(
        "messages, refused, trial {trial}: Redis paused {outage:?} from before the delivery, warm consumers: A answered {} after {refused_after:?}; redeliveries alternately on B and A every {REDELIVER_EVERY:?} saw [{}], {then}; executions {runs}",
        describe(&refused),
        tally(&seen),
    );

    let trial = format!("refused, trial {trial}");
    broken.check(
        &trial,
        matches!(&refused, Handled::Refused(refusal)
            if refusal.code().as_str() == "idempotency.store_unavailable" && refusal.retryable()),
        format!("the delivery during the outage got {}", describe(&refused)),
    );
    broken.check(
        &trial,
        refused_after <= REFUSED_WITHIN,
        format!("A refused the delivery only after {refused_after:?}"),
    );
    broken.check(
        &trial,
        seen.iter().all(requeued),
        format!(
            "before the first outcome, only InFlight or store_unavailable: [{}]",
            tally(&seen)
        ),
    );
    let ran_outcome = match &ran {
        Some((Handled::Ran(outcome), _, _)) => Some(outcome),
        Some((other, _, _)) => {
            broken.check(
                &trial,
                false,
                format!("a redelivery ran the handler: got {}", describe(other)),
            );
            None
        }
        None => {
            broken.check(&trial, false, "no redelivery got an outcome");
            None
        }
    };
    broken.check(
        &trial,
        to_ran.is_some_and(|to_ran| to_ran <= RAN_WITHIN),
        format!("the handler ran {to_ran:?} after Redis returned"),
    );
    broken.check(
        &trial,
        matches!(&next, Some((_, Handled::Replayed { outcome, .. })) if Some(outcome) == ran_outcome),
        format!(
            "the redelivery after the run replays its outcome: {}",
            next.as_ref()
                .map_or_else(|| "none sent".to_owned(), |(_, next)| describe(next))
        ),
    );
    broken.check(&trial, runs == 1, format!("the handler ran {runs} times"));
    drop(redis);
}

/// The lease of the trials whose outage falls in the handler.
const LEASE: Duration = Duration::from_secs(3);

/// How long the handler runs in those trials.
const HANDLER: Duration = Duration::from_secs(1);

/// (M2) A 1 s handler on A under a 3 s lease; Redis paused for 2.9 s from 0.9 s into
/// the handler (shorter than the lease, so A's claim must hold). Redeliveries on B every
/// 300 ms from the start of the pause. The handler runs once; A gets `Ran` at once (its
/// outcome kept and stored when Redis returns); B gets `Replayed` with the same outcome.
async fn outage_in_handler_trial(trial: usize, broken: &mut Broken) {
    let at = Duration::from_millis(900);
    let outage = Duration::from_millis(2900);
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let ledger = Ledger::default();
    let a = Consumer::start(&redis.url(), &ledger, "A", Some(LEASE)).await;
    let b = Consumer::start(&redis.url(), &ledger, "B", Some(LEASE)).await;
    warm_up(&a, &b).await;
    let key = format!("outage-in-handler-{trial}");
    let delivery = Delivery::new(&key, HANDLER);

    let first = tokio::spawn({
        let (a, delivery) = (a.clone(), delivery.clone());
        async move {
            let sent = Instant::now();
            let handled = a.deliver(delivery).await;
            (handled, sent.elapsed())
        }
    });
    let handler_started = ledger.started(&key).await;
    tokio::time::sleep_until((handler_started + at).into()).await;
    let (_, back) = pause(redis, outage).await;
    let redeliveries = tokio::spawn({
        let (b, delivery) = (b.clone(), delivery.clone());
        let until = Instant::now() + Duration::from_secs(15);
        async move { redeliver_until_outcome(vec![b], delivery, REDELIVER_EVERY, until).await }
    });
    let (redis, back) = back.await.unwrap();
    let (first, answered) = first.await.unwrap();
    let (replay, seen) = redeliveries.await.unwrap();
    let again = a.deliver(delivery).await;
    // Whatever was still in flight lands before the count is read.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let runs = ledger.runs(&key);
    let to_replay = replay
        .as_ref()
        .map(|(_, at, _)| at.saturating_duration_since(back));
    let replay = replay.map(|(handled, _, _)| handled);
    eprintln!(
        "messages, outage in the handler, trial {trial}: Redis paused {outage:?} at {at:?} into a {HANDLER:?} handler on A, lease {LEASE:?}, redeliveries on B every {REDELIVER_EVERY:?}: A answered {} after {answered:?}; B saw [{}], then {} {to_replay:?} after Redis returned; a redelivery on A then: {}; executions {runs}",
        describe(&first),
        tally(&seen),
        replay.as_ref().map_or_else(|| "no outcome".to_owned(), describe),
        describe(&again),
    );

    let trial = format!("outage in the handler, trial {trial}");
    broken.check(&trial, runs == 1, format!("the handler ran {runs} times"));
    let ran = match &first {
        Handled::Ran(outcome) => Some(outcome),
        other => {
            broken.check(&trial, false, format!("A got {}", describe(other)));
            None
        }
    };
    broken.check(
        &trial,
        answered < HANDLER + Duration::from_secs(1),
        format!("A's call returned only after {answered:?}"),
    );
    broken.check(
        &trial,
        seen.iter().all(requeued),
        format!(
            "before B's outcome, only InFlight or store_unavailable: [{}]",
            tally(&seen)
        ),
    );
    broken.check(
        &trial,
        matches!(&replay, Some(Handled::Replayed { outcome, .. }) if ran.is_some_and(|ran| ran == outcome)),
        format!(
            "B's outcome is a replay of A's: {}",
            replay
                .as_ref()
                .map_or_else(|| "none within 15 s".to_owned(), describe)
        ),
    );
    broken.check(
        &trial,
        to_replay.is_some_and(|to_replay| to_replay <= REPLAY_WITHIN),
        format!("B's outcome came {to_replay:?} after Redis returned"),
    );
    broken.check(
        &trial,
        matches!(&again, Handled::Replayed { outcome, .. } if ran.is_some_and(|ran| ran == outcome)),
        format!("a redelivery on A then got {}", describe(&again)),
    );
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_refused_while_redis_is_paused_leaves_no_claim_behind() {
    let mut broken = Broken::default();
    for trial in 0..3 {
        refused_trial(trial, Duration::from_secs(2), &mut broken).await;
    }
    broken.assert_none();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_for_less_than_the_lease_during_the_handler_runs_the_message_once() {
    let mut broken = Broken::default();
    for trial in 0..3 {
        outage_in_handler_trial(trial, &mut broken).await;
    }
    broken.assert_none();
}
