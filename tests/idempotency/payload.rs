//! A warehouse partner contract through a real axum server: the key is the body's
//! `correlation_id`, scoped by its `partner_id` (or `planner_id`); a replay answers
//! `200` with `"replay": true`; realtime calls are kept 30 days and webhooks 24 hours,
//! two routes on one store.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};
use tower_ids::idempotency::Policy;

use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::post, Router};
use bytes::Bytes;
use http::{request::Parts, HeaderName};
use serde_json::{json, Value};
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        extract::KeyRejection, store::ManualClock, ClientFromHeader, ClientId, IdempotencyKey,
        IdempotencyLayer, JsonReplayMarker, KeyFromJson, MokaStore, ReplayInfo,
    },
};

use crate::support::{client, send, serve, HttpClient, Reply};

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// The planner's side: each call that runs books one movement, numbered.
#[derive(Clone, Default)]
struct Planner(Arc<AtomicUsize>);

impl Planner {
    fn runs(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

async fn book(State(planner): State<Planner>, body: Bytes) -> impl IntoResponse {
    let n = planner.0.fetch_add(1, Ordering::SeqCst) + 1;
    let call: Value = serde_json::from_slice(&body).unwrap();
    let answer = json!({
        "movement_id": format!("mv-{n}"),
        "correlation_id": call["correlation_id"],
        "replay": false,
    });
    (StatusCode::CREATED, axum::Json(answer))
}

struct Partner {
    url: String,
    client: HttpClient,
    planner: Planner,
    clock: ManualClock,
}

impl Partner {
    async fn start() -> Self {
        let clock = ManualClock::default();
        let store = MokaStore::builder().clock(clock.clone()).build();
        let replay = JsonReplayMarker::new("replay").status(StatusCode::OK);
        let realtime = IdempotencyLayer::with_store(store.clone())
            .key(KeyFromJson::new("/correlation_id").client("/partner_id"))
            .require_key(true)
            .on_replay(replay.clone())
            .policy(Policy::new().ttl(30 * DAY))
            .unwrap();
        let webhook = IdempotencyLayer::with_store(store)
            .key(KeyFromJson::new("/correlation_id").client("/planner_id"))
            .require_key(true)
            .on_replay(replay)
            .policy(Policy::new().ttl(DAY))
            .unwrap();
        let planner = Planner::default();
        let app = Router::new()
            .route("/wes/v1/realtime", post(book).layer(realtime))
            .route("/wes/v1/webhook", post(book).layer(webhook))
            .with_state(planner.clone())
            .layer(CorrelationLayer::new());
        let addr = serve(app).await;
        Self {
            url: format!("http://{addr}"),
            client: client(),
            planner,
            clock,
        }
    }

    async fn call(&self, path: &str, body: &Value) -> Reply {
        let headers = [("content-type", "application/json")];
        send(
            &self.client,
            "POST",
            format!("{}{path}", self.url),
            &headers,
            &body.to_string(),
        )
        .await
    }
}

fn realtime(partner: &str, correlation: &str) -> Value {
    json!({"partner_id": partner, "correlation_id": correlation, "sku": "A-1", "qty": 3})
}

#[tokio::test]
async fn a_realtime_replay_answers_200_with_replay_true_and_books_nothing() {
    let partner = Partner::start().await;
    let call = realtime("partner-7", "0190f5d8-aaaa-7bbb-8ccc-000000000001");

    let first = partner.call("/wes/v1/realtime", &call).await;
    let replay = partner.call("/wes/v1/realtime", &call).await;
    let again = partner.call("/wes/v1/realtime", &call).await;

    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.json()["replay"], false);
    assert_eq!(replay.status, StatusCode::OK, "a replay is 200 OK");
    assert_eq!(replay.json()["replay"], true);
    assert_eq!(replay.json()["movement_id"], first.json()["movement_id"]);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        replay.header("content-length"),
        Some(replay.body.len().to_string().as_str())
    );
    // The hook adjusts a copy: the second replay is the first, not marked twice.
    assert_eq!(again.body, replay.body);
    assert_eq!(again.header("idempotency-request-count"), Some("3"));
    assert_eq!(partner.planner.runs(), 1, "no extra movement");
}

#[tokio::test]
async fn the_key_is_scoped_by_partner_and_by_surface() {
    let partner = Partner::start().await;
    let shared = "0190f5d8-aaaa-7bbb-8ccc-000000000002";

    let seven = partner
        .call("/wes/v1/realtime", &realtime("partner-7", shared))
        .await;
    let eight = partner
        .call("/wes/v1/realtime", &realtime("partner-8", shared))
        .await;
    let numeric = partner
        .call(
            "/wes/v1/realtime",
            &json!({"partner_id": 7, "correlation_id": shared, "sku": "A-1", "qty": 3}),
        )
        .await;
    let webhook = partner
        .call(
            "/wes/v1/webhook",
            &json!({"planner_id": "partner-7", "correlation_id": shared, "sku": "A-1", "qty": 3}),
        )
        .await;

    for reply in [&seven, &eight, &numeric, &webhook] {
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    }
    assert_eq!(partner.planner.runs(), 4, "one correlation_id, four scopes");
}

#[tokio::test]
async fn a_body_without_a_usable_key_is_a_clear_400() {
    let partner = Partner::start().await;
    let cases = [
        ("not json", "idempotency.body_not_json"),
        (r#"{"partner_id":"p"}"#, "idempotency.key_missing"),
        (
            r#"{"partner_id":"p","correlation_id":null}"#,
            "idempotency.key_missing",
        ),
        (
            r#"{"partner_id":"p","correlation_id":42}"#,
            "idempotency.key_invalid",
        ),
        (
            r#"{"partner_id":"p","correlation_id":""}"#,
            "idempotency.key_invalid",
        ),
        (r#"{"correlation_id":"c-1"}"#, "idempotency.client_invalid"),
        (
            r#"{"partner_id":true,"correlation_id":"c-1"}"#,
            "idempotency.client_invalid",
        ),
    ];
    for (body, code) in cases {
        let reply = send(
            &partner.client,
            "POST",
            format!("{}/wes/v1/realtime", partner.url),
            &[("content-type", "application/json")],
            body,
        )
        .await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(reply.json()["code"], code, "{body}: {}", reply.text());
    }
    let missing = send(
        &partner.client,
        "POST",
        format!("{}/wes/v1/realtime", partner.url),
        &[],
        r#"{"partner_id":"p"}"#,
    )
    .await;
    assert!(
        missing.json()["detail"]
            .as_str()
            .unwrap()
            .contains("/correlation_id"),
        "the detail says where the key goes"
    );
    assert_eq!(partner.planner.runs(), 0);
}

#[tokio::test]
async fn a_key_read_from_the_body_is_echoed_and_named_in_problems() {
    let partner = Partner::start().await;
    let key = "0190f5d8-aaaa-7bbb-8ccc-000000000009";
    let first = partner
        .call("/wes/v1/realtime", &realtime("p-1", key))
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("idempotency-key"), Some(key));
    let replay = partner
        .call("/wes/v1/realtime", &realtime("p-1", key))
        .await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("idempotency-key"), Some(key));

    let mut reused = realtime("p-1", key);
    reused["quantity"] = json!(99);
    let conflict = partner.call("/wes/v1/realtime", &reused).await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(conflict.header("idempotency-key"), Some(key));
    assert_eq!(conflict.json()["idempotency_key"], key);

    // Refused before its key could be read: nothing to echo or name.
    let unreadable = send(
        &partner.client,
        "POST",
        format!("{}/wes/v1/realtime", partner.url),
        &[("content-type", "application/json")],
        "not json",
    )
    .await;
    assert_eq!(unreadable.header("idempotency-key"), None);
    assert!(unreadable.json().get("idempotency_key").is_none());
    assert_eq!(partner.planner.runs(), 1);
}

#[tokio::test]
async fn another_payload_under_a_used_key_is_refused_not_replayed() {
    let partner = Partner::start().await;
    let key = "0190f5d8-aaaa-7bbb-8ccc-000000000003";
    partner
        .call("/wes/v1/realtime", &realtime("partner-7", key))
        .await;
    let mut other = realtime("partner-7", key);
    other["qty"] = json!(4);
    let refused = partner.call("/wes/v1/realtime", &other).await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(refused.json()["code"], "idempotency.fingerprint_mismatch");
    assert_eq!(partner.planner.runs(), 1);
}

#[tokio::test]
async fn realtime_keys_are_kept_30_days_and_webhooks_24_hours_on_one_store() {
    let partner = Partner::start().await;
    let call = realtime("partner-7", "0190f5d8-aaaa-7bbb-8ccc-000000000004");
    let hook = json!({"planner_id": "planner-1", "correlation_id": "wh-1", "sku": "A-1", "qty": 1});

    partner.call("/wes/v1/realtime", &call).await;
    partner.call("/wes/v1/webhook", &hook).await;
    partner.clock.advance(DAY - Duration::from_secs(1));
    let realtime_day = partner.call("/wes/v1/realtime", &call).await;
    let webhook_day = partner.call("/wes/v1/webhook", &hook).await;
    partner.clock.advance(Duration::from_secs(2));
    let realtime_after_day = partner.call("/wes/v1/realtime", &call).await;
    let webhook_after_day = partner.call("/wes/v1/webhook", &hook).await;
    assert_eq!(partner.planner.runs(), 3, "only the webhook's key expired");

    partner.clock.advance(29 * DAY - Duration::from_secs(2));
    let realtime_month = partner.call("/wes/v1/realtime", &call).await;
    partner.clock.advance(Duration::from_secs(2));
    let realtime_after_month = partner.call("/wes/v1/realtime", &call).await;

    assert_eq!(realtime_day.json()["replay"], true);
    assert_eq!(webhook_day.json()["replay"], true);
    assert_eq!(realtime_after_day.json()["replay"], true);
    assert_eq!(
        webhook_after_day.status,
        StatusCode::CREATED,
        "24 h: runs again"
    );
    assert_eq!(realtime_month.json()["replay"], true);
    assert_eq!(
        realtime_after_month.status,
        StatusCode::CREATED,
        "30 days: runs again"
    );
    assert_eq!(partner.planner.runs(), 4);
}

#[tokio::test]
async fn a_closure_reads_the_key_from_the_parts_and_the_body_and_the_caller_scopes_it() {
    // The key is the body's `ref`, prefixed by the path's tenant; the client is the
    // API key (the caller) and the body's `account` within it.
    let key = |parts: &Parts, body: &Bytes| -> Result<Option<_>, KeyRejection> {
        let value: Value =
            serde_json::from_slice(body).map_err(|_| KeyRejection::new("send JSON"))?;
        let Some(reference) = value["ref"].as_str() else {
            return Ok(None);
        };
        let tenant = parts.uri.path().split('/').nth(1).unwrap_or("");
        let key = IdempotencyKey::new(&format!("{tenant}:{reference}"))?;
        let account = value["account"].as_str().unwrap_or("none");
        Ok(Some(
            tower_ids::idempotency::extract::ExtractedKey::new(key).client(ClientId::new(account)),
        ))
    };
    let planner = Planner::default();
    let layer = IdempotencyLayer::new()
        .key(key)
        .client(ClientFromHeader::new(HeaderName::from_static("x-api-key")))
        .on_replay(
            |response: &mut http::Response<Bytes>, replay: &ReplayInfo| {
                let count = replay.request_count().to_string();
                response
                    .headers_mut()
                    .insert("x-replays", count.parse().unwrap());
            },
        );
    let app = Router::new()
        .route("/{tenant}/orders", post(book).layer(layer))
        .with_state(planner.clone());
    let url = format!("http://{}", serve(app).await);
    let client = client();
    let order = |api_key: &'static str, account: &'static str| {
        let client = client.clone();
        let url = format!("{url}/acme/orders");
        async move {
            let body = json!({"ref": "r-1", "account": account}).to_string();
            send(&client, "POST", url, &[("x-api-key", api_key)], &body).await
        }
    };

    let first = order("key-a", "acct-1").await;
    let replay = order("key-a", "acct-1").await;
    let other_account = order("key-a", "acct-2").await;
    let other_caller = order("key-b", "acct-1").await;
    let no_ref = send(
        &client,
        "POST",
        format!("{url}/acme/orders"),
        &[],
        r#"{"account":"acct-1"}"#,
    )
    .await;

    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("x-replays"), Some("2"));
    assert_eq!(
        replay.status,
        StatusCode::CREATED,
        "the hook kept the status"
    );
    assert_eq!(other_account.header("idempotent-replayed"), Some("false"));
    assert_eq!(other_caller.header("idempotent-replayed"), Some("false"));
    assert_eq!(
        no_ref.status,
        StatusCode::CREATED,
        "no key, none required: passed"
    );
    assert_eq!(no_ref.header("idempotent-replayed"), Some("false"));
    assert_eq!(planner.runs(), 4);
}
