//! Transactional mode through a real axum server: the handler's writes and the record
//! commit together, or not at all.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use axum::{extract::State, http::HeaderMap, response::Response, routing::post, Router};
use http::StatusCode;
use sqlx::PgPool;
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        store::{PostgresMode, PostgresStore, Transaction},
        IdempotencyLayer,
    },
};

use super::{
    database::TestDatabase,
    support::{client, send, serve, try_send, HttpClient, Reply},
};

#[derive(Clone)]
struct App {
    runs: Arc<AtomicUsize>,
}

/// Inserts a command in the request's transaction; `x-status`, `x-delay-ms`,
/// `x-panic` and `x-name` steer it.
async fn create(State(app): State<App>, tx: Transaction, headers: HeaderMap) -> Response {
    let run = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let header = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
    let name = header("x-name").unwrap_or_else(|| format!("run-{run}"));
    {
        let mut connection = tx.lock().await.unwrap();
        sqlx::query("INSERT INTO commands (name) VALUES ($1)")
            .bind(&name)
            .execute(&mut *connection)
            .await
            .unwrap();
    }
    if let Some(ms) = header("x-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
    }
    if header("x-panic").is_some() {
        panic!("the handler panicked after its insert");
    }
    let status = header("x-status").map_or(201, |s| s.parse().unwrap());
    Response::builder()
        .status(status)
        .body(axum::body::Body::from(format!("{{\"name\":\"{name}\"}}")))
        .unwrap()
}

struct Server {
    url: String,
    client: HttpClient,
    pool: PgPool,
    runs: Arc<AtomicUsize>,
}

impl Server {
    async fn start(database: &TestDatabase) -> Self {
        let pool = database.pool(10).await;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS commands (
               id bigserial PRIMARY KEY,
               -- Checked at commit: a second command of one name fails the commit.
               name text NOT NULL UNIQUE DEFERRABLE INITIALLY DEFERRED)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let store = PostgresStore::builder(pool.clone())
            .mode(PostgresMode::Transactional)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let router = Router::new()
            .route(
                "/commands",
                post(create).layer(IdempotencyLayer::with_store(store)),
            )
            .with_state(App { runs: runs.clone() })
            .layer(CorrelationLayer::new());
        Self {
            url: format!("http://{}/commands", serve(router).await),
            client: client(),
            pool,
            runs,
        }
    }

    async fn post(&self, key: &str, extra: &[(&str, &str)]) -> Reply {
        let mut headers = vec![("idempotency-key", key)];
        headers.extend_from_slice(extra);
        send(&self.client, "POST", self.url.clone(), &headers, "{}").await
    }

    async fn commands(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT name FROM commands ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    async fn record_stored(&self, completed: bool) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM tower_ids_idempotency WHERE completed = $1")
            .bind(completed)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writes_and_the_record_commit_together() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let server = Server::start(&database).await;

    let first = server.post("k-1", &[]).await;
    let retry = server.post("k-1", &[]).await;

    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(server.runs(), 1);
    assert_eq!(server.commands().await, ["run-1"]);
    assert_eq!(server.record_stored(true).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_that_is_not_stored_rolls_the_writes_back() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let server = Server::start(&database).await;

    let failed = server.post("k-2", &[("x-status", "500")]).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(server.commands().await.is_empty(), "rolled back");
    let retry = server.post("k-2", &[]).await;

    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(
        retry.header("idempotent-replayed"),
        Some("false"),
        "it ran again"
    );
    assert_eq!(server.runs(), 2);
    assert_eq!(server.commands().await, ["run-2"], "one command in the end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_leaves_nothing() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let server = Server::start(&database).await;

    // The connection is cut by the panic: no answer.
    let _ = try_send(
        &server.client,
        "POST",
        server.url.clone(),
        &[("idempotency-key", "k-3"), ("x-panic", "1")],
        "{}",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(server.commands().await.is_empty());
    let retry = server.post("k-3", &[]).await;

    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(server.commands().await, ["run-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_is_409_at_once_while_the_transaction_is_open() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let server = Arc::new(Server::start(&database).await);

    let first = tokio::spawn({
        let server = server.clone();
        async move { server.post("k-4", &[("x-delay-ms", "1000")]).await }
    });
    while server.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let asked = Instant::now();
    let duplicate = server.post("k-4", &[]).await;
    let waited = asked.elapsed();
    let first = first.await.unwrap();

    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.json()["code"], "idempotency.in_flight");
    assert!(
        waited < Duration::from_millis(300),
        "not blocked: {waited:?}"
    );
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(server.commands().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_fails_is_a_problem_and_leaves_nothing() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let server = Server::start(&database).await;
    let taken = server.post("k-5", &[("x-name", "taken")]).await;
    assert_eq!(taken.status, StatusCode::CREATED);

    // Another key, the same name: the deferred unique check fails the commit.
    let clash = server.post("k-6", &[("x-name", "taken")]).await;

    assert_eq!(clash.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        clash.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(clash.json()["code"], "idempotency.not_committed");
    assert!(clash.header("retry-after").is_some());
    assert_eq!(clash.header("idempotent-replayed"), Some("false"));
    assert_eq!(server.commands().await, ["taken"], "nothing of k-6 stands");
    assert_eq!(server.record_stored(true).await, 1, "only k-5's record");
    let retry = server.post("k-6", &[("x-name", "free")]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "the key was released");
    assert_eq!(server.commands().await, ["taken", "free"]);
}
