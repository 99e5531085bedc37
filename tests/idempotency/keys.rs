//! The key and what it is scoped by: the header's quoted and bare forms and the `X-`
//! header, the scope (client, method, path), a client header sent twice, a required
//! client missing, bad keys as `400` problems, an optional key, and a retry whose media
//! type differs only in case.

use http::{HeaderName, StatusCode};
use tower_ids::idempotency::{ClientFromAuthorization, ClientFromHeader, IdempotencyLayer};

use super::{send, start, BrokenStore, Logs, BODY, KEY};

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
