//! The idempotency layer through real axum servers on 127.0.0.1, counting how many
//! times the handler ran.
#![allow(missing_docs)]

#[path = "../support/mod.rs"]
mod support;

#[path = "../contract/mod.rs"]
mod contract;

mod conformance;

mod faults;

mod ids;

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
use http::{HeaderName, StatusCode};
use serde_json::json;
use support::{client, send, serve, try_send, HttpClient, Logs, Reply};
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        extract::ExtractEpoch,
        extract::IdentifyClient,
        store::ScopeKey,
        store::{
            Begin, Claim, Completion, IdempotencyStore, Lease, ManualClock, Record, Renewal,
            Settled, StoreError,
        },
        ClientFromAuthorization, ClientFromHeader, EpochFromExtension, EpochFromHeader,
        IdempotencyLayer, InFlight, MokaStore, StoreFailure,
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
async fn the_quoted_and_bare_forms_and_the_x_header_are_one_key() {
    let app = start(IdempotencyLayer::new()).await;

    app.post("/commands", &[("idempotency-key", "abc")], BODY)
        .await;
    let quoted = app
        .post("/commands", &[("idempotency-key", "\"abc\"")], BODY)
        .await;
    let x_header = app
        .post("/commands", &[("x-idempotency-key", "abc")], BODY)
        .await;
    let both_agree = app
        .post(
            "/commands",
            &[("idempotency-key", "abc"), ("x-idempotency-key", "\"abc\"")],
            BODY,
        )
        .await;
    // An RFC 8941 Item with a parameter: the parameter is ignored.
    let with_parameter = app
        .post("/commands", &[("idempotency-key", "\"abc\";p=1")], BODY)
        .await;

    assert_eq!(app.runs.get(), 1);
    for reply in [quoted, x_header, both_agree, with_parameter] {
        assert_eq!(reply.header("idempotent-replayed"), Some("true"));
    }
}

#[tokio::test]
async fn scope_is_client_method_and_path() {
    let layer =
        IdempotencyLayer::new().client(ClientFromHeader::new(HeaderName::from_static("x-api-key")));
    let app = start(layer).await;
    let alice = ("x-api-key", "alice-secret");
    let bob = ("x-api-key", "bob-secret");

    let alice_first = app.post("/commands", &[KEY, alice], BODY).await;
    let bob_same_key = app.post("/commands", &[KEY, bob], BODY).await;
    let other_path = app.post("/other", &[KEY, alice], BODY).await;
    let other_method = send(
        &app.client,
        "PATCH",
        format!("{}/commands", app.url),
        &[KEY, alice],
        BODY,
    )
    .await;
    assert_eq!(app.runs.get(), 4, "four different requests");
    for reply in [&bob_same_key, &other_path, &other_method] {
        assert_eq!(reply.header("idempotent-replayed"), Some("false"));
        assert_ne!(
            reply.body, alice_first.body,
            "never another request's response"
        );
    }

    let alice_retry = app.post("/commands", &[KEY, alice], BODY).await;
    let bob_retry = app.post("/commands", &[KEY, bob], BODY).await;
    assert_eq!(app.runs.get(), 4);
    assert_eq!(alice_retry.body, alice_first.body);
    assert_eq!(bob_retry.body, bob_same_key.body);
}

#[tokio::test]
async fn a_repeated_client_header_is_400_never_the_first_value() {
    let (logs, _guard) = Logs::capture();
    let api_key =
        IdempotencyLayer::new().client(ClientFromHeader::new(HeaderName::from_static("x-api-key")));
    let by_header = start(api_key).await;
    let by_token = start(IdempotencyLayer::new().client(ClientFromAuthorization)).await;

    let two_keys = by_header
        .post(
            "/commands",
            &[
                KEY,
                ("x-api-key", "alice-secret"),
                ("x-api-key", "bob-secret"),
            ],
            BODY,
        )
        .await;
    let two_tokens = by_token
        .post(
            "/commands",
            &[
                KEY,
                ("authorization", "Bearer alice-token"),
                ("authorization", "Bearer bob-token"),
            ],
            BODY,
        )
        .await;

    for (reply, header) in [(&two_keys, "x-api-key"), (&two_tokens, "authorization")] {
        assert_eq!(reply.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(reply.json()["code"], "idempotency.client_invalid");
        assert_eq!(
            reply.json()["type"],
            "https://docs.rs/tower-ids/latest/tower_ids/idempotency/index.html#idempotency.client_invalid"
        );
        assert!(reply.json()["detail"]
            .as_str()
            .unwrap()
            .starts_with(&format!("the {header} header, which names the client")));
        assert_eq!(reply.header("idempotent-replayed"), Some("false"));
    }
    assert_eq!(by_header.runs.get() + by_token.runs.get(), 0);
    let rejected = logs.events("idempotency.rejected");
    assert_eq!(rejected.len(), 2);
    for line in &rejected {
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["fields"]["reason"], "client_repeated");
        assert_eq!(line["fields"]["status"], 400);
    }
    for secret in ["alice-secret", "bob-secret", "alice-token", "bob-token"] {
        assert!(!logs.raw().contains(secret), "{secret} reached a log line");
    }

    // The same request with one credential runs, and its retry replays.
    let alice = [KEY, ("x-api-key", "alice-secret")];
    let first = by_header.post("/commands", &alice, BODY).await;
    let retry = by_header.post("/commands", &alice, BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(by_header.runs.get(), 1);
}

#[tokio::test]
async fn require_client_refuses_a_keyed_request_without_a_client_with_401() {
    let (logs, _guard) = Logs::capture();
    let api_key = || ClientFromHeader::new(HeaderName::from_static("x-api-key"));
    let app = start(
        IdempotencyLayer::new()
            .client(api_key())
            .require_client(true),
    )
    .await;
    // A store that fails every call: a request that reached it would be a 503.
    let broken = start(
        IdempotencyLayer::with_store(BrokenStore)
            .client(api_key())
            .require_client(true),
    )
    .await;
    let default = start(IdempotencyLayer::new().client(api_key())).await;
    let alice = ("x-api-key", "alice-secret");

    let anonymous = app
        .post("/commands", &[KEY, ("attempt-id", "1")], BODY)
        .await;
    let empty = app.post("/commands", &[KEY, ("x-api-key", "")], BODY).await;
    let anonymous_broken = broken.post("/commands", &[KEY], BODY).await;
    for reply in [&anonymous, &empty, &anonymous_broken] {
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(reply.json()["code"], "idempotency.client_missing");
        assert_eq!(reply.json()["status"], 401);
        assert_eq!(
            reply.header("www-authenticate"),
            None,
            "no made-up challenge"
        );
        assert_eq!(reply.header("idempotent-replayed"), Some("false"));
    }
    assert_eq!(anonymous.header("attempt-id"), Some("1"));
    assert_eq!(app.runs.get() + broken.runs.get(), 0, "no handler ran");
    assert!(
        logs.events("idempotency.store_failed").is_empty(),
        "the store was never asked"
    );
    let rejected = logs.events("idempotency.rejected");
    assert_eq!(rejected.len(), 3);
    for line in &rejected {
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["fields"]["reason"], "client_missing");
        assert_eq!(line["fields"]["status"], 401);
    }

    // With a client the request runs (or, on the broken store, reaches the store).
    let first = app.post("/commands", &[KEY, alice], BODY).await;
    let retry = app.post("/commands", &[KEY, alice], BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    let reached = broken.post("/commands", &[KEY, alice], BODY).await;
    assert_eq!(reached.json()["code"], "idempotency.store_unavailable");
    // Without a key the request passes through as before; nothing to scope.
    let keyless = app.post("/commands", &[], BODY).await;
    assert_eq!(keyless.status, StatusCode::CREATED);
    assert_eq!(app.runs.get(), 2);

    // Off (the default), anonymous callers share one global scope per key.
    let one = default.post("/commands", &[KEY], BODY).await;
    let other = default.post("/commands", &[KEY], BODY).await;
    assert_eq!(one.status, StatusCode::CREATED);
    assert_eq!(other.header("idempotent-replayed"), Some("true"));
    assert_eq!(default.runs.get(), 1);
}

#[tokio::test]
async fn bad_keys_are_400_problems() {
    let (logs, _guard) = Logs::capture();
    let app = start(IdempotencyLayer::new().require_key(true)).await;
    let oversized = "k".repeat(256);
    let cases: [(&[(&str, &str)], &str); 7] = [
        (&[], "idempotency.key_missing"),
        (&[("idempotency-key", "")], "idempotency.key_invalid"),
        (
            &[("idempotency-key", &oversized)],
            "idempotency.key_invalid",
        ),
        (
            &[("idempotency-key", "\"unterminated")],
            "idempotency.key_invalid",
        ),
        (
            &[("idempotency-key", "one"), ("x-idempotency-key", "two")],
            "idempotency.keys_disagree",
        ),
        (
            &[("idempotency-key", "one"), ("idempotency-key", "two")],
            "idempotency.key_repeated",
        ),
        (
            &[KEY, ("attempt-id", "has space")],
            "idempotency.attempt_id_invalid",
        ),
    ];
    for (headers, code) in cases {
        let reply = app.post("/commands", headers, BODY).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{code}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(reply.header("idempotent-replayed"), Some("false"));
        assert_eq!(reply.json()["code"], code);
        assert_eq!(reply.json()["status"], 400);
    }
    assert_eq!(app.runs.get(), 0);
    let rejected = logs.events("idempotency.rejected");
    assert_eq!(rejected.len(), 7);
    assert!(rejected.iter().all(|line| line["level"] == "WARN"));
    assert!(!logs.raw().contains(&oversized));
    let repeated = app
        .post(
            "/commands",
            &[("idempotency-key", "one"), ("idempotency-key", "two")],
            BODY,
        )
        .await;
    assert_eq!(
        repeated.json()["detail"],
        "the idempotency-key header was sent more than once; send it once",
        "no word of a second header name"
    );

    // The longest key allowed is fine.
    let longest = "k".repeat(255);
    let ok = app
        .post("/commands", &[("idempotency-key", &longest)], BODY)
        .await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

#[tokio::test]
async fn an_optional_key_lets_requests_without_one_through() {
    let app = start(IdempotencyLayer::new()).await;

    let first = app.post("/commands", &[], BODY).await;
    let second = app.post("/commands", &[], BODY).await;

    assert_eq!(app.runs.get(), 2);
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert_eq!(second.header("idempotent-replayed"), Some("false"));
}

#[tokio::test]
async fn a_retry_whose_media_type_differs_only_in_case_is_replayed() {
    let app = start(IdempotencyLayer::new()).await;

    let first = app
        .post(
            "/commands",
            &[KEY, ("content-type", "application/json; charset=utf-8")],
            BODY,
        )
        .await;
    let retry = app
        .post(
            "/commands",
            &[KEY, ("content-type", "Application/JSON;Charset=utf-8")],
            BODY,
        )
        .await;
    let other_value = app
        .post(
            "/commands",
            &[KEY, ("content-type", "application/json; charset=latin1")],
            BODY,
        )
        .await;

    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(other_value.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(app.runs.get(), 1);
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

#[tokio::test]
async fn waiting_mode_replays_the_first_outcome() {
    let layer = IdempotencyLayer::new().policy(Policy::new().in_flight(InFlight::Wait {
        timeout: Duration::from_secs(5),
    }));
    let app = Arc::new(start(layer).await);

    let first = tokio::spawn({
        let app = app.clone();
        async move {
            app.post("/commands", &[KEY, ("x-delay-ms", "200")], BODY)
                .await
        }
    });
    until_runs(&app.runs, 1).await;
    let waiter = app.post("/commands", &[KEY], BODY).await;
    let first = first.await.unwrap();

    assert_eq!(app.runs.get(), 1);
    assert_eq!(waiter.status, StatusCode::CREATED);
    assert_eq!(waiter.body, first.body);
    assert_eq!(waiter.header("idempotent-replayed"), Some("true"));
}

#[tokio::test]
async fn waiting_mode_times_out_into_409() {
    let layer = IdempotencyLayer::new().policy(Policy::new().in_flight(InFlight::Wait {
        timeout: Duration::from_millis(50),
    }));
    let app = Arc::new(start(layer).await);

    let first = tokio::spawn({
        let app = app.clone();
        async move {
            app.post("/commands", &[KEY, ("x-delay-ms", "400")], BODY)
                .await
        }
    });
    until_runs(&app.runs, 1).await;
    let waiter = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(waiter.status, StatusCode::CONFLICT);
    assert_eq!(waiter.header("retry-after"), Some("1"));
    first.await.unwrap();
    assert_eq!(app.runs.get(), 1);
}

#[tokio::test]
async fn a_client_error_is_not_stored_and_the_retry_runs_again() {
    let app = start(IdempotencyLayer::new()).await;

    app.post("/commands", &[KEY, ("x-status", "404")], BODY)
        .await;
    let retry = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("false"));
    assert_eq!(app.runs.get(), 2);
}

#[tokio::test]
async fn a_lost_lease_frees_the_key_and_the_late_outcome_is_not_stored() {
    let clock = ManualClock::new();
    let store = MokaStore::builder().clock(clock.clone()).build();
    let layer =
        IdempotencyLayer::with_store(store).policy(Policy::new().lease(Duration::from_secs(60)));
    let app = Arc::new(start(layer).await);

    let slow = tokio::spawn({
        let app = app.clone();
        async move {
            app.post("/commands", &[KEY, ("x-delay-ms", "300")], BODY)
                .await
        }
    });
    until_runs(&app.runs, 1).await;
    // A claim holds its key for one and a half leases.
    clock.advance(Duration::from_secs(91));
    let takeover = app.post("/commands", &[KEY], BODY).await;
    slow.await.unwrap();
    let replay = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(app.runs.get(), 2);
    assert_eq!(
        replay.body, takeover.body,
        "the newer claim's record stands"
    );
}

#[tokio::test]
async fn a_client_that_hangs_up_still_gets_the_replay() {
    let (logs, _guard) = Logs::capture();
    let app = start(IdempotencyLayer::new()).await;

    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        app.post("/commands", &[KEY, ("x-delay-ms", "300")], BODY),
    )
    .await;
    assert!(gave_up.is_err(), "the client hung up before the response");
    assert_eq!(app.runs.get(), 1);

    // The handler finishes on its own and its outcome is stored.
    for _ in 0..100 {
        if !logs.events("idempotency.stored").is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let retry = app.post("/commands", &[KEY], BODY).await;

    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.runs.get(), 1);
    // The request that did the work has its line, when it settled.
    let detached = logs.events("idempotency.detached");
    assert_eq!(detached.len(), 1, "{}", logs.raw());
    assert_eq!(detached[0]["level"], "INFO");
    assert_eq!(detached[0]["span"]["idempotency_key"], KEY.1);
}

/// Every panic message seen by this test binary, with the default hook still printing.
fn panic_messages() -> &'static std::sync::Mutex<Vec<String>> {
    static MESSAGES: std::sync::OnceLock<std::sync::Mutex<Vec<String>>> =
        std::sync::OnceLock::new();
    MESSAGES.get_or_init(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if let Some(messages) = MESSAGES.get() {
                messages.lock().unwrap().push(info.to_string());
            }
            default(info);
        }));
        std::sync::Mutex::new(Vec::new())
    })
}

#[tokio::test]
async fn a_panicking_handler_releases_the_key() {
    let panics = panic_messages();
    let (logs, _guard) = Logs::capture();
    let layer = IdempotencyLayer::new().policy(Policy::new().in_flight(InFlight::Wait {
        timeout: Duration::from_secs(5),
    }));
    let app = Arc::new(start(layer).await);

    let panicking = tokio::spawn({
        let app = app.clone();
        async move {
            try_send(
                &app.client,
                "POST",
                format!("{}/commands", app.url),
                &[KEY, ("x-panic", "1"), ("x-delay-ms", "100")],
                BODY,
            )
            .await
        }
    });
    until_runs(&app.runs, 1).await;
    let waiter = app.post("/commands", &[KEY], BODY).await;
    assert!(
        panicking.await.unwrap().is_err(),
        "the panic closes that connection"
    );

    assert_eq!(waiter.status, StatusCode::CONFLICT);
    assert_eq!(waiter.json()["code"], "idempotency.original_failed");
    assert_eq!(waiter.header("retry-after"), Some("1"));
    let released = logs.events("idempotency.released");
    assert_eq!(released[0]["fields"]["reason"], "handler_panicked");

    let retry = app.post("/commands", &[KEY], BODY).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(app.runs.get(), 2, "released, so the retry runs");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let panics = panics.lock().unwrap();
    assert!(
        !panics.iter().any(|m| m.contains("resumed after panicking")),
        "the panicked work was resumed: {panics:?}"
    );
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
    async fn wait(&self, _: &ScopeKey, _: Duration) -> Result<Settled, StoreError> {
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
        .policy(Policy::new().store_failure(StoreFailure::FailOpen));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_moka_store_keeps_the_store_contract() {
    contract::keeps_the_store_contract(Arc::new(MokaStore::new())).await;
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
