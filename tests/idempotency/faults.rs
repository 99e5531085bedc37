//! The completion path under store faults, through a real axum server: an outcome the
//! store cannot take is kept (never released) and stored later, duplicates get `409` or
//! wait meanwhile, the budget for kept outcomes holds, a handler may outlive its
//! lease, a graceful stop drains what the layer still owes the store, and a lease too
//! short for the store's recovery time is refused.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};
use tower_ids::idempotency::Policy;

use http::StatusCode;
use tower_ids::idempotency::{
    store::ScopeKey,
    store::{
        Begin, Claim, Completion, IdempotencyStore, Lease, Record, Renewal, StoreError, Waited,
    },
    IdempotencyLayer, InFlight, MokaStore,
};

use super::{start, Logs, BODY, KEY};

/// A moka store that cannot complete or renew while `down` is set, as a remote store
/// that went away just as the handler returned.
#[derive(Clone, Default)]
struct Flaky {
    inner: MokaStore,
    down: Arc<AtomicBool>,
    refused: Arc<AtomicUsize>,
    /// What it says of its [`recovery_time`](IdempotencyStore::recovery_time).
    recovery: Duration,
    /// Stores a completion but answers it with an error, as Redis whose replicas do
    /// not acknowledge the write (`WAIT`).
    unacknowledged: Arc<AtomicBool>,
}

impl Flaky {
    fn refuse(&self) -> StoreError {
        self.refused.fetch_add(1, Ordering::SeqCst);
        StoreError::with_source(
            "storing a record",
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused"),
        )
    }

    fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }
}

impl IdempotencyStore for Flaky {
    fn recovery_time(&self) -> Duration {
        self.recovery
    }
    async fn begin(&self, scope: &ScopeKey, claim: Claim) -> Result<Begin, StoreError> {
        self.inner.begin(scope, claim).await
    }
    async fn renew(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        claim: &Claim,
    ) -> Result<Renewal, StoreError> {
        if self.is_down() {
            return Err(self.refuse());
        }
        self.inner.renew(scope, lease, claim).await
    }
    async fn complete(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Result<Completion, StoreError> {
        if self.is_down() {
            return Err(self.refuse());
        }
        let completion = self.inner.complete(scope, lease, record, ttl).await?;
        if self.unacknowledged.load(Ordering::SeqCst) {
            return Err(self.refuse());
        }
        Ok(completion)
    }
    async fn release(&self, scope: &ScopeKey, lease: &Lease) -> Result<bool, StoreError> {
        self.inner.release(scope, lease).await
    }
    async fn wait(&self, scope: &ScopeKey, timeout: Duration) -> Result<Waited, StoreError> {
        self.inner.wait(scope, timeout).await
    }
}

#[tokio::test]
async fn an_outcome_the_store_cannot_take_is_kept_and_stored_later_never_released() {
    let (logs, _guard) = Logs::capture();
    let store = Flaky::default();
    let app = start(IdempotencyLayer::with_store(store.clone())).await;

    store.set_down(true);
    let first = app.post("/commands", &[KEY], BODY).await;
    let during = app.post("/commands", &[KEY], BODY).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "the first client gets its answer"
    );
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert_eq!(during.status, StatusCode::CONFLICT);
    assert_eq!(during.json()["code"], "idempotency.in_flight");
    assert_eq!(during.header("retry-after"), Some("1"));
    assert!(during.header("idempotency-first-seen").is_some());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        store.refused.load(Ordering::SeqCst) >= 2,
        "the layer keeps trying"
    );

    store.set_down(false);
    let deadline = Instant::now() + Duration::from_secs(3);
    let replay = loop {
        let reply = app.post("/commands", &[KEY], BODY).await;
        if reply.replayed() {
            break reply;
        }
        assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text());
        assert!(
            Instant::now() < deadline,
            "no replay once the store was back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    assert_eq!(app.runs.get(), 1, "the handler ran once");
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body);
    let failed = logs.events("idempotency.store_failed");
    assert_eq!(failed[0]["level"], "WARN");
    assert_eq!(failed[0]["fields"]["phase"], "complete");
    assert_eq!(
        failed[0]["fields"]["error"], "storing a record: connection refused",
        "the cause is in the event"
    );
    let stored = logs.events("idempotency.stored");
    assert_eq!(stored.len(), 1);
    assert!(stored[0]["fields"]["attempts"].as_u64().unwrap() >= 2);
    assert_eq!(stored[0]["span"]["idempotency_key"], KEY.1);
    assert!(
        logs.events("idempotency.released").is_empty(),
        "never released"
    );
}

#[tokio::test]
async fn a_waiting_duplicate_gets_the_kept_outcome_once_stored() {
    let store = Flaky::default();
    let layer = IdempotencyLayer::with_store(store.clone())
        .policy(Policy::new().in_flight(InFlight::Wait {
            timeout: Duration::from_secs(5),
        }))
        .unwrap();
    let app = Arc::new(start(layer).await);

    store.set_down(true);
    let first = app.post("/commands", &[KEY], BODY).await;
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { app.post("/commands", &[KEY], BODY).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the duplicate waits");
    store.set_down(false);
    let duplicate = waiting.await.unwrap();

    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, first.body);
    assert_eq!(app.runs.get(), 1);
}

#[tokio::test]
async fn kept_outcomes_past_their_budget_keep_the_key_without_the_response() {
    let (logs, _guard) = Logs::capture();
    let store = Flaky::default();
    let app = start(
        IdempotencyLayer::with_store(store.clone())
            .policy(Policy::new().max_kept_bytes(16))
            .unwrap(),
    )
    .await;

    store.set_down(true);
    let first = app.post("/commands", &[KEY], BODY).await;
    store.set_down(false);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let duplicate = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "the first client gets it all"
    );
    assert_eq!(duplicate.status, StatusCode::GONE);
    assert_eq!(duplicate.json()["code"], "idempotency.not_replayable");
    assert_eq!(app.runs.get(), 1, "recorded as run: never run again");
    let over = logs.events("idempotency.kept_over_budget");
    assert_eq!(over.len(), 1);
    assert_eq!(over[0]["level"], "WARN");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_running_three_times_the_lease_is_not_run_again() {
    let lease = Duration::from_millis(300);
    let app = Arc::new(
        start(
            IdempotencyLayer::new()
                .policy(Policy::new().lease(lease))
                .unwrap(),
        )
        .await,
    );
    let delay = (lease * 3).as_millis().to_string();

    let first = tokio::spawn({
        let app = app.clone();
        async move {
            app.post("/commands", &[KEY, ("x-delay-ms", &delay)], BODY)
                .await
        }
    });
    let mut seen = Vec::new();
    let replay = loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let reply = app.post("/commands", &[KEY], BODY).await;
        if reply.replayed() {
            break reply;
        }
        seen.push(reply.status.as_u16());
        assert!(seen.len() < 50, "no replay: {seen:?}");
    };
    let first = first.await.unwrap();

    assert_eq!(app.runs.get(), 1, "retries never ran it again: {seen:?}");
    assert!(
        seen.len() >= 6 && seen.iter().all(|s| *s == 409),
        "{seen:?}"
    );
    assert_eq!(replay.body, first.body);
}

/// The store goes away as the handler returns: the outcome is kept. A drain with a
/// deadline shorter than the outage names the key it could not settle; once the store
/// is back, a drain sees everything settled, and the retry replays.
#[tokio::test]
async fn a_drain_waits_for_kept_outcomes_and_names_the_keys_it_could_not_settle() {
    let (logs, _guard) = Logs::capture();
    let store = Flaky::default();
    let layer = IdempotencyLayer::with_store(store.clone());
    let drain = layer.drain();
    let app = start(layer).await;
    assert_eq!(drain.pending(), 0);

    store.set_down(true);
    let first = app.post("/commands", &[KEY], BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(drain.pending(), 1, "the kept outcome is owed");
    let cut_short = drain.wait(Duration::from_millis(200)).await;

    assert_eq!(cut_short.unsettled, 1);
    assert!(!cut_short.is_complete());
    let unsettled = logs.events("idempotency.drain_unsettled");
    assert_eq!(unsettled.len(), 1, "{}", logs.raw());
    assert_eq!(unsettled[0]["level"], "WARN");
    assert_eq!(unsettled[0]["fields"]["owed"], "outcome_kept");
    assert_eq!(
        unsettled[0]["span"]["idempotency_key"], KEY.1,
        "names the key"
    );
    assert!(unsettled[0]["span"]["correlation_id"].is_string());

    store.set_down(false);
    let drained = drain.wait(Duration::from_secs(3)).await;
    assert!(drained.is_complete());
    assert_eq!(logs.events("idempotency.drained").len(), 1);
    let replay = app.post("/commands", &[KEY], BODY).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(app.runs.get(), 1);
}

/// A client hangs up mid-handler: the handler runs on in a task of its own, and a
/// drain waits for it to finish and for its outcome to be stored.
#[tokio::test]
async fn a_drain_waits_for_a_handler_whose_client_hung_up() {
    let layer = IdempotencyLayer::new();
    let drain = layer.drain();
    let app = start(layer).await;

    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        app.post("/commands", &[KEY, ("x-delay-ms", "500")], BODY),
    )
    .await;
    assert!(gave_up.is_err(), "the client hung up before the response");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(drain.pending(), 1, "the detached handler is owed");
    let began = Instant::now();
    let drained = drain.wait(Duration::from_secs(5)).await;

    assert!(drained.is_complete());
    assert!(
        began.elapsed() >= Duration::from_millis(300),
        "it waited for the handler: {:?}",
        began.elapsed()
    );
    let replay = app.post("/commands", &[KEY], BODY).await;
    assert!(replay.replayed(), "stored before the drain returned");
    assert_eq!(app.runs.get(), 1);
}

/// A quarter of the lease must cover the store's recovery time and the 50 ms before a
/// failed renewal is tried again: `policy` refuses one that cannot, with an error that
/// says why and what would do, and the default lease is raised for a store that needs
/// more than 10 s.
#[test]
fn a_lease_too_short_for_the_store_is_refused() {
    let store = Flaky {
        recovery: Duration::from_millis(700),
        ..Flaky::default()
    };
    let refused = IdempotencyLayer::with_store(store.clone())
        .policy(Policy::new().lease(Duration::from_secs(2)))
        .expect_err("refused");
    assert_eq!(refused.shortest_lease(), Duration::from_secs(3));
    let message = refused.to_string();
    assert!(
        message.contains("a lease of 2s cannot outlive a store outage")
            && message.contains("set a lease of at least 3s"),
        "{message}"
    );
    // A lease whose quarter covers 700 ms and 50 ms is accepted, as is the default.
    let accepted = IdempotencyLayer::with_store(store.clone())
        .policy(Policy::new().lease(Duration::from_secs(3)))
        .unwrap();
    assert!(format!("{accepted:?}").contains("lease: 3s"));
    assert!(format!("{:?}", IdempotencyLayer::with_store(store)).contains("lease: 10s"));

    // A store that needs 2.95 s to recover: the default becomes 12 s.
    let slow = Flaky {
        recovery: Duration::from_millis(2950),
        ..Flaky::default()
    };
    assert!(format!("{:?}", IdempotencyLayer::with_store(slow)).contains("lease: 12s"));
}

/// The store took the outcome but never confirmed it (a shard whose replicas cannot
/// acknowledge): the replica that ran the request keeps it and tries again, yet answers
/// its duplicates as the store would, with the replay, not `409` until the store
/// confirms.
#[tokio::test]
async fn a_replica_keeping_an_outcome_the_store_holds_replays_it() {
    let store = Flaky::default();
    store.unacknowledged.store(true, Ordering::SeqCst);
    let app = start(IdempotencyLayer::with_store(store.clone())).await;

    let first = app.post("/commands", &[KEY], BODY).await;
    let duplicate = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(first.status, StatusCode::CREATED);
    assert!(
        duplicate.replayed(),
        "{} {}",
        duplicate.status,
        duplicate.text()
    );
    assert_eq!(duplicate.body, first.body);
    assert!(store.refused.load(Ordering::SeqCst) >= 1, "never confirmed");
    assert_eq!(app.runs.get(), 1);
}
