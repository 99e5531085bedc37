//! The database's passing faults as a handler meets them: recognised by
//! `store::is_transient` on real errors, and answered `503 handler_unavailable` by the
//! layer (not kept, the key free) when a tower service fails with one.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{error_handling::HandleErrorLayer, Router};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use sqlx::{postgres::PgPoolOptions, Connection as _, PgPool};
use tower::{service_fn, BoxError, ServiceBuilder};
use tower_ids::idempotency::{store::is_transient, IdempotencyLayer};

use super::{
    database::TestDatabase,
    store,
    support::{client, send, serve},
};

/// Two transactions that lock two rows in opposite orders: PostgreSQL aborts one with
/// `40P01`.
async fn a_deadlock(pool: &PgPool) -> sqlx::Error {
    sqlx::raw_sql("CREATE TABLE pair (id int PRIMARY KEY); INSERT INTO pair VALUES (1), (2)")
        .execute(pool)
        .await
        .unwrap();
    let mut first = pool.begin().await.unwrap();
    let mut second = pool.begin().await.unwrap();
    sqlx::query("UPDATE pair SET id = id WHERE id = 1")
        .execute(&mut *first)
        .await
        .unwrap();
    sqlx::query("UPDATE pair SET id = id WHERE id = 2")
        .execute(&mut *second)
        .await
        .unwrap();
    let crossing = async {
        let one = sqlx::query("UPDATE pair SET id = id WHERE id = 2").execute(&mut *first);
        let two = sqlx::query("UPDATE pair SET id = id WHERE id = 1").execute(&mut *second);
        let (one, two) = tokio::join!(one, two);
        one.err().or(two.err()).expect("one of the two is aborted")
    };
    tokio::time::timeout(Duration::from_secs(10), crossing)
        .await
        .expect("the deadlock detected within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_databases_passing_faults_are_transient_and_its_refusals_are_not() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let pool = database.pool(4).await;

    let deadlock = a_deadlock(&pool).await;
    assert_eq!(
        deadlock
            .as_database_error()
            .and_then(|e| e.code())
            .as_deref(),
        Some("40P01")
    );
    assert!(is_transient(&deadlock), "{deadlock}");

    let mut own = sqlx::PgConnection::connect(database.url()).await.unwrap();
    let terminated = sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
        .execute(&mut own)
        .await
        .unwrap_err();
    assert!(is_transient(&terminated), "{terminated}");
    let after = sqlx::query("SELECT 1").execute(&mut own).await.unwrap_err();
    assert!(is_transient(&after), "a connection already lost: {after}");

    let one = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(100))
        .connect(database.url())
        .await
        .unwrap();
    let _held = one.acquire().await.unwrap();
    let timed_out = one.acquire().await.unwrap_err();
    assert!(is_transient(&timed_out), "{timed_out}");

    // In a chain: a user's error whose source is the database's.
    let boxed: BoxError = Box::new(deadlock);
    assert!(is_transient(&*boxed));

    let duplicate = sqlx::query("INSERT INTO pair VALUES (1)")
        .execute(&pool)
        .await
        .unwrap_err();
    assert!(
        !is_transient(&duplicate),
        "a unique violation is the handler's: {duplicate}"
    );
    let syntax = sqlx::query("SELEC 1").execute(&pool).await.unwrap_err();
    assert!(!is_transient(&syntax), "{syntax}");
}

/// A tower service (a hyper service, or an axum route service behind
/// `HandleErrorLayer`) that fails with the database's error: its first run's backend is
/// terminated under it. The layer answers `503 handler_unavailable`, keeps nothing, and
/// the retry runs it again; the error layer never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_failing_on_a_terminated_backend_is_answered_503_and_runs_again() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let pool = database.pool(4).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = service_fn({
        let runs = runs.clone();
        let pool = pool.clone();
        move |_: Request<tower_ids::body::Body<axum::body::Body>>| {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let pool = pool.clone();
            async move {
                if run == 1 {
                    sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
                        .execute(&pool)
                        .await?;
                }
                Ok::<_, BoxError>(
                    Response::builder()
                        .status(StatusCode::CREATED)
                        .body(Full::new(Bytes::from(format!("run {run}"))))
                        .unwrap(),
                )
            }
        }
    });
    let app = Router::new().route_service(
        "/pay",
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(|error: BoxError| async move {
                (StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
            }))
            .layer(IdempotencyLayer::with_store(store(&database).await))
            .service(handler),
    );
    let address = serve(app).await;
    let client = client();
    let url = format!("http://{address}/pay");
    let key = [("idempotency-key", "pay-1")];

    let first = send(&client, "POST", url.clone(), &key, "{}").await;
    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        first.body
    );
    assert_eq!(first.json()["code"], "idempotency.handler_unavailable");
    assert!(first.header("retry-after").is_some());
    assert_eq!(first.header("idempotent-replayed"), Some("false"));

    let retry = send(&client, "POST", url.clone(), &key, "{}").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, "run 2");
    let replay = send(&client, "POST", url, &key, "{}").await;
    assert_eq!(replay.body, "run 2");
    assert!(replay.replayed());
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the fault's run and one more"
    );
}
