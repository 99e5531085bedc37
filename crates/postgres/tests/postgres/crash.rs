//! The whole PostgreSQL server SIGKILLed while a transactional request's COMMIT runs,
//! restarted 0.3 s later, with other clients' traffic on the second replica from the
//! moment it is back: their transactions take the IDs the crash lost, among them the
//! lost COMMIT's own. No client may be answered `201` for a command that is not in the
//! database, and a retried key runs once more at most: exactly one committed command.
//!
//! Each trial prints one line (`cargo test -p tower-ids-postgres --test postgres crash -- --nocapture`);
//! `TOWER_IDS_FULL_TRIALS=1` runs more of them.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use http::StatusCode;
use sqlx::PgPool;

use super::{
    faults::{pool, prepare, replica, seen, transaction_of, Mode, COMMIT_FAULTS},
    replica::{Ledger, Replica},
    server::PostgresServer,
    support::full_trials,
};

/// The store's timeout: the COMMIT's answer is lost once the server is killed (the
/// connection breaks), well within it.
const TIMEOUT: Duration = Duration::from_secs(1);
/// How long the slowed COMMIT would take had the server lived: the kill lands in it.
const SLOW_COMMIT: Duration = Duration::from_secs(3);
/// How long the server stays down before its restart (crash recovery then runs).
const DOWN: Duration = Duration::from_millis(300);
/// The traffic's clients on replica B, and how long each of their handlers takes.
const CLIENTS: usize = 4;
const TRAFFIC_HANDLER: Duration = Duration::from_millis(20);

async fn committed_runs(pool: &PgPool, key: &str) -> Vec<i64> {
    sqlx::query_scalar("SELECT run FROM commands WHERE key = $1 ORDER BY run")
        .bind(key)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Fresh keys posted on `node` by [`CLIENTS`] clients until `stop`: each a transaction
/// that takes a transaction ID. Returns every key that was answered `201`.
async fn traffic(node: Replica, trial: usize, stop: Arc<AtomicBool>) -> Vec<String> {
    let clients = (0..CLIENTS).map(|client| {
        let (node, stop) = (node.clone(), stop.clone());
        tokio::spawn(async move {
            let mut created = Vec::new();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let key = format!("traffic-{trial}-{client}-{n}");
                let reply = node.send(&key, Some(TRAFFIC_HANDLER)).await.ok();
                match reply {
                    Some(reply) if reply.status == StatusCode::CREATED => created.push(key),
                    // The server is down or recovering: try again shortly.
                    _ => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
            created
        })
    });
    let mut created = Vec::new();
    for client in clients {
        created.extend(client.await.unwrap());
    }
    created
}

/// The replicas' role, as on a managed service that does not let it read the server's
/// system identifier (`pg_control_system()`): the store then settles a lost commit by
/// its backend alone.
const UNTOLD: &str = "
    CREATE ROLE app LOGIN;
    REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC;
    GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO app;";

/// The WAL writer every 10 s rather than every 200 ms: on a loaded machine it may
/// otherwise write the killed transaction's first record to the kernel before the kill,
/// and that ID is not lost. A crash with a slower disk loses it as this one does.
async fn slow_wal_writer(setup: &PgPool) {
    for statement in [
        "ALTER SYSTEM SET wal_writer_delay = '10s'",
        "SELECT pg_reload_conf()",
    ] {
        sqlx::raw_sql(statement).execute(setup).await.unwrap();
    }
}

/// What one trial saw, for its line and the checks.
struct Seen {
    first: String,
    first_committed: bool,
    /// From the server's return to the first client's answer.
    answered_after_return: Option<Duration>,
    xid_reused: bool,
}

/// One trial: the first execution of `key` on A, its COMMIT slowed, the server killed
/// `kill_at` after the handler started; B's traffic from the restart on; then, if
/// `retry`, the key retried on B and A in turn until a `201`. With `untold`, the
/// replicas connect as a role that cannot read the server's lineage ([`UNTOLD`]).
async fn trial(trial: usize, retry: bool, kill_at: Duration, untold: bool) -> Option<Seen> {
    let mut server = PostgresServer::start()?;
    let setup = pool(&server.url()).await;
    prepare(&setup).await;
    sqlx::raw_sql(COMMIT_FAULTS).execute(&setup).await.unwrap();
    slow_wal_writer(&setup).await;
    let url = if untold {
        sqlx::raw_sql(UNTOLD).execute(&setup).await.unwrap();
        server.url().replace("//postgres@", "//app@")
    } else {
        server.url()
    };
    let ledger = Ledger::default();
    let a = replica(&url, &ledger, Mode::Transactional, true, TIMEOUT).await;
    let b = replica(&url, &ledger, Mode::Transactional, true, TIMEOUT).await;
    let key = format!("crash-{trial}-{retry}");
    sqlx::query("INSERT INTO commit_faults (key, sleep, fail) VALUES ($1, $2, false)")
        .bind(&key)
        .bind(SLOW_COMMIT.as_secs_f64())
        .execute(&setup)
        .await
        .unwrap();
    // The setup's connections are not needed until the checks: idle, they would only
    // reconnect.
    setup.close().await;

    let first = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move {
            let reply = a.send(&key, Some(Duration::ZERO)).await.ok();
            (reply, Instant::now())
        }
    });
    ledger.started(&key).await;
    // The handler inserts its command and returns; the COMMIT then sleeps 3 s. The
    // kill lands in it, before the WAL of the transaction's first write has left the
    // server's memory (the WAL writer wakes every 200 ms), so its transaction ID is
    // lost: the traffic's transactions are given it again after the restart.
    tokio::time::sleep(kill_at).await;
    let lost = transaction_of(&key).expect("the handler inserted its command");
    let (server, back) = tokio::task::spawn_blocking(move || {
        server.kill();
        std::thread::sleep(DOWN);
        server.restart();
        (server, Instant::now())
    })
    .await
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = tokio::spawn(traffic(b.clone(), trial, stop.clone()));

    let (first, first_at) = first.await.unwrap();
    let mut retries = Vec::new();
    if retry {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let node = if retries.len() % 2 == 0 { &b } else { &a };
            let reply = node.post(&key).await;
            let done = reply
                .as_ref()
                .is_some_and(|r| r.status == StatusCode::CREATED);
            retries.push(seen(reply.as_ref()));
            if done {
                break;
            }
            assert!(
                back.elapsed() < Duration::from_secs(20),
                "no 201 within 20 s of the server's return: {retries:?}"
            );
        }
    } else {
        // Long enough for the traffic to reuse the lost transaction IDs.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let created = traffic.await.unwrap();

    let check = pool(&server.url()).await;
    let rows = committed_runs(&check, &key).await;
    let mut missing = Vec::new();
    for traffic_key in &created {
        if committed_runs(&check, traffic_key).await.is_empty() {
            missing.push(traffic_key.clone());
        }
    }
    let xid_reused = created
        .iter()
        .filter_map(|k| transaction_of(k))
        .any(|(xid, _)| xid == lost.0);
    let first_after_return = created
        .iter()
        .filter_map(|k| transaction_of(k)?.0.parse::<u64>().ok())
        .min();
    let answered_after_return = first_at.checked_duration_since(back);
    eprintln!(
        "crash at COMMIT, trial {trial}, retried: {retry}, lineage untold: {untold}: first answer {} ({answered_after_return:?} after the server's return), retries {retries:?}; committed runs {rows:?}, handler runs {}; traffic: {} keys answered 201, {} missing; lost transaction {} reused by the traffic: {xid_reused} (the traffic's first: {first_after_return:?})",
        seen(first.as_ref()),
        ledger.runs(&key),
        created.len(),
        missing.len(),
        lost.0,
    );
    drop(server);

    assert!(
        missing.is_empty(),
        "answered 201, not committed: {missing:?}"
    );
    let first = first.expect("the first client is answered");
    let first_committed = rows.contains(&1);
    assert!(
        first.status != StatusCode::CREATED || first_committed,
        "the first client was answered 201 for a command that is not in the database (committed runs {rows:?})"
    );
    if retry {
        assert_eq!(rows.len(), 1, "exactly one committed command: {rows:?}");
        assert!(
            retries[..retries.len() - 1]
                .iter()
                .all(|r| r.starts_with("409 ") || r.starts_with("503 ")),
            "before the 201 only 409 or 503: {retries:?}"
        );
    } else {
        assert!(rows.len() <= 1, "at most one committed command: {rows:?}");
    }
    Some(Seen {
        first: seen(Some(&first)),
        first_committed,
        answered_after_return,
        xid_reused,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_during_a_commit_never_answers_201_for_it() {
    let trials = if full_trials() { 12 } else { 2 };
    let mut seen = Vec::new();
    for n in 0..trials {
        let kill_at = Duration::from_millis(30 + 20 * (n as u64 % 3));
        // The last trial as a role that cannot read the server's lineage.
        let Some(one) = trial(n, n % 2 == 0, kill_at, n + 1 == trials).await else {
            return;
        };
        seen.push(one);
    }
    let reused = seen.iter().filter(|s| s.xid_reused).count();
    let answers: Vec<_> = seen
        .iter()
        .map(|s| (s.first.clone(), s.first_committed, s.answered_after_return))
        .collect();
    eprintln!(
        "crash at COMMIT: {trials} trials, the lost transaction's ID reused in {reused}; first answers {answers:?}"
    );
    assert!(
        reused > 0,
        "no trial's lost transaction ID was handed out again: the trials no longer stage the hazard they are for"
    );
}

/// The same crash under a message consumer (the transactional inbox): the delivery whose
/// COMMIT the crash took must not come back as handled (the consumer would acknowledge
/// it), and its redelivery applies it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_during_a_commit_never_has_its_message_acknowledged() {
    use tower::{service_fn, ServiceBuilder, ServiceExt};
    use tower_ids::idempotency::{
        message::{Handled, MessageIdempotencyLayer, MessageKey},
        store::{PostgresMode, PostgresStore, Transaction},
        IdempotencyKey,
    };

    let trials = if full_trials() { 6 } else { 2 };
    let mut reused = 0;
    for trial in 0..trials {
        let Some(mut server) = PostgresServer::start() else {
            return;
        };
        let setup = pool(&server.url()).await;
        prepare(&setup).await;
        sqlx::raw_sql(COMMIT_FAULTS).execute(&setup).await.unwrap();
        slow_wal_writer(&setup).await;
        let key = format!("message-{trial}");
        sqlx::query("INSERT INTO commit_faults (key, sleep, fail) VALUES ($1, $2, false)")
            .bind(&key)
            .bind(SLOW_COMMIT.as_secs_f64())
            .execute(&setup)
            .await
            .unwrap();
        setup.close().await;
        let ledger = Ledger::default();
        let b = replica(&server.url(), &ledger, Mode::Transactional, true, TIMEOUT).await;
        let store = PostgresStore::builder(pool(&server.url()).await)
            .command_timeout(TIMEOUT)
            .mode(PostgresMode::Transactional)
            .build()
            .unwrap();
        let inserted = Arc::new(tokio::sync::Notify::new());
        let lost_xid = Arc::new(std::sync::Mutex::new(String::new()));
        let consumer = ServiceBuilder::new()
            .layer(
                MessageIdempotencyLayer::with_store(store).key(|message: &String| {
                    Ok(Some(MessageKey::new(IdempotencyKey::new(
                        message.as_str(),
                    )?)))
                }),
            )
            .service(service_fn({
                let (ledger, inserted, lost_xid) =
                    (ledger.clone(), inserted.clone(), lost_xid.clone());
                move |message: String| {
                    let (ledger, inserted, lost_xid) =
                        (ledger.clone(), inserted.clone(), lost_xid.clone());
                    async move {
                        let run = ledger.count(&message) as i64;
                        let transaction = Transaction::current().ok_or("no transaction")?;
                        let mut connection =
                            transaction.lock().await.map_err(|_| "transaction over")?;
                        let xid: String = sqlx::query_scalar(
                            "INSERT INTO commands (key, run) VALUES ($1, $2)
                             RETURNING pg_current_xact_id()::text",
                        )
                        .bind(&message)
                        .bind(run)
                        .fetch_one(&mut *connection)
                        .await
                        .map_err(|_| "insert failed")?;
                        *lost_xid.lock().unwrap() = xid;
                        inserted.notify_one();
                        Ok::<_, &'static str>(run)
                    }
                }
            }));

        let delivery = tokio::spawn(consumer.clone().oneshot(key.clone()));
        inserted.notified().await;
        tokio::time::sleep(Duration::from_millis(30 + 20 * (trial as u64 % 3))).await;
        let server_back = tokio::task::spawn_blocking(move || {
            server.kill();
            std::thread::sleep(DOWN);
            server.restart();
            server
        })
        .await
        .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let traffic = tokio::spawn(traffic(b.clone(), 100 + trial, stop.clone()));
        let first = delivery.await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::Relaxed);
        let created = traffic.await.unwrap();
        let lost = lost_xid.lock().unwrap().clone();
        if created
            .iter()
            .filter_map(|k| transaction_of(k))
            .any(|(xid, _)| xid == lost)
        {
            reused += 1;
        }

        let check = pool(&server_back.url()).await;
        let before = committed_runs(&check, &key).await;
        let first_seen = match &first {
            Ok(Handled::Ran(run)) => format!("ran {run} (acknowledged)"),
            Ok(Handled::Refused(refusal)) => {
                format!(
                    "refused {} (retryable: {})",
                    refusal.code(),
                    refusal.retryable()
                )
            }
            Ok(other) => format!("{:?}", other.outcome()),
            Err(error) => format!("handler error {error}"),
        };
        // The redelivery, until it is handled (the key is free once the crash is over).
        let redelivered = loop {
            match consumer.clone().oneshot(key.clone()).await {
                Ok(handled @ (Handled::Ran(_) | Handled::Replayed { .. })) => break handled,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        let after = committed_runs(&check, &key).await;
        eprintln!(
            "crash at an inbox COMMIT, trial {trial}: first delivery {first_seen}, committed runs then {before:?}; redelivery {:?}, committed runs {after:?}; lost transaction {lost} reused by the traffic: {}",
            redelivered.outcome(),
            reused > 0
        );
        drop(server_back);

        let acknowledged = matches!(first, Ok(Handled::Ran(_)));
        assert!(
            !acknowledged || before == [1],
            "the delivery was handled (and would be acknowledged) for an effect that is not in the database"
        );
        if let Ok(Handled::Refused(refusal)) = &first {
            assert!(refusal.retryable(), "requeued, never dropped");
        }
        assert_eq!(after.len(), 1, "the message applied once: {after:?}");
    }
    assert!(
        reused > 0,
        "no trial's lost transaction ID was handed out again: the trials no longer stage the hazard they are for"
    );
}
