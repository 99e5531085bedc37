//! Faults at the worst moment against a throwaway PostgreSQL server of the test's own:
//! the whole server paused (SIGSTOP) or killed (SIGKILL) and restarted (crash recovery)
//! around the end of a 1 s handler, under two replicas. Durable mode: the handler ran
//! exactly once. Transactional mode: exactly one command row per key is committed, and
//! the retry replays the response that goes with it.
//!
//! Each trial prints one line (`cargo test --test postgres faults -- --nocapture`).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{extract::State, http::HeaderMap, response::Response, routing::post, Router};
use http::StatusCode;
use serde_json::json;
use sqlx::{postgres::PgPoolOptions, PgPool};
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        store::{PostgresStore, Transaction},
        IdempotencyLayer,
    },
};

use super::{
    server::PostgresServer,
    support::{client, serve, try_send, HttpClient, Reply},
};

const HANDLER: Duration = Duration::from_secs(1);
/// Longer than any outage here (down 0.5 s, then crash recovery): a store that is gone
/// for longer than the lease cannot tell a worker cut off from it from a dead one, and
/// a retry may then run again (README, Guarantees under faults).
const LEASE: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// The handler does not take the transaction: claim, run, store.
    Durable,
    /// The handler inserts its command on the request's transaction.
    Transactional,
}

/// Handler runs per key, in this process.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<HashMap<String, usize>>>);

impl Ledger {
    fn runs(&self, key: &str) -> usize {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

async fn durable(State(ledger): State<Ledger>, headers: HeaderMap) -> Response {
    let (key, run) = count(&ledger, &headers);
    tokio::time::sleep(HANDLER).await;
    created(&key, run)
}

async fn transactional(
    State(ledger): State<Ledger>,
    tx: Transaction,
    headers: HeaderMap,
) -> Response {
    let (key, run) = count(&ledger, &headers);
    {
        let Ok(mut connection) = tx.lock().await else {
            return Response::builder()
                .status(503)
                .body(axum::body::Body::empty())
                .unwrap();
        };
        let inserted = sqlx::query("INSERT INTO commands (key, run) VALUES ($1, $2)")
            .bind(&key)
            .bind(run as i64)
            .execute(&mut *connection)
            .await;
        if inserted.is_err() {
            return Response::builder()
                .status(503)
                .body(axum::body::Body::empty())
                .unwrap();
        }
    }
    tokio::time::sleep(HANDLER).await;
    created(&key, run)
}

fn count(ledger: &Ledger, headers: &HeaderMap) -> (String, usize) {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let mut runs = ledger.0.lock().unwrap();
    let runs = runs.entry(key.clone()).or_default();
    *runs += 1;
    (key, *runs)
}

fn created(key: &str, run: usize) -> Response {
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(
            json!({ "key": key, "run": run }).to_string(),
        ))
        .unwrap()
}

async fn pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(1))
        .connect(url)
        .await
        .expect("the throwaway server accepts connections")
}

#[derive(Clone)]
struct Node {
    url: String,
    client: HttpClient,
}

impl Node {
    async fn start(database: &str, ledger: &Ledger, mode: Mode) -> Self {
        let store = PostgresStore::builder(pool(database).await)
            .build()
            .unwrap();
        let layer = IdempotencyLayer::with_store(store).lease(LEASE);
        let route = match mode {
            Mode::Durable => post(durable).layer(layer),
            Mode::Transactional => post(transactional).layer(layer),
        };
        let router = Router::new()
            .route("/commands", route)
            .with_state(ledger.clone())
            .layer(CorrelationLayer::new());
        Self {
            url: format!("http://{}/commands", serve(router).await),
            client: client(),
        }
    }

    async fn post(&self, key: &str) -> Option<Reply> {
        try_send(
            &self.client,
            "POST",
            self.url.clone(),
            &[("idempotency-key", key)],
            "{}",
        )
        .await
        .ok()
    }
}

fn replayed(reply: &Reply) -> bool {
    reply.status == StatusCode::CREATED && reply.header("idempotent-replayed") == Some("true")
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    Pause(Duration),
    Kill(Duration),
}

async fn trial(mode: Mode, fault: Fault, at: Duration) {
    let Some(server) = PostgresServer::start() else {
        return;
    };
    let setup = pool(&server.url()).await;
    sqlx::raw_sql("CREATE TABLE commands (key text NOT NULL, run bigint NOT NULL)")
        .execute(&setup)
        .await
        .unwrap();
    PostgresStore::builder(setup.clone())
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let ledger = Ledger::default();
    let a = Node::start(&server.url(), &ledger, mode).await;
    let b = Node::start(&server.url(), &ledger, mode).await;
    let key = format!("{mode:?}-{fault:?}-{at:?}");

    let first = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move { a.post(&key).await }
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while ledger.runs(&key) == 0 {
        assert!(Instant::now() < deadline, "the handler never started");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(at).await;
    let (server, back) = tokio::task::spawn_blocking(move || {
        let mut server = server;
        match fault {
            Fault::Pause(pause) => {
                server.pause();
                std::thread::sleep(pause);
                server.resume();
            }
            Fault::Kill(down) => {
                server.kill();
                std::thread::sleep(down);
                server.restart();
            }
        }
        (server, Instant::now())
    })
    .await
    .unwrap();
    let first = first.await.unwrap();

    // Retry on both replicas until one replays.
    let mut seen = Vec::new();
    let replay = loop {
        let node = if seen.len() % 2 == 0 { &b } else { &a };
        match node.post(&key).await {
            Some(reply) if replayed(&reply) => break reply,
            Some(reply) => seen.push(reply.status.as_u16()),
            None => seen.push(0),
        }
        assert!(
            back.elapsed() < Duration::from_secs(30),
            "no replay within 30 s of the server returning: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let to_replay = back.elapsed();
    let verify = pool(&server.url()).await;
    let rows: Vec<i64> = sqlx::query_scalar("SELECT run FROM commands WHERE key = $1")
        .bind(&key)
        .fetch_all(&verify)
        .await
        .unwrap();
    let runs = ledger.runs(&key);
    let first_status = first.as_ref().map(|r| r.status.as_u16());
    eprintln!(
        "{mode:?}, {fault:?} at {at:?} into the handler: handler runs {runs}, committed rows {rows:?}, first answer {first_status:?}, replay {to_replay:?} after the server returned, retries saw {seen:?}"
    );

    let replayed_run = replay.json()["run"].as_i64().unwrap();
    match mode {
        Mode::Durable => {
            assert_eq!(runs, 1, "the handler ran exactly once");
            let first = first.expect("the first client gets an answer");
            assert_eq!(first.status, StatusCode::CREATED);
            assert_eq!(replay.body, first.body);
        }
        Mode::Transactional => {
            assert_eq!(rows.len(), 1, "exactly one committed command: {rows:?}");
            assert_eq!(
                rows[0], replayed_run,
                "the replay is the committed run's answer"
            );
            if let Some(first) = first.filter(|f| f.status == StatusCode::CREATED) {
                assert_eq!(replay.body, first.body, "a 201 that was answered stands");
            }
        }
    }
    // A transaction that did not commit ran nothing: one retry may then run it (201).
    let fresh = seen.iter().filter(|s| **s == 201).count();
    let first_committed = first_status == Some(201);
    assert!(
        fresh == 0 || (mode == Mode::Transactional && fresh == 1 && !first_committed),
        "a second execution answered: {seen:?}"
    );
    assert!(
        seen.iter().all(|s| [201, 409, 503].contains(s)),
        "before the replay only 409 or 503: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_mode_through_a_paused_and_a_killed_server() {
    for (fault, at) in [
        (Fault::Pause(Duration::from_millis(500)), 950),
        (Fault::Pause(Duration::from_millis(2000)), 950),
        (Fault::Kill(Duration::from_millis(500)), 950),
        (Fault::Kill(Duration::from_millis(500)), 400),
    ] {
        trial(Mode::Durable, fault, Duration::from_millis(at)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_mode_through_a_paused_and_a_killed_server() {
    for (fault, at) in [
        (Fault::Pause(Duration::from_millis(500)), 950),
        (Fault::Pause(Duration::from_millis(2000)), 950),
        (Fault::Kill(Duration::from_millis(500)), 950),
        (Fault::Kill(Duration::from_millis(500)), 1010),
        (Fault::Kill(Duration::from_millis(500)), 400),
    ] {
        trial(Mode::Transactional, fault, Duration::from_millis(at)).await;
    }
}
