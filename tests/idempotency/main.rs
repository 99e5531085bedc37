//! The idempotency layer through real axum servers on 127.0.0.1, counting how many
//! times the handler ran.
#![allow(missing_docs)]

use tower_ids_test_support as support;

mod conformance;

mod faults;

mod ids;

mod keys;

mod lifecycle;

mod stress;

mod payload;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};
use tower_ids::idempotency::Policy;

use axum::{
    extract::State,
    http::{HeaderMap, Method},
    response::Response,
    routing::post,
    Router,
};
use bytes::Bytes;
use http::StatusCode;
use serde_json::json;
use support::{client, send, serve, try_send, HttpClient, Logs, Reply};
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        extract::ExtractEpoch,
        extract::IdentifyClient,
        store::ScopeKey,
        store::{
            Begin, Claim, Completion, IdempotencyStore, Lease, Record, Renewal, StoreError, Waited,
        },
        EpochFromExtension, EpochFromHeader, IdempotencyLayer, StoreFailure,
    },
};

/// How many times the handler ran.
#[derive(Clone, Default)]
pub struct Runs(Arc<AtomicUsize>);

impl Runs {
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// The handler under test. Request headers steer it (they are not part of the
/// fingerprint, so a retry can steer it differently): `x-delay-ms`, `x-status`,
/// `x-panic`, `x-big` (body size).
async fn handler(
    State(runs): State<Runs>,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let run = runs.0.fetch_add(1, Ordering::SeqCst) + 1;
    let directive = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
    if let Some(ms) = directive("x-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
    }
    if directive("x-panic").is_some() {
        panic!("the handler panicked on purpose");
    }
    let status = directive("x-status").map_or(201, |s| s.parse().unwrap());
    let body = match directive("x-big") {
        Some(size) => "x".repeat(size.parse().unwrap()),
        None => json!({
            "run": run,
            "method": method.as_str(),
            "echo": String::from_utf8_lossy(&body),
        })
        .to_string(),
    };
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("x-multi", "one")
        .header("set-cookie", "session=abc")
        .header("x-multi", "two")
        .header("set-cookie", "theme=dark")
        .header("x-run", run)
        .body(axum::body::Body::from(body))
        .unwrap()
}

struct App {
    url: String,
    runs: Runs,
    client: HttpClient,
}

impl App {
    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        send(
            &self.client,
            "POST",
            format!("{}{path}", self.url),
            headers,
            body,
        )
        .await
    }
}

async fn start<St, C, E>(layer: IdempotencyLayer<St, C, E>) -> App
where
    St: IdempotencyStore,
    C: IdentifyClient<axum::body::Body> + Clone + Send + Sync + 'static,
    E: ExtractEpoch<axum::body::Body> + Clone + Send + Sync + 'static,
{
    start_with(layer, |router| router).await
}

/// As [`start`], with `outer` wrapping the routes (inside the correlation layer).
async fn start_with<St, C, E>(
    layer: IdempotencyLayer<St, C, E>,
    outer: impl FnOnce(Router) -> Router,
) -> App
where
    St: IdempotencyStore,
    C: IdentifyClient<axum::body::Body> + Clone + Send + Sync + 'static,
    E: ExtractEpoch<axum::body::Body> + Clone + Send + Sync + 'static,
{
    let runs = Runs::default();
    let router = Router::new()
        .route(
            "/commands",
            post(handler).patch(handler).layer(layer.clone()),
        )
        .route("/other", post(handler).layer(layer))
        .with_state(runs.clone());
    let addr = serve(outer(router).layer(CorrelationLayer::new())).await;
    App {
        url: format!("http://{addr}"),
        runs,
        client: client(),
    }
}

/// Waits until the handler has started `n` times.
async fn until_runs(runs: &Runs, n: usize) {
    for _ in 0..500 {
        if runs.get() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the handler never ran {n} times");
}

const KEY: (&str, &str) = ("idempotency-key", "0193c4a2-7b1e-7cc0-9a51-3f2d6c1e8b47");
const BODY: &str = r#"{"device_id":"d-1","name":"reboot"}"#;

#[tokio::test]
async fn a_duplicate_gets_the_original_response_byte_for_byte() {
    let (logs, _guard) = Logs::capture();
    let app = start(IdempotencyLayer::new()).await;

    let first = app
        .post("/commands", &[KEY, ("attempt-id", "1")], BODY)
        .await;
    let second = app
        .post("/commands", &[KEY, ("attempt-id", "2")], BODY)
        .await;
    let third = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(app.runs.get(), 1);
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert_eq!(first.header("attempt-id"), Some("1"));
    assert_eq!(first.header("idempotency-first-seen"), None);

    assert_eq!(second.status, first.status);
    assert_eq!(second.body, first.body, "byte for byte");
    assert_eq!(second.header("idempotent-replayed"), Some("true"));
    assert_eq!(second.header("attempt-id"), Some("2"), "this attempt's ID");
    assert_eq!(second.header("original-attempt-id"), Some("1"));
    assert_eq!(second.header("idempotency-request-count"), Some("2"));
    assert_eq!(third.header("idempotency-request-count"), Some("3"));
    let first_seen =
        httpdate::parse_http_date(second.header("idempotency-first-seen").unwrap()).unwrap();
    let age = std::time::SystemTime::now()
        .duration_since(first_seen)
        .unwrap();
    assert!(age < Duration::from_secs(5));

    // Every header the handler set, repeats in order, except Set-Cookie.
    assert_eq!(second.all("x-multi"), ["one", "two"]);
    assert_eq!(first.all("set-cookie"), ["session=abc", "theme=dark"]);
    assert!(second.all("set-cookie").is_empty());
    assert_eq!(second.header("content-type"), Some("application/json"));
    assert_eq!(second.header("x-run"), Some("1"));
    assert_eq!(
        second.header("content-length"),
        first.header("content-length")
    );

    // Per-attempt headers are this attempt's.
    let first_id = first.header("x-correlation-id").unwrap();
    let second_id = second.header("x-correlation-id").unwrap();
    assert_ne!(first_id, second_id, "a retry is a new attempt");
    assert!(second.header("date").is_some());

    // The steps, at DEBUG, in the request's span with what the layer recorded there.
    let stored = &logs.events("idempotency.stored")[0];
    assert_eq!(stored["level"], "DEBUG");
    assert_eq!(stored["span"]["name"], "correlation");
    assert_eq!(stored["span"]["correlation_id"], first_id);
    assert_eq!(stored["span"]["idempotency_outcome"], "executed");
    let replayed = &logs.events("idempotency.replayed")[0];
    assert_eq!(replayed["level"], "DEBUG");
    assert_eq!(replayed["span"]["correlation_id"], second_id);
    assert_eq!(replayed["span"]["idempotency_key"], KEY.1);
}

#[tokio::test]
async fn an_oversized_request_body_is_413_and_runs_nothing() {
    let app = start(IdempotencyLayer::new().max_request_bytes(1024)).await;

    let big = "x".repeat(1025);
    let reply = app.post("/commands", &[KEY], &big).await;

    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(reply.json()["code"], "idempotency.body_too_large");
    assert_eq!(app.runs.get(), 0);
    let fits = app.post("/commands", &[KEY], &"x".repeat(1024)).await;
    assert_eq!(fits.status, StatusCode::CREATED);
    assert!(
        fits.text().contains(&"x".repeat(1024)),
        "the body reached the handler unchanged"
    );
}

#[tokio::test]
async fn over_the_byte_budget_is_503_and_touches_neither_handler_nor_store() {
    let (logs, _guard) = Logs::capture();
    // Every store call fails and is logged; failing open, the request still runs.
    let layer = IdempotencyLayer::with_store(BrokenStore)
        .policy(Policy::new().store_failure(StoreFailure::FailOpen))
        .unwrap()
        .max_buffered_bytes(1000);
    let app = Arc::new(start(layer).await);
    let body = "x".repeat(600);

    let holder = tokio::spawn({
        let (app, body) = (app.clone(), body.clone());
        async move {
            app.post("/commands", &[KEY, ("x-delay-ms", "300")], &body)
                .await
        }
    });
    until_runs(&app.runs, 1).await;
    let other_key = ("idempotency-key", "another-key");
    let refused = app
        .post("/commands", &[other_key, ("attempt-id", "1")], &body)
        .await;

    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(refused.json()["code"], "idempotency.overloaded");
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.header("idempotent-replayed"), Some("false"));
    assert_eq!(refused.header("attempt-id"), Some("1"));
    assert_eq!(app.runs.get(), 1, "the refused request never ran");
    let overloaded = logs.events("idempotency.overloaded");
    assert_eq!(overloaded.len(), 1);
    assert_eq!(overloaded[0]["level"], "WARN");
    assert_eq!(overloaded[0]["fields"]["budget_bytes"], 1000);
    assert_eq!(overloaded[0]["fields"]["requested_bytes"], 600);
    assert_eq!(
        logs.events("idempotency.store_failed").len(),
        1,
        "only the holder asked the store"
    );

    assert_eq!(holder.await.unwrap().status, StatusCode::CREATED);
    let retry = app.post("/commands", &[other_key], &body).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the budget is free again"
    );
    let whole = app.post("/commands", &[other_key], &"x".repeat(1001)).await;
    assert_eq!(whole.status, StatusCode::PAYLOAD_TOO_LARGE, "never fits");
    assert_eq!(app.runs.get(), 2);
}

#[tokio::test]
async fn a_response_too_large_to_keep_is_streamed_once_and_never_rerun() {
    let app = start(IdempotencyLayer::new().max_response_bytes(1024)).await;

    let first = app.post("/commands", &[KEY, ("x-big", "4096")], BODY).await;
    let duplicate = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 4096, "the first client gets all of it");
    assert_eq!(duplicate.status, StatusCode::GONE);
    assert_eq!(duplicate.json()["code"], "idempotency.not_replayable");
    assert_eq!(
        duplicate.header("idempotent-replayed"),
        Some("false"),
        "not a replay"
    );
    assert_eq!(duplicate.header("idempotency-request-count"), Some("2"));
    assert_eq!(app.runs.get(), 1);
}

/// A store whose every call fails, as an unreachable database would.
struct BrokenStore;

impl IdempotencyStore for BrokenStore {
    async fn begin(&self, _: &ScopeKey, _: Claim) -> Result<Begin, StoreError> {
        Err(StoreError::new("connection refused"))
    }
    async fn renew(&self, _: &ScopeKey, _: &Lease, _: &Claim) -> Result<Renewal, StoreError> {
        Err(StoreError::new("connection refused"))
    }
    async fn complete(
        &self,
        _: &ScopeKey,
        _: &Lease,
        _: Arc<Record>,
        _: Duration,
    ) -> Result<Completion, StoreError> {
        Err(StoreError::new("connection refused"))
    }
    async fn release(&self, _: &ScopeKey, _: &Lease) -> Result<bool, StoreError> {
        Err(StoreError::new("connection refused"))
    }
    async fn wait(&self, _: &ScopeKey, _: Duration) -> Result<Waited, StoreError> {
        Err(StoreError::new("connection refused"))
    }
}

#[tokio::test]
async fn a_failing_store_fails_closed_by_default() {
    let (logs, _guard) = Logs::capture();
    let app = start(IdempotencyLayer::with_store(BrokenStore)).await;

    let reply = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(reply.json()["code"], "idempotency.store_unavailable");
    assert!(reply.header("retry-after").is_some());
    assert_eq!(app.runs.get(), 0, "nothing runs");
    let failed = &logs.events("idempotency.store_failed")[0];
    assert_eq!(failed["level"], "WARN");
    assert_eq!(failed["fields"]["mode"], "fail_closed");
}

#[tokio::test]
async fn a_failing_store_can_fail_open() {
    let (logs, _guard) = Logs::capture();
    let layer = IdempotencyLayer::with_store(BrokenStore)
        .policy(Policy::new().store_failure(StoreFailure::FailOpen))
        .unwrap();
    let app = start(layer).await;

    let reply = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(reply.header("idempotent-replayed"), Some("false"));
    assert_eq!(app.runs.get(), 1);
    assert_eq!(
        logs.events("idempotency.store_failed")[0]["fields"]["mode"],
        "fail_open"
    );
}

#[tokio::test]
async fn uncovered_methods_pass_through() {
    let runs = Runs::default();
    let router = Router::new()
        .route("/commands", axum::routing::get(handler).post(handler))
        .with_state(runs.clone())
        .layer(IdempotencyLayer::new());
    let addr = serve(router).await;
    let client = client();

    for _ in 0..2 {
        let reply = send(
            &client,
            "GET",
            format!("http://{addr}/commands"),
            &[KEY],
            "",
        )
        .await;
        assert_eq!(reply.header("idempotent-replayed"), Some("false"));
    }
    assert_eq!(runs.get(), 2, "GET is not deduplicated");
}

/// The server's current control epoch, as a control layer would put it on requests.
#[derive(Clone, Copy)]
struct ControlEpoch(u64);

impl From<ControlEpoch> for u64 {
    fn from(epoch: ControlEpoch) -> u64 {
        epoch.0
    }
}

#[tokio::test]
async fn a_key_from_another_epoch_is_refused_not_replayed() {
    let (logs, _guard) = Logs::capture();
    let current = Arc::new(std::sync::atomic::AtomicU64::new(7));
    let epoch_source = current.clone();
    let layer = IdempotencyLayer::new().epoch(EpochFromExtension::<ControlEpoch>::new());
    let app = start_with(layer, move |router| {
        router.layer(axum::middleware::map_request(
            move |mut request: axum::extract::Request| {
                let epoch = ControlEpoch(epoch_source.load(Ordering::SeqCst));
                async move {
                    request.extensions_mut().insert(epoch);
                    request
                }
            },
        ))
    })
    .await;

    let first = app.post("/commands", &[KEY], BODY).await;
    let same_epoch = app.post("/commands", &[KEY], BODY).await;
    current.store(8, Ordering::SeqCst);
    let next_epoch = app.post("/commands", &[KEY], BODY).await;
    let new_key = app
        .post("/commands", &[("idempotency-key", "epoch-8-key")], BODY)
        .await;

    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(same_epoch.header("idempotent-replayed"), Some("true"));
    assert_eq!(next_epoch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        next_epoch.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(next_epoch.json()["code"], "idempotency.epoch_mismatch");
    assert_eq!(next_epoch.header("idempotent-replayed"), Some("false"));
    assert_eq!(new_key.status, StatusCode::CREATED);
    assert_eq!(app.runs.get(), 2, "the stale key never ran again");
    let mismatch = &logs.events("idempotency.epoch_mismatch")[0];
    assert_eq!(mismatch["fields"]["recorded_epoch"], 7);
    assert_eq!(mismatch["fields"]["request_epoch"], 8);
}

#[tokio::test]
async fn an_unreadable_epoch_header_is_400() {
    let app = start(IdempotencyLayer::new().epoch(EpochFromHeader::default())).await;

    let bad = app
        .post("/commands", &[KEY, ("idempotency-epoch", "seven")], BODY)
        .await;
    let good = app
        .post("/commands", &[KEY, ("idempotency-epoch", "7")], BODY)
        .await;
    let other = app
        .post("/commands", &[KEY, ("idempotency-epoch", "8")], BODY)
        .await;

    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.json()["code"], "idempotency.epoch_invalid");
    assert_eq!(good.status, StatusCode::CREATED);
    assert_eq!(other.json()["code"], "idempotency.epoch_mismatch");
    assert_eq!(app.runs.get(), 1);
}

/// Opt-in: every stored answer, first and replayed, says when it expires, within a
/// second of the store's TTL; a replay hook gets the same time; an answer that was not
/// stored says nothing.
#[tokio::test]
async fn the_expiry_header_says_when_the_stored_answer_expires() {
    let ttl = Duration::from_secs(3600);
    let seen = Arc::new(std::sync::Mutex::new(None));
    let hook = {
        let seen = seen.clone();
        move |_: &mut http::Response<Bytes>, replay: &tower_ids::idempotency::ReplayInfo| {
            *seen.lock().unwrap() = replay.expires_at();
        }
    };
    let app = start(
        IdempotencyLayer::new()
            .policy(Policy::new().ttl(ttl))
            .unwrap()
            .expiry_header(true)
            .on_replay(hook),
    )
    .await;

    let sent = std::time::SystemTime::now();
    let first = app.post("/commands", &[KEY], BODY).await;
    let replay = app.post("/commands", &[KEY], BODY).await;
    let refused = app
        .post(
            "/commands",
            &[("idempotency-key", "other"), ("x-status", "403")],
            BODY,
        )
        .await;

    assert!(Reply::within_a_second(first.expires(), sent + ttl));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.expires(), first.expires(), "the record's own expiry");
    let hooked = seen.lock().unwrap().expect("the hook got the expiry");
    assert!(Reply::within_a_second(hooked, first.expires()));
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert_eq!(refused.header("idempotency-expires"), None, "not stored");
    let off = start(IdempotencyLayer::new()).await;
    let quiet = off.post("/commands", &[KEY], BODY).await;
    assert_eq!(quiet.header("idempotency-expires"), None, "opt-in");
}
