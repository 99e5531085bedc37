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
use sqlx::{postgres::PgPoolOptions, PgPool};
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        store::{PostgresMode, PostgresStore, Transaction},
        IdempotencyLayer, InFlight, Policy,
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

/// Inserts a command in the request's transaction (a `500` if the database fails it);
/// `x-status`, `x-delay-ms` (after the insert), `x-delay-before-ms`, `x-panic` and
/// `x-name` steer it.
async fn create(State(app): State<App>, tx: Transaction, headers: HeaderMap) -> Response {
    let run = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let header = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
    let name = header("x-name").unwrap_or_else(|| format!("run-{run}"));
    if let Some(ms) = header("x-delay-before-ms") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
    }
    {
        let mut connection = tx.lock().await.unwrap();
        let inserted = sqlx::query("INSERT INTO commands (name) VALUES ($1)")
            .bind(&name)
            .execute(&mut *connection)
            .await;
        if let Err(error) = inserted {
            return Response::builder()
                .status(StatusCode::INTERNAL_SERVER_ERROR)
                .body(axum::body::Body::from(format!(
                    "the database failed: {error}"
                )))
                .unwrap();
        }
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
        Self::start_with(database.pool(10).await, Policy::new()).await
    }

    /// A server whose store uses `pool`, with `policy`.
    async fn start_with(pool: PgPool, policy: Policy) -> Self {
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
                // A `202` is not kept: its writes are rolled back.
                post(create).layer(
                    IdempotencyLayer::with_store(store)
                        .policy(policy)
                        .unwrap()
                        .store_if(|status| status != StatusCode::ACCEPTED),
                ),
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

    /// Waits until `runs` handlers have made their insert, and are sleeping in their
    /// open transactions.
    async fn until_inserted(&self, runs: usize) {
        for _ in 0..500 {
            let idle: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND state = 'idle in transaction'",
            )
            .fetch_one(&self.pool)
            .await
            .unwrap();
            if self.runs() >= runs && idle >= i64::try_from(runs).unwrap() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("{runs} handlers never held their transactions open");
    }

    /// Terminates the backend of the one request whose transaction is open.
    async fn terminate_the_open_transaction(&self) {
        let terminated: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND state = 'idle in transaction'",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap();
        assert_eq!(terminated, [true], "one open transaction, terminated");
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
    assert_eq!(
        duplicate.header("idempotency-first-seen"),
        None,
        "the store cannot see when the request in flight arrived: it does not say"
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_backend_frees_the_key_at_once() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let server = Arc::new(Server::start(&database).await);
    let first = tokio::spawn({
        let server = server.clone();
        async move { server.post("k-7", &[("x-delay-ms", "1500")]).await }
    });
    server.until_inserted(1).await;
    assert_eq!(server.post("k-7", &[]).await.status, StatusCode::CONFLICT);

    server.terminate_the_open_transaction().await;
    let terminated = Instant::now();
    let retry = loop {
        let retry = server.post("k-7", &[]).await;
        if retry.status != StatusCode::CONFLICT {
            break retry;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let free_after = terminated.elapsed();
    let first = first.await.unwrap();

    println!("a terminated backend's key ran again {free_after:?} after the terminate");
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("false"));
    assert!(
        free_after < Duration::from_secs(1),
        "the key was free at once, not after a lease: {free_after:?}"
    );
    // The first request's writes died with its backend: it must not claim otherwise.
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(first.json()["code"], "idempotency.not_committed");
    assert_eq!(
        server.commands().await,
        ["run-2"],
        "one command, the retry's"
    );
    assert_eq!(server.record_stored(true).await, 1);
    assert_eq!(server.post("k-7", &[]).await.body, retry.body);
}

/// The database, not the handler, failed: the handler's `500` (its insert met a
/// terminated backend) is answered as what it is, a passing fault the client retries,
/// and the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_on_a_terminated_backend_is_answered_503_not_its_500() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let server = Arc::new(Server::start(&database).await);
    let first = tokio::spawn({
        let server = server.clone();
        async move { server.post("k-8", &[("x-delay-before-ms", "800")]).await }
    });
    server.until_inserted(1).await;
    server.terminate_the_open_transaction().await;
    let first = first.await.unwrap();

    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        first.body
    );
    assert_eq!(first.json()["code"], "idempotency.not_committed");
    assert!(first.header("retry-after").is_some());
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    let retry = server.post("k-8", &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(server.runs(), 2);
    assert_eq!(
        server.commands().await,
        ["run-2"],
        "the retry's command alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_is_woken_by_the_commit_and_replays_it() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let policy = Policy::new().in_flight(InFlight::Wait {
        timeout: Duration::from_secs(5),
    });
    let server = Arc::new(Server::start_with(database.pool(10).await, policy).await);
    let first = tokio::spawn({
        let server = server.clone();
        async move { server.post("k-8", &[("x-delay-ms", "300")]).await }
    });
    server.until_inserted(1).await;

    let duplicate = server.post("k-8", &[]).await;
    let first = first.await.unwrap();

    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert_eq!(duplicate.header("idempotent-replayed"), Some("true"));
    assert_eq!(duplicate.body, first.body);
    assert_eq!(server.runs(), 1);
    assert_eq!(server.commands().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_of_a_request_that_died_runs_it_at_once() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let policy = Policy::new().in_flight(InFlight::Wait {
        timeout: Duration::from_secs(5),
    });
    let server = Arc::new(Server::start_with(database.pool(10).await, policy).await);
    let first = tokio::spawn({
        let server = server.clone();
        async move { server.post("k-9", &[("x-delay-ms", "3000")]).await }
    });
    server.until_inserted(1).await;
    let waiting = tokio::spawn({
        let server = server.clone();
        async move { server.post("k-9", &[]).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;

    server.terminate_the_open_transaction().await;
    let terminated = Instant::now();
    let waiting = waiting.await.unwrap();
    let answered_after = terminated.elapsed();

    println!("the waiting duplicate ran and answered {answered_after:?} after the terminate");
    assert_eq!(waiting.status, StatusCode::CREATED, "{}", waiting.text());
    assert_eq!(waiting.header("idempotent-replayed"), Some("false"));
    assert!(
        answered_after < Duration::from_secs(1),
        "woken by the end of the transaction, not its own timeout: {answered_after:?}"
    );
    assert_eq!(server.runs(), 2);
    assert_eq!(
        first.await.unwrap().json()["code"],
        "idempotency.not_committed"
    );
    assert_eq!(
        server.commands().await,
        ["run-2"],
        "one command, the waiter's"
    );
    let replay = server.post("k-9", &[]).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, waiting.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_answers_503_pool_exhausted_without_waiting_for_it() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(300))
        .connect(database.url())
        .await
        .unwrap();
    let server = Arc::new(Server::start_with(pool, Policy::new()).await);
    let holders: Vec<_> = ["k-10", "k-11"]
        .into_iter()
        .map(|key| {
            let server = server.clone();
            tokio::spawn(async move { server.post(key, &[("x-delay-ms", "2000")]).await })
        })
        .collect();
    while server.runs() < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let asked = Instant::now();
    let refused = server.post("k-12", &[]).await;
    let answered_after = asked.elapsed();

    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(refused.json()["code"], "idempotency.pool_exhausted");
    assert_eq!(refused.json()["status"], 503);
    assert!(refused.header("retry-after").is_some());
    assert_eq!(refused.header("idempotent-replayed"), Some("false"));
    assert!(
        answered_after < Duration::from_millis(1500),
        "answered within the acquire timeout, not after the holders: {answered_after:?}"
    );
    assert_eq!(server.runs(), 2, "the refused request ran nothing");
    for holder in holders {
        assert_eq!(holder.await.unwrap().status, StatusCode::CREATED);
    }
    let retry = server.post("k-12", &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(server.runs(), 3);
}

/// A message consumer over the store in transactional mode: the transactional inbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_handlers_writes_commit_with_its_record_and_a_redelivery_replays() {
    use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
    use tower_ids::idempotency::{
        message::{Handled, MessageIdempotencyLayer, MessageKey},
        IdempotencyKey,
    };

    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let pool = database.pool(4).await;
    sqlx::raw_sql("CREATE TABLE effects (key text NOT NULL, amount bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let store = PostgresStore::builder(pool.clone())
        .mode(PostgresMode::Transactional)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    // (key, amount, fail after the write)
    type Message = (&'static str, i64, bool);
    let key = |message: &Message| {
        Ok(Some(
            MessageKey::new(IdempotencyKey::new(message.0)?).fingerprint(message.1.to_be_bytes()),
        ))
    };
    let mut consumer = ServiceBuilder::new()
        .layer(
            MessageIdempotencyLayer::with_store(store)
                .key(key)
                .require_key(true)
                // An outcome of 0 is not kept: its writes are rolled back.
                .store_if(|outcome: &i64| *outcome != 0),
        )
        .service(service_fn({
            let runs = runs.clone();
            move |(key, amount, fail): Message| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let transaction = Transaction::current().expect("the delivery's transaction");
                    let mut connection = transaction.lock().await.unwrap();
                    sqlx::query("INSERT INTO effects (key, amount) VALUES ($1, $2)")
                        .bind(key)
                        .bind(amount)
                        .execute(&mut *connection)
                        .await
                        .unwrap();
                    if fail {
                        return Err("failed after the write");
                    }
                    Ok(amount * 2)
                }
            }
        }));
    let effects = || async {
        sqlx::query_scalar::<_, String>("SELECT key FROM effects ORDER BY key")
            .fetch_all(&pool)
            .await
            .unwrap()
    };

    let first = consumer
        .ready()
        .await
        .unwrap()
        .call(("m-1", 21, false))
        .await
        .unwrap();
    let redelivered = consumer
        .ready()
        .await
        .unwrap()
        .call(("m-1", 21, false))
        .await
        .unwrap();
    assert!(matches!(first, Handled::Ran(42)));
    assert!(redelivered.is_replay());
    assert_eq!(redelivered.outcome(), Some(&42));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A handler that fails after its write: rolled back, and the redelivery runs it.
    assert!(consumer
        .ready()
        .await
        .unwrap()
        .call(("m-2", 5, true))
        .await
        .is_err());
    assert_eq!(effects().await, ["m-1"], "nothing of m-2 stands");
    assert!(matches!(
        consumer
            .ready()
            .await
            .unwrap()
            .call(("m-2", 5, false))
            .await
            .unwrap(),
        Handled::Ran(10)
    ));
    assert_eq!(effects().await, ["m-1", "m-2"]);
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    // An outcome that is not kept: rolled back, so the consumer must not ack it.
    let Handled::Refused(refusal) = consumer
        .ready()
        .await
        .unwrap()
        .call(("m-3", 0, false))
        .await
        .unwrap()
    else {
        panic!("an outcome rolled back is refused");
    };
    assert_eq!(refusal.code().as_str(), "idempotency.not_committed");
    assert!(refusal.retryable(), "requeued, not acked");
    assert_eq!(effects().await, ["m-1", "m-2"], "nothing of m-3 stands");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_that_is_not_kept_is_rolled_back_and_never_answered_as_done() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let server = Server::start(&database).await;

    let accepted = server.post("k-13", &[("x-status", "202")]).await;

    assert_eq!(accepted.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(accepted.json()["code"], "idempotency.not_committed");
    assert!(
        server.commands().await.is_empty(),
        "its insert was rolled back"
    );
    let retry = server.post("k-13", &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(server.commands().await, ["run-2"]);
}

/// The layer's transactions run at READ COMMITTED whatever the database's default: at
/// REPEATABLE READ a duplicate woken by the owner's commit would read from a snapshot
/// taken before it, miss the record and run the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_woken_duplicate_sees_the_commit_whatever_the_databases_isolation() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let setup = database.pool(1).await;
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&setup)
        .await
        .unwrap();
    sqlx::raw_sql(&format!(
        "ALTER DATABASE {name} SET default_transaction_isolation = 'repeatable read'"
    ))
    .execute(&setup)
    .await
    .unwrap();
    setup.close().await;
    let policy = Policy::new().in_flight(InFlight::Wait {
        timeout: Duration::from_secs(5),
    });
    let server = Arc::new(Server::start_with(database.pool(10).await, policy).await);
    let first = tokio::spawn({
        let server = server.clone();
        async move { server.post("k-14", &[("x-delay-ms", "300")]).await }
    });
    server.until_inserted(1).await;

    let duplicate = server.post("k-14", &[]).await;
    let first = first.await.unwrap();

    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(duplicate.header("idempotent-replayed"), Some("true"));
    assert_eq!(duplicate.body, first.body);
    assert_eq!(server.runs(), 1, "the handler ran once");
    assert_eq!(server.commands().await.len(), 1);
}
