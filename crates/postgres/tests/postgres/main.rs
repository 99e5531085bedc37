//! The PostgreSQL store against a real server: the store contract, two replicas on one
//! database, records that outlive the service, and expired rows removed.
//!
//! Each test creates a database of its own on the server at `TOWER_IDS_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/postgres`) and drops it at the end.
//! Without a reachable server the tests print `SKIPPED` and pass, except in CI (the `CI`
//! variable set), where they fail.
#![allow(missing_docs)]

use tower_ids_test_support as support;

use tower_ids_test_support::replica;

use tower_ids_test_support::rabbitmq;

mod crash;
use tower_ids_test_support::postgres as database;
mod failover;
mod failover_messages;
mod faults;
use tower_ids_test_support::postgres_server as server;
use tower_ids_test_support::proxy;
mod transactional;
mod transient;

use std::{collections::HashMap, sync::Arc, time::Duration};
use tower_ids::idempotency::Policy;

use database::TestDatabase;
use http::StatusCode;
use replica::{Ledger, Replica};
use support::Reply;
use tower_ids::idempotency::{
    store::Fingerprint,
    store::ScopeKey,
    store::{Begin, Claim, IdempotencyStore, PostgresMode, PostgresStore},
    IdempotencyLayer,
};

async fn store(database: &TestDatabase) -> PostgresStore {
    let store = PostgresStore::builder(database.pool(10).await)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_store_keeps_the_store_contract() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    tower_ids::idempotency::store::contract::keeps_the_store_contract(Arc::new(
        store(&database).await,
    ))
    .await;
}

/// How long the replicas' handler takes (`x-delay-ms`).
const HANDLER: Duration = Duration::from_millis(20);

/// A replica: its own pool and store on the shared database, its own server.
async fn replica(database: &TestDatabase, ledger: &Ledger) -> Replica {
    Replica::start(IdempotencyLayer::with_store(store(database).await), ledger).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_database_run_each_key_once() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let ledger = Ledger::default();
    let replicas = [
        replica(&database, &ledger).await,
        replica(&database, &ledger).await,
    ];

    let burst: Vec<_> = (0..1000)
        .map(|i| {
            let replica = replicas[i % 2].clone();
            tokio::spawn(async move {
                let status = replica
                    .send(&format!("key-{}", i % 100), Some(HANDLER))
                    .await
                    .unwrap()
                    .status;
                (i % 100, status)
            })
        })
        .collect();
    let mut statuses = HashMap::new();
    // Keys the burst ran (a `201`, or a `409`: another request held it): a key whose
    // every request was refused `503` on a loaded machine never ran, and its first
    // check below runs it, once.
    let mut ran = std::collections::HashSet::new();
    for request in burst {
        let (key, status) = request.await.unwrap();
        if status != StatusCode::SERVICE_UNAVAILABLE {
            ran.insert(key);
        }
        *statuses.entry(status.as_u16()).or_insert(0) += 1;
    }
    // Every key answered once more on each replica: the stored outcome, never a run
    // (a `409` while an outcome the burst's timeouts kept is still being stored).
    for key in 0..100 {
        for replica in &replicas {
            // A kept outcome is stored as soon as the store answers, which on a machine
            // busy with other tests' servers took over 10 s once.
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            let reply = loop {
                let reply = replica
                    .send(&format!("key-{key}"), Some(HANDLER))
                    .await
                    .unwrap();
                // 409 while an outcome is still being stored; 503 when the pool of 10
                // is still busy on a loaded machine: both say "retry", neither ran.
                let retry = [StatusCode::CONFLICT, StatusCode::SERVICE_UNAVAILABLE];
                if !retry.contains(&reply.status) || std::time::Instant::now() > deadline {
                    break reply;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
            let replayed = if ran.insert(key) { "false" } else { "true" };
            assert_eq!(
                reply.header("idempotent-replayed"),
                Some(replayed),
                "key-{key}"
            );
        }
    }

    let runs = ledger.per_key();
    eprintln!("1,000 requests over 100 keys on two replicas: statuses {statuses:?}");
    assert_eq!(runs.len(), 100, "every key ran");
    assert!(
        runs.values().all(|n| *n == 1),
        "every key ran exactly once: {runs:?}"
    );
    // 503: the store's 1 s timeout, when 500 requests per replica wait on a pool of 10
    // on a busy machine: refused, never run.
    assert!(
        statuses.keys().all(|s| [201, 409, 503].contains(s)),
        "{statuses:?}"
    );

    let first = replicas[0].send("across", Some(HANDLER)).await.unwrap();
    let retry = replicas[1].send("across", Some(HANDLER)).await.unwrap();
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body, "B replays what A stored");
}

#[tokio::test]
async fn records_outlive_the_service_and_expired_rows_are_removed() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let scope = ScopeKey::from_bytes([9; 32]);
    let short = ScopeKey::from_bytes([8; 32]);
    let claim = Claim::new(
        Fingerprint::from_bytes([1; 32]),
        Duration::from_secs(10),
        None,
    );
    {
        let before = store(&database).await;
        for (scope, ttl) in [
            (scope, Duration::from_secs(3600)),
            (short, Duration::from_millis(50)),
        ] {
            let Begin::Claimed { lease } = before.begin(&scope, claim.clone()).await.unwrap()
            else {
                panic!("new key");
            };
            let record = tower_ids::idempotency::store::Record::new(
                claim.fingerprint,
                lease.first_seen,
                None,
                None,
                None,
            );
            before
                .complete(&scope, &lease, Arc::new(record), ttl)
                .await
                .unwrap();
        }
        before.pool().close().await;
    }
    // A new process: a new pool, a new store.
    let after = store(&database).await;
    assert!(matches!(
        after.begin(&scope, claim.clone()).await.unwrap(),
        Begin::Completed {
            request_count: 2,
            ..
        }
    ));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(after.remove_expired().await.unwrap(), 1, "the expired row");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM tower_ids_idempotency")
        .fetch_one(after.pool())
        .await
        .unwrap();
    assert_eq!(rows, 1, "the live record stays");
}

#[tokio::test]
async fn the_store_refuses_a_table_name_it_cannot_quote() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let error = PostgresStore::builder(database.pool(1).await)
        .table("records; DROP TABLE users")
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("invalid table name"));
    let custom = PostgresStore::builder(database.pool(1).await)
        .table("public.custom_idempotency")
        .build()
        .unwrap();
    custom.migrate().await.unwrap();
    custom.migrate().await.expect("migrating twice is harmless");
    let scope = ScopeKey::from_bytes([3; 32]);
    let claim = Claim::new(
        Fingerprint::from_bytes([1; 32]),
        Duration::from_secs(10),
        None,
    );
    assert!(matches!(
        custom.begin(&scope, claim).await.unwrap(),
        Begin::Claimed { .. }
    ));
}

#[tokio::test]
async fn migrating_an_existing_table_again_logs_nothing_at_info() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let store = PostgresStore::builder(database.pool(1).await)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let (logs, _capture) = support::Logs::capture();
    store.migrate().await.unwrap();
    let loud: Vec<_> = logs
        .lines()
        .into_iter()
        .filter(|line| line["level"] != "DEBUG" && line["level"] != "TRACE")
        .collect();
    assert!(
        loud.is_empty(),
        "a start logs its migrations quietly: {loud:?}"
    );
}

/// A database that answers COMMITs before their WAL is on disk is named once, at the
/// store's start, with the setting that makes it so; one that waits for the disk is
/// not named. (Current-thread runtime: the check's task logs on the captured thread.)
#[tokio::test]
async fn a_store_on_a_database_that_commits_before_the_disk_warns_once() {
    let (Some(durable), Some(hasty)) = (TestDatabase::create().await, TestDatabase::create().await)
    else {
        return;
    };
    let pool = hasty.pool(2).await;
    sqlx::raw_sql(
        "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET synchronous_commit = off', current_database()); END $$",
    )
    .execute(&pool)
    .await
    .unwrap();
    // Connections made from now on take the database's setting.
    pool.close().await;
    let (logs, _capture) = support::Logs::capture();
    let durable_store = PostgresStore::builder(durable.pool(2).await)
        .table("durable_records")
        .build()
        .unwrap();
    let hasty_store = PostgresStore::builder(hasty.pool(2).await)
        .table("hasty_records")
        .build()
        .unwrap();
    let transactional = hasty_store.with_mode(PostgresMode::Transactional);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while logs.events("idempotency.store_not_durable").is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "no warning for synchronous_commit = off"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Both checks have had time to answer: each reads once, on one connection.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let warnings = logs.events("idempotency.store_not_durable");
    assert_eq!(
        warnings.len(),
        1,
        "once, for the hasty store only: {warnings:?}"
    );
    let fields = &warnings[0]["fields"];
    assert_eq!(warnings[0]["level"], "WARN");
    assert_eq!(fields["table"], "hasty_records");
    assert_eq!(fields["synchronous_commit"], "off");
    assert_eq!(fields["fsync"], "on");
    drop((durable_store, hasty_store, transactional));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_starting_together_all_migrate() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let mut pools = Vec::new();
    for _ in 0..8 {
        pools.push(database.pool(2).await);
    }
    let migrations: Vec<_> = pools
        .into_iter()
        .map(|pool| {
            tokio::spawn(async move {
                let store = PostgresStore::builder(pool).build().unwrap();
                store.migrate().await
            })
        })
        .collect();
    for migration in migrations {
        migration
            .await
            .unwrap()
            .expect("every replica's migrate succeeds");
    }
}

/// The expiry a stored answer advertises is the row's `expires_at`, within a second.
#[tokio::test]
async fn the_expiry_header_is_the_rows_expiry_in_postgres() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let ttl = Duration::from_secs(7200);
    let layer = IdempotencyLayer::with_store(store(&database).await)
        .policy(Policy::new().ttl(ttl))
        .unwrap()
        .expiry_header(true);
    let replica = Replica::start(layer, &Ledger::default()).await;

    let first = replica.send("expiring", Some(HANDLER)).await.unwrap();
    let replay = replica.send("expiring", Some(HANDLER)).await.unwrap();

    let expires_ms: i64 = sqlx::query_scalar(
        "SELECT (extract(epoch FROM expires_at) * 1000)::bigint FROM tower_ids_idempotency",
    )
    .fetch_one(&database.pool(1).await)
    .await
    .unwrap();
    let in_postgres =
        std::time::UNIX_EPOCH + Duration::from_millis(u64::try_from(expires_ms).unwrap());
    assert!(
        Reply::within_a_second(first.expires(), in_postgres),
        "advertised {:?}, PostgreSQL {:?}",
        first.expires(),
        in_postgres
    );
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.expires(), first.expires());
}

/// A database whose default isolation is stricter than READ COMMITTED answers
/// concurrent duplicates as one at READ COMMITTED: the store's statements outside a
/// transaction that meet a concurrent change ("could not serialize access due to
/// concurrent update") run again instead of answering `503 store_unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_are_answered_whatever_the_databases_isolation() {
    for isolation in ["repeatable read", "serializable"] {
        for mode in [PostgresMode::Durable, PostgresMode::Transactional] {
            let Some(database) = TestDatabase::create().await else {
                return;
            };
            let setup = database.pool(1).await;
            let name: String = sqlx::query_scalar("SELECT current_database()")
                .fetch_one(&setup)
                .await
                .unwrap();
            sqlx::raw_sql(&format!(
                "ALTER DATABASE {name} SET default_transaction_isolation = '{isolation}'"
            ))
            .execute(&setup)
            .await
            .unwrap();
            setup.close().await;
            let ledger = Ledger::default();
            let mut replicas = Vec::new();
            for _ in 0..2 {
                let store = PostgresStore::builder(database.pool(10).await)
                    .mode(mode)
                    .build()
                    .unwrap();
                store.migrate().await.unwrap();
                replicas.push(Replica::start(IdempotencyLayer::with_store(store), &ledger).await);
            }
            // 20 keys, 8 duplicates each at once over both replicas: every duplicate
            // meets the others' claim or count on the key's row.
            let burst: Vec<_> = (0..160)
                .map(|i| {
                    let replica = replicas[i % 2].clone();
                    tokio::spawn(async move {
                        let reply = replica
                            .send(&format!("key-{}", i % 20), Some(HANDLER))
                            .await
                            .unwrap();
                        (reply.status.as_u16(), reply.problem_code())
                    })
                })
                .collect();
            let mut answers: HashMap<(u16, Option<String>), usize> = HashMap::new();
            for request in burst {
                *answers.entry(request.await.unwrap()).or_default() += 1;
            }
            let runs = ledger.per_key();
            eprintln!(
                "default isolation {isolation}, {mode:?}: 160 requests over 20 keys: {answers:?}"
            );
            assert!(
                answers
                    .keys()
                    .all(|(status, _)| [201, 409].contains(status)),
                "only 201 and 409 (in flight), no store failure: {answers:?}"
            );
            assert!(
                runs.values().all(|n| *n == 1),
                "each key ran once: {runs:?}"
            );
        }
    }
}
