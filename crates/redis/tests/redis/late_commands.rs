//! Commands whose caller gave up (timed out, answered `503`) but which reach Redis after
//! all: queued in a paused Redis's socket, or sent on the reconnected connection after a
//! restart. They must change nothing: neither take a key whose worker's claim ran out
//! during the pause, nor lock the key of a request that was refused, nor keep a claim
//! whose client hung up.
//!
//! Each trial prints one line (`cargo test -p tower-ids-redis --test redis late_commands -- --nocapture`).

use std::time::{Duration, Instant};

use http::StatusCode;

use super::{
    faults::{or_never, replica, retry_until, tally, warm_up, Broken, Fault, REPLAY_WITHIN},
    replica::Ledger,
    server::RedisServer,
    support::Reply,
};

/// The lease of the trials whose pause outlasts it.
const SHORT_LEASE: Duration = Duration::from_secs(3);

/// How long the retrying client of these trials waits after each answer.
const RETRY_EVERY: Duration = Duration::from_millis(300);

/// How soon after Redis returns a retry of a refused request must run.
const EXECUTED_WITHIN: Duration = Duration::from_secs(1);

fn created(reply: &Reply) -> bool {
    reply.status == StatusCode::CREATED
}

/// A reply as the client sees it: `201 idempotent-replayed: true`, or `409
/// idempotency.in_flight`.
fn describe(reply: &Reply) -> String {
    match (reply.header("idempotent-replayed"), reply.problem_code()) {
        (_, Some(code)) => format!("{} {code}", reply.status.as_u16()),
        (Some(replayed), None) => {
            format!("{} idempotent-replayed: {replayed}", reply.status.as_u16())
        }
        (None, None) => reply.status.as_u16().to_string(),
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
    let code = refused.problem_code();
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
